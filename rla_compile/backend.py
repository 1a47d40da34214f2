"""The `rla` torch.compile backend: re-trace, align, hand to the compiler.

    torch.compile(model, backend="rla")                          # entry point, no import needed
    torch.compile(model, backend="rla", options={"sites": ["rope"]})
    be = rla_compile.Backend(pin_rounding=True); torch.compile(model, backend=be); be.reports

Training needs the rewrite before autograd: a forward-only rewrite after AOTAutograd leaves a
backward derived from the old forward (contract.md). So the backend re-traces Dynamo's graph
to pre-dispatch ATen (normalised ops, no autograd yet), aligns it, and gives the result to
`compile_fx` (or AOTAutograd with eager kernels), which derives the backward from the fp32
forward. Inductor's caches key on the rewritten graph, and on the uuid of the pass that pins
the site roundings, which covers rla's code and options. Tensor-parallel graphs (DTensor
inputs) are re-traced the same way, their DTensor conversions kept as opaque nodes (dtensor.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.fx import GraphModule

from .config import Options
from .debug import Rewrite
from .graph_pass import align_and_record, graph_name, rank
from .lowering import KeepSiteRounding
from .report import GraphReport, lost_sites
from .retrace import pre_dispatch

__all__ = ["Backend", "align_function", "dynamo_backend"]

log = logging.getLogger(__name__)


class Backend:
    """rla's torch.compile backend, with its options; `.reports` has one report per graph.

        be = rla_compile.Backend(pin_rounding=True)      # or Backend(Options(...)), Backend({"sites": [...]})
        torch.compile(model, backend=be)
        be.reports

    Keyword arguments are the options (see `Options`: sites, compiler, pin_rounding, debug,
    inductor, rounding, attention_chunk_mib); invalid ones raise `OptionError` here, before anything compiles. With
    `keep_graphs=True`, `.rewrites` also keeps each graph's text before and after.
    """

    def __init__(self, options: Options | Mapping[str, Any] | None = None, /, *, keep_graphs: bool = False,
                 **kwargs: Any):
        if isinstance(options, Options):
            if kwargs:
                raise TypeError("pass either an Options object or keyword options, not both")
            self.options = options
        elif not kwargs or options is None:
            self.options = Options.from_dict(kwargs if options is None else options)  # from_dict checks the type
        elif isinstance(options, Mapping):
            self.options = Options.from_dict({**options, **kwargs})
        else:
            self.options = Options.from_dict(options)  # not a dict: from_dict says so
        self.keep_graphs = keep_graphs
        self.reports: list[GraphReport] = []
        self.rewrites: list[Rewrite] = []
        self._lost: set[tuple[str, str, str]] = set()  # (kind, module, reason) already warned of

    def _warn_lost(self, report: GraphReport) -> None:
        """A site an earlier graph aligned, missed in this one (a recompile): a warning, once per
        site and reason, so that no one trains on a stock site without a word."""
        for miss in lost_sites(self.reports, report):
            if (miss.kind, miss.module, miss.reason) not in self._lost:
                self._lost.add((miss.kind, miss.module, miss.reason))
                log.warning("rla: the %s site in %s was aligned in an earlier graph but not in %s (a recompile): %s",
                            miss.kind, miss.module, report.graph, miss.reason)

    def __repr__(self) -> str:
        return f"rla_compile.Backend({self.options})"

    def __call__(self, gm: GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        start = time.perf_counter()
        try:
            aten_gm = pre_dispatch(gm, example_inputs)
        except Exception as error:
            subclass = _subclass_input(example_inputs)
            if subclass is None:
                raise
            return self._compile_unaligned(gm, example_inputs, kwargs.get("mode"), subclass, error)
        seconds = {"retrace": time.perf_counter() - start}
        report, rewrite = align_and_record(aten_gm, self.options, graph_name(), keep_graphs=self.keep_graphs, seconds=seconds)
        self._warn_lost(report)
        self.reports.append(report)
        if self.keep_graphs:
            self.rewrites.append(rewrite)
        return self._compile(aten_gm, example_inputs, kwargs.get("mode"))

    def _compile_unaligned(
        self, gm: GraphModule, example_inputs: Sequence[Any], mode: str | None, subclass: str, error: Exception
    ) -> Callable:
        """A graph with tensor-subclass inputs (DTensor) is re-traced through its DTensor
        conversions (dtensor.py). Where that still fails (a subclass or a call rla does not
        know), compile the graph as written and say exactly why in the report rather than
        fail the training step."""
        message = str(error).strip().splitlines()
        reason = type(error).__name__ + (f": {message[0]}" if message else "")
        note = (
            f"not aligned: graph inputs are tensor subclasses ({subclass}) and rla's pre-dispatch "
            f"re-trace failed ({reason}); compiled as written"
        )
        report = GraphReport(graph_name(), note=note, rank=rank())
        self.reports.append(report)
        log.warning("%s", report.summary())
        return self._compile(gm, example_inputs, mode)

    def _compile(self, gm: GraphModule, example_inputs: Sequence[Any], mode: str | None) -> Callable:
        if self.options.compiler == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            return aot_eager(gm, example_inputs)

        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        patches: dict[str, Any] = dict(list_mode_options(mode)) if mode else {}
        patches.update(self.options.inductor_settings())
        user_pass = patches.get("post_grad_custom_post_pass")
        pin = KeepSiteRounding(self.options)
        patches["post_grad_custom_post_pass"] = pin if user_pass is None else [*_as_list(user_pass), pin]
        return compile_fx(gm, example_inputs, config_patches=patches)


def _subclass_input(example_inputs: Sequence[Any]) -> str | None:
    """The type name of the first tensor-subclass input (DTensor), or None."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for value in example_inputs:
        if isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value):
            return type(value).__name__
    return None


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def align_function(fn: Callable, *example_inputs: Any, **options: Any) -> Rewrite:
    """Trace `fn` (a function or module) on the inputs, align it, and return the first graph's
    report with its text before and after. Runs the rewritten graph once on eager kernels."""
    options.setdefault("compiler", "aot_eager")
    be = Backend(options, keep_graphs=True)
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=be, fullgraph=True)(*example_inputs)
    finally:
        torch._dynamo.reset()
    if not be.rewrites:
        raise RuntimeError(f"torch.compile produced no graph for {fn!r}: nothing to inspect")
    return be.rewrites[0]


def dynamo_backend(gm: GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None, options: dict | None = None) -> Callable:
    """The function registered as `backend="rla"` (entry point `torch_dynamo_backends`).

    Reports go to the `rla_compile` logger (`TORCH_LOGS=+rla_compile`); use
    `rla_compile.Backend(...)` to keep them on an object.
    """
    be = Backend(options)
    return be(gm, example_inputs, mode=mode)

