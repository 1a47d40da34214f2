"""The attention site's engine-paired form: the contract computed in the fp32 order of
vLLM-CPU's `vec` attention kernel (issue #25, item 6; docs/contract.md#engine-paired-forms).

The contract fixes where attention rounds (once, at its output) but not the order of its fp32
arithmetic; two exact fp32 forms still differ in the last bit, and after the one rounding
0.006-0.02% of the outputs flip. Across 4 layers that was what kept trainer and vLLM-CPU apart
(62% bitwise-equal logprobs with the site on both sides). A trainer paired with vLLM-CPU can do
better: compute what the kernel computes, in its order. Option `rounding={"attention":
"vllm_cpu_vec"}` (paired automatically when the probe in `integrations.vllm_kernels` finds the
engine's kernel equal to this form bit for bit) replaces the site by `torch.ops.rla.vllm_cpu_vec_attention`,
an op Inductor runs as one extern kernel (its arithmetic must not be fused or reassociated).

What the kernel does (vllm-cpu 0.32.0: csrc/cpu/cpu_attn_impl.hpp, cpu_attn_vec.hpp,
cpu_types_x86.hpp, cpu_arch_macros.h; x86 builds `_C_AVX2` (no FMA) and `_C_AVX512` (FMA),
loaded by whether the CPU has AVX-512), all fp32:

1. q × scale (before q · k; the site's own first step);
2. each score a chain over the head dimension in ascending order from 0: `c = c + q_d k_d`
   (AVX2: a multiply and an add, two roundings; AVX-512: one FMA);
3. online softmax over blocks of `kv_tile` keys, `kv_tile` from the L2 size, the head size and
   the thread count (`_kv_tile`); the running max moves only when it grows by more than 8;
   `p = exp(s - m)` with the kernel's exp (AVX2: glibc's `expf`; AVX-512: the kernel's own
   polynomial), P never rounded; the block's sum over 16 lanes, reduced as the build does;
   on a rescale `alpha = expf(m_old - m_new)`, `l = sum + alpha l`, `O = alpha O`;
4. `O = O + p_j v_j` key by key in ascending order (AVX2: multiply, add; AVX-512: FMA);
5. the output `(1 / l) × O`, rounded once: toward zero (the low 16 bits dropped) on CPUs
   without AVX512-BF16, to nearest with it (`output_rounding`).

FMAs and glibc's `expf` (double-precision with FMAs) are emulated exactly in float64 with
error-free transformations (`_fma32`, `_fma64`): ATen has no fused multiply-add.

Scope: causal or padded self-attention as the trainer sees it (the mask as an additive bias or
a causal flag; left padding handled per sequence, since the kernel's blocks start at a
sequence's first token), grouped heads repeated. Soft-capping is not emulated (that site keeps
the contract's form; the report says so). The backward is the contract's: autograd's formulas
over P recomputed as the contract computes it (`_contract_backward`), so gradients equal the
contract site's.

The forward runs as C (`csrc/vllm_cpu_vec.c`, built on first use by `native`, with no FMA
contraction and no reassociation), checked bit for bit against the Python form here
(`_one_request`, the reference: one ATen op per head-dimension step and per key). Without a C
compiler the Python form runs, and rla's logger says so once. Cost: docs/performance.md.
"""

import ctypes
import functools
import logging
import math

import torch

from ... import native
from . import chunked
from .chunked import safe_softmax

__all__ = ["attention", "kv_tile", "variant", "implementation"]

log = logging.getLogger("rla_compile")

_LOWEST = -3.4028234663852886e38  # std::numeric_limits<float>::lowest(): the running max's start
_RESCALE_BELOW = -8.0  # the max moves only when it grows by more than 8
_LANES = 16
_MASKED = -1e37  # an additive mask at or below this (HF: the dtype's minimum) is the kernel's -inf


