"""The rewrite engine: find sites, then make each one follow the rounding contract.

Every site, whatever its kind, is rewritten the same way (contract.md):

1. inputs: each low-precision value entering the region is upcast to fp32, once per site.
   Sites do not share upcasts: each is a boundary of its own, so in the backward each site's
   input gradient is rounded at that boundary and gradients from several sites add up in the
   input dtype, as they do between separately written modules. A value that the graph
   computed entirely in fp32 (from integers and fp32 values, never from a low-precision
   activation) and rounded only to feed sites — RoPE's cos/sin — is not upcast: the rounding
   is bypassed and the sites read the fp32 value. An activation's rounding (an MoE block's
   fp32 output cast back before the residual add) is the model's and stays.
2. inside: every cast in the region is removed, so nothing rounds to T.
3. outputs: every region value read outside the region is rounded back to the dtype it had
   before, exactly once. These casts are tagged so Inductor keeps them (see `pin_rounding`).
   The logits site is the exception (`Match.rounds_outputs=False`): its outputs leave in fp32,
   an fp32 upcast of them disappears, and a graph output of them becomes fp32.

A site whose contract computes differently from the graph (attention: `Match.computes`) is
not re-typed but replaced: its output by the computation the matcher emits, rounded once.

The rewrite keeps the dtypes the rest of the graph sees, so nothing outside the sites changes
(except cos/sin chains that only fed sites, and the logits when that site is selected). It
runs on pre-dispatch ATen (the `rla` backend, before autograd) and on Inductor's post-grad
ATen (vLLM) alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.fx import Graph, GraphModule, Node

from . import ops
from .config import Options
from .report import GraphReport, NearMiss, SiteReport
from .rewriter import Rewriter, tag_own_roundings
from . import sites as registry
from .sites import Match, Miss

__all__ = ["align", "find_sites", "Sites"]


class Sites(NamedTuple):
    """What the matchers found in a graph, in registry order."""

    aligned: list[Match]  # the sites to align
    skipped: list[tuple[Match, str]]  # sites found but not aligned, each with the reason
    misses: list[Miss]  # near misses: candidates rejected, each with the condition that failed


def find_sites(graph: Graph, selected: Iterable[str]) -> Sites:
    """The sites of the `selected` kinds in `graph`, those skipped, and the near misses.

    A matcher's candidate whose anchor an earlier matcher already claimed is the same site and
    is not looked at again; one whose nodes overlap an earlier site is skipped with a reason.
    """
    selected = set(selected)
    found = _Found()
    for matcher in registry.MATCHERS:
        for anchor in list(matcher.candidates(graph)):
            if anchor not in found.sites:
                found.add(anchor, matcher.match(anchor), selected)
    return Sites(list(found.sites.values()), found.skipped(), found.misses(selected))


class _Found:
    """The matchers' results so far: the sites claimed (by anchor, and by node for overlaps),
    those skipped, and the near misses."""

    def __init__(self) -> None:
        self.sites: dict[Node, Match] = {}  # anchor -> a site to align
        self.owner: dict[Node, Match] = {}  # region node -> the site it belongs to
        self.overlapping: list[tuple[Match, str]] = []
        self.unselected: dict[Node, Match] = {}  # anchor -> a default site not in options.sites
        self.missed: list[Miss] = []

    def add(self, anchor: Node, result: Match | Miss | None, selected: set[str]) -> None:
        if result is None:
            return
        if isinstance(result, Miss):
            self.missed.append(result)
        elif result.kind not in selected:
            if result.kind in registry.DEFAULT_SITES:  # deselected: reported as skipped
                self.unselected.setdefault(anchor, result)
            # an opt-in site (logits) not asked for is not a skipped site
        elif (other := next((self.owner[n] for n in result.nodes if n in self.owner), None)) is not None:
            self.overlapping.append((result, f"overlaps the {other.kind} site at {other.anchor.name}"))
        else:
            self.sites[anchor] = result
            self.owner.update(dict.fromkeys(result.nodes, result))

    def skipped(self) -> list[tuple[Match, str]]:
        deselected = [(m, f"{m.kind!r} is not in options.sites") for anchor, m in self.unselected.items()
                      if anchor not in self.sites]  # else e.g. a residual norm aligned as a plain rmsnorm
        return self.overlapping + deselected

    def misses(self, selected: set[str]) -> list[Miss]:
        """A near miss whose anchor was matched by another kind's matcher, or lies inside a site
        found, is not a miss; an opt-in site's misses count only when it is asked for."""
        claimed = set(self.owner) | {n for m in self.unselected.values() for n in m.nodes}
        claimed |= {n for m, _ in self.overlapping for n in m.nodes}
        return [m for m in self.missed if m.anchor not in self.sites and m.anchor not in self.unselected
                and m.anchor not in claimed and (m.kind in selected or m.kind in registry.DEFAULT_SITES)]


def _site_dtype(match: Match) -> torch.dtype:
    dtypes = [ops.dtype_of(n) for n in match.nodes]
    dtypes += [ops.dtype_of(p) for n in match.nodes for p in n.all_input_nodes]
    floating = (d for d in dtypes if d is not None and d.is_floating_point)
    return next((d for d in dtypes if d in ops.LOW_PRECISION), next(floating, torch.float32))


