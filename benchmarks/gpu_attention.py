"""The attention site on a CUDA GPU, one command (torch + Triton, no vLLM needed):

    python -m benchmarks.gpu_attention [--sections exact cost] [--tokens 2048 256] \
        [--json benchmarks/results/gpu_attention.json]

`exact`: one attention op at Qwen3-0.6B's shape (16 query heads, 8 kv heads of 128, causal),
256 and 2048 tokens, and a padded batch (4 × 512, a bool padding mask), against the contract
reference run eagerly on the same GPU (tests/support/contract_reference.py: fp32 q × scale,
scores, softmax and P · V, rounded once). Per form: the share of output elements and of q, k, v
gradient elements equal to the reference's, and the largest distance in bf16 ulps; the forms
are stock SDPA under each CUDA backend (flash, efficient, cuDNN, math; no rla) and rla's site
under `aot_eager` and Inductor. Also per shape: forward + backward time and peak CUDA memory
of stock SDPA (the backend torch picks) against the site under Inductor, side by side.

`cost`: `benchmarks/real_shape.py` on CUDA, Qwen3-0.6B's whole shape (28 layers, vocabulary
151,936, random bf16 weights), a training step and an inference forward per token count:
plain Inductor, rla's default sites, and the defaults plus `attention`; step times and peak
CUDA memory, ratios to plain Inductor.

Each section and shape prints as it goes and is written to the JSON after each; a failed part
is recorded with its error instead of losing the others.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

import rla_compile
from rla_compile.mismatch.metrics import ulp_distance

from . import real_shape
from .common import ROOT, write

sys.path.insert(0, str(ROOT / "tests" / "support"))
import contract_reference as ref  # noqa: E402  the eager fp32 reference the tests use

# (batch, query heads, kv heads, tokens, head size, padded): Qwen3-0.6B's attention
SHAPES = {"qwen3-256": (1, 16, 8, 256, 128, False), "qwen3-2048": (1, 16, 8, 2048, 128, False),
          "qwen3-4x512-padded": (4, 16, 8, 512, 128, True),
          "smoke": (1, 4, 2, 16, 32, False), "smoke-padded": (2, 4, 2, 80, 32, True)}  # smokes: CPU too
GPU_SHAPES = ["qwen3-256", "qwen3-2048", "qwen3-4x512-padded"]
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}


def _inputs(shape: str, device: str):
    """q, k, v; the padded shapes' bool mask (True keeps: causal, and sequence b's last 64·b keys
    padding), None for the causal ones; the query heads per kv head."""
    batch, heads, kv_heads, tokens, dim, padded = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, h, tokens, dim, generator=g, device=device).bfloat16()
               for h in (heads, kv_heads, kv_heads))
    mask = None
    if padded:
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
        lengths = torch.tensor([tokens - 64 * b for b in range(batch)], device=device)
        keep = torch.arange(tokens, device=device)[None, :] < lengths[:, None]
        mask = (causal[None] & keep[:, None, :])[:, None]
    return (q, k, v), mask, heads // kv_heads


def _attend(mask):
    if mask is None:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _run(fn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


def _compare(got, want) -> dict:
    """Share of elements equal, and the largest bf16 ulp distance, of an output and its grads.
    Rows a padding mask empties entirely (NaN in every form) compare as equal."""
    def one(a, b):
        same = (a == b) | (a.isnan() & b.isnan())
        finite = ~(a.isnan() | b.isnan())
        return {"equal": float(same.float().mean()),
                "max_ulp": float(ulp_distance(a[finite], b[finite]).max()) if bool(finite.any()) else 0.0}
    (out, grads), (ref_out, ref_grads) = got, want
    return {"out": one(out, ref_out), **{f"grad_{n}": one(a, b) for n, a, b in zip("qkv", grads, ref_grads)}}


def _timed_ms(fn, inputs, grad, reps: int = 20) -> tuple[float, float | None]:
    """Median ms of forward + backward, and on CUDA the peak memory (MiB) above what was
    allocated before it."""
    cuda = inputs[0].is_cuda
    for _ in range(3):
        _run(fn, inputs, grad)
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _run(fn, inputs, grad)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            _run(fn, inputs, grad)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None


def exact(shape: str, device: str = "cuda") -> dict:
    inputs, mask, groups = _inputs(shape, device)
    grad = torch.randn(inputs[0].shape, generator=torch.Generator(device=device).manual_seed(1),
                       device=device).bfloat16()
    tokens = inputs[0].shape[2]
    keep = mask if mask is not None else torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
    reference = _run(lambda q, k, v: ref.attention(q, k, v, mask=keep, groups=groups), inputs, grad)
    attend = _attend(mask)
    out = {"shape": shape, "dims": SHAPES[shape], "forms": {}}
    for name, backend in SDPA_BACKENDS.items() if device == "cuda" else [("math", "MATH")]:
        try:
            with torch.nn.attention.sdpa_kernel(getattr(torch.nn.attention.SDPBackend, backend)):
                out["forms"][f"stock sdpa ({name})"] = _compare(_run(attend, inputs, grad), reference)
        except RuntimeError as error:  # a backend that does not take this shape or mask
            out["forms"][f"stock sdpa ({name})"] = {"error": str(error).splitlines()[0][:300]}
    for compiler in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        backend = rla_compile.Backend(compiler=compiler, sites=["attention"])
        compiled = torch.compile(attend, backend=backend)
        result = _compare(_run(compiled, inputs, grad), reference)
        result["rewritten"] = sum(r.count("attention", "rewritten") for r in backend.reports)
        out["forms"][f"rla attention ({compiler})"] = result
        if compiler == "inductor":
            stock = torch.compile(attend, backend="inductor")
            stock_ms, stock_mib = _timed_ms(stock, inputs, grad)
            rla_ms, rla_mib = _timed_ms(compiled, inputs, grad)
            out["cost"] = {"stock_ms": stock_ms, "rla_ms": rla_ms, "time_ratio": rla_ms / stock_ms,
                           "stock_peak_mib": stock_mib, "rla_peak_mib": rla_mib,
                           "memory_ratio": rla_mib / stock_mib if stock_mib else None}
    torch._dynamo.reset()
    return out


def cost(tokens: int, reps: int) -> dict:
    args = real_shape.main_args(["--tokens", str(tokens), "--reps", str(reps), "--variants", "rla", "rla + attention"])
    return real_shape.measure(args, "cuda")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=["exact", "cost"], default=["exact", "cost"])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=GPU_SHAPES)
    parser.add_argument("--tokens", nargs="+", type=int, default=[2048, 256], help="the cost section's sequence lengths")
    parser.add_argument("--reps", type=int, default=5, help="the cost section's repetitions per variant")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "gpu_attention.json"))
    parser.add_argument("--device", default="cuda", help="cpu: a smoke of the exact section (the smoke shapes)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.gpu_attention needs a CUDA device; on CPU run benchmarks.attention_forms and "
              "benchmarks.real_shape (or this with --device cpu --sections exact --shapes smoke, a smoke)",
              file=sys.stderr)
        return 2
    if args.device != "cuda" and "cost" in args.sections:
        parser.error("the cost section runs on CUDA; on CPU run benchmarks.real_shape")
    results = {"exact": [], "cost": [], "errors": []}

    def part(section, name, fn):
        try:
            result = fn()
            results[section].append(result)
            print(section, name, json.dumps(result if section == "exact" else result["ratio_vs_inductor"]), flush=True)
        except Exception:  # keep the other parts
            results["errors"].append({"part": f"{section} {name}", "error": traceback.format_exc()})
            print(f"{section} {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        write(args.json, results, args.device)

    if "exact" in args.sections:
        for shape in args.shapes:
            part("exact", shape, lambda: exact(shape, args.device))
    if "cost" in args.sections:
        for tokens in args.tokens:
            part("cost", f"{tokens} tokens", lambda: cost(tokens, args.reps))
    print(f"wrote {args.json}")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
