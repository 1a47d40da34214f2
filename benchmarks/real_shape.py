"""What alignment costs at a real model's shape, side by side in one run: Qwen3-0.6B's shape
(28 layers, hidden 1024, 16/8 heads of 128, MLP 3072, vocabulary 151,936, tied embeddings),
random bf16 weights, a training step (SGD) and an inference forward on one sequence of 256 tokens.

    python -m benchmarks.real_shape --json benchmarks/results/real_shape_cpu.json
    python -m benchmarks.real_shape --variants rla "rla + attention" --json benchmarks/results/real_shape_attention_256_cpu.json
    python -m benchmarks.real_shape --tokens 2048 --reps 2 --variants rla "rla + attention" \
        --json benchmarks/results/real_shape_attention_2048_cpu.json
    python -m benchmarks.real_shape --layers 1 --hidden 64 --vocab 512 --tokens 16 --reps 1 --no-warm-up  # smoke

One model, compiled per variant (plain Inductor, rla, rla + the opt-in `logits` site), caches
and kernels compiled fresh. Per variant: first-step compile time of the training step (first step minus a steady
one) and of the inference forward (a recompile: grad mode changed), rla's re-trace and rewrite
seconds for each of those compiles, steady step times (repetitions alternate between the
variants), bytes saved for the backward (saved-tensor hooks), and the peak RSS of the variant's
compile and step above the RSS it started from (peak reset through /proc/self/clear_refs; the
allocator may keep freed pages, so this is the extra the variant asked for). Ratios are to
plain Inductor.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from torch._inductor.utils import fresh_cache

import rla_compile
import rla_compile.sites
from rla_compile.tiny import tiny_causal_lm

from .common import fresh_process_runs, saved_bytes_of, write

QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
VARIANTS = {
    "inductor": lambda: "inductor",
    "rla": lambda: rla_compile.Backend(),
    **{f"rla + {kind}": (lambda kind=kind: rla_compile.Backend(sites=[*rla_compile.DEFAULT_SITES, kind]))
       for kind in rla_compile.sites.OPT_IN_SITES},
}


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> int:
    """Release what can be released, reset the peak RSS to the current one; return it (KiB)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _rss_kib("VmRSS")


def _timed(fn, device: str = "cpu") -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _selected(args) -> dict:
    """The variants to run: plain Inductor (the baseline every ratio is to) and `args.variants`."""
    names = getattr(args, "variants", None) or list(VARIANTS)
    return {name: VARIANTS[name] for name in dict.fromkeys(["inductor", *names])}


def _warm_up(variants: dict) -> None:
    """Compile a one-layer model once per variant, untimed: the first compile in a process also
    pays for imports and Inductor's own set-up, which would fall on whichever variant runs first."""
    torch._dynamo.reset()
    tiny = tiny_causal_lm("qwen3", num_hidden_layers=1)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    for make in variants.values():
        compiled = torch.compile(tiny, backend=make())
        compiled(ids, labels=ids, use_cache=False).loss.backward()
        with torch.no_grad():
            compiled(ids, use_cache=False)
    torch._dynamo.reset()


