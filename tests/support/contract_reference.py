"""The rounding contract, written out as plain eager fp32 code (contract.md's table).

Independent of rla_compile: every site is computed in fp32 from its inputs (upcast on entry)
and rounded to the activation dtype once per output. Tests compare compiled, rewritten
graphs against these, bit for bit.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rmsnorm(x, weight=None, eps=1e-6, gemma=False, out_dtype=None):
    """out_dtype: the dtype to round to, when x is already an fp32 value (a residual sum)."""
    xf = x.to(torch.float32)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        wf = weight.to(torch.float32)
        y = y * (1.0 + wf if gemma else wf)
    return y.to(out_dtype or x.dtype)


def residual_rmsnorm(h, r, weight, eps=1e-6):
    s = h.to(torch.float32) + r.to(torch.float32)
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.to(torch.float32)
    return s.to(h.dtype), y.to(h.dtype)


def gated(g, u, act="silu"):
    gf, uf = g.to(torch.float32), u.to(torch.float32)
    if act == "silu":
        a = F.silu(gf)
    elif act == "x_sigmoid":  # SiLU spelled out; same math, its own fp32 formula
        a = gf * torch.sigmoid(gf)
    else:
        a = F.gelu(gf, approximate="tanh" if act == "gelu_tanh" else "none")
    return (a * uf).to(g.dtype)


def rotate(x, style):
    if style == "neox":
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def rope(x, cos, sin, style="neox", rotary_dim=None):
    """cos/sin as given (the reference upcasts them; pass fp32 ones where the contract bypasses)."""
    rotary_dim = rotary_dim or x.shape[-1]
    xr, xp = x[..., :rotary_dim], x[..., rotary_dim:]
    xf = xr.to(torch.float32)
    y = xf * cos.to(torch.float32) + rotate(xf, style) * sin.to(torch.float32)
    return torch.cat((y.to(x.dtype), xp), dim=-1)


def rope_pairs(x, cos, sin, layout="interleaved"):
    """The rotation written per pair: out = cat(x1*cos - x2*sin, x2*cos + x1*sin); x1/x2 the even/odd
    elements (DeepSeek) or the two halves; cos/sin have half of x's last dim."""
    xf = x.to(torch.float32)
    if layout == "interleaved":
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos.to(torch.float32), sin.to(torch.float32)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def logits(h, weight, bias=None, softcap=None):
    """The vocabulary projection from fp32 h and W, left in fp32 (not rounded): what the
    log-softmax after it reads. Gemma-style soft-capping in fp32 too."""
    y = F.linear(h.to(torch.float32), weight.to(torch.float32), None if bias is None else bias.to(torch.float32))
    if softcap is not None:
        y = torch.tanh(y / softcap) * softcap
    return y


def round_toward_zero(x):
    """fp32 -> bf16 with the low 16 bits dropped (rla's rounding mode "toward_zero"): rounded to
    nearest, then one bf16 step back toward zero where that went past |x| (bf16 is
    sign-magnitude: one less on the int16 pattern is one step toward zero, either sign)."""
    x = x.detach().to(torch.float32)
    nearest = x.to(torch.bfloat16)
    past = nearest.to(torch.float32).abs() > x.abs()
    return torch.where(past, (nearest.view(torch.int16) - 1).view(torch.bfloat16), nearest)


def attention(q, k, v, mask=None, scale=None, causal=False, softcap=None, groups=1, fill=-math.inf,
              rounding="nearest"):
    """Attention from fp32 q, k, v, rounded once: q × scale first (1/sqrt(E) by default), scores
    q·kᵀ, soft-cap tanh(s / c) * c, the mask (float: added; bool: True keeps, the rest `fill`;
    `causal`: keys after the query removed), softmax, P · v; grouped k/v heads repeated in fp32;
    a row whose every key is masked is 0.
    `rounding` "toward_zero": the one rounding drops the low bits (bf16 only)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qf = q.to(torch.float32) * scale
    kf, vf = (t.to(torch.float32) for t in (k, v))
    if groups > 1:
        kf, vf = (t.repeat_interleave(groups, dim=1) for t in (kf, vf))
    scores = qf @ kf.transpose(-2, -1)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        rows, cols = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(rows, cols, dtype=torch.bool).triu(1), -math.inf)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, fill)
    elif mask is not None:
        scores = scores + mask.to(torch.float32)
    # a query row every key of which is masked (left padding) attends to nothing: 0, as SDPA
    # computes it (its scores zeroed first, so the backward stays finite)
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
    out = (torch.softmax(scores.masked_fill(dead, 0.0), dim=-1) * ~dead) @ vf
    if rounding == "toward_zero":  # the gradient passes as through a cast
        return (out + (round_toward_zero(out).to(torch.float32) - out).detach()).to(torch.bfloat16)
    return out.to(q.dtype)


def router(h, weight, k, scoring="softmax", renormalize=False, bias=None, topk_of_logits=False, correction=None,
           scale=1.0, groups=None, out_dtype=None):
    """An MoE router from fp32 h and Wg: logits, scores (softmax or sigmoid over the experts), the
    top-k and their weights, all in fp32. `topk_of_logits` (GPT-OSS): the top-k of the logits, a
    softmax over those k. `correction` (DeepSeek-V3): the experts chosen by scores + correction,
    their weights the scores themselves; `groups` (DeepSeek-V3), (groups, groups kept): the experts
    chosen only from the groups whose two best corrected scores sum highest (top-k unsorted, as
    there). `scale`: a factor on the weights. Returns (weights,
    expert ids); the weights rounded to `out_dtype` where the model rounds them, else fp32."""
    logits = F.linear(h.to(torch.float32), weight.to(torch.float32), None if bias is None else bias.to(torch.float32))
    if topk_of_logits:
        values, ids = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(values, dim=-1)
    else:
        scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
        if correction is not None:
            choice = scores + correction.to(torch.float32)
            if groups is not None:
                count, kept = groups
                best = choice.view(len(choice), count, -1).topk(2, dim=-1)[0].sum(dim=-1)
                keep = torch.zeros_like(best, dtype=torch.bool).scatter(1, best.topk(kept, dim=-1, sorted=False)[1], True)
                choice = choice.masked_fill(~keep.repeat_interleave(choice.shape[1] // count, dim=1), 0.0)
            ids = torch.topk(choice, k, dim=-1, sorted=groups is None)[1]
            weights = scores.gather(1, ids)
        else:
            weights, ids = torch.topk(scores, k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * scale
    return (weights if out_dtype is None else weights.to(out_dtype)), ids


def expert_combine(experts, weights):
    """Each token's routing-weighted sum of its k experts' outputs (`experts` [T, k, H], the
    weights [T, k]): the products and the sum in fp32, slot by slot from the first, rounded once."""
    e, w = experts.to(torch.float32), weights.to(torch.float32)
    total = e[:, 0] * w[:, :1]
    for j in range(1, e.shape[1]):
        total = total + e[:, j] * w[:, j : j + 1]
    return total.to(experts.dtype)


def within_one_ulp(got, reference):
    """Inductor with rounding pinned: the contract's rounding locations with Inductor's own
    fp32 math (its reduction order in the backward's sums), which can move a value across a
    rounding boundary: at most 1 ulp, on at most 1% of the elements of each tensor. (The ulp
    distance is rla_compile's measuring tool, not part of the contract written out here.)"""
    from rla_compile.mismatch.metrics import ulp_distance

    for a, b in zip(got, reference, strict=True):
        differ = a != b
        assert int(differ.sum()) <= max(1, a.numel() // 100)
        if differ.any():
            assert float(ulp_distance(a[differ], b[differ]).max()) <= 1
