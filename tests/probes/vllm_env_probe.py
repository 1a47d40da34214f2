"""Run in a fresh process by test_vllm.py: a plain vLLM script with no rla in it (`plain`), or
one that passes rla's `compilation_config` explicitly (`explicit SITES DEBUG_DIR`); rla comes
in through RLA_VLLM / RLA_VLLM_OPTIONS and the `vllm.general_plugins` entry point.

    python vllm_env_probe.py MODEL_DIR plain|explicit [SITES DEBUG_DIR]
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")

from vllm import LLM, SamplingParams  # noqa: E402

model_dir, mode = sys.argv[1], sys.argv[2]
kwargs = {}
if mode == "explicit":
    from rla_compile.integrations import vllm as rla_vllm

    kwargs["compilation_config"] = rla_vllm.compilation_config(sites=sys.argv[3].split(","), debug=sys.argv[4])
llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=64, max_num_seqs=2, seed=0, **kwargs)
out = llm.generate(["import os\n"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
print(json.dumps({"tokens": list(out[0].outputs[0].token_ids)}))
