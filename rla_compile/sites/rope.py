"""RoPE: y = x * cos + rotate(x) * sin, per q and k.

rotate is neox `rotate_half` (cat(-x[..., h:], x[..., :h])) or gptj's interleave
(stack(-x[..., 1::2], x[..., ::2]).flatten(-2)). Partial rotary needs nothing special: the
rotated slice is the site's input and the pass-through part never enters the region. cos and
sin are inputs; when the graph computed them in fp32 and rounded them only to feed sites, the
engine hands the sites the fp32 values (the contract's cast bypass).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from torch.fx import Graph, Node

from .. import fx
from .base import Match, Miss

__all__ = ["RoPEMatcher"]


def _last_dim_slice(node: object, source: Node | None = None) -> tuple[Node, int, int, int] | None:
    """slice(x, -1, start, end, step) -> (x, start, end, step), ends normalised to the dim size."""
    if not fx.is_op(node, "slice"):
        return None
    x = node.args[0]
    shape = fx.shape_of(x)
    if shape is None or source is not None and x is not source:
        return None
    defaults = {"dim": 0, "start": None, "end": None, "step": 1}
    args = dict(zip(defaults, node.args[1:]))
    dim, start, end, step = (args.get(k, node.kwargs.get(k, v)) for k, v in defaults.items())
    if not isinstance(dim, int) or dim % len(shape) != len(shape) - 1:
        return None
    size = shape[-1]
    start = 0 if start is None else start
    end = size if end is None or (isinstance(end, int) and end >= sys.maxsize) else end
    if isinstance(size, int) and isinstance(end, int) and end > size:
        end = size
    return x, start, end, step


def _rotate_half(cat: Node) -> tuple[Node, set[Node], str] | None:
    """cat([-x2, x1], -1) with x1, x2 the halves of x -> (x, nodes, "neox")."""
    tensors, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2:
        return None
    neg, lo = tensors
    if not fx.is_op(neg, "neg"):
        return None
    hi = _last_dim_slice(neg.args[0])
    low = _last_dim_slice(lo)
    if hi is None or low is None or hi[0] is not low[0]:
        return None
    x, size = hi[0], fx.shape_of(hi[0])[-1]
    if dim % len(fx.shape_of(cat)) != len(fx.shape_of(cat)) - 1:
        return None
    half = size // 2 if isinstance(size, int) else None
    if (low[1], low[3], hi[3]) != (0, 1, 1) or (half is not None and (low[2] != half or hi[1] != half or hi[2] != size)):
        return None
    return x, {cat, neg, neg.args[0], lo}, "neox"


def _rotate_interleaved(stack: Node) -> tuple[Node, Node, set[Node], str] | None:
    """stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2) -> (x, rotated, nodes, "gptj")."""
    tensors = stack.args[0]
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2:
        return None
    neg, even = tensors
    if not fx.is_op(neg, "neg"):
        return None
    odd = _last_dim_slice(neg.args[0])
    ev = _last_dim_slice(even)
    if odd is None or ev is None or odd[0] is not ev[0] or (odd[1], odd[3], ev[1], ev[3]) != (1, 2, 0, 2):
        return None
    if len(stack.users) != 1:
        return None
    (flat,) = stack.users
    x = odd[0]
    if not fx.is_op(flat, "flatten", "view", "reshape", "_unsafe_view") or fx.shape_of(flat) != fx.shape_of(x):
        return None
    return x, flat, {stack, neg, neg.args[0], even, flat}, "gptj"


def _casts(node: Node, source: Node) -> set[Node]:
    found = set()
    while node is not source and fx.is_cast(node):
        found.add(node)
        node = node.args[0]
    return found


def _scaled(value: Node, x: Node) -> tuple[Node, Node] | None:
    """A user of `value` that multiplies it by another tensor -> (mul, the other tensor)."""
    for user in value.users:
        if fx.is_op(user, "mul") and len(user.args) == 2 and value in user.args:
            other = user.args[1] if user.args[0] is value else user.args[0]
            if isinstance(other, Node) and fx.strip_casts(other) is not fx.strip_casts(x):
                return user, other
    return None


class RoPEMatcher:
    kind = "rope"

    def candidates(self, graph: Graph) -> Iterable[Node]:
        return fx.call_nodes(graph, "cat", "stack")

    def match(self, anchor: Node) -> Match | Miss | None:
        neox = _rotate_half(anchor) if fx.is_op(anchor, "cat") else None
        if neox is not None:
            x, nodes, variant = neox
            rotated = anchor
        else:
            gptj = _rotate_interleaved(anchor)
            if gptj is None:
                tensors = anchor.args[0] if anchor.args else ()
                if isinstance(tensors, (list, tuple)) and any(fx.is_op(t, "neg") for t in tensors):
                    where = f"{anchor.name} at {fx.module_path(anchor) or 'top level'}"
                    return Miss(self.kind, anchor, f"{where}: {fx.op_name(anchor)} of a negated slice is not "
                                "a rotation (want cat(-x[..., h:], x[..., :h]) or stack(-x[..., 1::2], x[..., ::2]))")
                return None
            x, rotated, nodes, variant = gptj
        where = f"{anchor.name} at {fx.module_path(anchor) or 'top level'}"
        sin_mul = _scaled(rotated, x)
        if sin_mul is None:
            return Miss(self.kind, anchor, f"{where}: rotate(x) is not multiplied by a sin tensor")
        source = fx.strip_casts(x)
        for user in sin_mul[0].users:
            if not fx.is_op(user, "add") or len(user.args) != 2:
                continue
            cos_side = user.args[1] if user.args[0] is sin_mul[0] else user.args[0]
            if not fx.is_op(cos_side, "mul") or len(cos_side.args) != 2:
                continue
            a, b = cos_side.args
            xs = [t for t in (a, b) if isinstance(t, Node) and fx.strip_casts(t) is source]
            if len(xs) != 1:
                continue
            cos = b if xs[0] is a else a
            if not isinstance(cos, Node):
                continue
            nodes |= {sin_mul[0], cos_side, user} | _casts(xs[0], source) | _casts(x, source)
            roles = {"x": source, "cos": cos, "sin": sin_mul[1]}
            return Match(self.kind, anchor, frozenset(nodes), variant, roles)
        return Miss(self.kind, anchor, f"{where}: rotate(x) * sin is not added to x * cos")
