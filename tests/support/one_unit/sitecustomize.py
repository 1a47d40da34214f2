"""In the Python processes the tests start (benchmark scripts, engine probes, examples): build
each graph's Inductor CPU kernels as one C++ unit, as the test processes do
(tests/support/one_unit_per_graph.py). conftest.py puts this folder on PYTHONPATH; Python imports
this module at startup. It only waits for Inductor's `async_compile` to be imported: a process
that never compiles pays nothing."""

import importlib.abc
import importlib.machinery
import os
import sys

_TARGET = "torch._inductor.async_compile"
_SUPPORT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            sys.meta_path.remove(self) if self in sys.meta_path else None
            if "one_unit_per_graph" in sys.modules:  # being imported by a test process: it installs
                return
            if _SUPPORT not in sys.path:
                sys.path.append(_SUPPORT)
            import one_unit_per_graph

            one_unit_per_graph.install()

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterImport())
