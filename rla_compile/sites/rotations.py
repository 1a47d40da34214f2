"""The rotations RoPE is written with, each recognised by its graph shape: what `rope.py`'s
matcher calls to find `rotate(x)` (neox halves, gptj interleave, per-pair products, a complex
multiply, 2x2 rotation matrices). Each returns the rotated input and the nodes of the rotation,
or None."""

from __future__ import annotations

import sys

from torch.fx import Node

from .. import ops

__all__ = ["rotate_half", "rotate_interleaved", "rotate_pairs", "complex_rotation", "rotation_matrix", "scaled"]


def _last_dim_slice(node: object, source: Node | None = None) -> tuple[Node, int, int, int] | None:
    """slice(x, -1, start, end, step) -> (x, start, end, step), ends normalised to the dim size."""
    if not ops.is_op(node, "slice"):
        return None
    x = node.args[0]
    shape = ops.shape_of(x)
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


def _negated_pair(tensors: object) -> tuple[Node, Node] | None:
    """The operands of cat/stack([-a, b], ...) -> (the neg node, b); None for anything else."""
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or not ops.is_op(tensors[0], "neg"):
        return None
    return tensors[0], tensors[1]


def rotate_half(cat: Node) -> tuple[Node, set[Node], str] | None:
    """cat([-x2, x1], -1) with x1, x2 the halves of x -> (x, nodes, "neox")."""
    dim = cat.args[1] if len(cat.args) > 1 else 0
    pair = _negated_pair(cat.args[0])
    if pair is None:
        return None
    neg, lo = pair
    hi = _last_dim_slice(neg.args[0])
    low = _last_dim_slice(lo)
    if hi is None or low is None or hi[0] is not low[0]:
        return _rotate_chunked_halves(cat, neg, lo)
    x, size = hi[0], ops.shape_of(hi[0])[-1]
    if dim % len(ops.shape_of(cat)) != len(ops.shape_of(cat)) - 1:
        return None
    half = size // 2 if isinstance(size, int) else None
    if (low[1], low[3], hi[3]) != (0, 1, 1) or (half is not None and (low[2] != half or hi[1] != half or hi[2] != size)):
        return None
    return x, {cat, neg, neg.args[0], lo}, "neox"


def _rotate_chunked_halves(cat: Node, neg: Node, lo: Node) -> tuple[Node, set[Node], str] | None:
    """cat([-x2, x1], -1) with x1, x2 = x.chunk(2, -1) (ESM's rotate_half) or
    x.view(..., 2, h/2).unbind(-2) (OLMo-core's) -> (x, nodes, "neox")."""
    hi, low = _pair_part(neg.args[0]), _pair_part(lo)
    if hi is None or low is None or (hi[1:], low[1:]) != (("halves", 1), ("halves", 0)) or hi[0] is not low[0]:
        return None
    shape = ops.shape_of(cat)
    if (cat.args[1] if len(cat.args) > 1 else 0) % len(shape) != len(shape) - 1:
        return None
    nodes = {cat, neg, neg.args[0], lo} | _part_nodes(neg.args[0]) | _part_nodes(lo)
    return hi[0], nodes, "neox"


def rotate_interleaved(stack: Node) -> tuple[Node, Node, set[Node], str] | None:
    """stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2) -> (x, rotated, nodes, "gptj")."""
    pair = _negated_pair(stack.args[0])
    if pair is None:
        return None
    neg, even = pair
    odd = _last_dim_slice(neg.args[0])
    ev = _last_dim_slice(even)
    if odd is None or ev is None or odd[0] is not ev[0] or (odd[1], odd[3], ev[1], ev[3]) != (1, 2, 0, 2):
        return None
    if len(stack.users) != 1:
        return None
    (flat,) = stack.users
    x = odd[0]
    if not ops.is_op(flat, "flatten", "view", "reshape", "_unsafe_view") or ops.shape_of(flat) != ops.shape_of(x):
        return None
    return x, flat, {stack, neg, neg.args[0], even, flat}, "gptj"


def _products(node: object) -> list[tuple[Node, Node]] | None:
    """a*b +/- c*d -> [(a, b), (c, d)] of tensor operands, else None."""
    if not ops.is_op(node, "add", "sub") or len(node.args) != 2:
        return None
    pairs = []
    for term in node.args:
        if not ops.is_op(term, "mul") or len(term.args) != 2 or not all(isinstance(a, Node) for a in term.args):
            return None
        pairs.append(tuple(term.args))
    return pairs


def _halves_of(view: Node) -> Node | None:
    """x for view = x.view(..., 2, h/2) (the halves of x's last dim stacked on a new dim)."""
    if not ops.is_op(view, "view", "reshape", "_unsafe_view", "unflatten"):
        return None
    x, shape, whole = view.args[0], ops.shape_of(view), ops.shape_of(view.args[0])
    if shape is None or whole is None or len(shape) != len(whole) + 1 or shape[-2] != 2:
        return None
    if tuple(shape[:-2]) != tuple(whole[:-1]) or not isinstance(whole[-1], int) or whole[-1] != 2 * shape[-1]:
        return None
    return x


