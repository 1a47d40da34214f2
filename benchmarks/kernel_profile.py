"""Where a run-time difference lives: a per-kernel profile of plain Inductor and rla, side by side.

    python -m benchmarks.kernel_profile --size medium --mode training --json benchmarks/results/kernel_profile_medium_training_cpu.json
    python -m benchmarks.kernel_profile --size qwen3-width --mode inference --json benchmarks/results/kernel_profile_qwen3_inference_cpu.json
    python -m benchmarks.kernel_profile --device cuda --size qwen3-width --seq 2048 --mode inference \
        --json benchmarks/results/kernel_profile_qwen3_2048_inference_gpu.json
    python -m benchmarks.kernel_profile --device cuda --size qwen3-width --seq 2048 --mode training \
        --json benchmarks/results/kernel_profile_qwen3_2048_training_gpu.json

Each variant compiles its own model (caches off), runs 3 untimed steps, then `--steps` steps
under `torch.profiler` with Inductor's `cpp.enable_kernel_profile` (each generated C++ kernel
a profiler event). Events are grouped by name without the `graph_N_` prefix and `_N` suffix
(the same kernel family in both compiles), self CPU time per step; the rows print in the order
of the largest difference. On CUDA (`--device cuda`) the rows are the GPU kernels, self device
time and launches per step, and each variant's wall time per step (CUDA events) comes with
them. One profiled pair: a ranking of causes, not a ratio to quote.
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


def profile(size: str, mode: str, steps: int = 10, device: str = "cpu", seq: int | None = None) -> dict:
    """Variant -> kernel family -> microseconds of self CPU time (on CUDA: self device time of
    the GPU kernels) per step; on CUDA also "<variant> launches" (kernel family -> launches per
    step) and "<variant> wall" (ms per step, the median over the steps)."""
    from torch._inductor import config as inductor_config

    out = {}
    cuda = device == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with mock.patch.dict(common.SIZES, {"qwen3-width": QWEN3_WIDTH}), \
            inductor_config.patch({"fx_graph_cache": False, "cpp.enable_kernel_profile": True}):
        for name, make in VARIANTS.items():
            torch._dynamo.reset()
            model, ids = model_and_tokens(size, device, **({"seq": seq} if seq else {}))
            compiled = torch.compile(model, backend=make())
            if mode == "training":
                step = train_step(compiled, model, ids)
            else:
                def step():
                    with torch.no_grad():
                        compiled(ids, use_cache=False)
            for _ in range(3):
                step()
            if cuda:
                out[f"{name} wall"] = _wall_ms(step, steps)
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(steps):
                    step()
                if cuda:
                    torch.cuda.synchronize()
            families: collections.Counter = collections.Counter()
            launches: collections.Counter = collections.Counter()
            for event in prof.key_averages():
                if not cuda:
                    families[_family(event.key)] += event.self_cpu_time_total / steps
                elif event.self_device_time_total > 0:
                    families[_family(event.key)] += event.self_device_time_total / steps
                    launches[_family(event.key)] += event.count / steps
            out[name] = dict(families)
            if cuda:
                out[f"{name} launches"] = dict(launches)
    torch._dynamo.reset()
    return out


def _wall_ms(step, steps: int) -> float:
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", choices=[*SIZES, "qwen3-width"])
    parser.add_argument("--mode", default="training", choices=["inference", "training"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seq", type=int, help="tokens per sequence (default: the size's)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    us = profile(args.size, args.mode, args.steps, args.device, args.seq)
    ind, rla = us["inductor"], us["rla"]
    rows = sorted(set(ind) | set(rla), key=lambda k: -abs(rla.get(k, 0.0) - ind.get(k, 0.0)))
    cuda = args.device == "cuda"
    print(f"{args.size} {args.mode}: self {'device' if cuda else 'CPU'} time per step, us"
          + (" (launches per step)" if cuda else ""))
    print(f"{'kernel family':<100}{'inductor':>10}{'rla':>10}")
    for key in rows[:args.rows]:
        counts = (f"  ({us['inductor launches'].get(key, 0):.0f} / {us['rla launches'].get(key, 0):.0f})"
                  if cuda else "")
        print(f"{key[:100]:<100}{ind.get(key, 0.0):>10.0f}{rla.get(key, 0.0):>10.0f}{counts}")
    total = {name: sum(us[name].values()) for name in VARIANTS}
    print(f"{'total':<100}{total['inductor']:>10.0f}{total['rla']:>10.0f}")
    if cuda:
        launches = {name: sum(us[f"{name} launches"].values()) for name in VARIANTS}
        print(f"{'kernel launches per step':<100}{launches['inductor']:>10.0f}{launches['rla']:>10.0f}")
        print(f"{'wall ms per step (median)':<100}{us['inductor wall']:>10.2f}{us['rla wall']:>10.2f}")
    result = {"size": args.size, "mode": args.mode, "steps": args.steps, "device": args.device,
              "seq": args.seq, "us_per_step": us, "total_us_per_step": total}
    write(args.json, result, args.device)
    return result


if __name__ == "__main__":
    main()
