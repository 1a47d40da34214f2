"""The attention site's two forms side by side, one attention op, forward and backward: the
contract's own (matmul, softmax, matmul in fp32) and the engine-paired `vllm_cpu_vec` (the
contract in vLLM-CPU's kernel order, sites/attention_vllm_cpu.py; its C form, and up to 256
tokens its Python reference), as the rla backend emits them (aot_eager: the op is an extern
kernel under Inductor too), against plain SDPA.

    python -m benchmarks.attention_forms [--shapes shipped qwen3-256 qwen3-2048] [--reps 3] \
        [--json benchmarks/results/attention_forms_cpu.json]

Prints each form's median time per step (forward + backward) and its ratio to the contract's
form, measured in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F

import rla_compile
from rla_compile.sites import attention_vllm_cpu

from .common import write

# (batch, query heads, kv heads, tokens, head size)
SHAPES = {"shipped": (16, 4, 2, 96, 32), "qwen3-256": (1, 16, 8, 256, 128), "qwen3-2048": (1, 16, 8, 2048, 128)}
FORMS = {"sdpa (no rla)": None, "contract": "toward_zero", "vllm_cpu_vec": "vllm_cpu_vec",
         "vllm_cpu_vec (Python reference)": "vllm_cpu_vec"}
PYTHON_UP_TO = 256  # tokens: the reference's one ATen op per key and head-dimension step is slow beyond


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def measure(shape: str, reps: int) -> dict:
    batch, heads, kv_heads, tokens, dim = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(batch, h, tokens, dim, generator=g).bfloat16() for h in (heads, kv_heads, kv_heads)]
    times = {}
    for name, rounding in FORMS.items():
        python = "Python" in name
        if python and tokens > PYTHON_UP_TO:
            continue
        torch._dynamo.reset()
        backend = "aot_eager" if rounding is None else rla_compile.Backend(
            compiler="aot_eager", sites=["attention"], rounding={"attention": rounding})
        compiled = torch.compile(attend, backend=backend)
        leaves = [t.clone().requires_grad_() for t in inputs]

        def step():
            compiled(*leaves).float().sum().backward()

        with mock.patch.object(attention_vllm_cpu, "implementation", lambda: "python" if python else "c"):
            step()  # compile
            samples = []
            for _ in range(reps):
                start = time.perf_counter()
                step()
                samples.append(time.perf_counter() - start)
        times[name] = samples
    contract = statistics.median(times["contract"])
    return {"shape": shape, "batch_heads_kv_tokens_dim": SHAPES[shape], "reps": reps, "times_s": times,
            "ratio_vs_contract": {name: statistics.median(t) / contract for name, t in times.items()}}


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    results = []
    for shape in args.shapes:
        result = measure(shape, args.reps)
        results.append(result)
        print(f"{shape} {result['batch_heads_kv_tokens_dim']}: " + ", ".join(
            f"{name} {statistics.median(result['times_s'][name]) * 1e3:.1f} ms ({ratio:.2f}x)"
            for name, ratio in result["ratio_vs_contract"].items()), flush=True)
    write(args.json, results)
    return results


if __name__ == "__main__":
    main()
