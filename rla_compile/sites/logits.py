"""The projection to the vocabulary: logits = h @ W^T (+ b), computed from fp32 h and W and
left in fp32 — no rounding to bf16 before log-softmax, cross-entropy or a logprob gather.

Unlike the other sites its output is not rounded back: a bf16 logit is off by up to half an
ulp (0.03-0.06 nats at typical logit sizes), which moves every logprob an RL trainer computes.
vLLM's side of the same contract is `head_dtype=float32` (its LogitsProcessor runs
`F.linear(h.float(), W.float())` on CPU, an fp32-accumulating GEMM on CUDA), which
`rla_compile.integrations.vllm` sets when this site is selected.

Which linear is the head: a `linear` whose result (through views, casts and elementwise ops
with scalars, e.g. Gemma's logit soft-capping) ends only in graph outputs and fp32 upcasts, and
feeds no other matmul — plus evidence that it is the vocabulary projection: an fp32 upcast or
a log-softmax / cross-entropy after it, a module named like a head (`lm_head`, `output`,
`embed_out`), or a weight the graph also reads as an embedding table (tied embeddings). A
linear whose output merely leaves the graph (a graph break after `o_proj`) is not one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.fx import Graph, Node

from .. import ops
from .base import Match, Miss, Site

__all__ = ["SITE", "LogitsMatcher", "HEAD_NAMES"]

HEAD_NAMES = ("lm_head", "output", "embed_out", "head", "output_layer")
# elementwise ops the head's output may go through before it leaves (soft-capping: /cap, tanh, *cap)
_SCALAR_OPS = ("div", "mul", "add", "sub", "tanh")
_LOSS_OPS = ("log_softmax", "_log_softmax", "cross_entropy_loss", "softmax", "_softmax", "nll_loss", "logsumexp")


def _consumers(linear: Node) -> tuple[set[Node], list[Node], list[Node]] | str:
    """(region after the linear, fp32 upcasts read outside, graph outputs) or why not."""
    region, upcasts, outputs = set(), [], []
    frontier = list(linear.users)
    while frontier:
        user = frontier.pop()
        if user in region:
            continue
        if user.op == "output":
            outputs.append(user)
        elif ops.widens(user) and ops.dtype_of(user) == torch.float32:
            upcasts.append(user)
        elif ops.moves_data(user) or (
            ops.is_op(user, *_SCALAR_OPS)
            and sum(isinstance(a, Node) for a in user.args) == 1
            and ops.shape_of(user) == ops.shape_of(user.all_input_nodes[0])
        ):
            region.add(user)
            frontier.extend(user.users)
        else:
            return f"{ops.describe(user)} reads it in {_dtype(user.all_input_nodes[0])} ({ops.op_name(user)})"
    return region, upcasts, outputs


_COMPUTE_OPS = ("linear", "mm", "bmm", "matmul", "addmm", "baddbmm", "topk", "sort", "argsort", "scatter", "index_put",
                "embedding")


def _feeds_the_model(linear: Node, limit: int = 256) -> bool:
    """Whether anything computed from the linear's output goes into another matmul or a routing
    decision (an MoE router's logits go to top-k and the experts; a head's go to the loss)."""
    seen, frontier = set(), list(linear.users)
    while frontier and len(seen) < limit:
        node = frontier.pop()
        if node in seen or node.op == "output":
            continue
        seen.add(node)
        if ops.is_op(node, *_COMPUTE_OPS):
            return True
        frontier.extend(node.users)
    return bool(frontier)  # too far to tell: not a head


def _dtype(node: Node) -> str:
    return ops.dtype_name(ops.dtype_of(node))


def _evidence(linear: Node, upcasts: list[Node]) -> str | None:
    """Why this linear is the vocabulary projection, or None."""
    def reaches_loss(node: Node, depth: int = 6) -> bool:
        return depth > 0 and any(ops.is_op(u, *_LOSS_OPS) or reaches_loss(u, depth - 1) for u in node.users)

    if upcasts:
        return "logprobs" if any(reaches_loss(u) for u in upcasts) else "upcast"
    if ops.module_path(linear).rsplit(".", 1)[-1] in HEAD_NAMES:
        return "head"
    weight = linear.args[1]
    if any(ops.is_op(u, "embedding") for u in getattr(weight, "users", ())):
        return "tied"
    return None


class LogitsMatcher:
    """The head from fp32 h and W; its output leaves in fp32, not rounded, and the model's own
    upcast of it disappears (opt-in: `sites` must name "logits"). Before:

        %linear: bf16[T, V] = aten.linear.default(%h, %w)
        %to: fp32[T, V] = aten.to.dtype(%linear, fp32)
        return [%to]

    After:

        %h_fp32: fp32[T, D] = aten._to_copy.default(%h, dtype=fp32)
        %w_fp32: fp32[V, D] = aten._to_copy.default(%w, dtype=fp32)
        %linear: fp32[T, V] = aten.linear.default(%h_fp32, %w_fp32)
        return [%linear]
    """

    kind = "logits"

    def candidates(self, graph: Graph) -> Iterable[Node]:
        return ops.call_nodes(graph, "linear")

    def match(self, anchor: Node) -> Match | Miss | None:
        if len(anchor.args) < 2 or ops.shape_of(anchor.args[1]) is None or len(ops.shape_of(anchor.args[1])) != 2:
            return None
        if _feeds_the_model(anchor):
            return None  # an inner projection (or an MoE router): its output is computed on, not scored
        found = _consumers(anchor)
        if isinstance(found, str):
            return Miss(self.kind, anchor, f"{ops.describe(anchor)}: the output of a head-like linear is consumed "
                        f"before any fp32 upcast: {found}; left as written")
        region, upcasts, outputs = found
        if not upcasts and not outputs:
            return None
        evidence = _evidence(anchor, upcasts)
        if evidence is None:
            return Miss(self.kind, anchor, f"{ops.describe(anchor)}: a linear whose output leaves the graph, but nothing "
                        f"says it is the vocabulary projection (no fp32 upcast or log-softmax after it, module not "
                        f"named {'/'.join(HEAD_NAMES[:3])}, weight not tied to an embedding); left as written")
        variant = {"logprobs": "head, log-softmax", "upcast": "head, upcast", "head": "head",
                   "tied": "head, tied embedding"}[evidence]
        if region:
            variant += ", soft-capped" if any(ops.is_op(n, "tanh") for n in region) else ""
        return Match(self.kind, anchor, frozenset({anchor} | region), variant,
                     {"hidden": anchor.args[0], "weight": anchor.args[1]}, rounds_outputs=False,
                     recompute=("hidden", "weight"))  # the backward saves bf16 h and W, not their fp32 copies


SITE = Site(
    kind=LogitsMatcher.kind,
    matcher=LogitsMatcher(),
    summary="the LM head in fp32 and the logits left in fp32 (vLLM: head_dtype=float32)",
    opt_in="it changes the dtype of the logits the model returns (fp32) and only helps with the inference "
           "engine's head in fp32 too (docs/contract.md#logits)",
    engine_overrides={"head_dtype": "float32"},  # vLLM computes the logits outside its compiled graph
    engine_hooks=("fp32_head_rows",),  # vLLM-CPU's fp32 head: a decode step's rows as in a batch
    trainer_hooks=("fp32_logprob_head",),  # TRL scores completions with its own chunked head
)
