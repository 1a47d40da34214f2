"""The one step both compiled paths run on a graph (the torch.compile backend before
autograd, vLLM's post-grad pass): align it and everything inside it, time it, report it, and
record its text before and after when something reads it (`debug`, TORCH_TRACE)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
from torch.fx import GraphModule

from . import checkpoint, ops
from .config import Options
from .debug import Rewrite, record, snapshot, wants_graphs
from .engine import align
from .report import GraphReport, SiteReport
from .retrace import function_bodies

__all__ = ["align_and_record", "graph_name", "rank"]

log = logging.getLogger(__name__)


def align_and_record(
    gm: GraphModule, options: Options, name: str, *, post_grad: bool = False, keep_graphs: bool = False,
    seconds: dict[str, float] | None = None,
) -> tuple[GraphReport, Rewrite | None]:
    """Align `gm` in place (and the bodies of its activation-checkpointed regions; sites inside
    custom autograd Functions are reported as skipped): one report, logged, with this process's
    rank and the seconds spent (`seconds` adds earlier phases, e.g. the re-trace). The rewrite's
    text is returned when `keep_graphs` is set, and dumped or traced when the options ask."""
    start = time.perf_counter()
    before = snapshot(gm) if keep_graphs or wants_graphs(options.debug_dir) else None
    report = align(gm, options, name=name, post_grad=post_grad)
    for body in checkpoint.bodies(gm):
        inner = align(body, options, name=report.graph)
        report.sites.extend(inner.sites)
        report.near_misses.extend(inner.near_misses)
    for graph in (gm, *checkpoint.bodies(gm)):
        report.sites.extend(_function_sites(graph, options))
    report.seconds = {**(seconds or {}), "rewrite": time.perf_counter() - start}
    report.rank = rank()
    log.info("%s", report.summary())
    rewrite = record(report, before, gm, options.debug_dir) if before is not None else None
    return report, rewrite


def _function_sites(gm: GraphModule, options: Options) -> list[SiteReport]:
    """The sites inside custom autograd Functions' forward bodies, reported as skipped: the
    Function's own forward and backward run as written (retrace.py)."""
    found = []
    for node, body in function_bodies(gm):
        where = ops.source_line(node) or ops.module_path(node) or node.name
        reason = (f"inside a custom autograd.Function (applied at {where}): its own forward and backward "
                  "run as written, a kernel boundary rla does not rewrite")
        inner = align(body, options, name="function body")  # a traced copy: the graph keeps the Function's own body
        found += [replace(s, status="skipped", reason=reason, source=s.source or where) for s in inner.sites]
    return found


def rank() -> int | None:
    """This process's rank when torch.distributed is initialised (reports are per rank)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return None


def graph_name() -> str:
    """The name Dynamo gives the graph being compiled (its compile id), or "graph"."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    return str(compile_id) if compile_id is not None else "graph"
