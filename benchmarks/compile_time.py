"""Compile time: rla's share of the whole compile, and how the pass grows with model depth.

For each depth (decoder layers) a tiny Llama's training step is compiled under
`backend="rla"`; the first step's wall time (Dynamo + rla + AOTAutograd + Inductor, forward
and backward) is the compile time, and the report's `seconds` says what rla itself took: the
pre-dispatch re-trace and the rewrite (matching + editing the graph).

    python -m benchmarks.compile_time --json benchmarks/results/compile_time_cpu.json
    python -m benchmarks.compile_time --layers 1            # smoke
"""

from __future__ import annotations

import argparse
import time

import torch

import rla_compile

from .common import model_and_tokens, train_step, write


def measure(layers: int, device: str = "cpu") -> dict:
    torch._dynamo.reset()
    model, ids = model_and_tokens("small", device, num_hidden_layers=layers)
    backend = rla_compile.Backend()
    step = train_step(torch.compile(model, backend=backend), model, ids)
    start = time.perf_counter()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        step()  # compiles forward and backward, caches off: a cold compile
    first = time.perf_counter() - start
    start = time.perf_counter()
    step()
    steady = time.perf_counter() - start
    retrace = sum(r.seconds["retrace"] for r in backend.reports)
    rewrite = sum(r.seconds["rewrite"] for r in backend.reports)
    compile_s = first - steady
    nodes = sum(len(r.sites) for r in backend.reports)
    return {"layers": layers, "sites": nodes, "compile_s": compile_s, "retrace_s": retrace, "rewrite_s": rewrite,
            "rla_fraction": (retrace + rewrite) / compile_s, "rewrite_fraction": rewrite / compile_s}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results = []
    print(f"{'layers':>6}{'sites':>7}{'compile s':>11}{'retrace s':>11}{'rewrite s':>11}{'rla share':>11}{'rewrite share':>15}")
    for layers in args.layers:
        r = measure(layers)
        results.append(r)
        print(f"{layers:>6}{r['sites']:>7}{r['compile_s']:>11.2f}{r['retrace_s']:>11.3f}{r['rewrite_s']:>11.4f}"
              f"{r['rla_fraction']:>11.1%}{r['rewrite_fraction']:>15.2%}", flush=True)
    write(args.json, results)
    return results


if __name__ == "__main__":
    main()
