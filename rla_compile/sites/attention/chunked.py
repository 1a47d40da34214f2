"""The attention site's chunked form: the contract over blocks of query rows, its fp32 scores
and probabilities never whole in memory (issue #25, item 2; docs/performance.md#chunked).

The contract's form (`__init__.py`) materialises fp32 scores and probabilities [B, H, L, S] and
autograd keeps P for the backward: at 2048 tokens and 16 heads that is 268 MB per layer. Each
query row's attention is independent of the others, so `rla::attention_chunked` computes the
same ops, in the same order, one block of rows at a time: q_rows · kᵀ, soft-cap, mask,
softmax, P · v. It keeps only q, k, v (fp32, [B, H, L, E]) for its backward, which recomputes
each block's forward and applies autograd's formulas to it (`rla::attention_chunked_backward`).

Bits (measured, tests/test_attention_chunked.py and docs/performance.md#chunked): the output
and q's gradient equal the contract's form bit for bit: a row's scores, softmax and P · v are
the same ATen calls on fewer rows, and blocks of at least `MIN_ROWS` rows keep the GEMM's
kernel (a soft-cap's tanh can flip a last bit: its vectorised kernel's tail moves with the
block's size). k's and v's gradients sum over every query: over blocks
they add per block, an fp32 order of its own, so after their one rounding a few elements in
10,000 differ from autograd's single product (at one block they are equal). The contract fixes
where attention rounds, not the order of fp32 sums (docs/contract.md#attention-opt-in).

The block: `rows_per_block(B, H, L, S, budget)` rows, so that one block's fp32 scores take at
most `budget` bytes: option `attention_chunk_mib` (default 16 MiB), an argument of the op in the
compiled graph, so a different budget is a different graph (it is in the cache key). The site emits this
op where the scores' size is not known at compile time (dynamic shapes) or exceeds that budget
(`CHUNK_ABOVE_BYTES`); smaller static ones keep the contract's form as emitted ATen ops, which
Inductor fuses. An op of rla's own, Inductor runs it as one extern kernel on any device.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention", "safe_softmax", "rows_per_block", "blocks", "DEFAULT_BUDGET", "CHUNK_ABOVE_BYTES", "MIN_ROWS"]

# One block's fp32 scores at most this many MiB by default: on this CPU (AMD EPYC, 2 cores,
# Qwen3-0.6B's 16 heads of 128) forward + backward took about the whole form's time from 1024 to
# 2048 tokens at 16 MiB blocks (4 MiB: 1.1-1.6x, 32: 1.3x; docs/performance.md#chunked).
DEFAULT_BUDGET = 16 << 20  # bytes: option attention_chunk_mib's default
# The site's choice at compile time (static shapes): the chunked op above this many bytes of fp32
# scores (where one default block would not hold them), the contract's form as ATen ops at or
# below. Fixed, so a compiled graph's form does not depend on the environment (the cache key
# holds rla's source, not the environment).
CHUNK_ABOVE_BYTES = DEFAULT_BUDGET


# Fewest query rows in a block (unless all the rows are fewer). A matrix product's bits can depend
# on how many rows it has: ATen's CPU GEMM (MKL here) takes another kernel, with another order of
# its fp32 sums, for products of 1-3 rows (measured on an AMD EPYC with AVX2: head sizes 8-128,
# 12-1024 keys; from 4 rows on, each row equals the whole product's, bit for bit).
MIN_ROWS = 16


def rows_per_block(batch: int, heads: int, queries: int, keys: int, budget: int = DEFAULT_BUDGET) -> int:
    """Query rows per block: as many as keep one block's fp32 scores within `budget` bytes, at
    least `MIN_ROWS`, at most all of them."""
    per_row = max(1, batch * heads * keys * 4)
    return max(1, min(queries, max(MIN_ROWS, budget // per_row)))


def blocks(queries: int, rows: int) -> list[tuple[int, int]]:
    """(start, stop) of each block of `rows` query rows; a remainder of fewer than `MIN_ROWS`
    rows joins the last block, so no block but a lone one is short (see `MIN_ROWS`)."""
    starts = list(range(0, queries, rows))
    if len(starts) > 1 and queries - starts[-1] < MIN_ROWS:
        starts.pop()
    return list(zip(starts, [*starts[1:], queries]))


def _block(q, k, v, bias, remove, fill: float, causal: bool, softcap: float | None, start: int):
    """The contract's ops for the query rows start.. (q already sliced to them): the fp32 output
    rows, the probabilities, the causal mask (or None) and the soft-capped tanh (or None), the
    last three for the backward."""
    rows = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2))
    capped = None
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        scores = capped * softcap
    if bias is not None:
        scores = scores + _rows(bias, start, rows)
    if remove is not None:
        scores = scores.masked_fill(_rows(remove, start, rows), fill)
    above = None
    if causal:  # top-left aligned, as SDPA's is_causal
        keys = torch.arange(k.shape[-2], device=q.device)
        above = keys[None, :] > torch.arange(start, start + rows, device=q.device)[:, None]
        scores = scores.masked_fill(above, -math.inf)
    probs = safe_softmax(scores)
    return torch.matmul(probs, v), probs, above, capped


def safe_softmax(scores: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dimension, with P = 0 in a row whose every score is -inf (a
    query every key of which is masked: left padding), as SDPA computes it, instead of 0/0.
    Other rows: `_softmax`'s bits. The backward (`_softmax_backward_data` on P) is then 0 there."""
    alive = (scores != -math.inf).any(-1, keepdim=True)  # no branch on it: traced in a backward too
    return torch._softmax(scores.masked_fill(~alive, 0.0), -1, False).masked_fill(~alive, 0.0)


