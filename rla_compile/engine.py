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

The rewrite keeps the dtypes the rest of the graph sees, so nothing outside the sites changes
(except cos/sin chains that only fed sites, and the logits when that site is selected). It
runs on pre-dispatch ATen (the `rla` backend, before autograd) and on Inductor's post-grad
ATen (vLLM) alike.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.fx import Graph, GraphModule, Node

from . import fx
from .config import Options
from .report import GraphReport, NearMiss, SiteReport
from .sites import DEFAULT_SITES, MATCHERS, Match, Miss

__all__ = ["align", "find_sites", "ROUNDING_TAG", "is_site_rounding"]

ROUNDING_TAG = "rla_round"  # node.meta["custom"][ROUNDING_TAG] = site kind, on every output rounding


def is_site_rounding(node: Node) -> bool:
    return ROUNDING_TAG in (node.meta.get("custom") or {})


def find_sites(graph: Graph, selected: Iterable[str]) -> tuple[list[Match], list[tuple[Match, str]], list[Miss]]:
    """(matches to align, matches skipped with a reason, near misses), in registry order.

    A matcher's candidate whose anchor an earlier matcher already claimed is the same site and
    is not looked at again; one whose nodes overlap an earlier site is skipped with a reason.
    """
    selected = set(selected)
    claimed_anchors: dict[Node, Match] = {}
    claimed_nodes: dict[Node, Match] = {}
    matches: list[Match] = []
    unselected: dict[Node, Match] = {}
    skipped: list[tuple[Match, str]] = []
    misses: list[Miss] = []
    for matcher in MATCHERS:
        for anchor in list(matcher.candidates(graph)):
            if anchor in claimed_anchors:
                continue
            result = matcher.match(anchor)
            if result is None:
                continue
            if isinstance(result, Miss):
                misses.append(result)
                continue
            if result.kind not in selected:
                if result.kind in DEFAULT_SITES:  # deselected: reported as skipped
                    unselected.setdefault(anchor, result)
                continue  # an opt-in site (logits) not asked for is not a skipped site
            overlap = next((claimed_nodes[n] for n in result.nodes if n in claimed_nodes), None)
            if overlap is not None:
                skipped.append((result, f"overlaps the {overlap.kind} site at {overlap.anchor.name}"))
                continue
            claimed_anchors[anchor] = result
            claimed_nodes.update(dict.fromkeys(result.nodes, result))
            matches.append(result)
    for anchor, match in unselected.items():
        if anchor in claimed_anchors:
            continue  # e.g. a residual norm aligned as a plain rmsnorm
        skipped.append((match, f"{match.kind!r} is not in options.sites"))
    # A near miss whose anchor was matched by another kind's matcher is not a miss.
    misses = [m for m in misses if m.anchor not in claimed_anchors and m.anchor not in unselected
              and (m.kind in selected or m.kind in DEFAULT_SITES)]  # an opt-in site's misses only when asked for
    return matches, skipped, misses


def _site_dtype(match: Match) -> torch.dtype:
    dtypes = [fx.dtype_of(n) for n in match.nodes]
    dtypes += [fx.dtype_of(p) for n in match.nodes for p in n.all_input_nodes]
    floating = (d for d in dtypes if d is not None and d.is_floating_point)
    return next((d for d in dtypes if d in fx.LOW_PRECISION), next(floating, torch.float32))


def _mixed_note(match: Match) -> str:
    """A site whose inputs mix bf16 and fp16 is aligned like any other; say what that means."""
    inputs = {p for n in match.nodes for p in n.all_input_nodes if p not in match.nodes}
    if len({fx.dtype_of(p) for p in inputs} & set(fx.LOW_PRECISION)) < 2:
        return ""
    return "mixed bfloat16 and float16 inputs: each upcast; outputs keep their dtype (promoted ones are not rounded)"


