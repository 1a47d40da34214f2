"""Run time before and after one change, side by side in one run: how a site's rounded output
is widened back to fp32 where the widening shares a kernel with the rounding (the residual
stream the backward recomputes, once per layer; Qwen3's q/k norm feeding RoPE).

Unpinned, Inductor's C++ code generator would hand such a widening the fp32 value the rounding
came from (its cse cache trick), so rla must make it read the rounded value. Before: the
widening ran as an ATen call (a kernel of its own, writing an fp32 copy of the tensor). After:
it widens through fp64 inside the reader's kernel (`backend._upcast_through_fp64`, exact; the
cache only serves `convert<float>`). The "before" variant compiles with the old rule.

    python benchmarks/upcasts_before_after.py --json benchmarks/results/upcasts_before_after_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))
from common import SIZES, write  # noqa: E402
from runtime import measure  # noqa: E402

import rla_compile  # noqa: E402

backend_module = sys.modules["rla_compile.backend"]


def _on_aten(graph, upcast) -> None:
    upcast.meta["should_fallback"] = True


VARIANTS = {
    "inductor": lambda: "inductor",
    "rla before": lambda: rla_compile.backend(),
    "rla after": lambda: rla_compile.backend(),
}
COMPILING = {"rla before": lambda: mock.patch.object(backend_module, "_upcast_through_fp64", _on_aten),
             "rla after": contextlib.nullcontext}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--modes", nargs="+", default=["inference", "training"], choices=["inference", "training"])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    from torch._inductor import config as inductor_config

    results = []
    print(f"{'size':<8}{'mode':<11}{'inductor ms':>13}{'before/ind (IQR)':>24}{'after/ind (IQR)':>24}")
    for size in args.sizes:
        for mode in args.modes:
            # caches off: the two rla variants share a cache key
            with inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False):
                r = measure(size, mode, args.reps, variants=VARIANTS, compiling=COMPILING)
            results.append(r)
            ratio, iqr = r["ratio_vs_inductor"], r["round_ratio_quartiles"]
            cells = [f"{ratio[n]:.3f} ({iqr[n][0]:.2f}-{iqr[n][1]:.2f})" for n in ("rla before", "rla after")]
            print(f"{size:<8}{mode:<11}{r['median_s']['inductor'] * 1e3:>13.2f}{cells[0]:>24}{cells[1]:>24}", flush=True)
    write(args.json, results)
    return results


if __name__ == "__main__":
    main()
