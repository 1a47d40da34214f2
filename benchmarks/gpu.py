"""The same measurements on a CUDA machine (torch + Triton, no vLLM needed), one command:

    python -m benchmarks.gpu            # writes benchmarks/results/gpu.json

Run time (inference and training step, small and medium, aligned vs unaligned, pinned and
not), peak CUDA memory of the training step and saved-for-backward bytes, the residual stream
saved vs recomputed (`residual_save.py`), and compile time
with rla's share for 1-16 layers, and the real-shape comparison (`real_shape.py`, with and
without the logits site, peak CUDA memory too). Each section prints as it goes; a failed section is
recorded with its error instead of losing the others.
"""

from __future__ import annotations

import json
import sys
import traceback

import torch

from . import compile_time, memory, real_shape, residual_save, runtime
from .common import RESULTS, SIZES, VARIANTS, machine


def main() -> int:
    if not torch.cuda.is_available():
        print("benchmarks.gpu needs a CUDA device; on CPU run benchmarks.runtime, benchmarks.memory, benchmarks.compile_time", file=sys.stderr)
        return 2
    out = {"machine": machine("cuda"), "runtime": [], "memory": [], "residual_save": [], "compile_time": [], "real_shape": [],
           "errors": []}

    def section(name, fn):
        try:
            result = fn()
            out[name].append(result)
            print(name, json.dumps(result), flush=True)
        except Exception:  # keep the other measurements
            out["errors"].append({"section": name, "error": traceback.format_exc()})
            print(f"{name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)

    for size in SIZES:
        for mode in ("inference", "training"):
            section("runtime", lambda: runtime.measure(size, mode, reps=30, warmup=3, device="cuda"))
        section("memory", lambda: {"size": size, "peak_bytes": {n: memory.cuda_peak_bytes(size, m()) for n, m in VARIANTS.items()},
                                   "saved_bytes": {n: memory.saved_bytes(size, m(), "cuda") for n, m in VARIANTS.items()}})
        # Triton has no CPU-style cache of a rounded value, so recomputing the stream may cost nothing there
        section("residual_save", lambda: residual_save.compare(size, 15, "cuda"))
    section("residual_save", lambda: residual_save.compare("qwen3-width", 15, "cuda"))
    for layers in (1, 2, 4, 8, 16):
        section("compile_time", lambda: compile_time.measure(layers, "cuda"))
    section("real_shape", lambda: real_shape.measure(real_shape.main_args([]), "cuda"))  # Qwen3-0.6B's shape
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS / 'gpu.json'}")
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