def variant() -> str:
    """The x86 build vLLM-CPU loads here: "avx512" (FMA) where the CPU has AVX-512, else "avx2"."""
    return "avx512" if torch.cpu._is_avx512_supported() else "avx2"


def output_rounding() -> str:
    """How the kernel rounds its fp32 output to bf16 on this CPU: with AVX512-BF16 the build
    converts with the CPU's instruction, to nearest (ties to even); without it, it drops the low
    16 bits, toward zero. Measured equal to the kernel bit for bit both ways (tests/test_vllm.py)."""
    return "nearest" if torch.cpu._is_avx512_bf16_supported() else "toward_zero"


def _l2_bytes() -> int:
    return int(torch._C._cpu._get_cpu_capability().get("l2_cache_size", 1 << 20))


# -- exact fp32 arithmetic the kernel's compiler fused --------------------------------------
_SPLIT = 134217729.0  # 2**27 + 1 (Veltkamp)


def _two_sum(a, b):
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _two_prod(a, b):
    p = a * b
    c = _SPLIT * a
    ah = c - (c - a)
    c = _SPLIT * b
    bh = c - (c - b)
    al, bl = a - ah, b - bh
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _add_round_to_odd(x, y):
    """x + y in float64 rounded to odd: a later rounding to fewer bits is then correct."""
    s, err = _two_sum(x, y)
    bits = s.view(torch.int64)
    towards = torch.where((err > 0) == (s > 0), 1, -1).to(torch.int64)
    return torch.where((err != 0) & ((bits & 1) == 0), bits + towards, bits).view(torch.float64)


def _fma32(a, b, c):
    """fp32 fma(a, b, c), rounded once: a·b is exact in float64, the sum rounded to odd there."""
    return _add_round_to_odd(a.double() * b.double(), c.double()).float()


def _fma64(a, b, c):
    """float64 fma(a, b, c), rounded once (Boldo-Melquiond)."""
    p, p_err = _two_prod(a, b)
    s, s_err = _two_sum(c, p)
    return s + _add_round_to_odd(s_err, p_err)


# -- the kernel's exps -------------------------------------------------------------------------
_EXPF_TABLE = torch.tensor([
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
    0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
    0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
    0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540], dtype=torch.int64)
_H = float.fromhex


def _glibc_expf(x: torch.Tensor) -> torch.Tensor:
    """glibc's expf (2.28+, sysdeps/ieee754/flt-32/e_expf.c, the FMA variant libm picks on
    CPUs with FMA): 2^(k/32) from a table times a degree-3 polynomial, in double."""
    xd = x.double()
    kd = _fma64(torch.full_like(xd, _H("0x1.71547652b82fep+5")), xd, torch.full_like(xd, _H("0x1.8p+52")))
    kd = kd - _H("0x1.8p+52")  # the nearest integer to x · 32 / ln 2
    r = _fma64(torch.full_like(xd, _H("0x1.71547652b82fep+5")), xd, -kd)
    k = kd.clamp(-2 ** 20, 2 ** 20).to(torch.int64)
    s = (_EXPF_TABLE[k & 31] + k * (1 << 47)).view(torch.float64)
    z = _fma64(torch.full_like(r, _H("0x1.c6af84b912394p-20")), r, torch.full_like(r, _H("0x1.ebfce50fac4f3p-13")))
    y = _fma64(r, torch.full_like(r, _H("0x1.62e42ff0c52d6p-6")), torch.ones_like(r))
    y = _fma64(z, r * r, y)
    out = (y * s).float()
    out = torch.where(x > _H("0x1.62e42ep6"), math.inf, out)
    out = torch.where(x < _H("-0x1.9d1d9ep6"), 2.0 ** -149, out)
    out = torch.where(x < _H("-0x1.9fe368p6"), 0.0, out)
    return torch.where(torch.isnan(x), x, out)


def _bits(i: int) -> float:
    return torch.tensor(i, dtype=torch.int64).to(torch.int32).view(torch.float32).item()


