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

import torch
from torch.fx import Graph, GraphModule, Node

from . import ops
from .config import Options
from .report import GraphReport, NearMiss, SiteReport
from .sites import DEFAULT_SITES, MATCHERS, Match, Miss

__all__ = ["align", "find_sites", "mark_recompute", "mark_save", "ROUNDING_TAG", "is_site_rounding"]

ROUNDING_TAG = "rla_round"  # node.meta["custom"][ROUNDING_TAG] = site kind, on every output rounding


def is_site_rounding(node: Node) -> bool:
    return ROUNDING_TAG in (node.meta.get("custom") or {})


def find_sites(graph: Graph, selected: Iterable[str]) -> tuple[list[Match], list[tuple[Match, str]], list[Miss]]:
    """(matches to align, matches skipped with a reason, near misses), in registry order.

    A matcher's candidate whose anchor an earlier matcher already claimed is the same site and
    is not looked at again; one whose nodes overlap an earlier site is skipped with a reason.
    """
    selected = set(selected)
    found = _Found()
    for matcher in MATCHERS:
        for anchor in list(matcher.candidates(graph)):
            if anchor not in found.sites:
                found.add(anchor, matcher.match(anchor), selected)
    return list(found.sites.values()), found.skipped(), found.misses(selected)


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
            if result.kind in DEFAULT_SITES:  # deselected: reported as skipped
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
                and m.anchor not in claimed and (m.kind in selected or m.kind in DEFAULT_SITES)]


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


