"""The MoE experts paired with vLLM-CPU's fused MoE kernel (integrations.experts_vllm_cpu), what
runs without vLLM: the C form against its Python reference, the backward against autograd's
gradient of the fp32 form, and what `pair_experts` refuses. Against vLLM's own kernel:
tests/test_vllm.py::test_paired_experts_are_vllms_fused_moe_kernel_bit_for_bit (tox -e vllm)."""

from __future__ import annotations

import pytest
import torch

from rla_compile.integrations import experts_vllm_cpu as paired
from rla_compile.tiny import tiny_causal_lm


def _problem(tokens=11, hidden=32, inter=16, experts=4, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g).mul(hidden ** -0.5).bfloat16()
    w2 = torch.randn(experts, hidden, inter, generator=g).mul(inter ** -0.5).bfloat16()
    probs, ids = torch.randn(tokens, experts, generator=g).softmax(-1).topk(k)
    return x, ids, probs / probs.sum(-1, keepdim=True), w13, w2


@pytest.mark.parametrize("k", [1, 3])
def test_c_form_is_the_python_form_bit_for_bit(k):
    x, ids, weights, w13, w2 = _problem(k=k)
    c = paired.forward_form(x, ids, weights, w13, w2)
    assert torch.equal(c.view(torch.int16), paired.forward_form(x, ids, weights, w13, w2, c=False).view(torch.int16))
    # the kernel's arithmetic computes the experts: the fp32 form's values within bf16 rounding
    torch.testing.assert_close(c.float(), paired.fp32_form(x, ids, weights, w13, w2), rtol=2 ** -7, atol=1e-3)


def test_backward_is_the_gradient_of_the_fp32_form():
    x, ids, weights, w13, w2 = _problem()
    leaves = [t.float().requires_grad_() for t in (x, weights, w13, w2)]
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    expected = torch.autograd.grad(paired.fp32_form(leaves[0], ids, *leaves[1:]), leaves, grad)
    got = paired.fp32_form_backward(grad, *(t.detach() for t in leaves[:1]), ids, *(t.detach() for t in leaves[1:]))
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)  # fp32, summed in another order


def test_the_op_trains_under_torch_compile():
    x, ids, weights, w13, w2 = _problem()
    inputs = [t.clone().requires_grad_() for t in (x, weights, w13, w2)]
    compiled = torch.compile(lambda a, b, c, d: torch.ops.rla.vllm_cpu_experts(a, ids, b, c, d), backend="aot_eager",
                             fullgraph=True)
    out = compiled(*inputs)
    assert torch.equal(out, paired.forward_form(x, ids, weights, w13, w2))
    out.float().sum().backward()
    expected = paired.fp32_form_backward(torch.ones(x.shape), x, ids, weights, w13, w2)
    for leaf, e in zip(inputs, expected, strict=True):
        assert leaf.grad.dtype == leaf.dtype and torch.equal(leaf.grad, e)


def test_pair_experts_refuses_what_it_does_not_compute():
    with pytest.raises(ValueError, match="no experts module"):
        paired.pair_experts(tiny_causal_lm("llama"))
    gpt_oss = tiny_causal_lm("gpt_oss", num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"] * 2)
    with pytest.raises(ValueError, match="has_bias=True"):
        paired.pair_experts(gpt_oss)


def _routed(h, wg, w13, w2, rounded=True):
    """Qwen3-MoE's sparse block with its experts paired: the router as HF writes it (bf16 logits,
    fp32 softmax, renormalised top-2, the weights rounded), then the paired op."""
    probs = torch.nn.functional.linear(h, wg).softmax(-1, dtype=torch.float32)
    top, ids = probs.topk(2)
    top = top / top.sum(-1, keepdim=True)
    return torch.ops.rla.vllm_cpu_experts(h, ids, top.to(h.dtype) if rounded else top, w13, w2)


def _contract(h, wg, w13, w2):
    """The contract's router (fp32 logits from fp32 h and Wg, everything after in fp32), its
    weights never rounded, into the op: what vLLM-CPU's kernel reads with rla's router hook."""
    probs = (h.float() @ wg.float().t()).softmax(-1)
    top, ids = probs.topk(2)
    return torch.ops.rla.vllm_cpu_experts(h, ids, top / top.sum(-1, keepdim=True), w13, w2)


def test_the_combine_site_feeds_the_paired_experts_the_routers_fp32_weights():
    import rla_compile

    x, _, _, w13, w2 = _problem(tokens=13)
    wg = torch.randn(w13.shape[0], x.shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()

    def run(fn, *args, backend=None):
        leaves = [t.clone().requires_grad_() for t in (x, wg, w13, w2)]
        out = (torch.compile(fn, backend=backend, fullgraph=True) if backend else fn)(*leaves, *args)
        out.float().pow(2).sum().backward()
        return [out.detach()] + [leaf.grad for leaf in leaves]

    torch._dynamo.reset()
    backend = rla_compile.Backend(compiler="aot_eager", sites=["router", "expert_combine"])
    got, expected = run(_routed, backend=backend), run(_contract)
    (report,) = backend.reports
    combine = [s for s in report.sites if s.kind == "expert_combine"]
    assert [(s.status, s.variant) for s in combine] == [("rewritten", "paired with vLLM-CPU's fused MoE kernel, "
                                                                      "weights read in fp32")], str(report)
    assert [int((a != b).sum()) for a, b in zip(got, expected, strict=True)] == [0] * 5
    # the router alone leaves the weights rounded: the op computes another sum
    torch._dynamo.reset()
    router_only = run(_routed, backend=rla_compile.Backend(compiler="aot_eager", sites=["router"]))
    assert not torch.equal(router_only[0], expected[0])
