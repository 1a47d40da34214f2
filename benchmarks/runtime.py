"""Run time of aligned vs unaligned compiled models, measured side by side in one run.

The same tiny Llama is compiled three ways: plain Inductor, rla (site roundings pinned, the
default) and rla with `pin_rounding=True`. Repetitions alternate between them and the median
is reported with the ratios to plain Inductor.

    python -m benchmarks.runtime --runs 3 --json benchmarks/results/runtime_cpu.json
    python -m benchmarks.runtime --sizes small --modes inference --reps 1     # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from .common import SIZES, VARIANTS, fresh_process_runs, model_and_tokens, own_code, saved_bytes_of, train_step, write


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _workload(size: str, mode: str, backend, device: str = "cpu"):
    """The step to time and, in training, a forward that returns the loss (for the bytes saved
    for the backward, `common.saved_bytes_of`), both on one compiled model."""
    model, ids = model_and_tokens(size, device)
    compiled = torch.compile(own_code(model), backend=backend)
    if mode == "training":
        return train_step(compiled, model, ids), lambda: compiled(ids, labels=ids, use_cache=False).loss

    def step():
        with torch.no_grad():
            compiled(ids, use_cache=False)

    return step, None


def measure(size: str, mode: str, reps: int, warmup: int = 2, device: str = "cpu", variants=None,
            compiling=None, saved: bool = False, calls: bool = False) -> dict:
    """`variants`: name -> backend factory (default: `common.VARIANTS`, "inductor" first);
    `compiling`: name -> a context manager factory held while that variant compiles; `saved`
    (training): also the bytes each variant saves for the backward, on the model it times;
    `calls`: also the kernels each variant generated and the calls a step makes (`_calls`)."""
    from torch._inductor import metrics

    variants = variants or VARIANTS
    steps, losses, counts = {}, {}, {}
    torch._dynamo.reset()
    for name, make in variants.items():
        # no reset between variants: each backend keeps its own compiled code (Dynamo's cache
        # entries are per backend), so each variant compiles once
        steps[name], losses[name] = _workload(size, mode, make(), device)
        generated = metrics.generated_kernel_count
        with (compiling or {}).get(name, contextlib.nullcontext)():
            for _ in range(warmup):  # the first call compiles (forward and backward)
                steps[name]()
        counts[name] = {"generated_kernels": metrics.generated_kernel_count - generated}
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for i in range(reps):  # alternate, so load on the machine hits every variant alike, each
        for name in order[i % len(order):] + order[:i % len(order)]:  # round starting at the next variant
            step = steps[name]
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    # The spread: the ratio within each round (neighbouring repetitions see the same load),
    # its quartiles over the rounds.
    rounds = {name: sorted(a / b for a, b in zip(t, times["inductor"])) for name, t in times.items()}
    spread = {name: [_quantile(r, 0.25), _quantile(r, 0.75)] for name, r in rounds.items()}
    result = {"size": size, "mode": mode, "reps": reps, "median_s": medians, "times_s": times,
              "ratio_vs_inductor": {name: medians[name] / medians["inductor"] for name in medians},
              "round_ratio_quartiles": spread}
    if calls:  # after timing: a profiled step left every later step slower (about 20% here)
        result["calls"] = {name: {**counts[name], **_calls(step)} for name, step in steps.items()}
    if saved:
        if mode != "training":
            raise ValueError("saved bytes are those of a training step: pass mode='training'")
        result["saved_bytes"] = {name: saved_bytes_of(loss) for name, loss in losses.items()}
    return result


def _calls(step) -> dict:
    """What one step calls, under the profiler: the ATen (and rla) ops called from compiled code
    or the step itself, not those an op calls inside, by name. Inductor's generated kernels are
    not profiled ops: `generated_kernels` counts them (at compile time, forward and backward)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()

    def op(event) -> bool:
        return event.name.startswith(("aten::", "rla::"))

    top = [e.name for e in prof.events() if op(e) and not (e.cpu_parent is not None and op(e.cpu_parent))]
    return {"op_calls": len(top), "op_calls_by_name": {n: top.count(n) for n in sorted(set(top))}}


def _quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=4, method="inclusive")[int(q * 4) - 1] if len(values) > 1 else values[0]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--modes", nargs="+", default=["inference", "training"], choices=["inference", "training"])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--runs", type=int, default=1,
                        help="repeat the whole measurement in this many fresh processes and report the ratios' "
                             "spread across them (on a shared CPU a ratio moves more between processes than "
                             "between repetitions in one)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.runs > 1:
        return _across_processes(args, argv if argv is not None else sys.argv[1:])
    results = []
    print(f"{'size':<8}{'mode':<11}" + "".join(f"{n + ' ms':>16}" for n in VARIANTS) + f"{'rla/ind':>10}{'pinned/ind':>12}"
          + f"{'rla/ind per round (IQR)':>26}")
    for size in args.sizes:
        for mode in args.modes:
            r = measure(size, mode, args.reps)
            results.append(r)
            ms = "".join(f"{r['median_s'][n] * 1e3:>16.2f}" for n in VARIANTS)
            ratio = r["ratio_vs_inductor"]
            iqr = r["round_ratio_quartiles"]["rla"]
            print(f"{size:<8}{mode:<11}{ms}{ratio['rla']:>10.3f}{ratio['rla pinned']:>12.3f}"
                  f"{f'{iqr[0]:.3f}-{iqr[1]:.3f}':>26}", flush=True)
    write(args.json, results)
    return results


def _across_processes(args, argv: list[str]) -> list[dict]:
    """Run this script once per run in a fresh process; per (size, mode), every run's result
    and the median, min and max over the runs of each variant's ratio to plain Inductor."""
    runs = fresh_process_runs(__spec__.name, argv, args.runs)
    results = []
    print(f"{'size':<8}{'mode':<11}{'rla/ind median (min-max) over runs':>38}{'pinned/ind median (min-max)':>32}")
    for i, first in enumerate(runs[0]):
        per_run = [r[i] for r in runs]
        spread = {name: {"median": statistics.median(r["ratio_vs_inductor"][name] for r in per_run),
                         "min": min(r["ratio_vs_inductor"][name] for r in per_run),
                         "max": max(r["ratio_vs_inductor"][name] for r in per_run)} for name in VARIANTS}
        results.append({"size": first["size"], "mode": first["mode"], "runs": per_run, "ratio_across_runs": spread,
                        "ratio_vs_inductor": {name: spread[name]["median"] for name in VARIANTS}})
        cells = [f"{spread[n]['median']:.3f} ({spread[n]['min']:.3f}-{spread[n]['max']:.3f})" for n in ("rla", "rla pinned")]
        print(f"{first['size']:<8}{first['mode']:<11}{cells[0]:>38}{cells[1]:>32}", flush=True)
    write(args.json, results)
    return results


if __name__ == "__main__":
    main()
