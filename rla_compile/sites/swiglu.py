"""Gated MLP activation: y = act(g) * u, act = silu (SwiGLU) or gelu (GeGLU).

`F.silu`, `nn.SiLU`, `g * sigmoid(g)` and Inductor's `g / (1 + exp(-g))` read alike, as do separate gate/up projections and a
fused gate_up output split in either order (`chunk`, `split`, slices): the matcher only asks
that the activation's output, through casts, is multiplied by another same-shape tensor that
is not the activation's own input.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.fx import Graph, Node

from .. import ops
from .base import Match, Miss, Site

__all__ = ["SITE", "SwiGLUMatcher"]


def _activation(anchor: Node) -> tuple[Node, Node, set[Node], str] | str | None:
    """anchor -> (gate input, activation output, nodes, act name)."""
    if ops.is_op(anchor, "silu"):
        return anchor.args[0], anchor, {anchor}, "silu"
    if ops.is_op(anchor, "gelu"):
        approx = anchor.kwargs.get("approximate", anchor.args[1] if len(anchor.args) > 1 else "none")
        return anchor.args[0], anchor, {anchor}, "gelu_tanh" if approx == "tanh" else "gelu"
    if ops.is_op(anchor, "exp") and ops.is_op(anchor.args[0], "neg"):
        # Inductor's decomposition of silu: x / (1 + exp(-x))
        x = ops.strip_casts(anchor.args[0].args[0])
        for plus_one in anchor.users:
            if ops.is_op(plus_one, "add") and 1.0 in (ops.constant(a) for a in plus_one.args):
                for div in plus_one.users:
                    if ops.is_op(div, "div") and div.args[1] is plus_one and ops.strip_casts(div.args[0]) is x:
                        nodes = {anchor, anchor.args[0], plus_one, div}
                        nodes |= ops.casts_between(anchor.args[0].args[0], x) | ops.casts_between(div.args[0], x)
                        return anchor.args[0].args[0], div, nodes, "silu"
        return None
    if ops.is_op(anchor, "sigmoid"):
        g = ops.strip_casts(anchor.args[0])
        for user in anchor.users:
            if ops.is_op(user, "mul") and len(user.args) == 2:
                other = user.args[1] if user.args[0] is anchor else user.args[0]
                if isinstance(other, Node) and ops.strip_casts(other) is g:
                    nodes = {anchor, user} | ops.casts_between(other, g)
                    return anchor.args[0], user, nodes, "silu"
        return f"{ops.describe(anchor)}: sigmoid(g) is not multiplied by g (a gate, not SiLU)"
    return None



def _fused(g: Node, u: Node) -> bool:
    """g and u are two pieces of one tensor (fused gate_up projection)."""

    def parent(n: Node) -> Node | None:
        if ops.is_op(n, "getitem", "slice", "select", "narrow"):
            return n.args[0]
        return None

    return parent(g) is not None and parent(g) is parent(u)


class SwiGLUMatcher:
    """`act(gate) * up` (SiLU: SwiGLU; GELU: GeGLU): the activation and the product in fp32,
    the product rounded once (eager also rounds the activation's output). Before:

        %silu: bf16[T, F] = aten.silu.default(%gate)
        %mul: bf16[T, F] = aten.mul.Tensor(%silu, %up)

    After:

        %gate_fp32: fp32[T, F] = aten._to_copy.default(%gate, dtype=fp32)
        %silu: fp32[T, F] = aten.silu.default(%gate_fp32)
        %up_fp32: fp32[T, F] = aten._to_copy.default(%up, dtype=fp32)
        %mul: fp32[T, F] = aten.mul.Tensor(%silu, %up_fp32)
        %mul_rounded: bf16[T, F] = aten._to_copy.default(%mul, dtype=bf16)  # rla: round swiglu
    """

    kind = "swiglu"

    def candidates(self, graph: Graph) -> Iterable[Node]:
        return ops.call_nodes(graph, "silu", "gelu", "sigmoid", "exp")

    def match(self, anchor: Node) -> Match | Miss | None:
        act = _activation(anchor)
        if act is None:
            return None
        where = ops.describe(anchor)
        if isinstance(act, str):
            return Miss(self.kind, anchor, act)
        g_in, act_out, nodes, act_name = act
        g = ops.strip_casts(g_in)
        nodes |= ops.casts_between(g_in, g)

        cur, pending = act_out, set()
        while len(cur.users) == 1 and ops.is_cast(next(iter(cur.users))):
            cur = next(iter(cur.users))
            pending.add(cur)
        product = next(
            (
                user
                for user in cur.users
                if ops.is_op(user, "mul")
                and len(user.args) == 2
                and all(isinstance(a, Node) for a in user.args)
            ),
            None,
        )
        if product is None:
            if any(user.op == "output" for user in cur.users):
                return Miss(self.kind, anchor, f"{where}: partial site: {act_name}(g) leaves the graph before "
                            "its gate multiply (a graph break splits it); left as written")
            return Miss(self.kind, anchor, f"{where}: {act_name}(g) is not multiplied by a tensor (no gate)")
        u_in = product.args[1] if product.args[0] is cur else product.args[0]
        u = ops.strip_casts(u_in)
        if u is g:
            return Miss(self.kind, anchor, f"{where}: {act_name}(x) * x is not gated")
        if ops.shape_of(u) != ops.shape_of(g):
            return Miss(self.kind, anchor, f"{where}: {act_name}(g) * u with u shaped {ops.shape_of(u)}, g {ops.shape_of(g)}")
        nodes |= pending | {product} | ops.casts_between(u_in, u)
        variant = ("geglu" if act_name.startswith("gelu") else "swiglu") + (
            ", fused gate_up" if _fused(g, u) else ""
        )
        if act_name != "silu":
            variant += f" ({act_name})"
        return Match(self.kind, anchor, frozenset(nodes), variant, {"gate": g, "up": u})


SITE = Site(
    kind=SwiGLUMatcher.kind,
    matcher=SwiGLUMatcher(),
    summary="the gated activation (SwiGLU, GeGLU) in fp32, rounded once",
)
