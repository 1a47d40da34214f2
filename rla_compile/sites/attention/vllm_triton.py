"""The attention site's engine-paired form for vLLM's TRITON_ATTN backend on CUDA (issue #37,
item 3; docs/contract.md#engine-paired-forms): the trainer's attention computed by the kernel
the engine runs, vLLM's Triton `unified_attention`, on the trainer's own batch.

What the kernel computes (vLLM 0.32, v1/attention/ops/triton_unified_attention.py; its 2D
path, which every prefill batch takes, and decode batches too with `VLLM_BATCH_INVARIANT=1`):
per query row, over tiles of 32 keys aligned to key positions, S = scale · (q · kᵀ) accumulated
in fp32 (q not pre-scaled), keys after the query set to -inf, then the online softmax
m = max(M, max S), P = exp(S - m), alpha = exp(M - m), L = L · alpha + sum P, and
acc = acc · alpha + bf16(P) · V (P rounded to the value dtype, the product accumulated in
fp32); the output acc / L, rounded once, to nearest, as it is stored. Unlike the contract, P is
rounded before P · V (so the form is the contract's only up to that rounding) and on a GPU every
step's bits come from the GPU: `tl.exp` is an approximate `ex2`, the division approximate, the
tensor cores' sums in their own order. No emulation in torch could reproduce them, so the form
runs the same kernel: the trainer's [B, H, L, D] laid out as vLLM lays out a prefill batch
(`_packed`: tokens packed one sequence after another, keys in paged blocks). A sequence's rows
do not depend on the other sequences of the batch, nor on the block table or its block size
(a program handles one sequence's tokens; tiles are aligned to key positions and a row's fully
masked tiles change nothing), so the trainer's batch gets the engine's bits
(tests/test_vllm.py checks this under Triton's interpreter, against the engine's own call).

Scope: causal self-attention as HF trains it, with left or right padding (an additive mask of
0 and the dtype's minimum that is causal on each sequence's tokens: `_spans`); other masks,
soft-capping, sliding windows and a run-time scale keep the contract's form (the report says
so). Query rows outside a sequence's tokens (padding) keep the contract's output.

Backward: the gradient of that forward with P's rounding taken as the identity, as
FlashAttention's own backward does. On CUDA it is SDPA's backward (flash, or the
memory-efficient kernel with a padding mask) over a recomputed forward (`sdpa_backward`), at
about a fused kernel's cost; elsewhere (the interpreter tests) the contract's backward over P
recomputed in fp32 (`chunked.backward`, in blocks of query rows). Heads are summed back for
grouped queries; each gradient is rounded once to its input's dtype.

The kernel is vLLM's, imported from the installed `vllm` (the version the engine runs): rla
ships no copy of it. Pairing (`integrations.vllm_kernels.paired_attention_form`) selects this
form where the engine runs TRITON_ATTN on CUDA.
"""

from __future__ import annotations

import math

import torch

from . import chunked

__all__ = ["attention", "kernel", "spans", "packed", "MASKED"]

MASKED = -1e37  # an additive mask at or below this (HF: the dtype's minimum) removes the key
BLOCK = 16  # the paged block size the trainer's keys are laid out in (it does not change the arithmetic)


def kernel():
    """vLLM's `unified_attention`, or a RuntimeError that says what to install."""
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    except Exception as error:  # ImportError, or vLLM's own import-time checks
        raise RuntimeError(
            "rla's attention form 'vllm_triton' runs vLLM's own Triton kernel "
            "(vllm.v1.attention.ops.triton_unified_attention.unified_attention) on the trainer's batch and could not "
            f"import it ({type(error).__name__}: {error}). Install the vllm your engine runs next to the trainer, "
            "or use the attention site's contract form (rounding 'nearest')") from error
    return unified_attention


