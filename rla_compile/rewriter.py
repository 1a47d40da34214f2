"""The contract applied to one matched region: the rewrite `engine.align` runs on each site
it decided to rewrite (engine.py's docstring says what the four steps do and why)."""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from . import ops
from .config import Options
from .sites import Match

__all__ = ["Rewriter", "mark_recompute", "mark_save", "tag_own_roundings"]


class Rewriter:
    """Applies the contract to matched regions of one graph."""

    def __init__(self, graph: Graph, site_nodes: set[Node], post_grad: bool = False,
                 options: Options | None = None):
        self.graph = graph
        self.options = options or Options()  # a site's rounding resolved by `options.rounding_of`
        self.post_grad = post_grad  # Inductor's post-grad IR: casts are prims.convert_element_type
        self.site_nodes = site_nodes  # all nodes of sites being rewritten (for the bypass rule)
        self._fp32_only: dict[Node, bool] = {}
        # a node another site re-typed to fp32 -> its output rounding: what the graph's other
        # readers now read, and what a replaced site's role names (`replace`)
        self.rounded_as: dict[Node, Node] = {}
        self.notes: dict[Match, str] = {}  # what a replaced site's form says about itself (`replace`)

    def _output_rounding(self, kind: str) -> str:
        """How the site `kind`'s output rounds ("nearest" or "toward_zero")."""
        return self.options.rounding_of(kind).mode

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
        if ops.is_site_rounding(chain) or chain.args[0] in self.site_nodes:
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

    def _round(self, value: Node, dtype: torch.dtype, kind: str, name: str) -> Node:
        """The site `kind`'s one rounding of its fp32 `value`, placed right after it, tagged."""
        mode = self._output_rounding(kind)
        if mode == "nearest":
            with self.graph.inserting_after(value):
                rounded = self._cast(value, dtype, name)
        else:
            from .emit import Emitter

            rounded = Emitter(self.graph, value.next, self.post_grad).round(value, dtype, mode, name)
        ops.tag_rounding(rounded, kind)
        return rounded

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
        """Make `match`'s region follow the contract (the module docstring's four steps)."""
        if match.computes is not None:
            self.replace(match)
            return
        order = [n for n in self.graph.nodes if n in match.nodes]
        outside = {n: [u for u in n.users if u not in match.nodes] for n in order}
        dtype_before = {n: ops.dtype_of(n) for n in order}
        upcasts = self._upcast_inputs(match, order)
        fp32_value = self._compute_in_fp32(match, order)
        rounding = self._round_outputs(match, order, outside, dtype_before, fp32_value)
        for node in reversed(order):
            if ops.is_cast(node) and not node.users:
                self.graph.erase_node(node)
        if not self.post_grad:  # pre-dispatch: before autograd
            _mark_backward(match, upcasts, rounding)

    def _upcast_inputs(self, match: Match, order: list[Node]) -> dict[Node, Node]:
        """1. inputs: each low-precision value entering the region upcast once (or its fp32
        origin read, where the bypass rule covers its rounding). -> value -> its upcast."""
        upcasts: dict[Node, Node] = {}
        for node in order:
            for value in node.all_input_nodes:
                if value not in match.nodes and ops.is_low_precision(value):
                    node.replace_input_with(value, self.to_fp32(value, upcasts, node))
                elif value not in match.nodes and (bypass := self.rounded_upcast(value)) is not None:
                    self._bypass(*bypass)
        return upcasts

    def _compute_in_fp32(self, match: Match, order: list[Node]) -> dict[Node, Node]:
        """2. inside: casts disappear, everything else computes in fp32. -> region node -> the
        node now holding its fp32 value."""
        fp32_value: dict[Node, Node] = {}
        for node in order:
            if ops.is_cast(node):
                source = node.args[0]
                fp32_value[node] = fp32_value.get(source, source)
                for user in list(node.users):
                    if user in match.nodes:
                        user.replace_input_with(node, fp32_value[node])
            else:
                fp32_value[node] = node
                _compute_dtype_fp32(node)
                if ops.dtype_of(node) in ops.LOW_PRECISION:
                    _set_dtype(node, torch.float32)
        return fp32_value

    def _round_outputs(self, match: Match, order: list[Node], outside: dict, dtype_before: dict,
                       fp32_value: dict[Node, Node]) -> dict[Node, Node]:
        """3. outputs: one rounding per value read outside the region (none for a site whose
        outputs leave in fp32). -> region node -> its output rounding."""
        rounding: dict[Node, Node] = {}
        for node in order:
            users, value = outside[node], fp32_value[node]
            if not users:
                continue
            if not match.rounds_outputs:  # the outputs leave in fp32; an upcast of them is now a no-op
                for user in users:
                    if ops.widens(user) and ops.dtype_of(user) == torch.float32:
                        user.replace_all_uses_with(value)
                        self.graph.erase_node(user)
                    else:
                        user.replace_input_with(node, value)
                continue
            if dtype_before[node] in ops.LOW_PRECISION:
                rounded = self._round(value, dtype_before[node], match.kind, f"{node.name}_rounded")
                rounding[node] = self.rounded_as[node] = rounded
            else:
                rounded = value
            for user in users:
                user.replace_input_with(node, rounded)
            if rounded is value:  # the model's own rounding of an fp32 output: keep it
                for user in users:
                    if ops.is_cast(user) and ops.is_low_precision(user):
                        self._own_rounding(user, match.kind)
        return rounding

    def _own_rounding(self, cast: Node, kind: str) -> None:
        """The model's own rounding of a site's fp32 output is the site's one rounding: tagged,
        and recomputed in the site's rounding mode when that is not "nearest"."""
        mode = self._output_rounding(kind)
        if mode != "nearest":
            from .emit import Emitter

            own = Emitter(self.graph, cast, self.post_grad).round(cast.args[0], ops.dtype_of(cast), mode, f"{cast.name}_{mode}")
            cast.replace_all_uses_with(own)
            self.graph.erase_node(cast)
            cast = own
        ops.tag_rounding(cast, kind)

    def replace(self, match: Match) -> None:
        """A site that computes differently from the graph (`Match.computes`: attention): its
        one output is replaced by the contract's computation, emitted before it from the roles
        (upcast there), rounded once; the region's nodes nothing reads any more disappear."""
        from .emit import Emitter

        (output,) = [n for n in self.graph.nodes if n in match.nodes and any(u not in match.nodes for u in n.users)]
        emitter = Emitter(self.graph, output, self.post_grad)
        # a role another site rewrote before (q and k out of RoPE) now holds that site's fp32
        # value: the replacement reads what the graph's other readers read, its one rounding
        roles = {role: self.rounded_as.get(node, node) for role, node in match.roles.items()}
        value = match.computes(emitter, roles, self.options)
        self.notes[match] = emitter.note
        dtype = ops.dtype_of(output)
        if dtype in ops.LOW_PRECISION:
            value = emitter.round(value, dtype, self._output_rounding(match.kind), f"{output.name}_rounded")
            ops.tag_rounding(value, match.kind)
        # else the graph's own rounding of the fp32 output is the site's one rounding
        own = [] if dtype in ops.LOW_PRECISION else [u for u in output.users if ops.is_cast(u) and ops.is_low_precision(u)]
        value = emitter.laid_out_like(value, output.meta.get("val"))  # users may rely on the output's layout
        output.replace_all_uses_with(value)
        for cast in own:
            self._own_rounding(cast, match.kind)
        for node in reversed([n for n in self.graph.nodes if n in match.nodes]):
            if not node.users:
                self.graph.erase_node(node)
        if not self.post_grad:  # the backward recomputes these upcasts instead of saving fp32 copies
            sources = {roles[role] for role in match.recompute if role in roles}
            for node in emitter.emitted:
                if ops.is_cast(node) and node.args[0] in sources:
                    mark_recompute(node)


