"""vLLM's own kernels for a site, measured on this machine: which one runs and how it rounds.

A site whose engine half is a fused kernel outside the graph rla rewrites (attention: vLLM-CPU's
`cpu_attention_with_kv_cache`) cannot be aligned by a pass; what rla can do is know what the
kernel does and pair the trainer with it. On this CPU that is measured, not assumed: the probe
runs the kernel on a seeded causal problem and compares it with the contract computed in fp32
and rounded each way (config.ROUNDING_MODES).

Why rounding modes: vLLM-CPU converts fp32 to bf16 with `_mm512_cvtneps_pbh` (to nearest)
only when it is built for AVX512-BF16; otherwise (`csrc/cpu/cpu_types_x86.hpp`) it drops the low
16 bits: the `vec` kernel computes the contract in fp32 and rounds its output toward zero.
Rounded to nearest, the trainer's attention then differs from it on ~half of the elements by
one ulp; rounded toward zero, on 0.004% (docs/vllm.md#attention).

`Site.engine_rounding` names a probe here (`ROUNDING_PROBES`); `paired_rounding(options)`
gives the rounding modes the trainer needs for the selected sites, the TRL integration and
`rla-compile mismatch` apply them.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

from .. import sites as registry
from ..config import Options

__all__ = ["cpu_attention_kernel", "cpu_attention_rounding", "run_cpu_attention", "check_attention_kernel",
           "use_fp32_attention_kernel", "paired_rounding", "paired_attention_form", "ROUNDING_PROBES"]

log = logging.getLogger(__name__)

# A probe's verdict: the mode whose reference the kernel equals on at least this fraction of
# the elements (the rest: fp32 summation order and the kernel's exp, ~1e-4 of them).
AGREEMENT = 0.99


def cpu_attention_kernel(dtype: Any = None, block_size: int = 128, head_size: int = 32) -> tuple[str, str | None]:
    """(the attention kernel vLLM runs here, how it rounds its output: "nearest" /
    "toward_zero" when it computes the contract in fp32 and rounds once that way, None when it
    follows no mode: P held in bf16 (`amx`), or not a CPU: ("<platform> backends", None))."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return f"{current_platform.device_name} backends", None
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype or torch.bfloat16, block_size, head_size)
    return isa, cpu_attention_rounding(isa, head_size, block_size)


@functools.lru_cache(maxsize=None)
def cpu_attention_rounding(isa: str, head_size: int = 32, block_size: int = 128) -> str | None:
    """Run vLLM-CPU's attention kernel (`isa`) on 64 seeded bf16 tokens, 4 query heads over 2
    KV heads, causal, and say which rounding of the fp32 contract it equals: "vllm_cpu_vec"
    when the site's form in the `vec` kernel's order equals it bit for bit, else the rounding
    mode the contract's form agrees with on >= 99% of the elements (None: neither)."""
    import torch

    from ..config import ROUNDING_MODES

    tokens, heads, kv_heads = 64, 4, 2
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, h, head_size, generator=gen).bfloat16() for h in (heads, kv_heads, kv_heads))
    scale = 1 / math.sqrt(head_size)
    out = run_cpu_attention(q, k, v, scale, isa, block_size)
    # the contract, in fp32: q × scale first, scores, causal softmax, P · v
    groups = heads // kv_heads
    qf = q.float().transpose(0, 1) * scale
    kf, vf = (t.float().transpose(0, 1).repeat_interleave(groups, 0) for t in (k, v))
    scores = (qf @ kf.transpose(-1, -2)).masked_fill(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), -math.inf)
    exact = (torch.softmax(scores, -1) @ vf).transpose(0, 1).contiguous()
    agree = {mode: float((out == _rounded(exact, mode)).double().mean()) for mode in ROUNDING_MODES}
    if isa == "vec":  # the contract in the kernel's own fp32 order (sites/attention/vllm_cpu.py)
        from ..sites.attention import vllm_cpu as attention_vllm_cpu

        form = attention_vllm_cpu.attention(qf[None], kf[None], vf[None], None, True)[0].transpose(0, 1)
        agree["vllm_cpu_vec"] = float((out == _rounded(form.contiguous(), attention_vllm_cpu.output_rounding()))
                                      .double().mean())
    log.debug("vLLM-CPU %s attention against the contract rounded each way: %s", isa, agree)
    if agree.get("vllm_cpu_vec") == 1.0:  # bit for bit: the trainer can compute what the kernel computes
        return "vllm_cpu_vec"
    mode = max(ROUNDING_MODES, key=agree.get)
    return mode if agree[mode] >= AGREEMENT else None


