"""Align a (tiny, embedded) HF model with the rla backend and read the report.

    python examples/align_hf_model.py
"""

import torch

import rla_compile
from rla_compile.tiny import tiny_causal_lm

model = tiny_causal_lm("qwen3")  # swap in AutoModelForCausalLM.from_pretrained(...) for a real one
backend = rla_compile.Backend()  # or simply torch.compile(model, backend="rla")
compiled = torch.compile(model, backend=backend)

ids = torch.randint(0, model.config.vocab_size, (1, 16))
loss = compiled(ids, labels=ids, use_cache=False).loss  # training mode: the backward is aligned too
loss.backward()

report = backend.reports[0]
assert len(backend.reports) == 1  # one graph: the whole forward (and its backward)
assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
print(report)
print(report.counts())
assert report.count(status="rewritten") == len(report.sites)
# 2 layers: q_norm and k_norm per layer plus the final norm; two residual norms, one MLP and
# RoPE on q and k per layer
assert report.counts() == {"rmsnorm": 5, "rope": 4, "residual_rmsnorm": 4, "swiglu": 2}
