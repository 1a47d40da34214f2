"""The residual stream saved for the backward or recomputed there, side by side in one run.

rla tags each residual site's stream rounding round(s) to be saved (`rewriter.mark_save`). Left
to itself, AOTAutograd's partitioner saves the block outputs instead and recomputes the stream
in the backward, a chain of roundings and upcasts that Inductor fuses into one kernel, where
each upcast must then run on ATen (docs/contract.md: the CPU code generator's cse cache).
This prints what each choice costs against plain Inductor: training step time and the bytes
saved for the backward.

    python -m benchmarks.residual_save --json benchmarks/results/residual_save_cpu.json
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch

import rla_compile
from rla_compile import rewriter

from .common import SIZES, ratio_cell, write
from .upcasts_before_after import measure_alternatives

VARIANTS = {
    "inductor": lambda: "inductor",
    "rla (stream saved)": lambda: rla_compile.Backend(),
    "rla (stream recomputed)": lambda: rla_compile.Backend(),
}
COMPILING = {"rla (stream recomputed)": lambda: mock.patch.object(rewriter, "mark_save", lambda rounding: None)}


def compare(size: str, reps: int, device: str = "cpu") -> dict:
    """Both rla variants and plain Inductor at one size: training step times (runtime.measure)
    and the bytes each saves for the backward, on the same compiled models."""
    result = measure_alternatives(size, "training", reps, VARIANTS, COMPILING, device, saved=True)
    torch._dynamo.reset()
    saved = result["saved_bytes"]
    result["saved_ratio_vs_inductor"] = {n: b / saved["inductor"] for n, b in saved.items()}
    return result


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = [*SIZES, "qwen3-width"]
    parser.add_argument("--sizes", nargs="+", default=sizes, choices=sizes)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    results, names = [], list(VARIANTS)[1:]
    print(f"{'size':<13}{'inductor ms':>13}" + "".join(f"{n + ' / ind: time (IQR), saved':>52}" for n in names))
    for size in args.sizes:
        r = compare(size, args.reps)
        results.append(r)
        saved = r["saved_ratio_vs_inductor"]
        cells = "".join(f"{ratio_cell(r, n) + ', ' + format(saved[n], '.3f'):>52}" for n in names)
        print(f"{size:<13}{r['median_s']['inductor'] * 1e3:>13.2f}{cells}", flush=True)
    write(args.json, results)
    return results


if __name__ == "__main__":
    main()
