"""Options: align some sites only, run without codegen, pin all rounding, dump debug files,
round a site toward zero or in vLLM-CPU's kernel order.

    python examples/options.py
"""

import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import rla_compile


def block(x, gate, up):
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    return normed, F.silu(gate) * up


torch.manual_seed(0)
args = [torch.randn(2, 8, 64).bfloat16() for _ in range(3)]

# 1. Through torch.compile's own options (no import needed for the backend name).
normed, gated = torch.compile(block, backend="rla", options={"sites": ["swiglu"], "compiler": "aot_eager"})(*args)
# the SwiGLU site follows the contract: fp32 inside, one rounding at the end
assert torch.equal(gated, (F.silu(args[1].float()) * args[2].float()).to(torch.bfloat16))
assert not torch.equal(gated, block(*args)[1])  # eager's bf16 SwiGLU rounds twice: it differs
# the norm was not selected: it is computed as written, bit for bit (eager kernels: aot_eager)
assert torch.equal(normed, block(*args)[0])

# 2. Through a backend object, which keeps the reports.
with tempfile.TemporaryDirectory() as debug_dir:
    backend = rla_compile.Backend(sites=["swiglu", "rmsnorm"], pin_rounding=True, debug=debug_dir)
    torch.compile(block, backend=backend)(*args)
    report = backend.reports[0]
    print(report)
    # the norm is written in fp32 and rounded once already; SwiGLU's bf16 math is rewritten
    assert {s.kind: s.status for s in report.sites} == {"rmsnorm": "already_aligned", "swiglu": "rewritten"}
    index = Path(debug_dir, "index.txt").read_text()
    print(index)
    assert report.graph in index

# 3. A bad option is refused with the valid ones listed, when the backend object is built.
try:
    rla_compile.Backend(sites=["layernorm"])
except rla_compile.OptionError as error:
    print("refused:", error)
    assert "valid: rmsnorm, residual_rmsnorm, swiglu, rope, logits" in str(error)
else:
    raise AssertionError("an unknown site name was accepted")

# 4. Through backend="rla" the options are read at the first call, inside Dynamo, which wraps
#    every backend error in its BackendCompilerFailed; the OptionError is its inner_exception.
try:
    torch.compile(block, backend="rla", options={"sites": ["layernorm"]})(*args)
except torch._dynamo.exc.BackendCompilerFailed as error:
    assert isinstance(error.inner_exception, rla_compile.OptionError)
    print("refused at the first call:", error.inner_exception)
else:
    raise AssertionError("an unknown site name was accepted")

# 5. `rounding`: how a site's one rounding rounds, per site. "nearest" is every cast in torch;
#    "toward_zero" drops the low bits, as vLLM-CPU's attention kernel does on CPUs without
#    AVX512-BF16 (measured: docs/vllm.md#attention). The TRL integration and `rla-compile
#    mismatch` pair a trainer with the vLLM it samples from on their own; by hand:
def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


q, k, v = (torch.randn(1, 2, 16, 32).bfloat16() for _ in range(3))
backend = rla_compile.Backend(sites=["attention"], rounding={"attention": "toward_zero"}, compiler="aot_eager")
out = torch.compile(attend, backend=backend)(q, k, v)
# the contract in fp32 (q x scale first, P never rounded), then the low 16 bits dropped
scores = (q.float() * 32 ** -0.5) @ k.float().transpose(-1, -2)
exact = torch.softmax(scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf")), -1) @ v.float()
assert torch.equal(out, (exact.view(torch.int32) & -65536).view(torch.float32).bfloat16())
assert not torch.equal(out, exact.bfloat16())  # to nearest, about half of the elements are one ulp up
print(backend.reports[0].counts(), "rounding toward zero:", backend.options.rounding)

# 6. An engine-paired form: rounding "vllm_cpu_vec" computes attention in the fp32 order of
#    vLLM-CPU's `vec` kernel (its score chains, blocked online softmax, exp, lane sums), rounded
#    toward zero as it rounds, so the trainer's attention equals the engine's bit for bit
#    (checked against the kernel where vLLM is installed: tests/test_vllm.py). Its gradient is
#    the contract's.
backend = rla_compile.Backend(sites=["attention"], rounding={"attention": "vllm_cpu_vec"}, compiler="aot_eager")
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
paired = torch.compile(attend, backend=backend)(*leaves)
print(backend.reports[0].sites[0].reason)
assert "vec kernel order" in backend.reports[0].sites[0].reason
# the contract up to the kernel's fp32 order: equal here, or one ulp apart on a rare element
assert ((paired.float() - out.float()).abs() <= out.float().abs() * 2 ** -7).all()
weights = torch.randn(paired.shape)
(paired.float() * weights).sum().backward()
contract_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
torch._dynamo.reset()
contract = torch.compile(attend, backend=rla_compile.Backend(sites=["attention"], rounding={"attention": "toward_zero"},
                                                             compiler="aot_eager"))(*contract_leaves)
(contract.float() * weights).sum().backward()
assert all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, contract_leaves))  # the contract's gradient

# 7. The attention site's chunked form (docs/contract.md#chunked): where the fp32 scores would
#    exceed 16 MiB, or under dynamic shapes, the site computes the contract one block of query
#    rows at a time, so the [B, H, L, S] scores and probabilities are never whole in memory and
#    the backward keeps only q, k and v. Option attention_chunk_mib sets a block's budget (in
#    MiB, default 16); here a tiny one, so that 64 tokens make 3 blocks.
def attend_masked(q, k, v, mask):  # dynamic shapes: a mask tensor (is_causal needs static lengths)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


q, k, v = (torch.randn(1, 2, 64, 32).bfloat16() for _ in range(3))
causal = torch.zeros(64, 64).masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), float("-inf")).bfloat16()
torch._dynamo.reset()
backend = rla_compile.Backend(sites=["attention"], compiler="aot_eager", attention_chunk_mib=0.01)
blocked = torch.compile(attend_masked, backend=backend, dynamic=True)(q, k, v, causal)
print(backend.reports[0].sites[0].reason)
assert "blocks of query rows" in backend.reports[0].sites[0].reason
scores = (q.float() * 32 ** -0.5) @ k.float().transpose(-1, -2)
whole = torch.softmax(scores.masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), float("-inf")), -1) @ v.float()
assert torch.equal(blocked, whole.bfloat16())  # the output: the contract's, bit for bit

# 8. On CUDA, paired with vLLM's TRITON_ATTN backend: rounding "vllm_triton" runs vLLM's own
#    Triton attention kernel (imported from the installed vLLM) on the trainer's batch, laid out
#    as vLLM lays out a prefill batch, so the trainer's attention is the engine's, bit for bit
#    (docs/contract.md#vllm-triton, docs/vllm.md#gpu-attention). The rewrite is the same
#    anywhere; the kernel runs where vLLM and a GPU are: elsewhere the op says what is missing.
torch._dynamo.reset()
backend = rla_compile.Backend(sites=["attention"], rounding={"attention": "vllm_triton"}, compiler="aot_eager")
try:
    torch.compile(attend, backend=backend)(*(torch.randn(1, 2, 16, 32).bfloat16() for _ in range(3)))
except Exception as error:  # no vLLM here, or a CPU (Triton has no CPU backend): the kernel cannot run
    print("vllm_triton needs vLLM's kernel on a GPU here:", str(error).splitlines()[0][:120])
print(backend.reports[0].sites[0].reason)
assert "vLLM's Triton unified_attention kernel" in backend.reports[0].sites[0].reason
