"""Memory of the training step, aligned vs unaligned: the bytes of activations saved for the
backward (the part the rewrite can change: an aligned site may save fp32 values where the
original saved bf16 ones), counted exactly with saved-tensor hooks, and the parameters.

    python -m benchmarks.memory --json benchmarks/results/memory_cpu.json
"""

from __future__ import annotations

import argparse

import torch

from .common import SIZES, VARIANTS, model_and_tokens, saved_bytes_of, write


def saved_bytes(size: str, backend, device: str = "cpu") -> int:
    torch._dynamo.reset()
    model, ids = model_and_tokens(size, device)
    compiled = torch.compile(model, backend=backend)
    compiled(ids, labels=ids, use_cache=False).loss.backward()  # compile (and warm) first
    return saved_bytes_of(lambda: compiled(ids, labels=ids, use_cache=False).loss)


def cuda_peak_bytes(size: str, backend) -> int:
    """Peak allocated CUDA memory of one (warm) training step."""
    torch._dynamo.reset()
    model, ids = model_and_tokens(size, "cuda")
    compiled = torch.compile(model, backend=backend)
    compiled(ids, labels=ids, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    compiled(ids, labels=ids, use_cache=False).loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results = []
    print(f"{'size':<8}" + "".join(f"{n + ' KiB':>18}" for n in VARIANTS) + f"{'rla/ind':>10}{'pinned/ind':>12}")
    for size in args.sizes:
        saved = {name: saved_bytes(size, make()) for name, make in VARIANTS.items()}
        ratio = {name: saved[name] / saved["inductor"] for name in saved}
        results.append({"size": size, "saved_bytes": saved, "ratio_vs_inductor": ratio})
        print(f"{size:<8}" + "".join(f"{saved[n] / 1024:>18.1f}" for n in VARIANTS)
              + f"{ratio['rla']:>10.3f}{ratio['rla pinned']:>12.3f}", flush=True)
    write(args.json, results)
    return results


if __name__ == "__main__":
    main()
