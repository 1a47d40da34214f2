"""Align a mixture-of-experts model's router and expert combine (opt-in sites) on the trainer.

    python examples/align_moe.py

A tiny Qwen3-MoE built from its config (8 experts, top-2, random weights; no download), as HF
runs it under torch.compile (its `grouped_mm` experts). The router's logits, softmax, top-k
and renormalised weights are computed in fp32, and each token's weighted sum of its experts in
fp32, rounded once (docs/contract.md#mixture-of-experts-opt-in).

Then the experts paired with vLLM-CPU's fused MoE kernel (`integrations.experts_vllm_cpu`): the
trainer's forward computes the kernel's expert GEMMs, gated SiLU and weighted sum in its own
order, its backward the gradient of the fp32 form; one training step runs through it.
"""

import torch

import rla_compile
from rla_compile.tiny import tiny_causal_lm

model = tiny_causal_lm("qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)  # bf16, from its config
backend = rla_compile.Backend(compiler="aot_eager", sites=[*rla_compile.DEFAULT_SITES, "router", "expert_combine"])
ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    aligned = torch.compile(model, backend=backend)(ids).logits
    stock = model(ids).logits

(report,) = backend.reports
print(report)
moe = [(s.kind, s.status, s.variant) for s in report.sites if s.kind in ("router", "expert_combine")]
layers = model.config.num_hidden_layers
assert moe == [("router", "rewritten", "softmax, renormalised"),
               ("expert_combine", "rewritten", "grouped (sorted by expert), sum over k")] * layers, moe
print(f"logits moved by the alignment: max |Δ| = {(aligned.float() - stock.float()).abs().max():.4f}")

# the experts paired with vLLM-CPU's fused MoE kernel, trained one step under torch.compile
from rla_compile.integrations import experts_vllm_cpu  # noqa: E402

assert experts_vllm_cpu.pair_experts(model) == layers
torch._dynamo.reset()
backend = rla_compile.Backend(compiler="aot_eager", sites=[*rla_compile.DEFAULT_SITES, "router", "expert_combine"])
loss = torch.compile(model, backend=backend)(ids, labels=ids).loss
loss.backward()
experts_grad = model.model.layers[0].mlp.experts.gate_up_proj.grad
assert experts_grad is not None and experts_grad.abs().sum() > 0  # the paired form's backward reached the weights
routers = sum(r.count("router", "rewritten") for r in backend.reports)
assert routers == layers, routers
# the combine is the kernel's; the site hands it the router's weights unrounded, as vLLM's router does
paired = [s.variant for r in backend.reports for s in r.sites if s.kind == "expert_combine" and s.status == "rewritten"]
assert paired == ["paired with vLLM-CPU's fused MoE kernel, weights read in fp32"] * layers, paired
print(f"paired experts: one training step, loss {loss.item():.4f}; {routers} routers aligned in fp32, "
      f"their weights read unrounded by the paired experts")
