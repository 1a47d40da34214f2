"""Runs in its own process for `stacks.vllm_logprobs`: starts a vLLM engine on the model with
rla on the requested sites (or off), scores the sequences teacher-forced (prompt logprobs over
the full vocabulary) and saves the log-distributions. With `decode_after` (a `decode` stack),
the part of each sequence after that many tokens is scored as vLLM generates it: one decode
step per token, every sequence in one batch, each step forced to the sequence's token by a
logits processor (`ForcedTokens`); the logprobs are vLLM's raw ones, from the logits before
any processor, as RL trainers receive them. With `sample` ({"tokens": N, "seed": S}), the
engine draws N tokens after each prompt as RL samples them, and returns the sequences and the
drawn tokens' logprobs. With `routes`, it also returns which experts the engine's MoE routers
chose for each fed position (`vllm_localise.hook_routes`: vLLM's capture callback, traced into
the compiled graph).

    python -m rla_compile.mismatch.vllm_worker REQUEST.json
"""

from __future__ import annotations

import json
import sys

import torch


def forced_tokens_processor():
    """A vLLM logits processor class that makes each request generate the tokens in its
    `SamplingParams.extra_args["rla_forced"]`: at step n every logit but the n-th token's is
    -inf. vLLM's raw logprobs (the default `logprobs_mode`) are taken before it runs."""
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class ForcedTokens(AdapterLogitsProcessor):
        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params):
            forced = (params.extra_args or {}).get("rla_forced")
            if forced is None:
                return None

            def force(output_ids, logits):
                step = len(output_ids)
                if step >= len(forced):
                    raise RuntimeError(f"ForcedTokens: step {step} of a request forced to {len(forced)} tokens")
                keep = logits[forced[step]].clone()
                logits.fill_(float("-inf"))
                logits[forced[step]] = keep
                return logits

            return force

    return ForcedTokens


def engine(request: dict):
    """The vLLM engine the request describes, and its compilation config (None: rla off)."""
    from vllm import LLM

    config, extra = None, {}
    if request.get("decode_after"):
        extra["logits_processors"] = [forced_tokens_processor()]
    if request["sites"] is not None:
        from ..integrations import vllm as rla_vllm

        extra.update(rla_vllm.engine_kwargs(sites=request["sites"]))
        config = extra["compilation_config"]
    sequences = request["sequences"]
    llm = LLM(model=request["model_dir"], dtype=request["dtype"], max_model_len=max(len(s) for s in sequences) + (request.get("sample") or {}).get("tokens", 0) + 8,
              max_num_seqs=len(sequences), seed=0, skip_tokenizer_init=True, max_logprobs=-1,
              enforce_eager=not request["compiled"], **extra)
    return llm, config


def prompt_logprobs(llm, sequences: list[list[int]]) -> torch.Tensor:
    """Teacher-forced full-vocabulary logprobs of positions 1..T-1: [B, T-1, V] fp32. Sequences
    may differ in length (T the longest): a row's positions past its own end are NaN."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(max_tokens=1, prompt_logprobs=-1, detokenize=False, temperature=1.0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
    logprobs = torch.full((len(sequences), max(len(s) for s in sequences) - 1, vocab), float("nan"))
    for row, out in enumerate(outputs):
        for pos, dist in enumerate(out.prompt_logprobs[1:]):
            ids = torch.tensor(list(dist.keys()))
            logprobs[row, pos, ids] = torch.tensor([lp.logprob for lp in dist.values()], dtype=torch.float32)
    if any(torch.isnan(logprobs[row, :len(s) - 1]).any() for row, s in enumerate(sequences)):
        raise RuntimeError("vLLM returned fewer than the full vocabulary of prompt logprobs")
    return logprobs


def decode_logprobs(llm, sequences: list[list[int]], prompt_tokens: int) -> torch.Tensor:
    """[B, T-1, V] fp32: positions 1..prompt_tokens-1 from prompt scoring, the rest the full
    logprobs vLLM returned for each generated (forced) token, all sequences generated together."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = llm.llm_engine.model_config.get_vocab_size()
    total = len(sequences[0])
    params = [SamplingParams(max_tokens=total - prompt_tokens, min_tokens=total - prompt_tokens, ignore_eos=True,
                             logprobs=-1, prompt_logprobs=-1, detokenize=False, temperature=1.0,
                             extra_args={"rla_forced": s[prompt_tokens:]}) for s in sequences]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=s[:prompt_tokens]) for s in sequences], params, use_tqdm=False)
    logprobs = torch.full((len(sequences), total - 1, vocab), float("nan"))
    for row, (out, sequence) in enumerate(zip(outputs, sequences)):
        generated = out.outputs[0]
        if list(generated.token_ids) != sequence[prompt_tokens:]:
            raise RuntimeError(f"sequence {row}: vLLM generated other tokens than the forced ones "
                               f"({list(generated.token_ids)[:8]}... vs {sequence[prompt_tokens:][:8]}...)")
        steps = [*out.prompt_logprobs[1:], *generated.logprobs]
        for pos, dist in enumerate(steps):
            ids = torch.tensor(list(dist.keys()))
            logprobs[row, pos, ids] = torch.tensor([lp.logprob for lp in dist.values()], dtype=torch.float32)
    if torch.isnan(logprobs).any():
        raise RuntimeError("vLLM returned fewer than the full vocabulary of logprobs while decoding")
    return logprobs