def measure(args, device: str = "cpu") -> dict:
    config = {**QWEN3_0_6B, "num_hidden_layers": args.layers, "hidden_size": args.hidden,
              "vocab_size": args.vocab}
    if args.hidden != QWEN3_0_6B["hidden_size"]:  # a scaled-down smoke shape
        config.update(intermediate_size=2 * args.hidden, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=args.hidden // 4)
    torch._dynamo.config.recompile_limit = 64  # one model, several backends: an entry each
    torch._dynamo.config.accumulated_recompile_limit = 256
    model = tiny_causal_lm("qwen3", **config).to(device)
    ids = torch.randint(0, config["vocab_size"], (1, args.tokens), generator=torch.Generator().manual_seed(0)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)

    def make_steps(compiled):
        def train():
            compiled(ids, labels=ids, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def infer():
            with torch.no_grad():
                compiled(ids, use_cache=False)

        return train, infer

    out = {"config": config, "tokens": args.tokens, "reps": args.reps, "variants": {}}
    variants = _selected(args)
    if args.warm_up:
        _warm_up(variants)
    steps = {}
    for name, make in variants.items():  # no Dynamo reset: each backend keeps its own cache entries
        backend = make()
        compiled = torch.compile(model, backend=backend)
        train, infer = make_steps(compiled)
        steps[name] = (train, infer)
        rss_start = _reset_peak()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        # A fresh Inductor cache (C++ kernels included) per variant: else later variants reuse the
        # kernels an earlier one compiled and look cheaper.
        with fresh_cache(), torch._functorch.config.patch(enable_autograd_cache=False):
            first_train = _timed(train, device)
            n = len(getattr(backend, "reports", []))
            first_infer = _timed(infer, device)
        r = {"train_first_s": first_train, "infer_first_s": first_infer,
             "train_steady_s": _timed(train, device), "infer_steady_s": _timed(infer, device)}
        r["peak_rss_extra_mib"] = (_rss_kib("VmHWM") - rss_start) / 1024
        if device == "cuda":
            r["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        r["train_compile_s"] = first_train - r["train_steady_s"]
        r["infer_compile_s"] = first_infer - r["infer_steady_s"]
        reports = getattr(backend, "reports", [])
        r["train_rla_s"] = {k: sum(x.seconds[k] for x in reports[:n]) for k in ("retrace", "rewrite")} if reports else None
        r["infer_rla_s"] = {k: sum(x.seconds[k] for x in reports[n:]) for k in ("retrace", "rewrite")} if reports else None
        r["graphs"] = len(reports)
        r["saved_bytes"] = saved_bytes_of(lambda: compiled(ids, labels=ids, use_cache=False).loss)
        optimizer.zero_grad(set_to_none=True)
        out["variants"][name] = r
        print(f"{name}: compiled train {r['train_compile_s']:.1f} s, inference {r['infer_compile_s']:.1f} s, "
              f"rla {r['train_rla_s']} / {r['infer_rla_s']}", flush=True)

    times = {name: {"train": [], "infer": []} for name in steps}
    for _ in range(args.reps):  # alternate, so load on the machine hits every variant alike
        for name, (train, infer) in steps.items():
            times[name]["train"].append(_timed(train, device))
            times[name]["infer"].append(_timed(infer, device))
    for name, t in times.items():
        r = out["variants"][name]
        for mode in ("train", "infer"):
            r[f"{mode}_times_s"] = t[mode]
            r[f"{mode}_median_s"] = statistics.median(t[mode])
            r[f"{mode}_min_s"] = min(t[mode])  # under load from other jobs, the least disturbed repetition
    base = out["variants"]["inductor"]
    keys = ("train_compile_s", "infer_compile_s", "train_median_s", "infer_median_s", "train_min_s", "infer_min_s",
            "saved_bytes", "peak_rss_extra_mib")
    out["ratio_vs_inductor"] = {name: {k: r[k] / base[k] if base[k] else None for k in keys}
                                for name, r in out["variants"].items()}
    return out


def main_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=QWEN3_0_6B["num_hidden_layers"])
    parser.add_argument("--hidden", type=int, default=QWEN3_0_6B["hidden_size"])
    parser.add_argument("--vocab", type=int, default=QWEN3_0_6B["vocab_size"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), metavar="VARIANT",
                        help=f"which to run besides plain Inductor (default: all of {', '.join(VARIANTS)})")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false", help="smoke runs: skip the untimed warm-up")
    parser.add_argument("--runs", type=int, default=1,
                        help="repeat the whole measurement in this many fresh processes and report the ratios' "
                             "median and range across them (one compile per variant and run: compile times move "
                             "by several percent between runs)")
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


COLUMNS = ("train_compile_s", "infer_compile_s", "train_median_s", "infer_median_s", "train_min_s", "infer_min_s",
           "saved_bytes", "peak_rss_extra_mib")


def main(argv=None) -> dict:
    args = main_args(argv)
    if args.runs > 1:
        return _across_processes(args, argv if argv is not None else sys.argv[1:])
    out = measure(args)
    cols = COLUMNS
    print(f"{'variant':<14}" + "".join(f"{c:>20}" for c in cols))
    for name, r in out["variants"].items():
        print(f"{name:<14}" + "".join(f"{r[c]:>20.4g}" for c in cols))
    for name, ratio in out["ratio_vs_inductor"].items():
        print(f"{name + ' / ind':<14}" + "".join(f"{ratio[c]:>20.3f}" if ratio[c] is not None else f"{'-':>20}" for c in cols))
    for name, r in out["variants"].items():
        if r["train_rla_s"]:
            share = (r["train_rla_s"]["retrace"] + r["train_rla_s"]["rewrite"]) / max(r["train_compile_s"], 1e-9)
            print(f"{name}: re-trace {r['train_rla_s']['retrace']:.2f} s + rewrite {r['train_rla_s']['rewrite']:.3f} s"
                  f" = {share:.1%} of the training compile; again on the inference recompile:"
                  f" re-trace {r['infer_rla_s']['retrace']:.2f} s + rewrite {r['infer_rla_s']['rewrite']:.3f} s")
    write(args.json, out)
    return out


def _spread_cell(v: dict | None) -> str:
    return f"{v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})" if v else "-"


def _across_processes(args, argv: list[str]) -> dict:
    """Every run's result, and per variant and column the median, min and max of the ratio to
    plain Inductor over the runs."""
    runs = fresh_process_runs(__spec__.name, argv, args.runs)
    spread = {name: {c: {f.__name__: f(r["ratio_vs_inductor"][name][c] for r in runs)
                         for f in (statistics.median, min, max)} if runs[0]["ratio_vs_inductor"][name][c] is not None else None
                     for c in COLUMNS} for name in runs[0]["ratio_vs_inductor"]}
    print(f"ratio to plain Inductor, median (min-max) of {len(runs)} runs")
    print(f"{'variant':<14}" + "".join(f"{c:>22}" for c in COLUMNS))
    for name, cells in spread.items():
        print(f"{name + ' / ind':<14}" + "".join(f"{_spread_cell(v):>22}" for v in cells.values()))
    out = {"runs": runs, "ratio_across_runs": spread,
           "ratio_vs_inductor": {n: {c: v["median"] if v else None for c, v in cells.items()} for n, cells in spread.items()}}
    write(args.json, out)
    return out


if __name__ == "__main__":
    main()