class _Rewriter:
    """Applies the contract to matched regions of one graph."""

    def __init__(self, graph: Graph, site_nodes: set[Node], post_grad: bool = False):
        self.graph = graph
        self.post_grad = post_grad  # Inductor's post-grad IR: casts are prims.convert_element_type
        self.site_nodes = site_nodes  # all nodes of sites being rewritten (for the bypass rule)
        self._fp32_only: dict[Node, bool] = {}

    # -- inputs -------------------------------------------------------------------------
    def bypassable(self, value: Node) -> tuple[Node, set[Node]] | None:
        """(the cast that rounded `value`'s fp32 origin, the data-movement nodes between it and
        the sites) if that rounding only feeds sites, through views, gathers, splits and the
        sites' own upcasts of it (`cos.float()` inside a site)."""
        chain = value
        while ops.moves_data(chain):
            chain = chain.args[0]
        if not ops.is_cast(chain) or ops.dtype_of(chain.args[0]) != torch.float32:
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
            if not ((ops.moves_data(user) or ops.widens(user)) and user.args[0] is source):
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
                if ops.is_low_precision(current) or self._fp32_only.get(current) is False:
                    result = False
                stack.extend(current.all_input_nodes)
            self._fp32_only[node] = result
        return self._fp32_only[node]

    def rounded_upcast(self, value: Node) -> tuple[Node, set[Node]] | None:
        """The bypass for a site input that is an upcast of a rounding the bypass rule covers
        (`cos32.to(bf16)` outside, `cos.float()` inside the site)."""
        if ops.widens(value) and ops.is_low_precision(value.args[0]):
            return self.bypassable(value.args[0])
        return None

    def _bypass(self, cast: Node, moved: set[Node]) -> None:
        """Read the fp32 origin; the data movement between it and the sites now carries fp32."""
        cast.replace_all_uses_with(cast.args[0])
        self.graph.erase_node(cast)
        for node in moved:
            _set_dtype(node, torch.float32)

    def to_fp32(self, value: Node, upcasts: dict[Node, Node], reader: Node) -> Node:
        """The fp32 version of `value` for one site (`upcasts`: that site's upcasts so far),
        placed just before `reader`, its first reader in the site: the value's other users keep
        their order, so a bf16 value's gradients still accumulate in the order they did (a
        post-norm block's residual stream feeds its MLP before the residual add; a graph input
        read by a projection before the site)."""
        if value in upcasts:
            return upcasts[value]
        bypass = self.bypassable(value)
        if bypass is not None:
            self._bypass(*bypass)
            result = value
        else:
            with self.graph.inserting_before(reader):
                result = self._cast(value, torch.float32, f"{value.name}_fp32")
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
        if match.computes is not None:
            self.replace(match)
            return
        region = match.nodes
        order = [n for n in self.graph.nodes if n in region]
        outside = {n: [u for u in n.users if u not in region] for n in order}
        dtype_before = {n: ops.dtype_of(n) for n in order}

        upcasts: dict[Node, Node] = {}
        for node in order:  # 1. inputs
            for value in node.all_input_nodes:
                if value not in region and ops.is_low_precision(value):
                    node.replace_input_with(value, self.to_fp32(value, upcasts, node))
                elif value not in region and (bypass := self.rounded_upcast(value)) is not None:
                    self._bypass(*bypass)

        fp32_value: dict[Node, Node] = {}  # region node -> the node now holding its fp32 value
        rounding: dict[Node, Node] = {}  # region node -> its output rounding
        for node in order:  # 2. inside: casts disappear, everything else computes in fp32
            if ops.is_cast(node):
                source = node.args[0]
                fp32_value[node] = fp32_value.get(source, source)
                for user in list(node.users):
                    if user in region:
                        user.replace_input_with(node, fp32_value[node])
            else:
                fp32_value[node] = node
                if ops.dtype_of(node) in ops.LOW_PRECISION:
                    _set_dtype(node, torch.float32)

        for node in order:  # 3. outputs: one rounding per value read outside
            users = outside[node]
            if not users:
                continue
            value = fp32_value[node]
            if not match.rounds_outputs:  # the logits: they leave in fp32; an upcast of them is now a no-op
                for user in users:
                    if ops.widens(user) and ops.dtype_of(user) == torch.float32:
                        user.replace_all_uses_with(value)
                        self.graph.erase_node(user)
                    else:
                        user.replace_input_with(node, value)
                continue
            if dtype_before[node] in ops.LOW_PRECISION:
                with self.graph.inserting_after(value):
                    rounded = self._cast(value, dtype_before[node], f"{node.name}_rounded")
                _tag_rounding(rounded, match.kind)
                rounding[node] = rounded
            else:
                rounded = value
                for user in users:  # the model's own rounding of an fp32 output: keep it
                    if ops.is_cast(user) and ops.is_low_precision(user):
                        _tag_rounding(user, match.kind)
            for user in users:
                user.replace_input_with(node, rounded)

        for node in reversed(order):
            if ops.is_cast(node) and not node.users:
                self.graph.erase_node(node)

        if not self.post_grad:  # 4. what the backward recomputes (pre-dispatch: before autograd)
            for role in match.recompute:
                upcast = upcasts.get(match.roles[role])
                if upcast is not None and upcast is not match.roles[role]:  # not bypassed
                    mark_recompute(upcast)
            for role in match.save:
                if match.roles[role] in rounding:
                    mark_save(rounding[match.roles[role]])

    def replace(self, match: Match) -> None:
        """A site that computes differently from the graph (`Match.computes`: attention): its
        one output is replaced by the contract's computation, emitted before it from the roles
        (upcast there), rounded once; the region's nodes nothing reads any more disappear."""
        from .emit import Emitter

        (output,) = [n for n in self.graph.nodes if n in match.nodes and any(u not in match.nodes for u in n.users)]
        emitter = Emitter(self.graph, output, self.post_grad)
        value = match.computes(emitter, match.roles)
        dtype = ops.dtype_of(output)
        if dtype in ops.LOW_PRECISION:
            value = emitter.cast(value, dtype, f"{output.name}_rounded")
            _tag_rounding(value, match.kind)
        else:  # the graph's own rounding of an fp32 output: the site's one rounding
            for user in output.users:
                if ops.is_cast(user) and ops.is_low_precision(user):
                    _tag_rounding(user, match.kind)
        output.replace_all_uses_with(value)
        for node in reversed([n for n in self.graph.nodes if n in match.nodes]):
            if not node.users:
                self.graph.erase_node(node)
        if not self.post_grad:  # the backward recomputes these upcasts instead of saving fp32 copies
            sources = {match.roles[role] for role in match.recompute if role in match.roles}
            for node in emitter.emitted:
                if ops.is_cast(node) and node.args[0] in sources:
                    mark_recompute(node)


