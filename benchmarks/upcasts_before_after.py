"""Ways to make an upcast read a site's rounded output, side by side in one run: where the
upcast shares a kernel with the rounding (Qwen3's q/k norm feeding RoPE), Inductor's C++ code
generator, unpinned, would hand it the fp32 value the rounding came from (its cse cache
trick), so rla must make it read the rounded value.

- "rla (rounding in kernel)", what rla does (`lowering.round_in_kernel`): the rounding is
  written out on the fp32 bits in the generated kernel, so the value the cache hands the upcast
  is the rounded one. No extra call, no extra kernel.
- "rla (ATen upcasts)", rla before stop 45 (`lowering.upcast_on_aten`): the upcast runs as an
  ATen call, a kernel of its own writing an fp32 copy of the tensor, which the reader loads.
- "rla (bf16 copy)", tried: an ATen call writes a bf16 copy of the rounded value (another
  buffer, which the cache cannot serve), upcast in the reader's kernel: half the bytes.
- "rla (fp64 upcasts)", tried: the upcast widens through fp64 (bf16 -> fp64 -> fp32, both
  exact) inside the reader's kernel; the cache only serves `convert<float>(bf16)`. Fewer
  kernels, but at Qwen3-0.6B's width the fused q/k norm + RoPE kernel ran about 3x slower on an
  AVX2 EPYC (1.04x the step on an AVX-512 one, stop 45).
- "rla (prims fallback)", rla before stop 33: the upcast as a per-node fallback of the
  post-grad graph's `prims.convert_element_type`, which runs the prim's Python reference on
  every call (0.1-0.6 ms of host time each, where ATen's `_to_copy` takes 10 us): invisible
  next to CPU compute at 256 tokens, 3.1x the wall time of an H200's inference (the GPU waits
  for the host). "qwen3-host" shows the host's share on this machine.
- "inductor again": plain Inductor once more, on a model of its own like every variant: the
  resolution of the comparison (each variant's own copy of the weights moved a ratio by up to
  2 points in one run).

Each variant also reports the kernels Inductor generated for it and the ATen/rla op calls one
step makes (under the profiler).

Sizes: the tiny Llamas of runtime.py, "qwen3-width": 4 layers of Qwen3-0.6B's width
(hidden 1024, 16/8 heads of 128, MLP 3072), vocabulary 8192, one sequence of 256 tokens, and
"qwen3-host": the tiny Qwen3 (4 layers, hidden 64) on 4 tokens, where the time per step is
mostly the host's (calls, dispatch), as on a GPU.

    python -m benchmarks.upcasts_before_after --sizes qwen3-width --json benchmarks/results/upcasts_qwen3_cpu.json
    python -m benchmarks.upcasts_before_after --sizes qwen3-host --json benchmarks/results/upcasts_qwen3_host_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import torch

import rla_compile

import rla_compile.lowering as lowering

from . import common
from .common import SIZES, ratio_cell, write
from .real_shape import QWEN3_0_6B
from .runtime import measure

QWEN3_WIDTH = {**{k: v for k, v in QWEN3_0_6B.items() if k not in ("rope_theta", "tie_word_embeddings")},
               "num_hidden_layers": 4, "vocab_size": 8192, "batch": 1, "seq": 256, "model_type": "qwen3"}
QWEN3_HOST = {"num_hidden_layers": 4, "batch": 1, "seq": 4, "model_type": "qwen3"}


def _through_fp64(graph, upcast) -> None:
    """Widen through fp64 in the reader's kernel."""
    with graph.inserting_before(upcast):
        wide = graph.call_function(torch.ops.prims.convert_element_type.default, (upcast.args[0], torch.float64))
    wide.meta["val"] = upcast.args[0].meta["val"].to(torch.float64)
    upcast.replace_input_with(upcast.args[0], wide)


