"""Attention as people write it (issue #35's table), with `sites=["attention"]`: each spelling
aligned against the eager fp32 reference of the contract (`contract_reference.attention`),
outputs and gradients, bf16 and fp16, `aot_eager` and Inductor with rounding pinned; or, where
it is not aligned, a near miss with the reason. A softmax over a product of two tensors is never
passed over in silence (the fuzzer writes these spellings at random too: tests/test_fuzz.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import contract_reference as ref
import rla_compile
from rla_compile.mismatch.metrics import ulp_distance

B, H, L, D = 2, 4, 12, 16
SCALE = 1 / math.sqrt(D)
CAUSAL = torch.ones(L, L, dtype=torch.bool).tril()


def _alibi(dtype):
    slopes = torch.tensor([2.0 ** -(h + 1) for h in range(H)])
    return (slopes[:, None, None] * torch.arange(L)[None, None, :]).expand(H, L, L).repeat(B, 1, 1).to(dtype)


def einsum(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * SCALE
    s = s.masked_fill(~CAUSAL, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bhqk,bhkd->bhqd", p, v)


def baddbmm_alibi(q, k, v):  # heads flattened into the batch, the bias added by baddbmm, the dtype's min as fill
    q3, k3, v3 = (t.reshape(B * H, L, D) for t in (q, k, v))
    s = torch.baddbmm(_alibi(q.dtype), q3, k3.transpose(1, 2), beta=1, alpha=SCALE)
    s = s.masked_fill(~CAUSAL, torch.finfo(s.dtype).min)
    p = torch.softmax(s.float(), -1).to(q.dtype)
    return torch.bmm(p, v3).view(B, H, L, D)


def masked_fill_in_place(q, k, v):  # HF-era code
    s = torch.matmul(q, k.transpose(-1, -2)) * SCALE
    s.masked_fill_(~CAUSAL, torch.finfo(s.dtype).min)
    p = torch.softmax(s.float(), -1).to(q.dtype)
    return p @ v


def bmm_flat(q, k, v):
    q3, k3, v3 = (t.reshape(B * H, L, D) for t in (q, k, v))
    s = torch.bmm(q3, k3.transpose(1, 2)) * SCALE
    p = torch.softmax(s.float(), -1).to(q.dtype)
    return torch.bmm(p, v3).view(B, H, L, D)


def sdpa_bool_mask_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], attn_mask=CAUSAL, enable_gqa=True)


REFERENCES = {
    einsum: lambda q, k, v: ref.attention(q, k, v, causal=True),
    baddbmm_alibi: lambda q, k, v: ref.attention(q, k, v, mask=_alibi(q.dtype).view(B, H, L, L).masked_fill(
        ~CAUSAL, torch.finfo(q.dtype).min)),
    masked_fill_in_place: lambda q, k, v: ref.attention(q, k, v, mask=CAUSAL, fill=torch.finfo(q.dtype).min),
    bmm_flat: lambda q, k, v: ref.attention(q, k, v),
    sdpa_bool_mask_gqa: lambda q, k, v: ref.attention(q, k[:, :2], v[:, :2], mask=CAUSAL, groups=2),
}


def _qkv(dtype):
    torch.manual_seed(0)
    return [(torch.randn(B, H, L, D) * 2).to(dtype).requires_grad_() for _ in range(3)]


def _run(fn, compiler, q, k, v):
    backend = rla_compile.Backend(compiler=compiler, sites=["attention"], pin_rounding=compiler == "inductor")
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend)(q, k, v)
    torch._dynamo.reset()
    return out, backend.reports


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fn", list(REFERENCES), ids=lambda f: f.__name__)
def test_spelling_is_aligned_with_its_gradients(fn, dtype, compiler):
    q, k, v = _qkv(dtype)
    got, reports = _run(fn, compiler, q, k, v)
    (report,) = reports
    assert report.counts() == {"attention": 1} and not report.near_misses, report
    want = REFERENCES[fn](q, k, v)
    assert torch.equal(got, want)
    weights = torch.randn(got.shape)
    grads = torch.autograd.grad((got.float() * weights).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want.float() * weights).sum(), (q, k, v))
    if compiler == "aot_eager":
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))
    else:
        # Inductor's own fp32 sums in the softmax's backward (sum(dP * P)), as for SDPA and bmm
        # (tests/test_sites.py: _MIXED_PINNED_GRADIENTS): the contract fixes where attention rounds,
        # not the order of fp32 sums. Measured on these inputs: at most 3 ulp, on at most 27 of
        # 1536 elements (fp16; bf16: 2 ulp, 3 elements), for every spelling alike.
        for g, w in zip(grads, want_grads):
            differ = g != w
            assert int(differ.sum()) <= g.numel() // 50
            assert not differ.any() or float(ulp_distance(g[differ], w[differ]).max()) <= 3


def attention_sinks(q, k, v):  # GPT-OSS: a learned per-head logit joined to the scores, its column cut off after
    s = torch.matmul(q, k.transpose(-1, -2)) * SCALE
    sinks = torch.linspace(-1, 1, H).to(q.dtype).reshape(1, H, 1, 1).expand(B, H, L, 1)
    c = torch.cat([s, sinks], dim=-1)
    c = c - c.max(dim=-1, keepdim=True).values
    p = F.softmax(c, dim=-1, dtype=c.dtype)
    return p[..., :-1] @ v


def scores_returned(q, k, v):  # the probabilities leave the site (attention weights returned)
    p = torch.softmax(q @ k.transpose(-1, -2) * SCALE, -1, dtype=torch.float32).to(q.dtype)
    return p @ v, p


def probabilities_summed(q, k, v):  # a softmax over q·kᵀ that never meets v
    return torch.softmax(torch.einsum("bhqd,bhkd->bhqk", q, k), -1).sum(-1)


@pytest.mark.parametrize("fn, reason", [
    (attention_sinks, "not multiplied by the values"),
    (scores_returned, "read outside the site"),
    (probabilities_summed, "not multiplied by the values"),
], ids=lambda x: getattr(x, "__name__", ""))
def test_a_softmax_over_a_product_is_never_passed_over_in_silence(fn, reason):
    q, k, v = _qkv(torch.bfloat16)
    _, reports = _run(fn, "aot_eager", q, k, v)
    (report,) = reports
    assert report.counts() == {}
    (miss,) = report.near_misses
    assert miss.kind == "attention" and reason in miss.reason, miss.reason


def test_a_sampling_softmax_is_no_attention():
    """A softmax over a linear layer's output (sampling, a router) is no site and no near miss."""
    head = torch.nn.Linear(D, 32, dtype=torch.bfloat16)

    def sample(h):
        return torch.softmax(head(h).float(), -1)

    backend = rla_compile.Backend(compiler="aot_eager", sites=["attention"])
    torch._dynamo.reset()
    torch.compile(sample, backend=backend)(torch.randn(3, D, dtype=torch.bfloat16))
    torch._dynamo.reset()
    (report,) = backend.reports
    assert report.counts() == {} and not report.near_misses