def run_cpu_attention(q, k, v, scale: float, isa: str = "vec", block_size: int = 128):
    """vLLM-CPU's attention kernel on one causal prefill request, as its backend calls it (KV
    split off): q [T, H, E], k and v [T, H_kv, E] bf16 -> [T, H, E] bf16."""
    import torch
    from vllm import _custom_ops as ops

    tokens, heads, head_size = q.shape
    kv_heads = k.shape[1]
    blocks = -(-tokens // block_size)
    cache = torch.zeros(blocks, kv_heads, 2 * block_size, head_size, dtype=q.dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(tokens), isa)
    starts, lengths = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_size, seq_lens=lengths,
        dtype=q.dtype, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False)
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
        seq_lens=lengths, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=torch.arange(blocks, dtype=torch.int32)[None], softcap=0.0, scheduler_metadata=metadata,
        s_aux=None)
    return out


def _rounded(exact, mode: str):
    """fp32 `exact` rounded to bf16 as `mode` says (independent of the rewrite's emitted ops)."""
    import torch

    if mode == "toward_zero":
        return (exact.view(torch.int32) & -65536).view(torch.float32).bfloat16()
    return exact.bfloat16()


def check_attention_kernel() -> None:
    """The attention site's engine hook: say which kernel vLLM's attention runs and how it
    rounds (the site aligns the trainer's attention; the engine's is its kernel)."""
    kernel, mode = cpu_attention_kernel()
    if mode == "vllm_cpu_vec":
        log.info("rla's attention site: vLLM runs the %r attention kernel: fp32 scores and P, output rounded once "
                 "as its build rounds on this CPU, and the site's form in its fp32 order equals it bit for bit (measured); pair the "
                 "trainer with rounding={'attention': 'vllm_cpu_vec'}", kernel)
    elif mode is not None:
        log.info("rla's attention site: vLLM runs the %r attention kernel: fp32 scores and P, output rounded once, "
                 "%s (measured); pair the trainer with rounding={'attention': %r}", kernel,
                 mode.replace("_", " "), mode)
    else:
        log.warning("rla's attention site: vLLM runs %s attention, which does not follow the contract (measured: "
                    "no rounding of the fp32 contract equals it; P held in bf16?); the trainer side is aligned, "
                    "the engine's attention is not", kernel)


def use_fp32_attention_kernel() -> None:
    """The attention site's engine hook that changes a kernel: where vLLM-CPU would run its
    `amx` attention kernel (AMX CPUs, bf16: q and P held in bf16 tiles, which no rounding of
    the contract equals), run its `vec` kernel instead, which computes the contract in fp32
    (fp32 scores and P, the output rounded once) and whose order the trainer's `vllm_cpu_vec`
    form reproduces. vLLM picks the kernel with `cpu_attn._get_attn_isa` wherever it needs one
    (the metadata builder, the KV-cache layout), so the choice is patched there, for every
    engine this process builds while the hook is installed (the hook runs only in processes
    preparing engines that align attention). Idempotent; `integrations.vllm.undo()` restores
    vLLM's own. Not run against an AMX CPU yet (tests/test_vllm.py checks the choice with AMX
    reported present); `check_attention_kernel` then measures what runs."""
    from vllm.v1.attention.backends import cpu_attn

    from . import patching

    original = patching.original(cpu_attn, "_get_attn_isa")

    def _get_attn_isa(dtype, block_size, head_size=None, kv_cache_dtype=None):
        isa = original(dtype, block_size, head_size, kv_cache_dtype)
        if isa == "amx":
            _say_vec_for_amx()
            return "vec"
        return isa

    patching.patch(cpu_attn, "_get_attn_isa", _get_attn_isa)


