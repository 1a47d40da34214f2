"""Attention: softmax((q · scale) kᵀ [soft-capped] [+ mask]) v, computed in fp32, rounded once.

The contract (docs/contract.md#attention, opt-in): q × scale in fp32 first (1/sqrt(d) is not a
power of two, so where the scale goes changes the bits; vLLM's CPU kernel scales q first),
scores from fp32 q and k, Gemma 2's soft-cap `tanh(s / c) * c` and the mask in fp32, softmax
in fp32 with P never rounded, P · V from fp32 v, the output rounded once. Grouped heads
(GQA/MQA) repeat the fp32 k and v. Sliding windows are masks like any other.

Unlike the other sites, the rewrite does not only move roundings: HF's eager chain rounds its
scores and probabilities between bf16 matmuls, and SDPA is one fused kernel, so the region is
replaced by newly emitted ATen ops (`Match.computes`, `emit.Emitter`). The backward is
autograd's over that fp32 forward.

Matched by its math, not by module names:

- the eager chain (HF `eager_attention_forward`, hand-written attention):
  `matmul(q [* scale], kᵀ)` [`* scale` | `/ c`] [`/ c, tanh, * c`] [`+ mask` | `masked_fill` |
  `where`] `softmax` [casts, `.to(q.dtype)`] [`dropout(p=0)`] `matmul(P, v)`, with k and v
  grouped by `repeat_kv` (unsqueeze, expand, reshape) or `repeat_interleave`;
- SDPA: `aten.scaled_dot_product_attention` (what pre-dispatch ATen keeps of
  `F.scaled_dot_product_attention`), the ATen ops it lowers to
  (`_scaled_dot_product_flash_attention_for_cpu`, `_flash_attention`, `_efficient_attention`,
  `_cudnn_attention`, `_attention_math`), with their float or bool (True = keep) masks,
  `is_causal` (under dynamic shapes too: the chunked form applies it at run time), `scale`
  (default 1/sqrt(E)) and `enable_gqa`.

Near misses: `flex_attention` (its score_mod/mask_mod is a user function run inside the
kernel, which a graph rewrite cannot reorder), dropout with p > 0 in training, the
probabilities read outside the site (attention weights returned).

Memory: the replacement materialises fp32 scores and probabilities, [B, H, L, S] each, where
a fused kernel keeps them in tiles. Where they would exceed 16 MiB, or their size is known at
run time only (dynamic shapes), the site emits the chunked form instead
(sites/attention/chunked.py): the same ops one block of query rows at a time, its backward
recomputing each block, so neither the forward nor the saved tensors hold [B, H, L, S].

Before (HF eager, one head group):

    %matmul: bf16[1, 4, 8, 8] = aten.matmul.default(%q, %transpose)
    %mul: bf16[1, 4, 8, 8] = aten.mul.Tensor(%matmul, 0.25)
    %add: bf16[1, 4, 8, 8] = aten.add.Tensor(%mul, %mask)
    %softmax: fp32[1, 4, 8, 8] = aten.softmax.int(%add, -1, fp32)
    %to: bf16[1, 4, 8, 8] = aten.to.dtype(%softmax, bf16)
    %matmul_1: bf16[1, 4, 8, 16] = aten.matmul.default(%to, %v)

After:

    %_to_copy: fp32[1, 4, 8, 16] = aten._to_copy.default(%q, dtype=fp32)
    %mul_1: fp32[1, 4, 8, 16] = aten.mul.Tensor(%_to_copy, 0.25)
    ... k, v, mask upcast; matmul, add, _softmax, matmul in fp32 ...
    %_to_copy_5: bf16[1, 4, 8, 16] = aten._to_copy.default(%matmul_3, dtype=bf16)  # rla: round attention
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from ... import ops
from ...emit import Emitter
from . import chunked as attention_chunked  # registers torch.ops.rla.attention_chunked
from . import graph as reading
from ..base import Match, Miss, Site

__all__ = ["SITE", "AttentionMatcher"]

aten = torch.ops.aten

_SOFTMAX = ("softmax", "_softmax", "_safe_softmax")
# SDPA and the ATen ops it lowers to; their arguments are read by schema name.
_SDPA = ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math")


# -- the contract, as emitted ops -------------------------------------------------------------
@dataclass(frozen=True)
class _Attention:
    """The contract's computation for one site (roles q, k, v; mask when there is one; scale
    when it is a run-time value, which replaces `scale`)."""

    scale: float
    groups: int | Node = 1
    softcap: float | None = None
    mask: reading.Mask | None = None
    bias: bool = False  # baddbmm's bias (role "bias"), added to the scores in fp32 before the mask

    def __call__(self, e: Emitter, roles: dict[str, Node], options) -> Node:
        """The contract's computation, or the engine-paired form option `rounding` names
        ("vllm_cpu_vec", resolved by `Options.rounding_of`), from the roles; fp32, unrounded.
        The chunked form's blocks: option `attention_chunk_mib`."""
        form = options.rounding_of(SITE.kind).form
        if form == "vllm_triton":
            unsupported = self._beyond_vllm_triton(roles)
            if unsupported is None:
                return self._vllm_triton(e, roles)
            e.note = f"rounding 'vllm_triton': {unsupported}; the contract's form, rounded to nearest"
        q = e.mul(e.fp32(roles["q"]), roles.get("scale", self.scale), name="q_scaled")  # in fp32, before q·k
        k = e.repeat_heads(e.fp32(roles["k"]), self.groups)
        v = e.repeat_heads(e.fp32(roles["v"]), self.groups)
        if form == "vllm_cpu_vec":
            if self.softcap is None:
                return self._vllm_cpu_vec(e, q, k, v, roles)
            e.note = ("rounding 'vllm_cpu_vec': soft-capping is not emulated; the contract's form, rounded "
                      f"{vec_output_rounding().replace('_', ' ')} as the kernel rounds")
        if self._chunked(q, k, roles):
            return self._in_blocks(e, q, k, v, roles, int(options.attention_chunk_mib * (1 << 20)))
        scores = e.matmul(q, e.transpose_last(k), name="scores")
        if self.bias:
            scores = e.add(scores, e.fp32(roles["bias"]))
        if self.softcap is not None:
            scores = e.mul(e.tanh(e.div(scores, self.softcap)), self.softcap)
        if self.mask is not None:
            scores = self.mask.apply(e, scores, roles)
        if self.mask is None or self.mask.how == "causal":  # every query keeps a key
            return e.matmul(e.softmax(scores, kind="attention"), v, name="attention")  # P stays fp32
        # a query row whose every key is masked (left padding) gets P = 0, as SDPA computes it, not
        # softmax's 0/0; its scores become 0 first, so the backward reads no NaN either
        alive = e.call(aten.any.dim, e.call(aten.ne.Scalar, scores, -math.inf), -1, True, name="alive_rows")
        probs = e.softmax(e.where(alive, scores, 0.0), kind="attention")
        return e.matmul(e.where(alive, probs, 0.0), v, name="attention")

    def _chunked(self, q: Node, k: Node, roles: dict[str, Node]) -> bool:
        """Whether to emit the chunked form (sites/attention/chunked.py): where the fp32 scores
        [..., L, S] exceed its budget, or their size is known at run time only."""
        if self.mask is not None and self.mask.how == "where" and "mask_other" in roles:
            return False  # where(cond, scores, a tensor): not a fill the chunked op takes
        sizes = [*q.meta["val"].shape[:-1], k.meta["val"].shape[-2]]
        if not all(isinstance(s, int) for s in sizes):
            return True
        return math.prod(sizes) * 4 > attention_chunked.CHUNK_ABOVE_BYTES

    def _in_blocks(self, e: Emitter, q: Node, k: Node, v: Node, roles: dict[str, Node], budget: int) -> Node:
        """The contract one block of query rows at a time (`rla::attention_chunked`), each
        block's fp32 scores at most `budget` bytes."""
        bias, remove, fill, how = None, None, -math.inf, self.mask.how if self.mask is not None else None
        if self.bias:  # never with an additive mask too (the matcher's near miss)
            bias = e.fp32(roles["bias"])
        if how == "add":
            bias = e.fp32(roles["mask"])
        elif how == "fill":
            remove, fill = roles["mask"], self.mask.value
        elif how == "keep" or (how == "where" and self.mask.keep_first):
            remove, fill = e.logical_not(roles["mask"]), self.mask.value
        elif how == "where":
            remove, fill = roles["mask"], self.mask.value
        e.note = "computed in blocks of query rows (the chunked form: fp32 scores never whole in memory)"
        return e.call(torch.ops.rla.attention_chunked.default, q, k, v, bias, remove, fill, how == "causal",
                      self.softcap, budget, name="attention")

    def _beyond_vllm_triton(self, roles: dict[str, Node]) -> str | None:
        """Why the `vllm_triton` form cannot compute this site (None: it can): it runs vLLM's
        kernel, which takes causal self-attention with a constant scale and nothing else."""
        if self.softcap is not None:
            return "soft-capping is not paired"
        if "scale" in roles:
            return "the scale is a run-time value"
        if self.bias:
            return "a baddbmm bias is not paired"
        if not isinstance(self.groups, int):
            return "the heads' grouping is a run-time value"
        if self.mask is None:
            return "attention without a causal mask is not paired (the kernel is causal)"
        return None

    def _vllm_triton(self, e: Emitter, roles: dict[str, Node]) -> Node:
        """vLLM's Triton kernel on the trainer's batch (sites/attention/vllm_triton.py): one op
        on q, k, v as the model holds them, the mask as an additive fp32 bias unless causal."""
        from . import vllm_triton  # noqa: F401  registers torch.ops.rla.vllm_triton_attention

        bias = None
        if self.mask.how == "add":
            bias = e.fp32(roles["mask"])
        elif self.mask.how != "causal":  # a bool or filled mask, as the bias it amounts to
            bias = self.mask.apply(e, e.call(aten.zeros_like.default, roles["mask"], dtype=torch.float32), roles)
        e.note = "computed by vLLM's Triton unified_attention kernel on the trainer's batch (rounding 'vllm_triton')"
        return e.call(torch.ops.rla.vllm_triton_attention.default, roles["q"], roles["k"], roles["v"], self.scale, bias,
                      name="attention")

    def _vllm_cpu_vec(self, e: Emitter, q: Node, k: Node, v: Node, roles: dict[str, Node]) -> Node:
        """The contract in vLLM-CPU's `vec` kernel order (sites/attention/vllm_cpu.py): one op,
        the mask handed to it as an additive fp32 bias (or the causal flag)."""
        from . import vllm_cpu as attention_vllm_cpu  # registers torch.ops.rla.vllm_cpu_vec_attention

        bias, causal = (e.fp32(roles["bias"]) if self.bias else None), False
        if self.mask is not None and self.mask.how == "causal":
            causal = True
        elif self.mask is not None and self.mask.how == "add":
            bias = e.fp32(roles["mask"])
        elif self.mask is not None:  # a bool or filled mask, as the bias it amounts to
            if bias is None:
                bias = e.call(aten.zeros_like.default, roles["mask"], dtype=torch.float32)
            bias = self.mask.apply(e, bias, roles)
        e.note = f"computed in vLLM-CPU's {attention_vllm_cpu.variant()} vec kernel order (rounding 'vllm_cpu_vec')"
        return e.call(torch.ops.rla.vllm_cpu_vec_attention.default, q, k, v, bias, causal, name="attention")


