"""Run in a fresh process by test_vllm.py: start a real vLLM engine (CPU, compiled) on a saved
tiny model, generate twice with logprobs, print what happened as JSON.

    python vllm_probe.py MODEL_DIR stock|rla|rla-nosites [DEBUG_DIR]
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from rla_compile.integrations import vllm as rla_vllm  # noqa: E402

model_dir, mode = sys.argv[1], sys.argv[2]
debug = sys.argv[3] if len(sys.argv) > 3 else False
config = {
    "stock": None,
    "rla": lambda: rla_vllm.compilation_config(debug=debug),
    "rla-nosites": lambda: rla_vllm.compilation_config(sites=[]),
}[mode]
config = config() if config else None
llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=128, max_num_seqs=4, seed=0,
          skip_tokenizer_init=True, max_logprobs=5, compilation_config=config)
params = SamplingParams(max_tokens=8, temperature=1.0, logprobs=1, prompt_logprobs=1, seed=7,
                        ignore_eos=True, detokenize=False)
prompts = [TokensPrompt(prompt_token_ids=list(range(3, 3 + n))) for n in (5, 17)]
runs = []
for _ in range(2):
    outs = llm.generate(prompts, params, use_tqdm=False)
    runs.append([
        {
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
            "prompt_logprobs": [None if d is None else d[t].logprob for d, t in zip(o.prompt_logprobs, o.prompt_token_ids)],
        }
        for o in outs
    ])
reports = config["inductor_compile_config"]["post_grad_custom_post_pass"].reports if config else []
print(json.dumps({"runs": runs, "counts": [r.counts() for r in reports],
                  "statuses": [sorted({s.status for s in r.sites}) for r in reports]}))
