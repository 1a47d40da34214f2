"""What must not be rewritten: graphs without sites, look-alikes, fp32 models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rla_compile
from models import expected_sites, tiny_causal_lm

X = torch.randn(4, 16, 64).bfloat16()
Y = torch.randn(4, 16, 64).bfloat16()
Z = torch.randn(4, 16, 64).bfloat16()


def no_sites(x, w):
    return (x @ w).relu() + 1


def rsqrt_not_a_norm(x):  # rsqrt of something that is not mean(x^2)
    return x * torch.rsqrt(x.abs() + 1)


def rms_over_wrong_dim(x):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(0, keepdim=True) + 1e-6)).to(x.dtype)


def layernorm_by_hand(x):  # mean-centred: a LayerNorm, not an RMSNorm
    xf = x.float()
    c = xf - xf.mean(-1, keepdim=True)
    return (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def cat_not_a_rotation(x):  # negates the wrong half
    h = x.shape[-1] // 2
    return x * 2 + torch.cat((-x[..., :h], x[..., h:]), dim=-1) * 3


def rotation_not_added(x, c, s):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1) * s, x * c


def silu_not_gated(x):
    return F.silu(x) * x


def sigmoid_gate(a, b):  # Qwen3-Next's output gate: a * sigmoid(b) is not SiLU
    return a * torch.sigmoid(b)


NEAR_MISSES = [
    (rsqrt_not_a_norm, (X,), "rmsnorm", "not a mean or sum/D"),
    (rms_over_wrong_dim, (X,), "rmsnorm", "not the last dim"),
    (layernorm_by_hand, (X,), "rmsnorm", "LayerNorm"),
    (cat_not_a_rotation, (X,), "rope", "not a rotation"),
    (rotation_not_added, (X, Y, Z), "rope", "not added to x * cos"),
    (silu_not_gated, (X,), "swiglu", "not gated"),
    (sigmoid_gate, (X, Y), "swiglu", "a gate, not SiLU"),
]


def test_graph_without_sites_is_unchanged():
    w = torch.randn(64, 64).bfloat16()
    result = rla_compile.inspect(no_sites, X, w)
    assert result.report.sites == [] and result.report.near_misses == []
    assert result.after == result.before


@pytest.mark.parametrize("fn,args,kind,reason", NEAR_MISSES, ids=[f.__name__ for f, *_ in NEAR_MISSES])
def test_near_miss_is_reported_not_rewritten(fn, args, kind, reason):
    result = rla_compile.inspect(fn, *args)
    assert result.report.sites == [], str(result.report)
    assert result.after == result.before
    assert [m.kind for m in result.report.near_misses] == [kind], str(result.report)
    assert reason in result.report.near_misses[0].reason


def test_fp32_model_has_nothing_to_align():
    pytest.importorskip("transformers")
    model = tiny_causal_lm("llama", dtype=torch.float32)
    backend = rla_compile.backend(inner="aot_eager")
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randint(0, 128, (1, 8)), use_cache=False)
    (report,) = backend.reports
    assert report.note == "nothing to align: activations are float32"
    assert report.counts() == expected_sites(model.config)
    assert {s.status for s in report.sites} == {"already_aligned"}
    assert "nothing to align" in str(report)