class AttentionMatcher:
    """HF's eager attention chain and SDPA, replaced by the contract's fp32 computation."""

    kind = "attention"

    def candidates(self, graph: Graph) -> Iterable[Node]:
        return ops.call_nodes(graph, *_SOFTMAX, *_SDPA, "flex_attention")

    def match(self, anchor: Node) -> Match | Miss | None:
        if ops.is_op(anchor, "flex_attention"):
            return Miss(self.kind, anchor, f"{ops.describe(anchor)}: flex_attention is not rewritten: its "
                        "score_mod/mask_mod is a user function run inside the fused kernel, whose order of "
                        "operations and roundings a graph rewrite cannot reach")
        if ops.is_op(anchor, *_SDPA):
            return self._sdpa(anchor)
        return self._eager(anchor)

    # -- SDPA ------------------------------------------------------------------------------
    def _sdpa(self, node: Node) -> Match | Miss | None:
        where = ops.describe(node)
        schema = node.target._schema.arguments
        args = {a.name: (a.default_value if a.has_default_value() else None) for a in schema}
        args.update({a.name: v for a, v in zip(schema, node.args)})
        args.update(node.kwargs)
        q, k, v = args["query"], args["key"], args["value"]
        mask = args.get("attn_mask", args.get("attn_bias"))
        if args.get("dropout_p"):
            return Miss(self.kind, node, f"{where}: dropout_p={args['dropout_p']} drops probabilities at random; "
                        "not rewritten (the contract covers attention without dropout)")
        region = {node}
        if isinstance(node.meta.get("val"), (tuple, list)):  # (output, logsumexp, ...): the output only
            outs = [u for u in node.users if ops.is_op(u, "getitem")]
            if len([u for u in outs if u.args[1] == 0]) != 1 or any(u.users for u in outs if u.args[1] != 0):
                return Miss(self.kind, node, f"{where}: reads more of the fused kernel than its output "
                            "(its logsumexp, for a backward of its own); not rewritten")
            region |= set(outs)
        shape_q, shape_k = ops.shape_of(q), ops.shape_of(k)
        if shape_q is None or shape_k is None or len(shape_q) < 2:
            return None
        scale = args.get("scale")
        roles = {"scale": scale} if isinstance(scale, Node) else {}  # a run-time (symbolic) scale
        scale = 1.0 / math.sqrt(shape_q[-1]) if scale is None else 1.0 if isinstance(scale, Node) else float(scale)
        nodes: set[Node] = set()
        k_src, k_groups = reading.ungroup(k, nodes)
        v_src, v_groups = reading.ungroup(v, nodes)
        if k_groups is not v_groups and k_groups != v_groups:
            return None
        heads_k = ops.shape_of(k_src)[-3] if len(shape_k) >= 3 else 1
        groups = shape_q[-3] // heads_k if args.get("enable_gqa") and len(shape_q) >= 3 else k_groups
        roles.update({"q": q, "k": k_src, "v": v_src})
        op = ops.op_name(node)
        variant = "sdpa" if op == "scaled_dot_product_attention" else op.removeprefix("_scaled_dot_product_")
        the_mask = None
        if args.get("is_causal"):
            # with dynamic lengths the site emits the chunked form (or the engine-paired op), each
            # taking the causal flag and applying it at the sizes it runs with
            the_mask, variant = reading.Mask("causal"), variant + ", causal"
        elif isinstance(mask, Node):
            roles["mask"] = mask
            if ops.dtype_of(mask) == torch.bool:
                the_mask, variant = reading.Mask("keep"), variant + ", bool mask"
            else:
                the_mask, variant = reading.Mask("add"), variant + ", float mask"
        if isinstance(groups, Node) or groups > 1:
            variant += ", grouped"
        region |= reading.owned(nodes, region)
        return Match(self.kind, node, frozenset(region), variant, roles,
                     recompute=("q", "k", "v"), computes=_Attention(scale, groups, None, the_mask))

    # -- the eager chain ------------------------------------------------------------------------
    def _eager(self, softmax: Node) -> Match | Miss | None:
        shape = ops.shape_of(softmax)
        if shape is None or ops.normalize_dim(softmax.args[1], len(shape)) != [len(shape) - 1]:
            return None
        where = ops.describe(softmax)
        nodes: set[Node] = {softmax}
        # forward: the probabilities, through casts and a dropout that drops nothing, into P · V
        p = softmax
        while len(p.users) == 1:
            user = next(iter(p.users))
            if ops.is_cast(user):
                p = user
            elif ops.is_op(user, "dropout", "native_dropout"):
                rate, train = user.args[1], (user.args[2] if len(user.args) > 2 else True)
                if rate and train:
                    return Miss(self.kind, softmax, f"{where}: dropout(p={rate}) on the probabilities in "
                                "training; not rewritten (the contract covers attention without dropout)")
                p = user
            else:
                break
            nodes.add(p)
        qk = reading.first_matmul(softmax.args[0])
        if qk is None:
            return None  # a softmax over no product of two tensors: not attention's (sampling, a router)
        pv = next((u for u in p.users if (prod := reading.product(u)) is not None and prod.left is p
                   and prod.transposed and prod.bias is None), None)
        if pv is None:
            # a softmax over a product (q · kᵀ in some spelling) is aligned or says why: never silent
            read = ", ".join(f"{ops.describe(u)} ({ops.op_name(u)})" for u in p.users) or "nothing"
            return Miss(self.kind, softmax, f"{where}: a softmax over the product {ops.describe(qk)} "
                        f"({ops.op_name(qk)}) whose probabilities are read by {read}, not multiplied by the values "
                        "as they are (a reshape of P, or attention sinks' column cut off, is not followed); "
                        "not rewritten")
        if len(p.users) != 1:
            return Miss(self.kind, softmax, f"{where}: the attention probabilities are read outside the site "
                        "(attention weights returned); not rewritten")
        nodes.add(pv)

        # back: mask, soft-cap, scale, to q · kᵀ
        scale, softcap, mask, roles = 1.0, None, None, {}
        s = reading.through_casts(softmax.args[0], nodes)
        masked = reading.kind_of_mask(s, qk)
        if masked is not None:
            nodes.add(s)
            s, mask, roles = masked
            s = reading.through_casts(s, nodes)
        if (capped := reading.softcap(s, nodes)) is not None:
            s, softcap = capped
            s = reading.through_casts(s, nodes)
        symbolic: list[Node] = []  # a scale known at run time only
        while s is not qk and (scaled := reading.scalar_operand(s) or reading.symbolic_factor(s)) is not None:
            nodes.add(s)
            s, factor = scaled
            symbolic += [factor] if isinstance(factor, Node) else []
            scale *= 1.0 if isinstance(factor, Node) else factor
            s = reading.through_casts(s, nodes)
        if s is not qk:
            return Miss(self.kind, softmax, f"{where}: the scores reach the softmax through {ops.describe(s)} "
                        f"({ops.op_name(s)}), not a scale, soft-cap or mask; not rewritten")
        nodes.add(qk)
        scores = reading.product(qk)
        if scores.beta != 1.0:
            return Miss(self.kind, softmax, f"{where}: {ops.describe(qk)} scales its added bias by beta={scores.beta}; "
                        "not rewritten (the contract adds a mask as it is)")
        if scores.bias is not None:  # baddbmm: alpha · q · kᵀ + bias, the bias an additive mask
            if mask is not None and mask.how == "add":
                return Miss(self.kind, softmax, f"{where}: two additive masks ({ops.describe(qk)}'s bias and "
                            f"{ops.describe(roles['mask'])}); not rewritten")
            if softcap is not None:
                return Miss(self.kind, softmax, f"{where}: a soft-cap over {ops.describe(qk)}, whose bias is added "
                            "before it; not rewritten")
            scale *= scores.alpha
            roles["bias"] = scores.bias

        inputs: set[Node] = set()  # the inputs' casts, transposes and repeats: the site's if only it reads them
        q = reading.widened(scores.left, inputs)
        while (scaled := reading.scalar_operand(q) or reading.symbolic_factor(q)) is not None and len(q.users) == 1:  # q pre-scaled
            inputs.add(q)
            q, factor = scaled
            symbolic += [factor] if isinstance(factor, Node) else []
            scale *= 1.0 if isinstance(factor, Node) else factor
            q = reading.widened(q, inputs)
        if symbolic and (len(symbolic) > 1 or scale != 1.0):
            return Miss(self.kind, softmax, f"{where}: scaled by a run-time (symbolic) value and by another "
                        "factor, which would have to be multiplied before q; not rewritten")
        k_t = reading.widened(scores.right, inputs)
        k = reading.transposed(k_t) if scores.transposed else k_t  # einsum "...qd,...kd": the key as stored
        if k is None:
            return Miss(self.kind, softmax, f"{where}: the scores' second operand {ops.describe(k_t)} is not "
                        "a transposed key; not rewritten")
        if scores.transposed:
            inputs.add(k_t)
        k, k_groups = reading.ungroup(reading.widened(k, inputs), inputs)
        v, v_groups = reading.ungroup(reading.widened(reading.product(pv).right, inputs), inputs)
        shapes = [ops.shape_of(n) for n in (q, k, v)]
        if any(shape is None or len(shape) != len(shapes[0]) for shape in shapes) or (
                k_groups is not v_groups and k_groups != v_groups):
            return Miss(self.kind, softmax, f"{where}: q, k and v of {ops.describe(qk)} and {ops.describe(pv)} "
                        "do not have the shapes of one attention (ranks or head groups differ); not rewritten")
        roles = {"q": q, "k": k, "v": v, **roles, **({"scale": symbolic[0]} if symbolic else {})}
        region = nodes | reading.owned(inputs, nodes)
        outside = [n for n in region if n is not pv and any(u not in region for u in n.users)]
        if outside:
            return Miss(self.kind, softmax, f"{where}: {ops.describe(outside[0])} inside attention is read "
                        "outside it; not rewritten")
        spelling = {"einsum": ", einsum", "baddbmm": ", baddbmm with a bias"}.get(ops.op_name(qk), "")
        variant = "eager" + spelling + (", soft-capped" if softcap else "") + (f", {mask.how} mask" if mask else "") + (
            ", grouped" if isinstance(k_groups, Node) or k_groups > 1 else "")
        return Match(self.kind, softmax, frozenset(region), variant, roles, recompute=("q", "k", "v"),
                     computes=_Attention(scale, k_groups, softcap, mask, bias="bias" in roles))


