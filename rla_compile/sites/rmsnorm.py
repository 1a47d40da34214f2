"""RMSNorm: y = w * x * rsqrt(mean(x^2) + eps), Gemma's (1 + w), or weightless.

Spellings read alike: `x.pow(2)` / `x*x` / `x.square()`; `mean` / `sum / D` / `sum * (1/D)`;
`rsqrt` / `1/sqrt` / `pow(-0.5)` / `x / sqrt(...)`; weight on either side; any casts in
between. The anchor is the inverse square root; everything else is read off the graph around
it by math, not by one op sequence.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch.fx import Graph, Node

from .. import ops
from .base import Match, Miss, Site

__all__ = ["SITE", "RMSNormMatcher", "RMSNorm", "find_rmsnorm"]


@dataclass
class RMSNorm:
    """The pieces of one matched norm, for matchers that build on it (residual RMSNorm)."""

    x: Node  # the value being normalised, before any upcast
    out: Node  # last node of the site (before its output rounding)
    nodes: set[Node]
    variant: str
    weight: Node | None



def _mean_square(ms: Node) -> tuple[Node, set[Node]] | str:
    """ms = mean(x^2 over the last dim) in any spelling -> (x, nodes)."""
    nodes = {ms}
    reduce = ms
    if ops.is_op(ms, "div", "mul") and ops.constant(ms.args[1]) is not None:
        reduce = ms.args[0]  # sum / D or sum * (1/D)
        if not ops.is_op(reduce, "sum"):
            return f"{ms.name}: scaled value is not a sum"
        nodes.add(reduce)
    elif not ops.is_op(ms, "mean"):
        return f"{ms.name}: not a mean or sum/D"
    square = reduce.args[0]
    shape = ops.shape_of(square)
    dims = reduce.args[1] if len(reduce.args) > 1 else reduce.kwargs.get("dim")
    if shape is None or ops.normalize_dim(dims, len(shape)) != [len(shape) - 1]:
        return f"{reduce.name}: reduces over {dims}, not the last dim"
    if ops.is_op(square, "pow") and ops.constant(square.args[1]) == 2.0:
        x = square.args[0]
    elif ops.is_op(square, "square"):
        x = square.args[0]
    elif ops.is_op(square, "mul") and ops.strip_casts(square.args[0]) is ops.strip_casts(square.args[1]):
        x = square.args[0]
    else:
        return f"{reduce.name}: does not reduce a square"
    nodes.add(square)
    source = ops.strip_casts(x)
    nodes |= ops.casts_between(x, source)
    if ops.is_op(source, "sub") and any(ops.is_op(a, "mean") for a in source.args):
        return f"{source.name}: mean-centred input (LayerNorm, not RMSNorm)"
    return source, nodes


def _inverse_rms(anchor: Node) -> tuple[Node, Node, set[Node]] | str:
    """anchor computes 1/sqrt(ms + eps) -> (inv, ms, nodes), inv being the node x is multiplied by.

    For `x / sqrt(...)` inv is the sqrt itself and the caller sees a div.
    """
    nodes = {anchor}
    if ops.is_op(anchor, "rsqrt"):
        inner, inv = anchor.args[0], anchor
    elif ops.is_op(anchor, "pow") and ops.constant(anchor.args[1]) == -0.5:
        inner, inv = anchor.args[0], anchor
    elif ops.is_op(anchor, "sqrt"):
        inner, inv = anchor.args[0], anchor
        for user in anchor.users:
            if ops.is_op(user, "reciprocal") or (
                ops.is_op(user, "div") and ops.constant(user.args[0]) == 1.0
            ):
                inv = user
                nodes.add(user)
        # `1 / sqrt(v)` traces as reciprocal(sqrt(v)) * 1
        if len(inv.users) == 1:
            (user,) = inv.users
            if ops.is_op(user, "mul") and 1.0 in (ops.constant(a) for a in user.args):
                inv = user
                nodes.add(user)
    else:
        return f"{anchor.name}: not an inverse square root"
    # `add_`: aten's composite F.rms_norm (fp32 input, bf16 weight: torchtune) adds eps in place
    if ops.is_op(inner, "add", "add_") and ops.constant(inner.args[1]) is not None:
        nodes.add(inner)
        ms = inner.args[0]
    elif ops.is_op(inner, "add") and ops.constant(inner.args[0]) is not None:
        nodes.add(inner)
        ms = inner.args[1]
    else:
        ms = inner  # no eps
    return inv, ms, nodes


def _normalised(inv: Node, x: Node) -> Node | None:
    """The node computing x * inv (or x / sqrt), x read through casts. A bare sqrt only
    divides: `x * sqrt(mean(x^2))` scales by the RMS, it does not normalise."""
    for user in inv.users:
        if ops.is_op(user, "mul") and inv in user.args and not ops.is_op(inv, "sqrt"):
            other = user.args[1] if user.args[0] is inv else user.args[0]
            if ops.strip_casts(other) is x:
                return user
        if ops.is_op(user, "div") and user.args[1] is inv and ops.strip_casts(user.args[0]) is x:
            return user
    return None


def _weight(mul: Node, value: Node, dim: int) -> tuple[Node, set[Node], str] | None:
    """If `mul` scales `value` by a per-channel weight w or (1 + w): (w, nodes, variant)."""
    if not ops.is_op(mul, "mul") or len(mul.args) != 2:
        return None
    other = mul.args[1] if mul.args[0] is value else mul.args[0]
    if not isinstance(other, Node):
        return None
    nodes: set[Node] = set()
    w, variant = ops.strip_casts(other), "llama"
    nodes |= ops.casts_between(other, w)
    if ops.is_op(w, "add") and 1.0 in (ops.constant(w.args[0]), ops.constant(w.args[1])):
        nodes.add(w)
        inner = w.args[1] if ops.constant(w.args[0]) == 1.0 else w.args[0]
        w, variant = ops.strip_casts(inner), "gemma (1 + w)"
        nodes |= ops.casts_between(inner, w)
    shape = ops.shape_of(w)
    if shape is None or len(shape) != 1 or shape[0] != dim:
        return None
    return w, nodes, variant


def find_rmsnorm(anchor: Node) -> RMSNorm | str | None:
    inverse = _inverse_rms(anchor)
    if isinstance(inverse, str):
        return None
    inv, ms, nodes = inverse
    square = _mean_square(ms)
    if isinstance(square, str):
        return f"{ops.describe(anchor)}: {square}"
    x, square_nodes = square
    nodes |= square_nodes
    y = _normalised(inv, x)
    if y is None:
        return f"{ops.describe(anchor)}: not multiplied by its own input"
    nodes.add(y)
    for operand in y.args:
        if isinstance(operand, Node):
            nodes |= ops.casts_between(operand, x)
    dim = ops.shape_of(x)[-1]

    # Walk forward: casts, then an optional weight multiply. Casts followed by nothing are the
    # output rounding and stay outside the region. `w.type_as(x)` reads only x's dtype, so it
    # does not count as a second consumer of x.
    out, pending, weight, variant = y, set(), None, "weightless"
    cur = y
    while len(users := _value_users(cur)) == 1:
        (user,) = users
        if ops.is_cast(user):
            pending.add(user)
            cur = user
            continue
        found = _weight(user, cur, dim) if weight is None else None
        if found is None:
            break
        weight, weight_nodes, variant = found
        nodes |= pending | weight_nodes | {user}
        pending, out, cur = set(), user, user
    if weight is None and (scale := _unclaimed_weight(y, dim)) is not None:
        # Never claim a weightless norm is aligned while its weight multiply runs outside it.
        return (f"{ops.describe(anchor)}: its output is scaled by a per-channel weight at {scale.name} "
                "that does not belong to the site alone (the normalised value has other consumers)")
    return RMSNorm(x=x, out=out, nodes=nodes, variant=variant, weight=weight)


def _value_users(node: Node) -> list[Node]:
    """Users that read node's value: not `other.type_as(node)` / `other.to(node)` (dtype only)."""
    return [u for u in node.users
            if not (ops.is_op(u, "type_as", "to") and len(u.args) > 1 and u.args[1] is node and u.args[0] is not node)]


