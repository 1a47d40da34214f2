"""Residual RMSNorm: s = h + r; y = norm(s).

The contract: the norm reads the fp32 sum, and the residual stream gets round(s), its one
rounding. HF rounds s to bf16 first and normalises the rounded sum; vLLM's native fused
add+norm normalises the fp32 sum. Matching is RMSNorm's plus one step up: the normalised value
is a low-precision add of two same-shape tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.fx import Graph, Node

from .. import fx
from .base import Match, Miss
from .rmsnorm import RMSNormMatcher, find_rmsnorm

__all__ = ["ResidualRMSNormMatcher"]


def _is_residual_add(node: Node) -> bool:
    if not fx.is_op(node, "add") or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return False
    h, r = node.args
    return all(
        isinstance(t, Node) and fx.shape_of(t) == fx.shape_of(node) and fx.dtype_of(t) is not None
        for t in (h, r)
    )


class ResidualRMSNormMatcher:
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
        return Match(self.kind, anchor, frozenset(norm.nodes | {add}), norm.variant, roles)