def vec_output_rounding() -> str:
    """How the `vllm_cpu_vec` form's output rounds here: as vLLM-CPU's vec kernel rounds on this CPU."""
    from .vllm_cpu import output_rounding

    return output_rounding()


SITE = Site(
    kind=AttentionMatcher.kind,
    matcher=AttentionMatcher(),
    summary="attention in fp32 from q × scale (scores, softmax, P·V), output rounded once",
    opt_in="it replaces fused attention kernels (flash) by the contract's fp32 matmul-softmax-matmul, in blocks of "
           "query rows at long sequences: 1.33x the default sites' training step at Qwen3-0.6B's shape, 2048 tokens, "
           "on an H200 (docs/performance.md#attention); it pays where the engine computes attention in fp32 "
           "(vLLM-CPU's vec kernel)",
    # the fused ops Inductor runs as kernels of their own (the composite and the math op decompose)
    kernel_boundaries=tuple(op for op in _SDPA
                            if op not in ("scaled_dot_product_attention", "_scaled_dot_product_attention_math")),
    # vLLM-CPU's `vec` kernel computes the contract in fp32; with its KV split across threads (the
    # default), single-request decode sums in another order than prefill (0.013-0.017% of elements differ)
    engine_env={"VLLM_CPU_ATTN_SPLIT_KV": "0"},
    # vLLM-CPU's fp32 `vec` kernel where it would run `amx` (P in bf16); then say which kernel runs and how it rounds
    engine_hooks=("fp32_attention_kernel", "check_attention_kernel"),
    # its output rounding is to nearest or toward zero, by how vLLM was built for this CPU: measured
    engine_rounding="cpu_attention",
    # the trainer's attention in the fp32 order of vLLM-CPU's vec kernel, rounded as its build rounds
    # on this CPU (sites/attention/vllm_cpu.py; the probe pairs it when equal); on CUDA, vLLM's
    # Triton kernel (TRITON_ATTN) run on the trainer's batch (sites/attention/vllm_triton.py)
    engine_forms={"vllm_cpu_vec": vec_output_rounding, "vllm_triton": "nearest"},
)