def sample(llm, prompts: list[list[int]], tokens: int, seed: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """What RL samples: each prompt's continuation of `tokens` tokens, drawn at temperature 1
    with `seed` (every prompt in one batch), and the logprob vLLM returned for each drawn
    token (its raw logprobs, as RL trainers receive them): (sequences, [tokens] fp32 each)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, logprobs=0, detokenize=False,
                            temperature=1.0, seed=seed)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    sequences, logprobs = [], []
    for prompt, out in zip(prompts, outputs):
        drawn = list(out.outputs[0].token_ids)
        sequences.append(list(prompt) + drawn)
        logprobs.append(torch.tensor([step[token].logprob for token, step in zip(drawn, out.outputs[0].logprobs)],
                                     dtype=torch.float32))
    return sequences, logprobs


def recorded_routes(record: list, sequences: list[list[int]], prompt_lengths: list[int] | None) -> list[torch.Tensor]:
    """Each sequence's expert ids as the engine's routers chose them, [positions, MoE layers, k]:
    every position of a scored prompt (`prompt_lengths` None), or positions 0..T-2 of a generated
    sequence (the last token is drawn, never fed)."""
    from . import vllm_localise as recorded

    forwards = recorded._forwards(record)
    if prompt_lengths is None:
        lengths = [len(s) for s in sequences]
        placed = recorded.prompt_placements(forwards, sequences)
    else:
        lengths = [len(s) - 1 for s in sequences]
        placed = recorded.decode_placements(forwards, sequences, prompt_lengths)
    ids = recorded.routes(recorded._assemble(forwards, placed, len(sequences), max(lengths), lengths))
    return [ids[b, :n] for b, n in enumerate(lengths)]


def reports(config) -> list[dict]:
    return [r.to_dict() for r in config["inductor_compile_config"]["post_grad_custom_post_pass"].reports] if config else []


def main(request_path: str) -> None:
    request = json.loads(open(request_path).read())
    record: list = []
    if request.get("routes"):
        from . import vllm_localise

        vllm_localise._install(record, hook=vllm_localise.hook_routes)
    llm, config = engine(request)
    record.clear()  # the warm-up's and the compile's runs
    out, sequences, prompt_lengths = {"reports": reports(config)}, request["sequences"], None
    if request.get("sample"):
        prompt_lengths = [len(s) for s in sequences]
        sequences, out["sampled_logprobs"] = sample(llm, sequences, request["sample"]["tokens"], request["sample"]["seed"])
        out["sequences"] = sequences
    elif request.get("decode_after"):
        out["logprobs"] = decode_logprobs(llm, sequences, request["decode_after"])
        prompt_lengths = [request["decode_after"]] * len(sequences)
    else:
        out["logprobs"] = prompt_logprobs(llm, sequences)
    if request.get("routes"):
        out["routes"] = recorded_routes(record, sequences, prompt_lengths)
    torch.save(out, request["out"])


if __name__ == "__main__":
    main(sys.argv[1])