_LN_FLT_MIN, _LN_FLT_MAX = _bits(0xc2aeac50), _bits(0x42b17218)
_LOG2E, _LN2 = _bits(0x3fb8aa3b), _bits(0x3f317218)
_EXP_POLY = (0.00828929059, 0.0418978221, 0.166676521, 0.499991506, 0.999999701, 1.0)


def _fast_expf(x: torch.Tensor) -> torch.Tensor:
    """The AVX-512 build's exp (DEFINE_FAST_EXP, cpu_arch_macros.h), its FMAs exact."""
    def full(c):
        return torch.full_like(x, c)

    src = x.clamp(_LN_FLT_MIN, _LN_FLT_MAX)
    fx = torch.floor(_fma32(src, full(_LOG2E), full(0.5)))
    r = _fma32(-fx, full(_LN2), src)
    res = full(_EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        res = _fma32(r, res, full(c))
    pow2 = ((fx - 1.0).to(torch.int32) + 127 << 23).view(torch.float32)
    res = res * torch.where(x < _LN_FLT_MIN, 0.0, pow2)
    return res + res


# -- the kernel's schedule -------------------------------------------------------------------
def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def kv_tile(tokens: int, head_size: int, threads: int | None = None, l2_bytes: int | None = None) -> list[int]:
    """The online softmax's block size (keys) for each query row of one prefill request of
    `tokens` tokens (AttentionScheduler::schedule with the KV split off: query tiles of 8
    tokens shared out over `threads` by KV length, cut into chunks of `default_tile` tokens;
    a chunk's `kv_tile` from the half of L2 its buffers leave)."""
    threads = threads or torch.get_num_threads()
    cache = (l2_bytes or _l2_bytes()) >> 1
    rows = 8  # query heads (MHA in prefill) x tokens per iteration
    default_tile = max(min(cache // (head_size * (4 + 2 * 2 + 4) + rows * 4), 128 * rows) // rows * rows, rows)
    tiles = [(min(rows, tokens - t), _round_up(min(t + rows, tokens), 32)) for t in range(0, tokens, rows)]
    per_thread = _round_up(sum(kv for _, kv in tiles) // threads, 32)
    items, per_item = [], [0] * threads
    start = count = kv_len = tid = token = 0
    left = per_thread
    for n, kv in tiles:  # the greedy balancer, as written (min split 32)
        while True:
            if kv <= left + 32 or tid == threads - 1:
                count, kv_len, left = count + n, kv_len + kv, left - kv
                if left < 0:
                    left -= 32
                break
            if left < 32 and (kv_len > 0 or per_item[tid] > 0):
                if kv_len > 0:
                    items.append((start, count))
                    per_item[tid] += 1
                    start, count, kv_len = token, 0, 0
                tid, left = tid + 1, per_thread
                continue
            if count % default_tile == 0 and (kv_len > 0 or per_item[tid] > 0):
                if kv_len > 0:
                    items.append((start, count))
                    per_item[tid] += 1
                start, count, kv_len = token, 0, 0
                tid, left = tid + 1, per_thread
            count, kv_len, left = count + n, kv_len + kv, left - kv
            break
        token += n
    if kv_len > 0:
        items.append((start, count))
    out = [0] * tokens
    for first, n in items:
        for offset in range(0, n, default_tile):
            m = min(default_tile, n - offset)
            r = _round_up(m, rows)
            per_key = rows * 4 + (0 if r <= rows else 2 * head_size * 2)
            size = max((cache - r * head_size * 8) // per_key // 32 * 32, 32)
            out[first + offset:first + offset + m] = [size] * m
    return out


def _lane_sum(p: torch.Tensor, fused: bool) -> torch.Tensor:
    """The block's sum as the kernel forms it: 16 lanes, each summed in key order from 0, then
    reduced (AVX2: two chains of 8; AVX-512: `_mm512_reduce_add_ps`'s tree)."""
    width = p.shape[-1]
    if width % _LANES:
        p = torch.nn.functional.pad(p, (0, _LANES - width % _LANES))
    acc = torch.zeros(*p.shape[:-1], _LANES, dtype=p.dtype)
    for chunk in p.split(_LANES, dim=-1):
        acc = acc + chunk
    a = acc.unbind(-1)
    if not fused:
        lo, hi = a[0] + 0.0, a[8] + 0.0
        for i in range(1, 8):
            lo, hi = lo + a[i], hi + a[8 + i]
        return lo + hi
    s = [a[i + 8] + a[i] for i in range(8)]
    t = [s[i + 4] + s[i] for i in range(4)]
    return (t[2] + t[0]) + (t[3] + t[1])


@functools.lru_cache(maxsize=64)
def _blocks(tokens: int, dim: int, causal: bool, threads: int, l2: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row: its key-block size and where its block loop stops (causal: after the
    last row with that block size; the blocks past a row's own keys add nothing). Cached: the
    callers only read them."""
    tiles = torch.tensor(kv_tile(tokens, dim, threads, l2))
    limits = torch.full_like(tiles, tokens)
    if causal:
        for tile in set(tiles.tolist()):
            rows = (tiles == tile).nonzero().flatten()
            limits[rows] = int(rows.max()) + 1
    return tiles, limits


@functools.cache
def _kernel():
    library = native.load("vllm_cpu_vec")
    function = library.rla_vllm_cpu_vec_attention
    function.restype = ctypes.c_int
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, pointer, pointer, pointer, size, size, size, size, size, pointer, pointer,
                         ctypes.c_int, pointer, size, size, ctypes.c_int]
    return function


def _openmp() -> bool:
    """Whether the C form shares its heads out over torch's OpenMP threads itself (built with
    OpenMP: `native.OPENMP`); else `_one_request_c` splits them over a thread pool."""
    return bool(native.load("vllm_cpu_vec").rla_vllm_cpu_vec_openmp())


@functools.cache
def _pool(threads: int):
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(threads, thread_name_prefix="rla_vllm_cpu_vec")


# Below this many scores (heads x tokens x tokens) a request runs on the calling thread: handing
# work to other threads costs more than it saves.
_THREADED_FROM = 1 << 16


def implementation() -> str:
    """"c" where the C form builds and loads here, else "python" (rla's logger said why, once)."""
    try:
        _kernel()
        return "c"
    except native.NativeUnavailable as error:
        _warn_once(str(error))
        return "python"


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("rla: the attention site's vllm_cpu_vec form runs its Python reference, one ATen op per "
                "head-dimension step and per key (the same bits, much slower): %s", reason)


def _one_request_c(q, k, v, bias, fused: bool, threads: int, l2: int):
    """`_one_request` in C (csrc/vllm_cpu_vec.c): the same operations in the same order."""
    heads, tokens, dim = q.shape
    q, k, v = (t.contiguous() for t in (q, k, v))
    bias = None if bias is None else bias.contiguous()
    tiles, limits = _blocks(tokens, dim, bias is None, threads, l2)
    out = torch.empty(heads, tokens, v.shape[-1])
    workers = min(torch.get_num_threads(), heads) if heads * tokens * tokens >= _THREADED_FROM else 1

    def run(first: int, last: int, threads: int = 1) -> int:  # ctypes lets go of the GIL during the call
        return _kernel()(q.data_ptr(), k.data_ptr(), v.data_ptr(), None if bias is None else bias.data_ptr(),
                         1 if bias is None else bias.shape[0], heads, tokens, dim, v.shape[-1], tiles.data_ptr(),
                         limits.data_ptr(), int(fused), out.data_ptr(), first, last, threads)

    # the heads shared out over the threads ATen uses (the kernel's own parallelism)
    if workers > 1 and not _openmp():
        cuts = [heads * w // workers for w in range(workers + 1)]
        statuses = list(_pool(workers).map(run, cuts[:-1], cuts[1:]))
    else:
        statuses = [run(0, heads, workers)]
    if any(statuses):
        raise MemoryError(f"rla's vllm_cpu_vec attention could not allocate its buffers ({tokens} tokens)")
    return out


def _one_request(q, k, v, bias, fused: bool, threads: int, l2: int):
    """q [H, L, D] (scaled), k, v [H, L, D], bias [H|1, L, L] or None (causal): fp32 [H, L, D].
    The reference, in ATen ops (`_one_request_c` runs it as C)."""
    heads, tokens, dim = q.shape
    exp = _fast_expf if fused else _glibc_expf
    mul_add = _fma32 if fused else (lambda a, b, c: c + a * b)
    s = torch.zeros(heads, tokens, tokens)
    for d in range(dim):  # the chain over the head dimension
        s = mul_add(q[..., d, None].expand_as(s), k[:, None, :, d].expand_as(s), s)
    if bias is None:
        s = s.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), -math.inf)
    else:
        s = (s + bias).masked_fill(bias <= _MASKED, -math.inf)
    tiles, limits = _blocks(tokens, dim, bias is None, threads, l2)
    out = torch.empty(heads, tokens, v.shape[-1])
    for tile in sorted(set(tiles.tolist())):  # rows with one block size at a time
        rows = (tiles == tile).nonzero().flatten()
        m = torch.full((heads, rows.numel()), _LOWEST)
        total = torch.zeros(heads, rows.numel())
        acc = torch.zeros(heads, rows.numel(), v.shape[-1])
        for c0 in range(0, int(limits[rows[0]]), tile):
            c1 = min(c0 + tile, tokens)
            block = s[:, rows, c0:c1]
            m_new = torch.maximum(m, block.amax(-1))
            diff = m - m_new
            grows = diff < _RESCALE_BELOW
            m = torch.where(grows, m_new, m)
            p = exp(block - m[..., None])
            block_sum = _lane_sum(p, fused)
            alpha = _glibc_expf(diff)
            rescaled = _fma32(total, alpha, block_sum) if fused else block_sum + alpha * total
            total = torch.where(grows, rescaled, block_sum + total)
            acc = torch.where(grows[..., None], acc * alpha[..., None], acc)
            for j in range(c0, c1):  # P · V key by key
                acc = mul_add(p[..., j - c0, None].expand_as(acc), v[:, None, j, :].expand_as(acc), acc)
        out[:, rows] = torch.ones_like(total).div(total)[..., None] * acc
    return out


def _leading_masked(bias: torch.Tensor) -> list[int]:
    """Per sequence, the keys every query masks before its first token (left padding)."""
    last_row = bias[:, 0, -1, :] <= _MASKED  # [B, S]
    return last_row.int().cumprod(-1).sum(-1).tolist()


def _contract_probs(q, k, bias, causal: bool):
    """The contract's fp32 probabilities from the scaled q."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    if causal:
        rows, cols = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(rows, cols, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    if bias is None:  # causal, or no mask at all: every row keeps a key
        return torch._softmax(scores, -1, False)
    return safe_softmax(scores + bias)  # a row every key of which is masked (left padding): P = 0, as SDPA


def _contract(q, k, v, bias, causal: bool):
    """The contract's fp32 forward from the scaled q."""
    return torch.matmul(_contract_probs(q, k, bias, causal), v)


@torch.library.custom_op("rla::vllm_cpu_vec_attention", mutates_args=(), device_types="cpu")
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """fp32 attention output [B, H, L, Ev] (before its rounding) in vLLM-CPU's `vec` order,
    from the scaled fp32 q [B, H, L, E], fp32 k, v [B, H, S, E] (heads repeated), an fp32
    additive `bias` [B|1, H|1, L, S] or None, `causal` (keys after the query removed)."""
    if bias is None and not causal:  # no mask: every key, as a bias of zeros
        bias = q.new_zeros(1, 1, q.shape[-2], k.shape[-2])
    if bias is not None:
        bias = bias.expand(q.shape[0], *bias.shape[1:-2], *bias.shape[-2:])
        if causal:
            rows, cols = bias.shape[-2:]
            bias = bias.masked_fill(torch.ones(rows, cols, dtype=torch.bool).triu(1), -math.inf)
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(f"rla's vllm_cpu_vec attention emulates self-attention (prefill): {q.shape[-2]} queries "
                         f"over {k.shape[-2]} keys; use rounding 'toward_zero' (the contract's form) here")
    fused, threads, l2 = variant() == "avx512", torch.get_num_threads(), _l2_bytes()
    one_request = _one_request_c if implementation() == "c" else _one_request
    if bias is None:  # causal, unpadded: each sequence a request of its own, all heads side by side
        out = one_request(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), None, fused, threads, l2)
        return out.view(*q.shape[:-1], v.shape[-1])
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    for b, first in enumerate(_leading_masked(bias)):
        if first:  # rows the kernel never sees (left padding) keep the contract's
            out[b, :, :first] = _contract_rows(q[b:b + 1], k[b:b + 1], v[b:b + 1], bias[b:b + 1], causal, first)[0]
        rows = slice(first, None)
        out[b, :, rows] = one_request(q[b, :, rows], k[b, :, rows], v[b, :, rows], bias[b, :, rows, rows], fused,
                                      threads, l2)
    return out


def _contract_rows(q, k, v, bias, causal: bool, rows: int):
    """The contract's output for the first `rows` query rows, as in the whole product: computed
    over at least `chunked.MIN_ROWS` rows (a product of 1-3 rows takes another GEMM kernel)."""
    upto = min(q.shape[-2], max(rows, chunked.MIN_ROWS))
    return _contract(q[..., :upto, :], k, v, None if bias is None else bias[..., :upto, :], causal)[..., :rows, :]


@attention.register_fake
def _(q, k, v, bias, causal):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def _setup(ctx, inputs, output):
    q, k, v, bias, causal = inputs
    ctx.save_for_backward(q, k, v, bias)
    ctx.causal = causal


# From this many queries (or past the chunked form's threshold, for memory) the backward runs
# one block of query rows at a time over the keys the block keeps, skipping the causal half;
# below, it recomputes P whole, as the contract site's own backward (its gradients bit for bit).
# Measured (the backward alone, causal, fp32, 16 heads of 128 unless said, 25 alternating
# rounds, median of the per-round ratio blocks / whole, the 2-core EPYC of
# docs/performance.md): 96 tokens (16 sequences, 4 heads of 32) 1.16, 128 0.98, 160 1.06,
# 192 0.66, 256 0.47, 512 0.41, 1024 0.37.
_BLOCKED_FROM_QUERIES = 192


def _contract_backward(ctx, grad):
    """The contract's backward: autograd's formulas over the contract's forward (matmul, softmax,
    matmul), P recomputed. Below `_BLOCKED_FROM_QUERIES` queries (and scores within
    `chunked.CHUNK_ABOVE_BYTES`) P whole, as the contract site's own backward (bit for bit its
    gradients); else those formulas one block of query rows at a time (`backward_in_blocks`)."""
    q, k, v, bias = ctx.saved_tensors
    if q.shape[-2] >= _BLOCKED_FROM_QUERIES or math.prod(q.shape[:-1]) * k.shape[-2] * 4 > chunked.CHUNK_ABOVE_BYTES:
        return (*backward_in_blocks(grad, q, k, v, bias, ctx.causal), None, None)
    probs = _contract_probs(q, k, bias, ctx.causal)
    grad_v = torch.matmul(probs.transpose(-1, -2), grad)
    grad_scores = torch._softmax_backward_data(torch.matmul(grad, v.transpose(-1, -2)), probs, -1, torch.float32)
    grad_q = torch.matmul(grad_scores, k)
    grad_k = torch.matmul(q.transpose(-1, -2), grad_scores).transpose(-1, -2)
    return grad_q, grad_k, grad_v, None, None


@torch.library.custom_op("rla::vllm_cpu_vec_attention_backward", mutates_args=(), device_types="cpu")
def backward_in_blocks(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                       causal: bool, budget: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_backward_in_blocks` as one op: traced into a compiled backward, its in-place block
    updates would become copies of whole gradients (slice_scatter), one per block."""
    return _backward_in_blocks(grad, q, k, v, bias, causal, budget)


@backward_in_blocks.register_fake
def _(grad, q, k, v, bias, causal, budget=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _backward_in_blocks(grad, q, k, v, bias, causal: bool, budget: int | None = None):
    """The contract's backward one block of query rows at a time, P recomputed, each block over
    the keys up to the last one a row of it keeps (causal: its last row's own; the additive
    mask's too). The keys after have P = 0 in every row of the block, so they add nothing to any
    gradient: the same formulas as the chunked site's backward on fewer keys, an fp32
    summation order of their own (as the chunked form's k and v gradients already are;
    docs/contract.md#chunked), in about half the time of a causal batch. A block holds an
    eighth of the queries (at least `chunked.MIN_ROWS`, in multiples of 16: the fastest measured
    at 96-1024 tokens), fewer where its fp32 scores would exceed `budget` (default
    `chunked.DEFAULT_BUDGET`; `chunked.rows_per_block`)."""
    queries, keys = q.shape[-2], k.shape[-2]
    rows = min(chunked.rows_per_block(math.prod(q.shape[:-2]), 1, queries, keys, budget or chunked.DEFAULT_BUDGET),
               max(chunked.MIN_ROWS, -(-queries // 8 // 16) * 16))
    q, k, v, grad = (t.contiguous() for t in (q, k, v, grad))
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    # [B x H, L, E] views: each block's k and v gradients accumulate in place (baddbmm)
    sums_k, sums_v = grad_k.flatten(0, -3), grad_v.flatten(0, -3)
    for start, stop in chunked.blocks(queries, rows):
        end = min(stop, keys) if causal else keys
        if bias is not None:
            kept = (bias[..., start:stop, :end] > _MASKED).flatten(0, -2).any(0).nonzero()
            end = int(kept.max()) + 1 if kept.numel() else 1
        q_rows, g_rows, k_keys, v_keys = q[..., start:stop, :], grad[..., start:stop, :], k[..., :end, :], v[..., :end, :]
        scores = torch.matmul(q_rows, k_keys.transpose(-1, -2))
        above = None
        if causal:
            above = torch.arange(end)[None, :] > torch.arange(start, stop)[:, None]
            scores.masked_fill_(above, -math.inf)
        if bias is not None:
            scores += (bias if bias.shape[-2] == 1 else bias[..., start:stop, :])[..., :end]
        # causal without a mask, every row keeps its own key: no row for safe_softmax to zero
        probs = torch._softmax(scores, -1, False) if bias is None else safe_softmax(scores)
        grad_scores = torch._softmax_backward_data(torch.matmul(g_rows, v_keys.transpose(-1, -2)), probs, -1,
                                                   torch.float32)
        if above is not None:
            grad_scores.masked_fill_(above, 0)
        grad_q[..., start:stop, :] = torch.matmul(grad_scores, k_keys)
        sums_k[:, :end].baddbmm_(grad_scores.flatten(0, -3).transpose(-1, -2), q_rows.flatten(0, -3))
        sums_v[:, :end].baddbmm_(probs.flatten(0, -3).transpose(-1, -2), g_rows.flatten(0, -3))
    return grad_q, grad_k, grad_v  # contiguous, as the fake ones


attention.register_autograd(_contract_backward, setup_context=_setup)