@functools.cache
def _say_vec_for_amx() -> None:
    log.info("rla's attention site: vLLM-CPU runs its 'vec' attention kernel instead of 'amx' (which holds q and P in "
             "bf16): 'vec' computes the contract in fp32")


# How the engine's own kernel for a site rounds (`Site.engine_rounding` names one): "nearest",
# "toward_zero", a form of the site in the kernel's order ("vllm_cpu_vec"), or None (it does not follow the contract).
ROUNDING_PROBES = {"cpu_attention": lambda: cpu_attention_kernel()[1]}


def paired_rounding(options: Options) -> dict[str, str]:
    """The `rounding` option a trainer paired with this machine's vLLM needs for the selected
    sites whose engine half is a kernel of vLLM's own (`Site.engine_rounding`), measured; a
    mode the user set in `options.rounding` wins. Sites whose kernel follows no mode are left
    out (the engine hook says so)."""
    paired = {}
    for site in registry.selected(options.sites):
        if site.engine_rounding and site.kind not in options.rounding:
            mode = ROUNDING_PROBES[site.engine_rounding]()
            if mode is not None and mode != "nearest":
                paired[site.kind] = mode
    return {**paired, **options.rounding}


def paired_attention_form(vllm_config: Any) -> tuple[str | None, str]:
    """The attention site's engine-paired form (option `rounding={"attention": form}`) for the
    engine `vllm_config` (a `vllm.config.VllmConfig`) describes, and why; (None, why none).

    - CPU: "vllm_cpu_vec" where the probe finds vLLM-CPU's kernel equal to it bit for bit here
      (`cpu_attention_kernel`), whatever backend was asked for (vLLM-CPU runs CPU_ATTN);
    - CUDA with the TRITON_ATTN backend (`attention_config.backend`, engine argument
      `attention_backend="TRITON_ATTN"`): "vllm_triton", vLLM's own Triton kernel run on the
      trainer's batch (sites/attention/vllm_triton.py). Prefill batches take its 2D path; decode
      batches too only with VLLM_BATCH_INVARIANT=1 in the engine's environment (else small
      decode batches split the keys and merge the splits: other sums);
    - any other backend, or none chosen (vLLM then picks when it builds the model: FLASH_ATTN
      on H100/H200): no form; its kernels are CUDA C++ that keep P in bf16, which rla cannot
      run in the trainer."""
    device = str(getattr(vllm_config.device_config, "device_type", "") or "")
    backend = vllm_config.attention_config.backend
    name = getattr(backend, "name", backend)
    if device == "cpu":
        kernel, mode = cpu_attention_kernel()
        if mode == "vllm_cpu_vec":
            return mode, f"vLLM-CPU's {kernel} attention kernel equals the vllm_cpu_vec form here, bit for bit (measured)"
        return None, f"vLLM-CPU's {kernel} attention kernel follows no paired form here (measured: {mode})"
    if device != "cuda":
        return None, f"no attention form pairs with vLLM on {device or 'an unknown device'}"
    if name == "TRITON_ATTN":
        return "vllm_triton", ("TRITON_ATTN: vLLM's Triton unified_attention, run on the trainer's batch; decode batches "
                               "take the same path only with VLLM_BATCH_INVARIANT=1 in the engine's environment")
    if name is None:
        return None, ("no attention backend chosen: vLLM picks one when it builds the model (FLASH_ATTN on H100/H200), "
                      "whose kernel rla cannot run in the trainer; select TRITON_ATTN (attention_backend='TRITON_ATTN') "
                      "to pair the trainer with the engine")
    return None, (f"{name}: a kernel rla cannot run in the trainer (CUDA C++, P held in bf16); select TRITON_ATTN "
                  "(attention_backend='TRITON_ATTN') to pair the trainer with the engine")

