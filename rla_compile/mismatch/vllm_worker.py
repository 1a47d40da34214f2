"""Runs in its own process for `stacks.vllm_logprobs`: starts a vLLM engine on the model with
rla on the requested sites (or off), scores the sequences teacher-forced (prompt logprobs over
the full vocabulary) and saves the log-distributions.

    python -m rla_compile.mismatch.vllm_worker REQUEST.json
"""

from __future__ import annotations

import json
import sys

import torch


def engine(request: dict):
    """The vLLM engine the request describes, and its compilation config (None: rla off)."""
    from vllm import LLM

    config, extra = None, {}
    if request["sites"] is not None:
        from ..integrations import vllm as rla_vllm

        extra = rla_vllm.engine_kwargs(sites=request["sites"])
        config = extra["compilation_config"]
    sequences = request["sequences"]
    llm = LLM(model=request["model_dir"], dtype=request["dtype"], max_model_len=max(len(s) for s in sequences) + 8,
              max_num_seqs=len(sequences), seed=0, skip_tokenizer_init=True, max_logprobs=-1,
              enforce_eager=not request["compiled"], **extra)
    return llm, config


def prompt_logprobs(llm, sequences: list[list[int]]) -> torch.Tensor:
    """Teacher-forced full-vocabulary logprobs of positions 1..T-1: [B, T-1, V] fp32."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(max_tokens=1, prompt_logprobs=-1, detokenize=False, temperature=1.0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
    logprobs = torch.full((len(sequences), len(sequences[0]) - 1, vocab), float("nan"))
    for row, out in enumerate(outputs):
        for pos, dist in enumerate(out.prompt_logprobs[1:]):
            ids = torch.tensor(list(dist.keys()))
            logprobs[row, pos, ids] = torch.tensor([lp.logprob for lp in dist.values()], dtype=torch.float32)
    if torch.isnan(logprobs).any():
        raise RuntimeError("vLLM returned fewer than the full vocabulary of prompt logprobs")
    return logprobs


def reports(config) -> list[dict]:
    return [r.to_dict() for r in config["inductor_compile_config"]["post_grad_custom_post_pass"].reports] if config else []


def main(request_path: str) -> None:
    request = json.loads(open(request_path).read())
    llm, config = engine(request)
    logprobs = prompt_logprobs(llm, request["sequences"])
    torch.save({"logprobs": logprobs, "reports": reports(config)}, request["out"])


if __name__ == "__main__":
    main(sys.argv[1])