def spans(bias: torch.Tensor | None, batch: int, tokens: int) -> list[tuple[int, int]]:
    """Per sequence, (first, end): the tokens the engine would hold, from the additive mask
    [B|1, H|1, L, L] (None: causal over all `tokens`): the keys the last row that keeps its own
    key keeps (left padding: the last row; right padding: the last real one; padding rows,
    whatever they keep, HF's unmasked fully masked rows included, are not the engine's; a
    sequence whose every row keeps every key, HF's all-padding one, holds none: (0, 0)). On
    those tokens the mask must be causal with 0 where a key is kept, and those rows must keep no
    other key; else a ValueError says so."""
    if bias is None:
        return [(0, tokens)] * batch
    bias = bias.expand(batch, *bias.shape[1:])
    found = []
    for b in range(batch):
        kept = bias[b] > MASKED  # [H|1, L, L]
        own = kept.diagonal(dim1=-2, dim2=-1).all(0).nonzero()
        if own.numel() == 0 or bool(kept.all()):  # no token attends to itself, or every row keeps every key (HF
            found.append((0, 0))                    # unmasks an all-padding sequence so): the contract's rows
            continue
        last = int(own.max())
        keys = kept[:, last].all(0).nonzero().flatten()
        first, end = int(keys.min()), last + 1
        causal = torch.ones(end - first, end - first, dtype=torch.bool, device=bias.device).tril()
        inside = kept[:, first:end, first:end]
        if not (bool((inside == causal).all()) and bool((bias[b][:, first:end, first:end][causal.expand_as(inside)] == 0).all())
                and not bool(kept[:, first:end, :first].any()) and not bool(kept[:, first:end, end:].any())):
            raise ValueError(
                f"rla's attention form 'vllm_triton' pairs causal self-attention with padding (sequence {b}: tokens "
                f"{first}..{last}); this mask is not causal with 0 on those tokens. Use the attention site's "
                "contract form (rounding 'nearest') for it")
        found.append((first, end))
    return found


def packed(q, k, v, seqs: list[tuple[int, int]]):
    """The trainer's q [B, H, L, D], k, v [B, Hkv, L, D] as vLLM's prefill batch: q's tokens
    [T, H, D] one sequence after another, the keys and values in paged blocks of `BLOCK`
    [N, BLOCK, Hkv, D], each sequence's block table, its query start and its length; and the
    index of each packed token (sequence, position)."""
    live = [(b, first, end) for b, (first, end) in enumerate(seqs) if end > first]
    queries = torch.cat([q[b, :, first:end].transpose(0, 1) for b, first, end in live])
    blocks = [math.ceil((end - first) / BLOCK) for _, first, end in live]
    table = torch.zeros(len(live), max(blocks), dtype=torch.int32, device=q.device)
    caches = []
    start = 0
    for row, ((b, first, end), n) in enumerate(zip(live, blocks)):
        table[row, :n] = torch.arange(start, start + n, dtype=torch.int32, device=q.device)
        start += n
    for x in (k, v):
        paged = []
        for (b, first, end), n in zip(live, blocks):
            own = x[b, :, first:end].transpose(0, 1)  # [n tokens, Hkv, D]
            paged.append(torch.nn.functional.pad(own, (0, 0, 0, 0, 0, n * BLOCK - own.shape[0])).reshape(n, BLOCK, *own.shape[1:]))
        caches.append(torch.cat(paged).contiguous())
    lengths = torch.tensor([end - first for _, first, end in live], dtype=torch.int32, device=q.device)
    starts = torch.zeros(len(live) + 1, dtype=torch.int32, device=q.device)
    starts[1:] = lengths.cumsum(0)
    return queries.contiguous(), caches[0], caches[1], table, starts, lengths, live


def run(q, k, v, scale: float, seqs: list[tuple[int, int]]) -> torch.Tensor:
    """The kernel's output for the tokens in `seqs` ([B, H, L, D], q's dtype; other rows zero)."""
    out = q.new_zeros(q.shape)
    if not any(end > first for first, end in seqs):
        return out
    queries, keys, values, table, starts, lengths, live = packed(q, k, v, seqs)
    result = torch.empty_like(queries)
    longest = int(lengths.max())
    kernel()(q=queries, k=keys, v=values, out=result, cu_seqlens_q=starts, max_seqlen_q=longest, seqused_k=lengths,
             max_seqlen_k=longest, softmax_scale=scale, causal=True, window_size=(-1, -1), block_table=table, softcap=0,
             q_descale=None, k_descale=None, v_descale=None)
    for (b, first, end), a, z in zip(live, starts[:-1].tolist(), starts[1:].tolist()):
        out[b, :, first:end] = result[a:z].transpose(0, 1)
    return out


