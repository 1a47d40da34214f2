"""RoPE: y = x * cos + rotate(x) * sin, per q and k.

rotate is neox `rotate_half` (cat(-x[..., h:], x[..., :h])) or gptj's interleave
(stack(-x[..., 1::2], x[..., ::2]).flatten(-2)); or the rotation is written out per pair,
cat(x1*cos - x2*sin, x2*cos + x1*sin) with x1/x2 the even/odd elements (DeepSeek's
interleave, de-interleaved on output) or the two halves; or it is a complex multiply
(view_as_complex(x) * freqs_cis, torchtitan / Meta Llama); or each consecutive pair times its
2x2 rotation matrix ((x.view(..., d/2, 1, 2) * R).sum(-1)). Partial rotary needs nothing special: the
rotated slice is the site's input and the pass-through part never enters the region. cos and
sin are inputs; when the graph computed them in fp32 and rounded them only to feed sites, the
engine hands the sites the fp32 values (the contract's cast bypass).

A low-precision activation multiplied by a table computed from positions that no spelling
claims is reported as a near miss; tables computed from a rounded `inv_freq` (a model cast
with `.to(torch.bfloat16)`) get a note on the site.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import replace

from torch.fx import Graph, Node

from .. import ops
from .base import Match, Miss

__all__ = ["RoPEMatcher"]


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


def _rotate_half(cat: Node) -> tuple[Node, set[Node], str] | None:
    """cat([-x2, x1], -1) with x1, x2 the halves of x -> (x, nodes, "neox")."""
    tensors, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2:
        return None
    neg, lo = tensors
    if not ops.is_op(neg, "neg"):
        return None
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


def _rotate_interleaved(stack: Node) -> tuple[Node, Node, set[Node], str] | None:
    """stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2) -> (x, rotated, nodes, "gptj")."""
    tensors = stack.args[0]
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2:
        return None
    neg, even = tensors
    if not ops.is_op(neg, "neg"):
        return None
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


def _rotate_pairs(anchor: Node) -> tuple[Node, Node, set[Node], str, Node, Node] | None:
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



def _scaled(value: Node, x: Node) -> tuple[Node, Node] | None:
    """A user of `value` that multiplies it by another tensor -> (mul, the other tensor)."""
    for user in value.users:
        if ops.is_op(user, "mul") and len(user.args) == 2 and value in user.args:
            other = user.args[1] if user.args[0] is value else user.args[0]
            if isinstance(other, Node) and ops.strip_casts(other) is not ops.strip_casts(x):
                return user, other
    return None


def _complex_rotation(real: Node) -> tuple[Node, set[Node], Node] | None:
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


def _rotation_matrix(total: Node) -> tuple[Node, Node, set[Node], Node] | None:
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


_TRIG = ("cos", "sin", "polar")
_PROJECTIONS = ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "embedding", "convolution")


def position_table(node: Node, depth: int = 40) -> bool:
    """Whether `node` is computed from positions only: cos/sin (or polar) of something, and no
    projection or embedding of an activation anywhere behind it (walks at most `depth` nodes)."""
    seen, stack, trig = set(), [node], False
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if len(seen) > depth or ops.is_op(current, *_PROJECTIONS):
            return False
        trig = trig or ops.is_op(current, *_TRIG)
        stack.extend(current.all_input_nodes)
    return trig


def rounded_frequencies(tables: Iterable[Node], depth: int = 40) -> Node | None:
    """The low-precision graph input (a bf16 `inv_freq` buffer) behind the cos/sin tables, if
    they were computed from one: `model.to(torch.bfloat16)` rounds HF's fp32 `inv_freq`."""
    seen, stack = set(), [t for t in tables if isinstance(t, Node)]
    while stack and len(seen) < depth:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op in ("placeholder", "get_attr") and ops.is_low_precision(current):
            if any(ops.widens(user) for user in current.users):
                return current
        stack.extend(current.all_input_nodes)
    return None


