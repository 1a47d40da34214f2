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

from .. import fx
from .base import Match, Miss

__all__ = ["RMSNormMatcher", "RMSNorm", "find_rmsnorm"]


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
    if fx.is_op(ms, "div", "mul") and fx.constant(ms.args[1]) is not None:
        reduce = ms.args[0]  # sum / D or sum * (1/D)
        if not fx.is_op(reduce, "sum"):
            return f"{ms.name}: scaled value is not a sum"
        nodes.add(reduce)
    elif not fx.is_op(ms, "mean"):
        return f"{ms.name}: not a mean or sum/D"
    square = reduce.args[0]
    shape = fx.shape_of(square)
    dims = reduce.args[1] if len(reduce.args) > 1 else reduce.kwargs.get("dim")
    if shape is None or fx.normalize_dim(dims, len(shape)) != [len(shape) - 1]:
        return f"{reduce.name}: reduces over {dims}, not the last dim"
    if fx.is_op(square, "pow") and fx.constant(square.args[1]) == 2.0:
        x = square.args[0]
    elif fx.is_op(square, "square"):
        x = square.args[0]
    elif fx.is_op(square, "mul") and fx.strip_casts(square.args[0]) is fx.strip_casts(square.args[1]):
        x = square.args[0]
    else:
        return f"{reduce.name}: does not reduce a square"
    nodes.add(square)
    source = fx.strip_casts(x)
    nodes |= fx.casts_between(x, source)
    if fx.is_op(source, "sub") and any(fx.is_op(a, "mean") for a in source.args):
        return f"{source.name}: mean-centred input (LayerNorm, not RMSNorm)"
    return source, nodes


def _inverse_rms(anchor: Node) -> tuple[Node, Node, set[Node]] | str:
    """anchor computes 1/sqrt(ms + eps) -> (inv, ms, nodes), inv being the node x is multiplied by.

    For `x / sqrt(...)` inv is the sqrt itself and the caller sees a div.
    """
    nodes = {anchor}
    if fx.is_op(anchor, "rsqrt"):
        inner, inv = anchor.args[0], anchor
    elif fx.is_op(anchor, "pow") and fx.constant(anchor.args[1]) == -0.5:
        inner, inv = anchor.args[0], anchor
    elif fx.is_op(anchor, "sqrt"):
        inner, inv = anchor.args[0], anchor
        for user in anchor.users:
            if fx.is_op(user, "reciprocal") or (
                fx.is_op(user, "div") and fx.constant(user.args[0]) == 1.0
            ):
                inv = user
                nodes.add(user)
        # `1 / sqrt(v)` traces as reciprocal(sqrt(v)) * 1
        if len(inv.users) == 1:
            (user,) = inv.users
            if fx.is_op(user, "mul") and 1.0 in (fx.constant(a) for a in user.args):
                inv = user
                nodes.add(user)
    else:
        return f"{anchor.name}: not an inverse square root"
    if fx.is_op(inner, "add") and fx.constant(inner.args[1]) is not None:
        nodes.add(inner)
        ms = inner.args[0]
    elif fx.is_op(inner, "add") and fx.constant(inner.args[0]) is not None:
        nodes.add(inner)
        ms = inner.args[1]
    else:
        ms = inner  # no eps
    return inv, ms, nodes


def _normalised(inv: Node, x: Node) -> Node | None:
    """The node computing x * inv (or x / sqrt), x read through casts. A bare sqrt only
    divides: `x * sqrt(mean(x^2))` scales by the RMS, it does not normalise."""
    for user in inv.users:
        if fx.is_op(user, "mul") and inv in user.args and not fx.is_op(inv, "sqrt"):
            other = user.args[1] if user.args[0] is inv else user.args[0]
            if fx.strip_casts(other) is x:
                return user
        if fx.is_op(user, "div") and user.args[1] is inv and fx.strip_casts(user.args[0]) is x:
            return user
    return None


def _weight(mul: Node, value: Node, dim: int) -> tuple[Node, set[Node], str] | None:
    """If `mul` scales `value` by a per-channel weight w or (1 + w): (w, nodes, variant)."""
    if not fx.is_op(mul, "mul") or len(mul.args) != 2:
        return None
    other = mul.args[1] if mul.args[0] is value else mul.args[0]
    if not isinstance(other, Node):
        return None
    nodes: set[Node] = set()
    w, variant = fx.strip_casts(other), "llama"
    nodes |= fx.casts_between(other, w)
    if fx.is_op(w, "add") and 1.0 in (fx.constant(w.args[0]), fx.constant(w.args[1])):
        nodes.add(w)
        inner = w.args[1] if fx.constant(w.args[0]) == 1.0 else w.args[0]
        w, variant = fx.strip_casts(inner), "gemma (1 + w)"
        nodes |= fx.casts_between(inner, w)
    shape = fx.shape_of(w)
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
        return f"{fx.describe(anchor)}: {square}"
    x, square_nodes = square
    nodes |= square_nodes
    y = _normalised(inv, x)
    if y is None:
        return f"{fx.describe(anchor)}: not multiplied by its own input"
    nodes.add(y)
    for operand in y.args:
        if isinstance(operand, Node):
            nodes |= fx.casts_between(operand, x)
    dim = fx.shape_of(x)[-1]

    # Walk forward: casts, then an optional weight multiply. Casts followed by nothing are the
    # output rounding and stay outside the region.
    out, pending, weight, variant = y, set(), None, "weightless"
    cur = y
    while len(cur.users) == 1:
        (user,) = cur.users
        if fx.is_cast(user):
            pending.add(user)
            cur = user
            continue
        found = _weight(user, cur, dim) if weight is None else None
        if found is None:
            break
        weight, weight_nodes, variant = found
        nodes |= pending | weight_nodes | {user}
        pending, out, cur = set(), user, user
    return RMSNorm(x=x, out=out, nodes=nodes, variant=variant, weight=weight)


class RMSNormMatcher:
    kind = "rmsnorm"

    def candidates(self, graph: Graph) -> Iterable[Node]:
        return fx.call_nodes(graph, "rsqrt", "sqrt", "pow")

    def match(self, anchor: Node) -> Match | Miss | None:
        norm = find_rmsnorm(anchor)
        if norm is None:
            return None
        if isinstance(norm, str):
            return Miss(self.kind, anchor, norm)
        roles = {"x": norm.x} | ({"weight": norm.weight} if norm.weight is not None else {})
        return Match(self.kind, anchor, frozenset(norm.nodes), norm.variant, roles)
