"""See exactly what the rewrite does to one site: the graph before and after.

    python examples/inspect_a_function.py
"""

import torch

import rla_compile


def llama_rmsnorm(x, w, eps=1e-6):  # HF Llama: rounds x_norm to bf16, then a bf16 weight multiply
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


result = rla_compile.align_function(llama_rmsnorm, torch.randn(2, 8, 64).bfloat16(), torch.ones(64).bfloat16())
print(result.report)
print("\n--- before ---\n" + result.before)
print("\n--- after ---\n" + result.after)
# one RMSNorm found and rewritten: the norm computed in fp32 and rounded once, where HF rounded x_norm
assert [(s.kind, s.status) for s in result.report.sites] == [("rmsnorm", "rewritten")]
assert "round rmsnorm" in result.after and "round rmsnorm" not in result.before