def _mixed_note(match: Match) -> str:
    """A site whose inputs mix bf16 and fp16 is aligned like any other; say what that means."""
    inputs = {p for n in match.nodes for p in n.all_input_nodes if p not in match.nodes}
    if len({ops.dtype_of(p) for p in inputs} & set(ops.LOW_PRECISION)) < 2:
        return ""
    return "mixed bfloat16 and float16 inputs: each upcast; outputs keep their dtype (promoted ones are not rounded)"


def _where(node: Node) -> tuple[str, str]:
    return ops.module_path(node), ops.source_line(node)


@dataclass
class _Plan:
    """What `align` does with one site: its match, activation dtype and region (node names in
    graph order, before the rewrite), and its status and reason once decided."""

    match: Match
    dtype: torch.dtype
    nodes: tuple[str, ...]
    status: str | None = None  # None: not decided yet
    reason: str = ""


def align(gm: GraphModule, options: Options, name: str = "graph", post_grad: bool = False) -> GraphReport:
    """Rewrite `gm` in place to the rounding contract; return what was found and done.

    1. find the sites (`find_sites`), one plan each in graph order;
    2. decide every site's status before any rewrite (a bypass done for one site serves others);
    3. rewrite the sites to rewrite, and report them all.

    `post_grad`: the graph is Inductor's post-grad IR (inference passes, vLLM), where new casts
    must be `prims.convert_element_type`; otherwise pre-dispatch ATen (the rla backend)."""
    graph = gm.graph
    found = find_sites(graph, options.sites)
    plans = _plans(graph, found.aligned, found.skipped)
    rewriter = Rewriter(graph, {n for p in plans if p.status is None for n in p.match.nodes}, post_grad,
                        options)
    _decide(plans, rewriter)
    for plan in plans:
        if plan.status == "rewritten":
            rewriter.rewrite(plan.match)
            plan.reason = "; ".join(r for r in (plan.reason, rewriter.notes.get(plan.match, "")) if r)
        elif plan.status == "already_aligned" and plan.dtype in ops.LOW_PRECISION:
            tag_own_roundings(plan.match)

    report = GraphReport(
        graph=name,
        sites=[_site_report(p) for p in plans],
        near_misses=[NearMiss(m.kind, m.anchor.name, ops.module_path(m.anchor), m.reason) for m in found.misses],
        note=_graph_note(graph),
    )
    if any(s.status == "rewritten" for s in report.sites):
        graph.lint()
        gm.recompile()
    return report


def _plans(graph: Graph, matches: list[Match], skipped: list[tuple[Match, str]]) -> list[_Plan]:
    """One plan per site found, in graph order of the anchors. Skipped sites, and sites whose
    activations are not low precision, are decided here; the others wait for `_decide`."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    found = [(m, None) for m in matches] + skipped  # sorted stably: a site before one skipped at its anchor
    plans = []
    for match, skip_reason in sorted(found, key=lambda pair: position[pair[0].anchor]):
        plan = _Plan(match, _site_dtype(match), tuple(n.name for n in graph.nodes if n in match.nodes))
        if skip_reason is not None:
            plan.status, plan.reason = "skipped", skip_reason
        elif plan.dtype not in ops.LOW_PRECISION:
            plan.status = "already_aligned"
            plan.reason = f"{ops.dtype_name(plan.dtype)} activations: no rounding to move"
        plans.append(plan)
    return plans


def _decide(plans: list[_Plan], rewriter: Rewriter) -> None:
    """Rewritten, or already aligned: computed in fp32 with no rounding inside and none of its
    inputs a rounding the cast bypass would remove."""
    for plan in plans:
        if plan.status is not None:
            continue
        match = plan.match
        lowp_inside = [n for n in match.nodes if ops.dtype_of(n) in ops.LOW_PRECISION]
        inputs = {p for n in match.nodes for p in n.all_input_nodes if p not in match.nodes}
        rounded_inputs = [
            p for p in inputs
            if (ops.is_low_precision(p) and rewriter.bypassable(p) is not None)
            or rewriter.rounded_upcast(p) is not None
        ]
        if not lowp_inside and not rounded_inputs and match.computes is None:  # a replaced site is recomputed
            plan.status, plan.reason = "already_aligned", "computed in fp32, rounded once"
        else:
            plan.status, plan.reason = "rewritten", _mixed_note(match)


def _graph_note(graph: Graph) -> str:
    """Why a graph has nothing to align, when it has no low-precision value at all."""
    if any(ops.is_low_precision(n) for n in graph.nodes):
        return ""
    floats = sorted({ops.dtype_name(d) for n in graph.nodes if (d := ops.dtype_of(n)) is not None and d.is_floating_point})
    return "nothing to align: " + (f"activations are {', '.join(floats)}" if floats else "no floating-point values")


def _site_report(plan: _Plan) -> SiteReport:
    match, nodes = plan.match, plan.nodes
    # Where the site's result is computed (the weight multiply, the gated product, RoPE's add)
    # names the user's line better than the anchor deep inside it.
    last = max(match.nodes, key=lambda n: nodes.index(n.name) if n.name in nodes else -1)
    module, source = _where(last)
    if not module:
        module = ops.module_path(match.anchor)
    return SiteReport(
        kind=match.kind,
        status=plan.status,
        variant=match.variant,
        dtype=ops.dtype_name(plan.dtype),
        module=module,
        source=source,
        anchor=match.anchor.name,
        reason="; ".join(r for r in (plan.reason, match.note) if r),
        nodes=nodes,
    )
