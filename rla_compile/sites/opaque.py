"""Norms computed inside one opaque op: found, never rewritten, always reported.

vLLM's IR ops (`vllm_ir.rms_norm`, `vllm_ir.fused_add_rms_norm`) reach post-grad passes as
single nodes while their torch wrapping is on (vLLM's default on GPUs); vLLM lowers them to
their math only after every custom pass has run. ATen's `rms_norm` / `_fused_rms_norm` are
the same shape of problem in a graph nobody decomposed. The math is out of the graph's
reach, so the rounding inside cannot be moved: each such node is a near miss that says how
to expose the math, instead of a norm that silently goes unaligned.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.fx import Graph, Node

from .. import ops
from .base import Miss, Site

__all__ = ["OpaqueNormMatcher"]

# what to do, by op namespace
_HOW = {
    "vllm_ir": "set vLLM's compilation_config ir_enable_torch_wrap=False (rla_compile.integrations.vllm"
    ".compilation_config() does) so vLLM hands passes the norm's math",
    "aten": "decompose it before the pass (the rla backend does)",
}


class OpaqueNormMatcher:
    """Finds no site: the graph stays as it is, and the report's near misses say why and what
    to do. For

        %rms_norm: bf16[T, D] = vllm_ir.rms_norm.default(%x, %w, 1e-06)

    the near miss reads `rmsnorm: rms_norm at <module>: opaque vllm_ir.rms_norm.default computes the
    whole norm in one op, out of reach: set vLLM's compilation_config ir_enable_torch_wrap=False ...`.
    """

    kind = None  # finds no site of its own: its near misses name the site each op hides

    def __init__(self, sites: Iterable[Site]):
        self.hides = {op: site.kind for site in sites for op in site.opaque_ops}  # op name -> the site it hides

    def candidates(self, graph: Graph) -> Iterable[Node]:
        return ops.call_nodes(graph, *self.hides)

    def match(self, anchor: Node) -> Miss:
        op = str(anchor.target)  # vllm_ir.rms_norm.default
        how = _HOW.get(op.split(".")[0], "decompose it before the pass")
        reason = f"{ops.describe(anchor)}: opaque {op} computes the whole norm in one op, out of reach: {how}"
        return Miss(self.hides[ops.op_name(anchor)], anchor, reason)
