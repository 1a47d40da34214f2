"""Run time of aligned vs unaligned compiled models, measured side by side in one run.

For each configuration the same tiny Llama is compiled three ways: plain Inductor, rla with
site roundings pinned only (default), and rla with all rounding pinned (`pin_rounding=True`,
Inductor's emulate_precision_casts). Repetitions alternate between them and the median is
reported, with the ratios to plain Inductor.

    python benchmarks/runtime.py                    # small and medium, inference and training
    python benchmarks/runtime.py --sizes small --reps 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import rla_compile
from rla_compile.tiny import tiny_causal_lm

SIZES = {
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, batch=2, seq=32),
    "medium": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=32, vocab_size=512, max_position_embeddings=256, batch=4, seq=128),
}
VARIANTS = {
    "inductor": lambda: "inductor",
    "rla": lambda: rla_compile.backend(),
    "rla pinned": lambda: rla_compile.backend(pin_rounding=True),
}


def _workload(size: str, mode: str, backend):
    cfg = dict(SIZES[size])
    batch, seq = cfg.pop("batch"), cfg.pop("seq")
    model = tiny_causal_lm("llama", **cfg)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend=backend)
    if mode == "inference":
        def step():
            with torch.no_grad():
                compiled(ids, use_cache=False)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            loss = compiled(ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return step


def measure(size: str, mode: str, reps: int, warmup: int = 2) -> dict:
    steps = {}
    for name, make in VARIANTS.items():
        torch._dynamo.reset()
        steps[name] = _workload(size, mode, make())
        for _ in range(warmup):
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):  # alternate so load on the machine hits all variants alike
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "size": size,
        "mode": mode,
        "median_s": medians,
        "ratio_vs_inductor": {name: medians[name] / medians["inductor"] for name in medians},
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--modes", nargs="+", default=["inference", "training"], choices=["inference", "training"])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results = []
    print(f"{'size':<8}{'mode':<11}" + "".join(f"{n + ' ms':>16}" for n in VARIANTS) + f"{'rla/ind':>10}{'pinned/ind':>12}")
    for size in args.sizes:
        for mode in args.modes:
            r = measure(size, mode, args.reps)
            results.append(r)
            ms = "".join(f"{r['median_s'][n] * 1e3:>16.2f}" for n in VARIANTS)
            ratio = r["ratio_vs_inductor"]
            print(f"{size:<8}{mode:<11}{ms}{ratio['rla']:>10.3f}{ratio['rla pinned']:>12.3f}", flush=True)
    if args.json:
        machine = {"machine": platform.machine(), "processor": platform.processor(), "threads": torch.get_num_threads(),
                   "torch": torch.__version__, "device": "cpu"}
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
