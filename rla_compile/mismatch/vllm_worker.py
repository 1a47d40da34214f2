"""Runs in its own process for `stacks.vllm_logprobs`: starts a vLLM engine on the model with
rla on the requested sites (or off), scores the sequences teacher-forced (prompt logprobs over
the full vocabulary) and saves the log-distributions.

    python -m rla_compile.mismatch.vllm_worker REQUEST.json
"""

from __future__ import annotations

import json
import sys

import torch


def main(request_path: str) -> None:
    request = json.loads(open(request_path).read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    config, extra = None, {}
    if request["sites"] is not None:
        from ..integrations import vllm as rla_vllm

        extra = rla_vllm.engine_kwargs(sites=request["sites"])
        config = extra["compilation_config"]
    sequences = request["sequences"]
    llm = LLM(model=request["model_dir"], dtype=request["dtype"], max_model_len=max(len(s) for s in sequences) + 8,
              max_num_seqs=len(sequences), seed=0, skip_tokenizer_init=True, max_logprobs=-1,
              enforce_eager=not request["compiled"], **extra)
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
    reports = config["inductor_compile_config"]["post_grad_custom_post_pass"].reports if config else []
    torch.save({"logprobs": logprobs, "reports": [r.to_dict() for r in reports]}, request["out"])


if __name__ == "__main__":
    main(sys.argv[1])
