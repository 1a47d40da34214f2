"""Test-suite speed: Inductor's CPU kernels of one compiled graph built as one C++ unit.

Inductor (torch 2.13, Python wrapper) builds every CPU kernel of a graph as its own shared
library: one `g++` per kernel, and each `g++` spends about 0.55 s of its 1 s re-reading the
precompiled `cpp_prefix.h` (its deferred template instantiations, `-ftime-report`: "phase lang.
deferred"), measured on this repository's 2-core CI machine. A tiny model's graph has 12-18
kernels; the test suite builds about 1,800 of them.

With this installed, the kernels a wrapper module defines are
collected and built together when the module calls `async_compile.wait(globals())`: one
translation unit in which each kernel's source sits unchanged in a namespace of its own, its
`kernel` renamed `kernel_<i>`, with one Python binding per kernel. Each kernel's code, flags
and optimisation level are Inductor's; only the number of `g++` runs changes. A graph whose
kernels cannot be built together (a source with an include of its own, or a unit that fails to
build) is built kernel by kernel, as Inductor does.

The test processes use it (conftest.py installs it) and so do the Python processes they start
(benchmark smokes, engine probes, examples: `one_unit/sitecustomize.py`, on their PYTHONPATH).
Nothing outside the tests does: the benchmark scripts run by hand, whose results the docs
quote (compile times included), build as users' processes do.
"""

from __future__ import annotations

import contextlib
import threading

from torch._inductor import async_compile, codecache

PREFIX = "#include <torch/csrc/inductor/cpp_prefix.h>"

_pending = threading.local()
# why each unit that did not build did not (read by the test that the units build)
FALLBACKS: list[str] = []
# what this process built as units: how many units, how many kernels in them
BUILT = {"units": 0, "kernels": 0}


class _Kernel:
    """What `cpp_pybinding` returns: the kernel's callable once its module is built."""

    def __init__(self, argtypes, source):
        self.argtypes, self.source, self.fn = list(argtypes), source, None

    def __call__(self, *args):
        if self.fn is None:
            _build(_take_pending())
        return self.fn(*args)


def _take_pending():
    kernels = getattr(_pending, "kernels", [])
    _pending.kernels = []
    return [k for k in kernels if k.fn is None]


def _batchable(kernel):
    body = kernel.source.strip()
    return body.startswith(PREFIX) and "#include" not in body[len(PREFIX):]


def _unit(kernels):
    """One C++ source: each kernel in `namespace rla_k<i>`, its `kernel` renamed `kernel_<i>`,
    then the bindings (Inductor's own argument parsing, one method per kernel)."""
    parts = [PREFIX]
    for i, k in enumerate(kernels):
        body = k.source.strip()[len(PREFIX):]
        parts.append(f"namespace rla_k{i} {{\n#define kernel kernel_{i}\n{body}\n#undef kernel\n}}")
    template = codecache.CppPythonBindingsCodeCache.suffix_template
    head, _, _ = template.partition("static PyObject* {entry_func}_py")
    parts.append(head.format(extra_parse_arg="", entry_func="kernel"))
    for i, k in enumerate(kernels):
        parse = ", ".join(f"parse_arg<{t.replace('const ', '')}>(args, {n})" for n, t in enumerate(k.argtypes))
        parts.append(f"""
static PyObject* kernel_{i}_py(PyObject* self, PyObject* args) {{
    try {{
        if(!PyTuple_CheckExact(args)) [[unlikely]] throw std::runtime_error("tuple args required");
        if(PyTuple_GET_SIZE(args) != {len(k.argtypes)}) [[unlikely]] throw std::runtime_error("requires {len(k.argtypes)} args");
        rla_k{i}::kernel_{i}({parse}); Py_RETURN_NONE;
    }} catch(std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what()); return nullptr;
    }} catch(...) {{
        PyErr_SetString(PyExc_RuntimeError, "unhandled error"); return nullptr;
    }}
}}""")
    methods = "".join(f'{{"kernel_{i}", kernel_{i}_py, METH_VARARGS, ""}},\n' for i in range(len(kernels)))
    # the module's init as Inductor writes it: the module is loaded as "<key>.kernel"
    _, _, tail = template.partition("static PyMethodDef py_methods[] = {{")
    tail = "static PyMethodDef py_methods[] = {{" + tail
    tail = tail.replace('{{"{entry_func}", {entry_func}_py, METH_VARARGS, ""}},', methods.replace("{", "{{").replace("}", "}}"))
    parts.append(tail.format(entry_func="kernel"))
    return "\n".join(parts)


def _build_one(kernel):
    kernel.fn = codecache.CppPythonBindingsCodeCache.load_pybinding(kernel.argtypes, kernel.source)


def _build(kernels):
    together = [k for k in kernels if _batchable(k)]
    for k in kernels:
        if not _batchable(k):
            _build_one(k)
    # kernels that use the vectorised helpers are built with the vector ISA's flags: keep
    # each group's flags as Inductor picks them for its kernels
    groups = {}
    for k in together:
        groups.setdefault(codecache._resolve_needs_vec_isa("cpu", k.source, None), []).append(k)
    for group in groups.values():
        if len(group) == 1:
            _build_one(group[0])
            continue
        try:
            module = codecache.CppPythonBindingsCodeCache.load_async(_unit(group), "cpu")()
        except Exception as e:  # a unit that does not build: kernel by kernel, as Inductor does
            FALLBACKS.append(repr(e)[:2000])
            for k in group:
                _build_one(k)
            continue
        for i, k in enumerate(group):
            k.fn = getattr(module, f"kernel_{i}")
        BUILT["units"] += 1
        BUILT["kernels"] += len(group)


def _cpp_pybinding(self, argtypes, source_code):
    kernel = _Kernel(argtypes, source_code)
    if not hasattr(_pending, "kernels"):
        _pending.kernels = []
    _pending.kernels.append(kernel)
    return kernel


_original_wait = async_compile.AsyncCompile.wait


def _wait(self, scope):
    kernels = _take_pending()
    if kernels:
        _build(kernels)
    for name, value in list(scope.items()):
        if isinstance(value, _Kernel):
            scope[name] = value.fn
    return _original_wait(self, scope)


_original_cpp_pybinding = async_compile.AsyncCompile.cpp_pybinding


def install():
    """Build each wrapper module's CPU kernels as one unit (this process only)."""
    async_compile.AsyncCompile.cpp_pybinding = _cpp_pybinding
    async_compile.AsyncCompile.wait = _wait


@contextlib.contextmanager
def kernel_by_kernel():
    """Inductor's own build, one unit per kernel, for the duration (the check that both builds
    compute the same bits: tests/test_cache.py)."""
    installed = async_compile.AsyncCompile.cpp_pybinding is _cpp_pybinding
    async_compile.AsyncCompile.cpp_pybinding = _original_cpp_pybinding
    async_compile.AsyncCompile.wait = _original_wait
    try:
        yield
    finally:
        if installed:
            install()
