"""Property-based fuzzing: random spellings of every site and random look-alikes, in random
surrounding graphs (fuzz_graphs.py), compiled with `rla_compile.Backend(compiler="aot_eager")`.

For every program:
(a) each real site is in the report with its expected status, and the compiled output equals
    the program's contract reference (plain eager code, fp32 inside each site, one rounding
    per site output) bit for bit;
(b) no look-alike is rewritten: the report lists exactly the expected sites, and each
    look-alike that reaches a matcher is a near miss of its kind;
(c) the rewrite changes only rounding: the graph before and after `align`, both evaluated with
    every floating dtype promoted to float64, agree to float64 noise.

The default run is bounded and deterministic (derandomized); `tox -e fuzz` (HYPOTHESIS_PROFILE=
extended) runs many more examples. A failure prints the shrunk program: model and reference.
"""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx import GraphModule, Interpreter
from torch.utils._pytree import tree_map

import rla_compile
from fuzz_graphs import Program, build
from rla_compile.retrace import pre_dispatch

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("default", max_examples=80, derandomize=True, **_COMMON)
settings.register_profile("extended", max_examples=int(os.environ.get("RLA_FUZZ_EXAMPLES", 2000)), **_COMMON)
FUZZ = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@st.composite
def programs(draw, lookalikes: bool = True) -> Program:
    return build(lambda options: draw(st.sampled_from(list(options))), lookalikes=lookalikes)


# -- float64 evaluation -------------------------------------------------------------------
_WIDE = {torch.bfloat16: torch.float64, torch.float16: torch.float64, torch.float32: torch.float64,
         torch.complex32: torch.complex128, torch.complex64: torch.complex128}


def _widen(value):
    if isinstance(value, torch.dtype):
        return _WIDE.get(value, value)
    if isinstance(value, torch.Tensor) and value.dtype in _WIDE:
        return value.to(_WIDE[value.dtype])
    return value


class Float64(Interpreter):
    """Runs a graph with every floating tensor and dtype argument promoted to float64: each
    cast becomes a no-op, so what is left is the graph's math without any rounding."""

    def run_node(self, n):
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return getattr(self, n.op)(n.target, tree_map(_widen, args), tree_map(_widen, kwargs))


def _float64(gm: GraphModule, inputs) -> list[torch.Tensor]:
    out = Float64(gm).run(*[_widen(t) for t in inputs])
    return list(out) if isinstance(out, (list, tuple)) else [out]


class Capture:
    """The rla backend as users call it, plus the graph before and after `align` for (c)."""

    def __init__(self):
        self.rla = rla_compile.Backend(compiler="aot_eager", sites=[*rla_compile.DEFAULT_SITES, "attention"])  # opt-in
        self.graphs: list[tuple[GraphModule, GraphModule, list]] = []

    def __call__(self, gm, example_inputs):
        before, after = pre_dispatch(gm, example_inputs), pre_dispatch(gm, example_inputs)
        rla_compile.align(after, self.rla.options)
        self.graphs.append((before, after, list(example_inputs)))
        return self.rla(gm, example_inputs)


def _compile(program: Program):
    model, reference = program.functions()
    args = program.make_inputs()
    torch._dynamo.reset()  # a fresh compile per example: no recompiles, no dynamic shapes
    capture = Capture()
    got = torch.compile(model, backend=capture, fullgraph=True)(*args)
    return capture, got, reference(*args)


def _differing(got, want) -> list[str]:
    return [
        f"output {i}: {a.dtype} vs {b.dtype}, {int((a != b).sum())}/{a.numel()} elements differ"
        for i, (a, b) in enumerate(zip(got, want, strict=True))
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b)
    ]


@FUZZ
@given(programs())
def test_sites_follow_the_contract_and_lookalikes_stay(program: Program):
    capture, got, want = _compile(program)
    (report,) = capture.rla.reports
    context = f"{program}\n{report}"

    # (a) + (b): exactly the expected sites with their status; look-alikes are near misses
    assert Counter((s.kind, s.status) for s in report.sites) == Counter(program.sites), context
    assert Counter(m.kind for m in report.near_misses) == Counter(program.misses), context
    if program.dtype == torch.float32:
        assert report.note == "nothing to align: activations are float32", context
    assert not _differing(got, want), "\n".join([*_differing(got, want), context])

    # (c): only rounding changed
    ((before, after, inputs),) = capture.graphs
    wide_before, wide_after = _float64(before, inputs), _float64(after, inputs)
    assert all(t.dtype in (torch.float64, torch.int64) for t in wide_before), context
    for a, b in zip(wide_before, wide_after, strict=True):
        # float64 noise only: both graphs compute the same ops once the casts are no-ops
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"{m}\n{context}")


def test_float64_check_sees_a_changed_op():
    """(c) can fail: the same comparison on a graph whose math was altered reports it."""
    rng = random.Random(3)
    program = build(lambda options: rng.choice(list(options)), blocks=1, lookalikes=False)
    while not any(status == "rewritten" for _, status in program.sites):
        program = build(lambda options: rng.choice(list(options)), blocks=1, lookalikes=False)
    capture, _, _ = _compile(program)
    ((before, after, inputs),) = capture.graphs
    node = next(n for n in after.graph.nodes if n.target == torch.ops.aten.mul.Tensor)
    node.target = torch.ops.aten.add.Tensor
    after.recompile()
    with pytest.raises(AssertionError):
        for a, b in zip(_float64(before, inputs), _float64(after, inputs)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_reference_differs_from_unaligned_compiles():
    """(a) can fail: without rla, the generated programs' rewritten sites round differently
    from the contract reference (20 seeded bf16 programs, plain aot_eager)."""
    rng = random.Random(0)
    differing = checked = 0
    while checked < 20:
        program = build(lambda options: rng.choice(list(options)), lookalikes=False)
        if program.dtype != torch.bfloat16 or not any(s == "rewritten" for _, s in program.sites):
            continue
        model, reference = program.functions()
        args = program.make_inputs()
        torch._dynamo.reset()
        got = torch.compile(model, backend="aot_eager", fullgraph=True)(*args)
        differing += bool(_differing(got, reference(*args)))
        checked += 1
    assert differing >= 15, f"only {differing}/20 unaligned programs differ from the reference"