def _rows(mask: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """A mask's rows for a block (a mask broadcast over the queries has one row: as it is)."""
    if mask.dim() < 2 or mask.shape[-2] == 1:
        return mask
    return mask[..., start:start + rows, :]


def _check(q, k, v, bias, remove):
    if q.dim() < 2 or k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2]:
        raise ValueError(f"rla's chunked attention takes q [..., L, E], k [..., S, E], v [..., S, Ev]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    for name, mask in (("bias", bias), ("mask", remove)):
        if mask is not None and mask.dim() >= 2 and mask.shape[-2] not in (1, q.shape[-2]):
            raise ValueError(f"rla's chunked attention: the {name}'s query dimension is {mask.shape[-2]}, "
                             f"neither 1 nor the {q.shape[-2]} queries")


@torch.library.custom_op("rla::attention_chunked", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
              remove: torch.Tensor | None, fill: float, causal: bool, softcap: float | None,
              budget: int = DEFAULT_BUDGET) -> torch.Tensor:
    """fp32 attention output [..., L, Ev] (before its rounding), the contract one block of query
    rows at a time, from the scaled fp32 q [..., L, E] and fp32 k, v [..., S, E] (heads repeated);
    `softcap` (tanh(s / c) · c) or None; an fp32 additive `bias` and a bool `remove` mask (True:
    the score becomes `fill`), each broadcastable to [..., L, S] or None; `causal` (keys after
    the query removed, top-left aligned); `budget`: one block's fp32 scores at most this many
    bytes (option `attention_chunk_mib`)."""
    _check(q, k, v, bias, remove)
    queries = q.shape[-2]
    rows = rows_per_block(math.prod(q.shape[:-2]), 1, queries, k.shape[-2], budget)
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    for start, stop in blocks(queries, rows):
        out[..., start:stop, :] = _block(q[..., start:stop, :], k, v, bias, remove, fill, causal, softcap, start)[0]
    return out


@attention.register_fake
def _(q, k, v, bias, remove, fill, causal, softcap, budget=DEFAULT_BUDGET):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.custom_op("rla::attention_chunked_backward", mutates_args=())
def backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
             remove: torch.Tensor | None, fill: float, causal: bool, softcap: float | None,
             bias_grad: bool, budget: int = DEFAULT_BUDGET) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `attention` for q, k, v (and the bias when `bias_grad`; else an empty
    tensor), by autograd's formulas for each op of a block (those `_block` calls), its forward
    recomputed: q's rows block by block; k's, v's and a query-broadcast bias's summed over the
    blocks."""
    queries = q.shape[-2]
    rows = rows_per_block(math.prod(q.shape[:-2]), 1, queries, k.shape[-2], budget)
    grad_q = q.new_empty(q.shape)  # all four contiguous, as the fake ones
    grad_k = grad_v = None
    grad_bias = bias.new_zeros(bias.shape) if bias_grad else q.new_empty(0)
    per_row_bias = bias_grad and bias.dim() >= 2 and bias.shape[-2] != 1
    for start, stop in blocks(queries, rows):
        q_rows, g_rows = q[..., start:stop, :], grad[..., start:stop, :]
        _, probs, above, capped = _block(q_rows, k, v, bias, remove, fill, causal, softcap, start)
        block_v = torch.matmul(probs.transpose(-1, -2), g_rows)
        grad_scores = torch._softmax_backward_data(torch.matmul(g_rows, v.transpose(-1, -2)), probs, -1,
                                                   torch.float32)
        if above is not None:
            grad_scores = grad_scores.masked_fill(above, 0)
        if remove is not None:
            grad_scores = grad_scores.masked_fill(_rows(remove, start, q_rows.shape[-2]), 0)
        if per_row_bias:
            grad_bias[..., start:stop, :] = grad_scores.sum_to_size(grad_bias[..., start:stop, :].shape)
        elif bias_grad:
            grad_bias += grad_scores.sum_to_size(bias.shape)
        if capped is not None:  # tanh(s / c) · c
            grad_scores = torch.ops.aten.tanh_backward(grad_scores * softcap, capped) / softcap
        grad_q[..., start:stop, :] = torch.matmul(grad_scores, k)
        block_k = torch.matmul(q_rows.transpose(-1, -2), grad_scores).transpose(-1, -2)
        grad_k = block_k if grad_k is None else grad_k + block_k
        grad_v = block_v if grad_v is None else grad_v + block_v
    return grad_q, grad_k.contiguous(), grad_v.contiguous(), grad_bias


@backward.register_fake
def _(grad, q, k, v, bias, remove, fill, causal, softcap, bias_grad, budget=DEFAULT_BUDGET):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            bias.new_empty(bias.shape) if bias_grad else q.new_empty(0))


def _setup(ctx, inputs, output):
    q, k, v, bias, remove, fill, causal, softcap, budget = inputs
    ctx.save_for_backward(q, k, v, bias, remove)
    ctx.fill, ctx.causal, ctx.softcap, ctx.budget = fill, causal, softcap, budget


def _backward(ctx, grad):
    q, k, v, bias, remove = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[3]
    grad_q, grad_k, grad_v, grad_bias = backward(grad, q, k, v, bias, remove, ctx.fill, ctx.causal, ctx.softcap,
                                                 bias_grad, ctx.budget)
    return grad_q, grad_k, grad_v, (grad_bias if bias_grad else None), None, None, None, None, None


attention.register_autograd(_backward, setup_context=_setup)