def mark_recompute(upcast: Node) -> None:
    """Tag a site's fp32 upcast of an input for recomputation in the backward (AOTAutograd's
    partitioner honours `meta["recompute"]`, the tag activation checkpointing uses): the
    backward then saves the low-precision input instead of its fp32 copy, and upcasts it
    again, exactly (the same bits)."""
    from torch.utils.checkpoint import CheckpointPolicy

    upcast.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


def mark_save(rounding: Node) -> None:
    """Tag a site's output rounding to be saved for the backward (`meta["recompute"]`, as
    above), so the backward reads the stored low-precision value instead of recomputing it.

    For a rounding that the backward would otherwise recompute and upcast in one kernel: the
    residual stream, where the partitioner left alone recomputes round(s_k) and the next sum
    up(round(s_k)) + up(out_k+1) from the block outputs, a chain of pointwise ops Inductor fuses
    into one kernel. There its C++ code generator would hand the upcast the fp32 value the
    rounding came from, so `backend.keep_site_roundings` must run those upcasts on ATen (small
    Llama training 1.08x plain Inductor). Saved, the stream is a backward input: no rounding
    in the backward's kernels at all. It costs bytes: the norm's backward reads the fp32 sum, rebuilt
    from the saved stream and the block output (two bf16 tensors), where plain Inductor's norm
    reads its one saved bf16 sum (benchmarks/results/residual_save_cpu.json). Inside an
    activation-checkpointed region, the checkpoint's own policy replaces this tag."""
    from torch.utils.checkpoint import CheckpointPolicy

    rounding.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def _set_dtype(node: Node, dtype: torch.dtype) -> None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype != dtype:
        node.meta["val"] = val.to(dtype)
    node.meta.pop("tensor_meta", None)


def _tag_rounding(node: Node, kind: str) -> None:
    node.meta["custom"] = {**(node.meta.get("custom") or {}), ROUNDING_TAG: kind}
    # Read by Inductor's pointwise lowering: round here even when the consumer fuses.
    node.meta["low_precision_pointwise_barrier"] = True


def _tag_own_roundings(match: Match) -> None:
    """An already aligned site's own rounding of its fp32 output is its one rounding, and is
    kept like a rewritten site's: tagged, so that Inductor neither fuses it away nor computes
    the fp32 value it rounds with other math than eager's when rounding is pinned (litgpt's
    Qwen3 q/k norms: Inductor's own mean moved one element of one row across a rounding
    boundary, 33 logits differed)."""
    if not match.rounds_outputs:
        return
    for node in match.nodes:
        for user in node.users:
            if user not in match.nodes and ops.is_cast(user) and ops.is_low_precision(user):
                _tag_rounding(user, match.kind)


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
    matches, skipped, misses = find_sites(graph, options.sites)
    plans = _plans(graph, matches, skipped)
    rewriter = _Rewriter(graph, {n for p in plans if p.status is None for n in p.match.nodes}, post_grad)
    _decide(plans, rewriter)
    for plan in plans:
        if plan.status == "rewritten":
            rewriter.rewrite(plan.match)
        elif plan.status == "already_aligned" and plan.dtype in ops.LOW_PRECISION:
            _tag_own_roundings(plan.match)

    report = GraphReport(
        graph=name,
        sites=[_site_report(p) for p in plans],
        near_misses=[NearMiss(m.kind, m.anchor.name, ops.module_path(m.anchor), m.reason) for m in misses],
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


def _decide(plans: list[_Plan], rewriter: _Rewriter) -> None:
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