def _picked(node: Node) -> tuple[Node, int, int] | None:
    """(source, dim, index) for select(source, dim, index) or unbind(source, dim)[index]."""
    if ops.is_op(node, "select") and len(node.args) == 3:
        return node.args
    if ops.is_op(node, "getitem") and ops.is_op(node.args[0], "unbind"):
        pieces = node.args[0]
        dim = pieces.args[1] if len(pieces.args) > 1 else pieces.kwargs.get("dim", 0)
        return pieces.args[0], dim, node.args[1]
    return None


def _part_nodes(part: Node) -> set[Node]:
    """The nodes between one half of a pair and the tensor it is taken from: the chunk, split or
    unbind it indexes, and the view that stacks the halves (excluding the part itself)."""
    nodes = set()
    if ops.is_op(part, "getitem"):
        nodes.add(part.args[0])
        part = part.args[0]
    if ops.is_op(part, "select", "unbind") and _halves_of(part.args[0]) is not None:
        nodes.add(part.args[0])
    return nodes


def _pair_part(node: Node) -> tuple[Node, str, int] | None:
    """One half of a pair: (whole, layout, which) for x[..., 0::2] / x[..., 1::2] ("interleaved"),
    the first/second half of x ("halves": slices, chunk/split, or OLMo-core's
    x.view(..., 2, h/2).unbind(-2)), or xs[..., 0] / xs[..., 1] of xs = x.reshape(..., -1, 2)
    ("pairs")."""
    picked = _picked(node)
    if picked is not None:
        whole, dim, index = picked
        shape = ops.shape_of(whole)
        if not shape or not isinstance(dim, int) or index not in (0, 1):
            return None
        if dim % len(shape) == len(shape) - 1 and shape[-1] == 2:
            return whole, "pairs", index
        if dim % len(shape) == len(shape) - 2 and (x := _halves_of(whole)) is not None:
            return x, "halves", index
        return None
    if ops.is_op(node, "getitem") and ops.is_op(node.args[0], "chunk", "split") and node.args[1] in (0, 1):
        pieces = node.args[0]
        whole, dim = pieces.args[0], pieces.args[2] if len(pieces.args) > 2 else 0
        shape = ops.shape_of(whole)
        size = shape[-1] if shape else None
        two = pieces.args[1] == 2 if ops.is_op(pieces, "chunk") else isinstance(size, int) and pieces.args[1] * 2 == size
        if shape and dim % len(shape) == len(shape) - 1 and two:
            return whole, "halves", node.args[1]
        return None
    part = _last_dim_slice(node)
    if part is None:
        return None
    whole, start, end, step = part
    size = ops.shape_of(whole)[-1]
    if step == 2 and start in (0, 1):
        return whole, "interleaved", start
    if step == 1 and isinstance(size, int) and (start, end) in ((0, size // 2), (size // 2, size)):
        return whole, "halves", 0 if start == 0 else 1
    return None


def _same(a: Node, b: Node) -> bool:
    return ops.same_value(ops.strip_casts(a), ops.strip_casts(b))


def _same_pairs(products: list, want: list) -> bool:
    """products [(a, b), (c, d)] equal want [(p, q), (r, s)] up to order, value for value."""

    def pair(t, w):
        return (_same(t[0], w[0]) and _same(t[1], w[1])) or (_same(t[0], w[1]) and _same(t[1], w[0]))

    (t1, t2), (w1, w2) = products, want
    return (pair(t1, w1) and pair(t2, w2)) or (pair(t1, w2) and pair(t2, w1))


def rotate_pairs(anchor: Node) -> tuple[Node, Node, set[Node], str, Node, Node] | None:
    """cat/stack([x1*cos - x2*sin, x2*cos + x1*sin]): the rotation written out per pair, x1/x2
    the even/odd elements (DeepSeek), the two halves, or the two columns of x viewed as pairs
    (gpt-fast) -> (x, output, nodes, variant, cos, sin)."""
    tensors = anchor.args[0]
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2:
        return None
    first, second = tensors
    if not ops.is_op(first, "sub") or not ops.is_op(second, "add"):
        return None
    p1, p2 = _products(first), _products(second)
    if p1 is None or p2 is None:
        return None
    for x1, cos in (p1[0], p1[0][::-1]):
        for x2, sin in (p1[1], p1[1][::-1]):
            part1, part2 = _pair_part(x1), _pair_part(x2)
            if part1 is None or part2 is None or part1[1] != part2[1] or (part1[2], part2[2]) != (0, 1):
                continue
            if not ops.same_value(part1[0], part2[0]):
                continue
            # the second half must be x2*cos + x1*sin, the same values (possibly other nodes)
            if _same_pairs(p2, [(x2, cos), (x1, sin)]):
                break
        else:
            continue
        break
    else:
        return None
    whole, layout = part1[:2]
    nodes = {anchor, first, second, *first.args, *second.args}
    parts = {t for term in (*first.args, *second.args) for t in term.args
             if (part := _pair_part(t)) is not None and ops.same_value(part[0], whole)}
    nodes |= parts | {n for p in parts for n in _part_nodes(p)}  # the chunk/split/unbind itself
    out = anchor
    if layout == "pairs":  # x.reshape(..., -1, 2) ... stack(-1).flatten(-2)
        if not ops.is_op(whole, "view", "reshape", "_unsafe_view", "unflatten") or len(anchor.users) != 1:
            return None
        (out,) = anchor.users
        x = whole.args[0]
        if not ops.is_op(out, "flatten", "view", "reshape", "_unsafe_view") or ops.shape_of(out) != ops.shape_of(x):
            return None
        nodes |= {whole, out}
    else:
        x = whole
    return x, out, nodes, layout, cos, sin



def scaled(value: Node, x: Node) -> tuple[Node, Node] | None:
    """A user of `value` that multiplies it by another tensor -> (mul, the other tensor)."""
    for user in value.users:
        if ops.is_op(user, "mul") and len(user.args) == 2 and value in user.args:
            other = user.args[1] if user.args[0] is value else user.args[0]
            if isinstance(other, Node) and ops.strip_casts(other) is not ops.strip_casts(x):
                return user, other
    return None


def complex_rotation(real: Node) -> tuple[Node, set[Node], Node] | None:
    """view_as_real(view_as_complex(x.reshape(..., -1, 2)) * freqs).flatten(-2) -> (x, nodes, freqs):
    torchtitan's and Llama's reference RoPE, a complex multiply (complex64, so fp32 inside)."""
    product = real.args[0]
    if not ops.is_op(product, "mul") or len(product.args) != 2:
        return None
    as_complex = next((a for a in product.args if ops.is_op(a, "view_as_complex")), None)
    if as_complex is None:
        return None
    freqs = product.args[1] if product.args[0] is as_complex else product.args[0]
    pairs = as_complex.args[0]
    if not ops.is_op(pairs, "view", "reshape", "_unsafe_view", "unflatten") or len(real.users) != 1:
        return None
    x = pairs.args[0]
    (flat,) = real.users
    if not ops.is_op(flat, "flatten", "view", "reshape", "_unsafe_view") or ops.shape_of(flat) != ops.shape_of(x):
        return None
    return x, {pairs, as_complex, product, real, flat}, freqs

_RESHAPES = ("view", "reshape", "_unsafe_view", "unflatten", "unsqueeze")


def rotation_matrix(total: Node) -> tuple[Node, Node, set[Node], Node] | None:
    """(x.view(..., d/2, 1, 2) * R).sum(-1).flatten(-2), R[..., d/2, 2, 2] = [[cos, -sin], [sin, cos]]:
    each consecutive pair times its 2x2 rotation matrix -> (x, output, nodes, R). Summed over
    the last axis, row i of R dots the pair: (x0*cos - x1*sin, x0*sin + x1*cos), the interleaved
    rotation. R is an input of the site (computed from positions, like cos and sin)."""
    shape = ops.shape_of(total)
    dims = ops.normalize_dim(total.args[1] if len(total.args) > 1 else None, len(shape) + 1) if shape else None
    if dims is None or dims[-1:] != [len(shape)] or len(dims) != 1 or total.kwargs.get("keepdim", False) \
            or (len(total.args) > 2 and total.args[2]):
        return None
    product = total.args[0]
    if not ops.is_op(product, "mul") or len(product.args) != 2 or not all(isinstance(a, Node) for a in product.args):
        return None
    for pairs, matrix in (product.args, product.args[::-1]):
        ps, ms = ops.shape_of(pairs), ops.shape_of(matrix)
        if ps is None or ms is None or len(ps) < 3 or tuple(ps[-2:]) != (1, 2) or tuple(ms[-2:]) != (2, 2):
            continue
        n, lead, x, nodes = ps[-3], tuple(ps[:-3]), pairs, set()
        while (ops.is_op(x, *_RESHAPES) or ops.is_cast(x)) and not _is_whole(x, lead, n):
            nodes.add(x)
            x = x.args[0]
        if not _is_whole(x, lead, n) or len(total.users) != 1:
            continue
        (out,) = total.users
        if not ops.is_op(out, "flatten", "view", "reshape", "_unsafe_view") or ops.shape_of(out) != ops.shape_of(x):
            continue
        return x, out, nodes | {product, total, out}, matrix
    return None


def _is_whole(x: object, lead: tuple, n: object) -> bool:
    """x[..., 2n] with the pairs' leading dims: the tensor the pairs were cut from."""
    shape = ops.shape_of(x)
    return shape is not None and tuple(shape[:-1]) == lead and isinstance(n, int) and shape[-1] == 2 * n
