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

from collections.abc import Iterable
from dataclasses import replace

from torch.fx import Graph, Node

from .. import ops
from . import rotations
from .base import Match, Miss, Site

__all__ = ["SITE", "RoPEMatcher"]


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
        rotation = rotations.rotation_matrix(anchor)
        if rotation is None:
            return None
        x, _, nodes, matrix = rotation
        source = ops.strip_casts(x)
        nodes |= ops.casts_between(x, source)
        return Match(self.kind, anchor, frozenset(nodes), "rotation matrix", {"x": source, "rotation": matrix})

    def _complex(self, anchor: Node) -> Match | None:
        """x as complex pairs times freqs_cis (`_complex_rotation`)."""
        rotation = rotations.complex_rotation(anchor)
        if rotation is None:
            return None
        x, nodes, freqs = rotation
        source = ops.strip_casts(x)
        nodes |= ops.casts_between(x, source)
        return Match(self.kind, anchor, frozenset(nodes), "complex", {"x": source, "freqs": freqs})

    def _pairs(self, anchor: Node) -> Match | None:
        """The rotation written out per pair (`_rotate_pairs`)."""
        pairs = rotations.rotate_pairs(anchor)
        if pairs is None:
            return None
        x, _, nodes, layout, cos, sin = pairs
        variant = {"interleaved": "interleaved pairs", "halves": "pairs of halves", "pairs": "pairs"}[layout]
        source = ops.strip_casts(x)
        nodes |= ops.casts_between(x, source)
        return Match(self.kind, anchor, frozenset(nodes), variant, {"x": source, "cos": cos, "sin": sin})

    def _rotated(self, anchor: Node) -> Match | Miss | None:
        """x * cos + rotate(x) * sin with rotate neox's `_rotate_half` or gptj's `_rotate_interleaved`."""
        neox = rotations.rotate_half(anchor) if ops.is_op(anchor, "cat") else None
        if neox is not None:
            x, nodes, variant = neox
            rotated = anchor
        else:
            gptj = rotations.rotate_interleaved(anchor)
            if gptj is None:
                tensors = anchor.args[0] if anchor.args else ()
                if isinstance(tensors, (list, tuple)) and any(ops.is_op(t, "neg") for t in tensors):
                    where = ops.describe(anchor)
                    return Miss(self.kind, anchor, f"{where}: {ops.op_name(anchor)} of a negated slice is not "
                                "a rotation (want cat(-x[..., h:], x[..., :h]) or stack(-x[..., 1::2], x[..., ::2]))")
                return None
            x, rotated, nodes, variant = gptj
        where = ops.describe(anchor)
        sin_mul = rotations.scaled(rotated, x)
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


SITE = Site(
    kind=RoPEMatcher.kind,
    matcher=RoPEMatcher(),
    summary="rotary embedding from fp32 cos/sin tables, rounded once",
    engine_hooks=("fp32_rope_tables",),  # vLLM rounds its cos/sin cache to the model dtype at load time
)