def _contract(q, k, v, scale: float, bias):
    """The contract's fp32 output (q × scale first, causal, the additive mask), heads repeated."""
    groups = q.shape[1] // k.shape[1]
    qf = q.float() * scale
    kf, vf = (x.float().repeat_interleave(groups, 1) for x in (k, v))
    scores = torch.matmul(qf, kf.transpose(-1, -2))
    rows, cols = scores.shape[-2:]
    scores = scores.masked_fill(torch.ones(rows, cols, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    if bias is not None:
        scores = scores + bias
    return torch.matmul(chunked.safe_softmax(scores), vf)


@torch.library.custom_op("rla::vllm_triton_attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 attention output [B, H, L, D] (the kernel's rounded values, widened; the site's
    rounding then changes nothing) from q [B, H, L, D] and k, v [B, Hkv, L, D] in the model's
    dtype, causal, with HF's additive padding mask `bias` [B|1, H|1, L, L] or None."""
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(f"rla's attention form 'vllm_triton' pairs self-attention (prefill): {q.shape[-2]} queries over "
                         f"{k.shape[-2]} keys; use the contract form (rounding 'nearest') here")
    seqs = spans(bias, q.shape[0], q.shape[-2])
    out = run(q, k, v, scale, seqs).float()
    for b, (first, end) in enumerate(seqs):  # rows the engine never holds (padding): the contract's
        if first > 0 or end < q.shape[-2]:
            own = None if bias is None else bias.expand(q.shape[0], *bias.shape[1:])[b:b + 1]
            whole = _contract(q[b:b + 1], k[b:b + 1], v[b:b + 1], scale, own)[0]
            out[b, :, :first], out[b, :, end:] = whole[:, :first], whole[:, end:]
    return out


@attention.register_fake
def _(q, k, v, scale, bias):
    return q.new_empty(q.shape, dtype=torch.float32)


def _setup(ctx, inputs, output):
    q, k, v, scale, bias = inputs
    ctx.save_for_backward(q, k, v, bias)
    ctx.scale = scale


def _backward(ctx, grad):
    """On CUDA, SDPA's own backward (`sdpa_backward`); elsewhere the contract's (P recomputed in
    fp32, blocks of query rows), q's gradient through its scale, the repeated heads' gradients
    summed per KV head."""
    q, k, v, bias = ctx.saved_tensors
    if q.is_cuda:
        return (*sdpa_backward(grad, q, k, v, ctx.scale, bias), None, None)
    groups = q.shape[1] // k.shape[1]
    qf = q.float() * ctx.scale
    kf, vf = (x.float().repeat_interleave(groups, 1) for x in (k, v))
    grad_q, grad_k, grad_v, _ = chunked.backward(grad.float().contiguous(), qf, kf, vf, bias, None, 0.0, True, None,
                                                 False)

    def per_kv_head(g):
        return g.unflatten(1, (k.shape[1], groups)).sum(2)

    return ((grad_q * ctx.scale).to(q.dtype), per_kv_head(grad_k).to(k.dtype), per_kv_head(grad_v).to(v.dtype),
            None, None)


def sdpa_backward(grad, q, k, v, scale: float, bias):
    """The gradients of SDPA's forward on q, k, v in their dtype (heads repeated, summed back per
    KV head), by SDPA's backward over a recomputed forward: on CUDA flash attention's (causal) or
    the memory-efficient kernel's (a padding mask), whose forward, like vLLM's Triton kernel,
    rounds P to the value dtype before P · V; their backward recomputes P in fp32, so P's
    rounding passes as the identity, as in the contract's backward. About a fused forward and
    backward's time, where the contract's fp32 products cost several times that on a GPU."""
    groups = q.shape[1] // k.shape[1]
    leaves = [x.detach().requires_grad_() for x in (q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))]
    with torch.enable_grad():
        out = torch.nn.functional.scaled_dot_product_attention(
            *leaves, attn_mask=None if bias is None else bias.to(q.dtype), is_causal=bias is None, scale=scale)
        grad_q, grad_k, grad_v = torch.autograd.grad(out, leaves, grad.to(out.dtype))

    def per_kv_head(g):
        return g.unflatten(1, (k.shape[1], groups)).float().sum(2).to(k.dtype)

    return grad_q, per_kv_head(grad_k), per_kv_head(grad_v)


attention.register_autograd(_backward, setup_context=_setup)