def _frequencies_note(roles: dict) -> str:
    tables = [v for k, v in roles.items() if k != "x"]
    if not any(position_table(t) for t in tables):
        return ""
    source = rounded_frequencies(tables)
    if source is None:
        return ""
    return (f"cos/sin computed from {ops.dtype_name(ops.dtype_of(source))} frequencies ({source.name}): "
            "model.to(torch.bfloat16) rounded the fp32 inv_freq buffer, so the rotation angles differ from an "
            "engine's (vLLM computes them in fp32 from the config) whatever the rounding; load the model "
            "with from_pretrained(..., dtype=torch.bfloat16) instead, which keeps inv_freq in fp32")


class RoPEMatcher:
    """`x * cos + rotate(x) * sin`, per q and k: the rotation in fp32, rounded once (eager
    rounds both products and the sum). Before, with neox's rotate_half (x: bf16[T, H]):

        %mul: bf16[T, H] = aten.mul.Tensor(%x, %cos)
        %slice_1: bf16[T, H/2] = aten.slice.Tensor(%x, 1, H/2, 9223372036854775807)
        %neg: bf16[T, H/2] = aten.neg.default(%slice_1)
        %slice_2: bf16[T, H/2] = aten.slice.Tensor(%x, 1, 0, H/2)
        %cat: bf16[T, H] = aten.cat.default([%neg, %slice_2], -1)
        %mul_1: bf16[T, H] = aten.mul.Tensor(%cat, %sin)
        %add: bf16[T, H] = aten.add.Tensor(%mul, %mul_1)

    After (x, cos and sin upcast once each):

        %mul: fp32[T, H] = aten.mul.Tensor(%x_fp32, %cos_fp32)
        %slice_1: fp32[T, H/2] = aten.slice.Tensor(%x_fp32, 1, H/2, 9223372036854775807)
        ... neg, slice, cat in fp32 ...
        %mul_1: fp32[T, H] = aten.mul.Tensor(%cat, %sin_fp32)
        %add: fp32[T, H] = aten.add.Tensor(%mul, %mul_1)
        %add_rounded: bf16[T, H] = aten._to_copy.default(%add, dtype=bf16)  # rla: round rope

    When the graph computed cos/sin in fp32 and rounded them only to feed sites, the engine
    removes that rounding instead of upcasting (the cast bypass).
    """

    kind = "rope"

    def candidates(self, graph: Graph) -> Iterable[Node]:
        return ops.call_nodes(graph, "cat", "stack", "view_as_real", "sum", "mul")

    def match(self, anchor: Node) -> Match | Miss | None:
        if ops.is_op(anchor, "mul"):
            return self._unmatched_rotation(anchor)
        if ops.is_op(anchor, "view_as_real"):
            found = self._complex(anchor)
        elif ops.is_op(anchor, "sum"):
            found = self._matrix(anchor)
        else:
            found = self._pairs(anchor)
            found = found if found is not None else self._rotated(anchor)
        if isinstance(found, Match) and (note := _frequencies_note(found.roles)):
            found = replace(found, note=note)
        return found

    def _unmatched_rotation(self, anchor: Node) -> Miss | None:
        """A low-precision activation times a table computed from positions: RoPE in some
        spelling. The engine drops this miss when the product belongs to a site it matched;
        otherwise it says that a rotation went unrecognised (and unaligned)."""
        if len(anchor.args) != 2 or not all(isinstance(a, Node) for a in anchor.args):
            return None
        for x, table in (anchor.args, anchor.args[::-1]):
            if ops.is_low_precision(ops.strip_casts(x)) and not position_table(x) and position_table(table):
                return Miss(self.kind, anchor, f"{ops.describe(anchor)}: a {ops.dtype_name(ops.dtype_of(ops.strip_casts(x)))} "
                            "value times a table computed from positions (cos/sin), but no RoPE spelling matched "
                            "(x * cos + rotate(x) * sin, per-pair rotation, complex multiply, 2x2 rotation matrix); "
                            "its roundings are not aligned: please report this spelling")
        return None

    def _matrix(self, anchor: Node) -> Match | None:
        """Consecutive pairs times 2x2 rotation matrices (`_rotation_matrix`)."""
        rotation = _rotation_matrix(anchor)
        if rotation is None:
            return None
        x, _, nodes, matrix = rotation
        source = ops.strip_casts(x)
        nodes |= ops.casts_between(x, source)
        return Match(self.kind, anchor, frozenset(nodes), "rotation matrix", {"x": source, "rotation": matrix})

    def _complex(self, anchor: Node) -> Match | None:
        """x as complex pairs times freqs_cis (`_complex_rotation`)."""
        rotation = _complex_rotation(anchor)
        if rotation is None:
            return None
        x, nodes, freqs = rotation
        source = ops.strip_casts(x)
        nodes |= ops.casts_between(x, source)
        return Match(self.kind, anchor, frozenset(nodes), "complex", {"x": source, "freqs": freqs})

    def _pairs(self, anchor: Node) -> Match | None:
        """The rotation written out per pair (`_rotate_pairs`)."""
        pairs = _rotate_pairs(anchor)
        if pairs is None:
            return None
        x, _, nodes, layout, cos, sin = pairs
        variant = {"interleaved": "interleaved pairs", "halves": "pairs of halves", "pairs": "pairs"}[layout]
        source = ops.strip_casts(x)
        nodes |= ops.casts_between(x, source)
        return Match(self.kind, anchor, frozenset(nodes), variant, {"x": source, "cos": cos, "sin": sin})

    def _rotated(self, anchor: Node) -> Match | Miss | None:
        """x * cos + rotate(x) * sin with rotate neox's `_rotate_half` or gptj's `_rotate_interleaved`."""
        neox = _rotate_half(anchor) if ops.is_op(anchor, "cat") else None
        if neox is not None:
            x, nodes, variant = neox
            rotated = anchor
        else:
            gptj = _rotate_interleaved(anchor)
            if gptj is None:
                tensors = anchor.args[0] if anchor.args else ()
                if isinstance(tensors, (list, tuple)) and any(ops.is_op(t, "neg") for t in tensors):
                    where = ops.describe(anchor)
                    return Miss(self.kind, anchor, f"{where}: {ops.op_name(anchor)} of a negated slice is not "
                                "a rotation (want cat(-x[..., h:], x[..., :h]) or stack(-x[..., 1::2], x[..., ::2]))")
                return None
            x, rotated, nodes, variant = gptj
        where = ops.describe(anchor)
        sin_mul = _scaled(rotated, x)
        if sin_mul is None:
            return Miss(self.kind, anchor, f"{where}: rotate(x) is not multiplied by a sin tensor")
        source = ops.strip_casts(x)
        for user in sin_mul[0].users:
            if not ops.is_op(user, "add") or len(user.args) != 2:
                continue
            cos_side = user.args[1] if user.args[0] is sin_mul[0] else user.args[0]
            if not ops.is_op(cos_side, "mul") or len(cos_side.args) != 2:
                continue
            a, b = cos_side.args
            xs = [t for t in (a, b) if isinstance(t, Node) and ops.strip_casts(t) is source]
            if len(xs) != 1:
                continue
            cos = b if xs[0] is a else a
            if not isinstance(cos, Node):
                continue
            nodes |= {sin_mul[0], cos_side, user} | ops.casts_between(xs[0], source) | ops.casts_between(x, source)
            roles = {"x": source, "cos": cos, "sin": sin_mul[1]}
            return Match(self.kind, anchor, frozenset(nodes), variant, roles)
        return Miss(self.kind, anchor, f"{where}: rotate(x) * sin is not added to x * cos")