def _through_bf16_copy(graph, upcast) -> None:
    """An ATen bf16 copy of the rounded value, which the upcast loads in the reader's kernel."""
    rounded = upcast.args[0]
    with graph.inserting_before(upcast):
        copy = graph.call_function(torch.ops.aten.clone.default, (rounded,))
    copy.meta["val"] = rounded.meta["val"].clone()
    copy.meta["should_fallback"] = True
    upcast.replace_input_with(rounded, copy)


def _prims_fallback(graph, upcast) -> None:
    """The post-grad prim itself as a per-node fallback (rla before stop 33)."""
    upcast.meta["should_fallback"] = True


def _instead_of_rounding_in_kernel(through):
    """`lowering.keep_site_roundings` with `through(graph, upcast)` for every upcast that reads a
    site's rounded output in the same kernel, instead of `round_in_kernel`."""
    @contextlib.contextmanager
    def patched():
        with mock.patch.object(lowering, "round_in_kernel", lambda rounding: False), \
                mock.patch.object(lowering, "upcast_on_aten", through):
            yield
    return patched()


VARIANTS = {
    "inductor": lambda: "inductor",
    "rla (rounding in kernel)": lambda: rla_compile.Backend(),
    "rla (ATen upcasts)": lambda: rla_compile.Backend(),
    "rla (bf16 copy)": lambda: rla_compile.Backend(),
    "rla (fp64 upcasts)": lambda: rla_compile.Backend(),
    "rla (prims fallback)": lambda: rla_compile.Backend(),
    "inductor again": lambda: "inductor",
}
COMPILING = {"rla (ATen upcasts)": lambda: _instead_of_rounding_in_kernel(lowering.upcast_on_aten),
             "rla (bf16 copy)": lambda: _instead_of_rounding_in_kernel(_through_bf16_copy),
             "rla (fp64 upcasts)": lambda: _instead_of_rounding_in_kernel(_through_fp64),
             "rla (prims fallback)": lambda: _instead_of_rounding_in_kernel(_prims_fallback)}


def measure_alternatives(size: str, mode: str, reps: int, variants: dict, compiling: dict, device: str = "cpu",
                         saved: bool = False, calls: bool = False) -> dict:
    """`runtime.measure` of variants that share rla's cache key (caches off), at the sizes of
    `runtime.py` or "qwen3-width" ("saved", "calls": runtime.measure's)."""
    from torch._inductor import config as inductor_config

    with mock.patch.dict(common.SIZES, {"qwen3-width": QWEN3_WIDTH, "qwen3-host": QWEN3_HOST}), \
            inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False):
        return measure(size, mode, reps, device=device, variants=variants, compiling=compiling, saved=saved, calls=calls)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = [*SIZES, "qwen3-width", "qwen3-host"]
    parser.add_argument("--sizes", nargs="+", default=sizes, choices=sizes)
    parser.add_argument("--modes", nargs="+", default=["inference", "training"], choices=["inference", "training"])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, help="ATen's threads (default: 1 for qwen3-host, where a step is host "
                        "time as on a GPU and two threads' hand-offs around each small GEMM moved its time by "
                        "10%% between identical runs; else torch's default)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.threads or args.sizes == ["qwen3-host"]:
        torch.set_num_threads(args.threads or 1)

    results = []
    names = list(VARIANTS)[1:]
    print(f"{'size':<13}{'mode':<11}{'inductor ms':>13}" + "".join(f"{n + ' / ind (IQR)':>34}" for n in names))
    for size in args.sizes:
        for mode in args.modes:
            r = measure_alternatives(size, mode, args.reps, VARIANTS, COMPILING, calls=True)
            r["threads"] = torch.get_num_threads()
            results.append(r)
            cells = "".join(f"{ratio_cell(r, n):>34}" for n in names)
            print(f"{size:<13}{mode:<11}{r['median_s']['inductor'] * 1e3:>13.2f}{cells}", flush=True)
            for name, c in r["calls"].items():
                print(f"    {name}: {c['generated_kernels']} kernels generated, {c['op_calls']} op calls a step "
                      f"{c['op_calls_by_name']}", flush=True)
    write(args.json, results)
    return results


if __name__ == "__main__":
    main()