def _unclaimed_weight(y: Node, dim: int) -> Node | None:
    """A multiply by a [D] tensor reached from y through casts only: a weight the walk left out."""
    frontier, seen = [y], set()
    while frontier:
        cur = frontier.pop()
        seen.add(cur)
        for user in _value_users(cur):
            if ops.is_cast(user) and user not in seen:
                frontier.append(user)
            elif _weight(user, cur, dim) is not None:
                return user
    return None


class RMSNormMatcher:
    """`w * (x * rsqrt(mean(x^2) + eps))`. HF's Llama norm rounds the normalised value before
    the weight multiply; aligned, the whole norm is fp32 and only its output is rounded.
    Before (x: bf16[T, D], w: bf16[D]):

        %to: fp32[T, D] = aten.to.dtype(%x, fp32)
        %pow_1: fp32[T, D] = aten.pow.Tensor_Scalar(%to, 2)
        ... mean, + eps, rsqrt ...
        %mul: fp32[T, D] = aten.mul.Tensor(%to, %rsqrt)
        %to_1: bf16[T, D] = aten.to.dtype(%mul, bf16)
        %mul_1: bf16[T, D] = aten.mul.Tensor(%w, %to_1)

    After:

        %x_fp32: fp32[T, D] = aten._to_copy.default(%x, dtype=fp32)
        %pow_1: fp32[T, D] = aten.pow.Tensor_Scalar(%x_fp32, 2)
        ... mean, + eps, rsqrt ...
        %mul: fp32[T, D] = aten.mul.Tensor(%x_fp32, %rsqrt)
        %w_fp32: fp32[D] = aten._to_copy.default(%w, dtype=fp32)
        %mul_1: fp32[T, D] = aten.mul.Tensor(%w_fp32, %mul)
        %mul_1_rounded: bf16[T, D] = aten._to_copy.default(%mul_1, dtype=bf16)  # rla: round rmsnorm
    """

    kind = "rmsnorm"

    def candidates(self, graph: Graph) -> Iterable[Node]:
        return ops.call_nodes(graph, "rsqrt", "sqrt", "pow")

    def match(self, anchor: Node) -> Match | Miss | None:
        norm = find_rmsnorm(anchor)
        if norm is None:
            return None
        if isinstance(norm, str):
            return Miss(self.kind, anchor, norm)
        roles = {"x": norm.x} | ({"weight": norm.weight} if norm.weight is not None else {})
        return Match(self.kind, anchor, frozenset(norm.nodes), norm.variant, roles)


SITE = Site(
    kind=RMSNormMatcher.kind,
    matcher=RMSNormMatcher(),
    summary="RMSNorm computed in fp32, its output rounded once",
    opaque_ops=("rms_norm", "_fused_rms_norm"),
)