def _mark_backward(match: Match, upcasts: dict[Node, Node], rounding: dict[Node, Node]) -> None:
    """4. what the backward recomputes (`Match.recompute`) and what it reads saved (`Match.save`)."""
    for role in match.recompute:
        upcast = upcasts.get(match.roles[role])
        if upcast is not None and upcast is not match.roles[role]:  # not bypassed
            mark_recompute(upcast)
    for role in match.save:
        if match.roles[role] in rounding:
            mark_save(rounding[match.roles[role]])


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
    rounding came from, so `lowering.keep_site_roundings` must run those upcasts on ATen (small
    Llama training 1.08x plain Inductor). Saved, the stream is a backward input: no rounding
    in the backward's kernels at all. It costs bytes: the norm's backward reads the fp32 sum, rebuilt
    from the saved stream and the block output (two bf16 tensors), where plain Inductor's norm
    reads its one saved bf16 sum (benchmarks/results/residual_save_cpu.json). Inside an
    activation-checkpointed region, the checkpoint's own policy replaces this tag."""
    from torch.utils.checkpoint import CheckpointPolicy

    rounding.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def _compute_dtype_fp32(node: Node) -> None:
    """An op inside a region told to compute in a low-precision dtype (GPT-OSS's
    `softmax(x, dtype=bf16)`) computes in fp32."""
    if any(a in ops.LOW_PRECISION for a in node.args):
        node.args = tuple(torch.float32 if a in ops.LOW_PRECISION else a for a in node.args)
    if any(v in ops.LOW_PRECISION for v in node.kwargs.values()):
        node.kwargs = {k: torch.float32 if v in ops.LOW_PRECISION else v for k, v in node.kwargs.items()}


def _set_dtype(node: Node, dtype: torch.dtype) -> None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype != dtype:
        node.meta["val"] = val.to(dtype)
    node.meta.pop("tensor_meta", None)


def tag_own_roundings(match: Match) -> None:
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
                ops.tag_rounding(user, match.kind)
