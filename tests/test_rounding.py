"""The `rounding` option: a site's one rounding toward zero instead of to nearest (to pair the
trainer with an engine kernel that truncates, e.g. vLLM-CPU's attention without AVX512-BF16).

Checked against the contract reference rounded toward zero (`contract_reference.
round_toward_zero`, written independently of the ops the rewrite emits), outputs and gradients,
on a re-typed site (RMSNorm) and a replaced one (attention)."""

from __future__ import annotations

import functools

import pytest
import torch

import contract_reference as ref
import rla_compile
from rla_compile import OptionError

transformers = pytest.importorskip("transformers")
from rla_compile.tiny import tiny_causal_lm  # noqa: E402
from test_attention import _ids, _training_step, contract_attention  # noqa: E402  (the shared helpers)


@pytest.mark.parametrize("rounding, message", [
    ("toward_zero", "takes a dict of site kind to mode"),
    ({"rmsnorm": "down"}, "unknown mode"),
    ({"attention": "toward_zero"}, "not among the selected sites"),
    ({"rms": "toward_zero"}, "rms"),
])
def test_bad_rounding_is_named(rounding, message):
    with pytest.raises(OptionError, match=message):
        rla_compile.Backend(sites=["rmsnorm"], rounding=rounding)


def _norm(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_retyped_site_rounds_toward_zero(compiler):
    """RMSNorm (re-typed in place): its one rounding drops the low bits; the gradient passes
    through it as through a cast."""
    torch.manual_seed(0)
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    backend = rla_compile.Backend(compiler=compiler, sites=["rmsnorm"], rounding={"rmsnorm": "toward_zero"},
                                  pin_rounding=True)
    torch._dynamo.reset()
    try:
        got = torch.compile(_norm, backend=backend)(x, w)
    finally:
        torch._dynamo.reset()
    got.float().sum().backward()
    got_grads = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None

    xf, wf = x.float(), w.float()
    exact = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * wf
    want = (exact + (ref.round_toward_zero(exact).float() - exact).detach()).to(torch.bfloat16)
    assert torch.equal(got, want)
    assert not torch.equal(got, exact.to(torch.bfloat16))  # to nearest differs: the test can fail
    want.float().sum().backward()
    ref.within_one_ulp(got_grads, (x.grad, w.grad))


def _attention_model():
    model = tiny_causal_lm("qwen3").train()
    model.set_attn_implementation("eager")
    return model


transformers.AttentionInterface.register("rla_contract_toward_zero",
                                        functools.partial(contract_attention, rounding="toward_zero"))


def test_attention_rounds_toward_zero():
    """The replaced attention site, all sites on, in a training step: logits and every
    parameter's gradient equal the model with the default sites and the reference attention
    rounded toward zero, bit for bit (eager kernels)."""
    model = _attention_model()
    runs = {}
    for name, implementation, sites, rounding in (
            ("toward_zero", "eager", [*rla_compile.DEFAULT_SITES, "attention"], {"attention": "toward_zero"}),
            ("reference", "rla_contract_toward_zero", list(rla_compile.DEFAULT_SITES), {}),
            ("nearest", "eager", [*rla_compile.DEFAULT_SITES, "attention"], {})):
        model.set_attn_implementation(implementation)
        torch._dynamo.reset()
        try:
            backend = rla_compile.Backend(compiler="aot_eager", sites=sites, rounding=rounding)
            runs[name] = _training_step(model, torch.compile(model, backend=backend))
        finally:
            torch._dynamo.reset()
    (got, got_grads), (want, want_grads) = runs["toward_zero"], runs["reference"]
    assert torch.equal(got, want)
    assert [n for n in want_grads if not torch.equal(got_grads[n], want_grads[n])] == []
    assert not torch.equal(got, runs["nearest"][0])


def test_attention_toward_zero_under_pinned_inductor():
    """Inductor with rounding pinned computes the same logits as eager kernels do (the bit
    operations are exact; the softmax runs as ATen's kernel)."""
    model = _attention_model().eval()
    logits = []
    for compiler in ("aot_eager", "inductor"):
        backend = rla_compile.Backend(compiler=compiler, sites=[*rla_compile.DEFAULT_SITES, "attention"],
                                      rounding={"attention": "toward_zero"}, pin_rounding=True)
        torch._dynamo.reset()
        try:
            with torch.no_grad():
                logits.append(torch.compile(model, backend=backend)(_ids(), use_cache=False).logits)
        finally:
            torch._dynamo.reset()
    assert torch.equal(*logits)


def test_toward_zero_is_for_bf16_only():
    model = tiny_causal_lm("qwen3", dtype=torch.float16).eval()
    backend = rla_compile.Backend(compiler="aot_eager", sites=["attention"], rounding={"attention": "toward_zero"})
    torch._dynamo.reset()
    try:
        with pytest.raises(Exception, match="toward_zero: bf16 only"):
            torch.compile(model, backend=backend)(_ids(), use_cache=False)
    finally:
        torch._dynamo.reset()
