"""Where a run-time difference lives: a per-kernel profile of plain Inductor and rla, side by side.

    python -m benchmarks.kernel_profile --size medium --mode training --json benchmarks/results/kernel_profile_medium_training_cpu.json
    python -m benchmarks.kernel_profile --size qwen3-width --mode inference --json benchmarks/results/kernel_profile_qwen3_inference_cpu.json

Each variant compiles its own model (caches off), runs 3 untimed steps, then `--steps` steps
under `torch.profiler` with Inductor's `cpp.enable_kernel_profile` (each generated C++ kernel
a profiler event). Events are grouped by name without the `graph_N_` prefix and `_N` suffix
(the same kernel family in both compiles), self CPU time per step; the rows print in the order
of the largest difference. One profiled pair: a ranking of causes, not a ratio to quote.
"""

from __future__ import annotations

import argparse
import collections
import re
from unittest import mock

import torch

import rla_compile

from . import common
from .common import SIZES, model_and_tokens, train_step, write
from .upcasts_before_after import QWEN3_WIDTH

VARIANTS = {"inductor": lambda: "inductor", "rla": lambda: rla_compile.Backend()}


def _family(name: str) -> str:
    return re.sub(r"_\d+$", "", re.sub(r"^graph_\d+_", "", name))


def profile(size: str, mode: str, steps: int = 10) -> dict[str, dict[str, float]]:
    """Variant -> kernel family -> microseconds of self CPU time per step."""
    from torch._inductor import config as inductor_config

    out = {}
    with mock.patch.dict(common.SIZES, {"qwen3-width": QWEN3_WIDTH}), \
            inductor_config.patch({"fx_graph_cache": False, "cpp.enable_kernel_profile": True}):
        for name, make in VARIANTS.items():
            torch._dynamo.reset()
            model, ids = model_and_tokens(size)
            compiled = torch.compile(model, backend=make())
            if mode == "training":
                step = train_step(compiled, model, ids)
            else:
                def step():
                    with torch.no_grad():
                        compiled(ids, use_cache=False)
            for _ in range(3):
                step()
            with torch.profiler.profile() as prof:
                for _ in range(steps):
                    step()
            families: collections.Counter = collections.Counter()
            for event in prof.key_averages():
                families[_family(event.key)] += event.self_cpu_time_total / steps
            out[name] = dict(families)
    torch._dynamo.reset()
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", choices=[*SIZES, "qwen3-width"])
    parser.add_argument("--mode", default="training", choices=["inference", "training"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    us = profile(args.size, args.mode, args.steps)
    ind, rla = us["inductor"], us["rla"]
    rows = sorted(set(ind) | set(rla), key=lambda k: -abs(rla.get(k, 0.0) - ind.get(k, 0.0)))
    print(f"{args.size} {args.mode}: self CPU time per step, us")
    print(f"{'kernel family':<100}{'inductor':>10}{'rla':>10}")
    for key in rows[:args.rows]:
        print(f"{key[:100]:<100}{ind.get(key, 0.0):>10.0f}{rla.get(key, 0.0):>10.0f}")
    total = {name: sum(v.values()) for name, v in us.items()}
    print(f"{'total':<100}{total['inductor']:>10.0f}{total['rla']:>10.0f}")
    result = {"size": args.size, "mode": args.mode, "steps": args.steps, "us_per_step": us, "total_us_per_step": total}
    write(args.json, result)
    return result


if __name__ == "__main__":
    main()
