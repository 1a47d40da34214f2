"""Residual RMSNorm: s = h + r; y = norm(s).

The contract: the norm reads the fp32 sum, and the residual stream gets round(s), its one
rounding. HF rounds s to bf16 first and normalises the rounded sum; vLLM's native fused
add+norm normalises the fp32 sum. Matching is RMSNorm's plus one step up: the normalised value
is a low-precision add of two same-shape tensors.

In training, the stream's rounding is saved for the backward (`Match.save`, `rewriter.mark_save`).
Left to itself, AOTAutograd's partitioner saved the block outputs and recomputed the stream in
the backward: a chain of roundings and upcasts that Inductor fuses into one kernel, whose
upcasts then had to run on ATen (benchmarks/residual_save.py: small Llama training 1.08x plain
Inductor recomputed, 1.02x saved; saved bytes 1.00x recomputed, 1.04x saved at the tiny sizes,
where the stream is a larger share of the activations than at a real model's shape). Tagging
the stream for recomputation instead (an earlier version) made every layer's backward
recompute the whole stream from the embedding (docs/performance.md, measured at commit 7418346).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.fx import Graph, Node

from .. import ops
from .base import Match, Miss, Site
from .rmsnorm import RMSNormMatcher, find_rmsnorm

__all__ = ["SITE", "ResidualRMSNormMatcher"]


def _is_residual_add(node: Node) -> bool:
    if not ops.is_op(node, "add") or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return False
    h, r = node.args
    return all(
        isinstance(t, Node) and ops.shape_of(t) == ops.shape_of(node) and ops.dtype_of(t) is not None
        for t in (h, r)
    )


class ResidualRMSNormMatcher:
    """`h = x + residual; y = rmsnorm(h)`, one site with two outputs: the sum is computed in
    fp32 and rounded once for the residual stream, and the norm reads the fp32 sum. Before:

        %add: bf16[T, D] = aten.add.Tensor(%x, %residual)
        %to: fp32[T, D] = aten.to.dtype(%add, fp32)
        ... the norm, as in RMSNormMatcher ...
        %mul_1: bf16[T, D] = aten.mul.Tensor(%w, %to_1)
        return [%mul_1, %add]

    After:

        %add: fp32[T, D] = aten.add.Tensor(%x_fp32, %residual_fp32)
        %add_rounded: bf16[T, D] = aten._to_copy.default(%add, dtype=bf16)  # rla: round residual_rmsnorm
        %pow_1: fp32[T, D] = aten.pow.Tensor_Scalar(%add, 2)
        ... the norm in fp32 ...
        %mul_1: fp32[T, D] = aten.mul.Tensor(%w_fp32, %mul)
        %mul_1_rounded: bf16[T, D] = aten._to_copy.default(%mul_1, dtype=bf16)  # rla: round residual_rmsnorm
        return [%mul_1_rounded, %add_rounded]
    """

    kind = "residual_rmsnorm"

    def candidates(self, graph: Graph) -> Iterable[Node]:
        return RMSNormMatcher().candidates(graph)

    def match(self, anchor: Node) -> Match | Miss | None:
        norm = find_rmsnorm(anchor)
        if norm is None or isinstance(norm, str) or not _is_residual_add(norm.x):
            return None  # plain norms are rmsnorm's business, misses are reported there
        add = norm.x
        roles = {"x": add, "residual": add.args[0], "update": add.args[1]}
        if norm.weight is not None:
            roles["weight"] = norm.weight
        return Match(self.kind, anchor, frozenset(norm.nodes | {add}), norm.variant, roles,
                     save=("x",))  # the backward reads the stream saved (rewriter.mark_save)


SITE = Site(
    kind=ResidualRMSNormMatcher.kind,
    matcher=ResidualRMSNormMatcher(),
    summary="the residual add and the norm after it in fp32: the stream and the norm output each rounded once",
    opaque_ops=("fused_add_rms_norm",),
)