class _Rewriter:
    """Applies the contract to matched regions of one graph."""

    def __init__(self, graph: Graph, site_nodes: set[Node], post_grad: bool = False):
        self.graph = graph
        self.post_grad = post_grad  # Inductor's post-grad IR: casts are prims.convert_element_type
        self.site_nodes = site_nodes  # all nodes of sites being rewritten (for the bypass rule)
        self._input_casts_end: Node | None = None  # last upcast of a graph input
        self._fp32_only: dict[Node, bool] = {}

    # -- inputs -------------------------------------------------------------------------
    def bypassable(self, value: Node) -> tuple[Node, set[Node]] | None:
        """(the cast that rounded `value`'s fp32 origin, the data-movement nodes between it and
        the sites) if that rounding only feeds sites, through views, gathers, splits and the
        sites' own upcasts of it (`cos.float()` inside a site)."""
        chain = value
        while fx.moves_data(chain):
            chain = chain.args[0]
        if not fx.is_cast(chain) or fx.dtype_of(chain.args[0]) != torch.float32:
            return None
        if is_site_rounding(chain) or chain.args[0] in self.site_nodes:
            return None  # a site's own output rounding (e.g. the residual stream's) stays
        if not self._computed_in_fp32(chain.args[0]):
            return None  # an activation's rounding (e.g. an MoE block's output) is the model's
        moved: set[Node] = set()
        frontier = [(user, chain) for user in chain.users]
        while frontier:
            user, source = frontier.pop()
            if user in self.site_nodes or user in moved:
                continue
            if not ((fx.moves_data(user) or fx.widens(user)) and user.args[0] is source):
                return None
            moved.add(user)
            frontier.extend((u, user) for u in user.users)
        return chain, moved

    def _computed_in_fp32(self, node: Node) -> bool:
        """Whether `node` is computed from integers and fp32 values only (RoPE's tables from
        positions and inv_freq), never from a low-precision activation."""
        if node not in self._fp32_only:
            stack, seen, result = [node], set(), True
            while stack and result:
                current = stack.pop()
                if current in seen:
                    continue
                seen.add(current)
                if fx.is_low_precision(current) or self._fp32_only.get(current) is False:
                    result = False
                stack.extend(current.all_input_nodes)
            self._fp32_only[node] = result
        return self._fp32_only[node]

    def rounded_upcast(self, value: Node) -> tuple[Node, set[Node]] | None:
        """The bypass for a site input that is an upcast of a rounding the bypass rule covers
        (`cos32.to(bf16)` outside, `cos.float()` inside the site)."""
        if fx.widens(value) and fx.is_low_precision(value.args[0]):
            return self.bypassable(value.args[0])
        return None

    def _bypass(self, cast: Node, moved: set[Node]) -> None:
        """Read the fp32 origin; the data movement between it and the sites now carries fp32."""
        cast.replace_all_uses_with(cast.args[0])
        self.graph.erase_node(cast)
        for node in moved:
            _set_dtype(node, torch.float32)

    def to_fp32(self, value: Node, upcasts: dict[Node, Node]) -> Node:
        """The fp32 version of `value` for one site (`upcasts`: that site's upcasts so far)."""
        if value in upcasts:
            return upcasts[value]
        bypass = self.bypassable(value)
        if bypass is not None:
            self._bypass(*bypass)
            result = value
        else:
            after = value
            if value.op == "placeholder":  # keep the inputs together at the top of the graph
                after = self._input_casts_end or list(self.graph.find_nodes(op="placeholder"))[-1]
            with self.graph.inserting_after(after):
                result = self._cast(value, torch.float32, f"{value.name}_fp32")
            if value.op == "placeholder":
                self._input_casts_end = result
        upcasts[value] = result
        return result

    def _cast(self, value: Node, dtype: torch.dtype, name: str) -> Node:
        if self.post_grad:
            target, args, kwargs = torch.ops.prims.convert_element_type.default, (value, dtype), {}
        else:
            target, args, kwargs = torch.ops.aten._to_copy.default, (value,), {"dtype": dtype}
        node = self.graph.create_node("call_function", target, args, kwargs, name=name)
        node.meta.update({k: v for k, v in value.meta.items() if k in ("nn_module_stack", "stack_trace")})
        node.meta["val"] = value.meta["val"].to(dtype)
        return node

    # -- the rewrite --------------------------------------------------------------------
    def rewrite(self, match: Match) -> None:
        region = match.nodes
        order = [n for n in self.graph.nodes if n in region]
        outside = {n: [u for u in n.users if u not in region] for n in order}
        dtype_before = {n: fx.dtype_of(n) for n in order}

        upcasts: dict[Node, Node] = {}
        for node in order:  # 1. inputs
            for value in node.all_input_nodes:
                if value not in region and fx.is_low_precision(value):
                    node.replace_input_with(value, self.to_fp32(value, upcasts))
                elif value not in region and (bypass := self.rounded_upcast(value)) is not None:
                    self._bypass(*bypass)

        fp32_value: dict[Node, Node] = {}  # region node -> the node now holding its fp32 value
        for node in order:  # 2. inside: casts disappear, everything else computes in fp32
            if fx.is_cast(node):
                source = node.args[0]
                fp32_value[node] = fp32_value.get(source, source)
                for user in list(node.users):
                    if user in region:
                        user.replace_input_with(node, fp32_value[node])
            else:
                fp32_value[node] = node
                if fx.dtype_of(node) in fx.LOW_PRECISION:
                    _set_dtype(node, torch.float32)

        for node in order:  # 3. outputs: one rounding per value read outside
            users = outside[node]
            if not users:
                continue
            value = fp32_value[node]
            if not match.rounds_outputs:  # the logits: they leave in fp32; an upcast of them is now a no-op
                for user in users:
                    if fx.widens(user) and fx.dtype_of(user) == torch.float32:
                        user.replace_all_uses_with(value)
                        self.graph.erase_node(user)
                    else:
                        user.replace_input_with(node, value)
                continue
            if dtype_before[node] in fx.LOW_PRECISION:
                with self.graph.inserting_after(value):
                    rounded = self._cast(value, dtype_before[node], f"{node.name}_rounded")
                _tag_rounding(rounded, match.kind)
            else:
                rounded = value
                for user in users:  # the model's own rounding of an fp32 output: keep it
                    if fx.is_cast(user) and fx.is_low_precision(user):
                        _tag_rounding(user, match.kind)
            for user in users:
                user.replace_input_with(node, rounded)

        for node in reversed(order):
            if fx.is_cast(node) and not node.users:
                self.graph.erase_node(node)


