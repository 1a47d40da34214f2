"""What the opt-in `logits` site costs at a real vocabulary: the LM head of Qwen3-0.6B's shape
(hidden 1024, vocabulary 151,936, bf16 weights) on 256 tokens, compiled with rla's four default
sites vs the four plus `logits`, measured side by side in one run.

    python -m benchmarks.logits_cost [--tokens 256] [--hidden 1024] [--vocab 151936] [--reps 5] [--json out.json]
    python -m benchmarks.logits_cost --reps 3 --json benchmarks/results/logits_cost_cpu.json

Per variant: the median time of a training step (head + cross-entropy, forward and backward)
and of an inference forward (head + log-softmax), repetitions alternating between variants;
bytes saved for the backward (saved-tensor hooks); the bytes of the logits tensor; and the
peak RSS of a fresh process running one warm training step. What it shows: the logits site
projects from fp32 inputs (an fp32 GEMM; the weight is upcast per call, a transient fp32 copy
of the head), where the default rounds a bf16 GEMM's output.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

import rla_compile

from .common import module_command, module_env, saved_bytes_of, write

VARIANTS = {
    "rla (4 sites)": list(rla_compile.DEFAULT_SITES),
    "rla + logits": [*rla_compile.DEFAULT_SITES, "logits"],
}


class Head(torch.nn.Module):
    """The LM head as HF writes it: bf16 logits, upcast for the loss."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16)

    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        if labels is None:
            return logits.float().log_softmax(-1)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def setup(args, sites):
    torch.manual_seed(0)
    head = Head(args.hidden, args.vocab)
    h = torch.randn(1, args.tokens, args.hidden).bfloat16().requires_grad_()
    labels = torch.randint(0, args.vocab, (1, args.tokens))
    backend = rla_compile.Backend(sites=sites)
    return head, torch.compile(head, backend=backend), h, labels, backend


def train_step(compiled, h, labels):
    loss = compiled(h, labels)
    loss.backward()
    return loss


def peak_rss(args, name: str) -> float:
    """Peak RSS (MB) of a fresh process: one warm-up and one measured training step."""
    done = subprocess.run(module_command(__spec__.name, "--rss-of", name, "--tokens", args.tokens, "--hidden", args.hidden,
                                         "--vocab", args.vocab), capture_output=True, text=True, check=True, env=module_env())
    return float(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--rss-of", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_of:
        head, compiled, h, labels, _ = setup(args, VARIANTS[args.rss_of])
        for _ in range(2):
            train_step(compiled, h, labels)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        return {}

    runs = {}
    torch._dynamo.reset()
    for name, sites in VARIANTS.items():  # no reset between variants: each keeps its compiled code
        head, compiled, h, labels, backend = setup(args, sites)
        start = time.perf_counter()
        train_step(compiled, h, labels)
        with torch.no_grad():
            logprobs = compiled(h)
        first = time.perf_counter() - start
        logits_sites = [s.status for r in backend.reports for s in r.sites if s.kind == "logits"]
        runs[name] = {"compiled": compiled, "h": h, "labels": labels, "first_call_s": first, "logits_site": logits_sites,
                      "saved_bytes": saved_bytes_of(lambda: compiled(h, labels)), "logprobs": logprobs}
    for run in runs.values():  # warm: both variants compiled and run before any timing
        train_step(run["compiled"], run["h"], run["labels"])
        with torch.no_grad():
            run["compiled"](run["h"])
    times = {name: {"train": [], "infer": []} for name in VARIANTS}
    for _ in range(args.reps):  # alternate, so drift on a shared machine hits both alike
        for name, run in runs.items():
            start = time.perf_counter()
            train_step(run["compiled"], run["h"], run["labels"])
            times[name]["train"].append(time.perf_counter() - start)
            with torch.no_grad():
                start = time.perf_counter()
                run["compiled"](run["h"])
                times[name]["infer"].append(time.perf_counter() - start)
    logits_bytes = {"rla (4 sites)": args.tokens * args.vocab * 2, "rla + logits": args.tokens * args.vocab * 4}
    results = {"shape": {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab}, "variants": {}}
    base = "rla (4 sites)"
    for name, run in runs.items():
        results["variants"][name] = {
            "logits_site": run["logits_site"],
            "train_s": statistics.median(times[name]["train"]), "train_s_all": times[name]["train"],
            "infer_s": statistics.median(times[name]["infer"]), "infer_s_all": times[name]["infer"],
            "first_call_s": run["first_call_s"], "saved_bytes": run["saved_bytes"],
            "logits_bytes": logits_bytes[name], "peak_rss_mb": peak_rss(args, name),
        }
    v = results["variants"]
    results["ratios"] = {key: v["rla + logits"][key] / v[base][key]
                         for key in ("train_s", "infer_s", "saved_bytes", "logits_bytes", "peak_rss_mb")}
    diff = (runs["rla + logits"]["logprobs"] - runs[base]["logprobs"]).abs()
    results["mean_abs_logprob_change"] = float(diff.mean())
    print(f"LM head {args.tokens} tokens x hidden {args.hidden} -> vocabulary {args.vocab}, bf16 weights; "
          f"medians of {args.reps} alternating repetitions")
    print(f"{'variant':<16}{'train s':>9}{'infer s':>9}{'saved MB':>10}{'logits MB':>10}{'peak RSS MB':>12}  logits site")
    for name, r in v.items():
        print(f"{name:<16}{r['train_s']:>9.3f}{r['infer_s']:>9.3f}{r['saved_bytes'] / 2**20:>10.1f}"
              f"{r['logits_bytes'] / 2**20:>10.1f}{r['peak_rss_mb']:>12.0f}  {', '.join(r['logits_site']) or '-'}")
    print("ratio (+logits / 4 sites): " + ", ".join(f"{k} {x:.3f}" for k, x in results["ratios"].items()))
    print(f"mean |Δ logprob| the rounding of bf16 logits causes here: {results['mean_abs_logprob_change']:.2e}")
    write(args.json, results)
    return results


if __name__ == "__main__":
    main()