def _set_dtype(node: Node, dtype: torch.dtype) -> None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype != dtype:
        node.meta["val"] = val.to(dtype)
    node.meta.pop("tensor_meta", None)


def _tag_rounding(node: Node, kind: str) -> None:
    node.meta["custom"] = {**(node.meta.get("custom") or {}), ROUNDING_TAG: kind}
    # Read by Inductor's pointwise lowering: round here even when the consumer fuses.
    node.meta["low_precision_pointwise_barrier"] = True


def _where(node: Node) -> tuple[str, str]:
    return fx.module_path(node), fx.source_line(node)


def align(gm: GraphModule, options: Options, name: str = "graph", post_grad: bool = False) -> GraphReport:
    """Rewrite `gm` in place to the rounding contract; return what was found and done.

    `post_grad`: the graph is Inductor's post-grad IR (inference passes, vLLM), where new casts
    must be `prims.convert_element_type`; otherwise pre-dispatch ATen (the rla backend)."""
    graph = gm.graph
    matches, skipped, misses = find_sites(graph, options.sites)
    report = GraphReport(graph=name)

    position = {n: i for i, n in enumerate(graph.nodes)}
    matches.sort(key=lambda m: position[m.anchor])
    names = {m: tuple(n.name for n in graph.nodes if n in m.nodes) for m in matches}
    names.update({m: tuple(n.name for n in graph.nodes if n in m.nodes) for m, _ in skipped})
    skipped = [(m, reason, _site_dtype(m)) for m, reason in skipped]
    plans = []
    for match in matches:
        dtype = _site_dtype(match)
        if dtype not in fx.LOW_PRECISION:
            name = str(dtype).removeprefix("torch.")
            plans.append((match, dtype, "already_aligned", f"{name} activations: no rounding to move"))
        else:
            plans.append((match, dtype, None, ""))
    site_nodes = {n for m, _, status, _ in plans if status is None for n in m.nodes}
    rewriter = _Rewriter(graph, site_nodes, post_grad)

    decided = []  # every status before any rewrite: a bypass done for one site serves others too
    for match, dtype, status, reason in plans:
        if status is None:
            lowp_inside = [n for n in match.nodes if fx.dtype_of(n) in fx.LOW_PRECISION]
            inputs = {p for n in match.nodes for p in n.all_input_nodes if p not in match.nodes}
            rounded_inputs = [
                p for p in inputs
                if (fx.is_low_precision(p) and rewriter.bypassable(p) is not None)
                or rewriter.rounded_upcast(p) is not None
            ]
            if not lowp_inside and not rounded_inputs:
                status, reason = "already_aligned", "computed in fp32, rounded once"
            else:
                status, reason = "rewritten", _mixed_note(match)
        decided.append((match, dtype, status, reason))
    for match, dtype, status, reason in decided:
        if status == "rewritten":
            rewriter.rewrite(match)
        report.sites.append(_site_report(match, status, dtype, reason, names[match]))

    for match, reason, dtype in skipped:
        report.sites.append(_site_report(match, "skipped", dtype, reason, names[match]))
    order = {m.anchor.name: position[m.anchor] for m in matches} | {m.anchor.name: position[m.anchor] for m, _, _ in skipped}
    report.sites.sort(key=lambda s: order[s.anchor])
    for miss in misses:
        report.near_misses.append(NearMiss(miss.kind, miss.anchor.name, fx.module_path(miss.anchor), miss.reason))

    if not any(fx.is_low_precision(n) for n in graph.nodes):
        floats = sorted({str(d).removeprefix("torch.") for n in graph.nodes
                         if (d := fx.dtype_of(n)) is not None and d.is_floating_point})
        report.note = "nothing to align: " + (f"activations are {', '.join(floats)}" if floats else "no floating-point values")
    if any(s.status == "rewritten" for s in report.sites):
        graph.lint()
        gm.recompile()
    return report


def _site_report(
    match: Match, status: str, dtype: torch.dtype, reason: str, nodes: tuple[str, ...]
) -> SiteReport:
    # Where the site's result is computed (the weight multiply, the gated product, RoPE's add)
    # names the user's line better than the anchor deep inside it.
    last = max(match.nodes, key=lambda n: nodes.index(n.name) if n.name in nodes else -1)
    module, source = _where(last)
    if not module:
        module = fx.module_path(match.anchor)
    return SiteReport(
        kind=match.kind,
        status=status,
        variant=match.variant,
        dtype=str(dtype).removeprefix("torch."),
        module=module,
        source=source,
        anchor=match.anchor.name,
        reason=reason,
        nodes=nodes,
    )
