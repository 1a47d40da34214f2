"""Site spellings as users write them, each with its contract reference and expectation.

Every case is a small function over bf16/fp16 tensors containing exactly one kind of site
(RoPE cases: one site per rotated tensor). `reference` computes the contract with
`contract_reference`, independently of rla_compile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import contract_reference as ref

EPS = 1e-6
D = 64  # hidden size
T = 16  # tokens


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    fn: Callable
    make_inputs: Callable[[torch.dtype], tuple]
    reference: Callable
    status: str = "rewritten"
    count: int = 1
    grads: tuple[int, ...] = ()  # indices of inputs that require grad

    def inputs(self, dtype: torch.dtype) -> tuple:
        torch.manual_seed(0)
        args = self.make_inputs(dtype)
        return tuple(a.detach().requires_grad_(i in self.grads) if a.is_floating_point() else a for i, a in enumerate(args))


def _x_w(dtype):
    return (torch.randn(2, T, D) * 3).to(dtype), (1 + 0.2 * torch.randn(D)).to(dtype)


def _gemma_w(dtype):
    return (torch.randn(2, T, D) * 3).to(dtype), (0.2 * torch.randn(D)).to(dtype)


# -- RMSNorm --------------------------------------------------------------------------------
def norm_llama(x, w):  # HF Llama: rounds x_norm, then a bf16 weight multiply
    xf = x.to(torch.float32)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return w * y.to(x.dtype)


def norm_spelled(x, w):  # square, sum / D, 1 / sqrt, weight on the right, .float(), positive dim
    xf = x.float()
    inv = 1 / torch.sqrt(xf.square().sum(dim=2, keepdim=True) / D + EPS)
    return (inv * xf).type_as(x) * w


def norm_pow(x, w):  # x * x, pow(-0.5), type_as
    xf = x.to(torch.float32)
    y = xf * (xf * xf).mean(-1, keepdim=True).add(EPS).pow(-0.5)
    return y.type_as(x) * w


def norm_div(x, w):  # x / sqrt(...)
    xf = x.float()
    return w * (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def norm_bf16(x, w):  # no upcast at all: every op rounds
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def norm_gemma_aligned(x, w):  # HF Gemma: fp32 through (1 + w), one rounding
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (y * (1.0 + w.float())).type_as(x)


def norm_gemma_rounding(x, w):  # (1 + w) form rounding x_norm first
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return y.to(x.dtype) * (1 + w)


def norm_weightless(x):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def norm_weightless_bf16(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def residual_norm_hf(h, r, w):  # HF decoder layer: bf16 add, norm of the rounded sum
    s = r + h
    sf = s.to(torch.float32)
    y = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + EPS)
    return s, w * y.to(h.dtype)


# -- SwiGLU / GeGLU -------------------------------------------------------------------------
def _g_u(dtype):
    return (torch.randn(2, T, 2 * D) * 2).to(dtype), (torch.randn(2, T, 2 * D) * 2).to(dtype)


def _gu(dtype):
    return ((torch.randn(2, T, 4 * D) * 2).to(dtype),)


def glu_silu(g, u):
    return F.silu(g) * u


_silu_module = torch.nn.SiLU()


def glu_module_commuted(g, u):
    return u * _silu_module(g)


def glu_sigmoid(g, u):
    return g * torch.sigmoid(g) * u


def glu_fused_chunk(gu):  # fused gate_up, gate first
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def glu_fused_split_up_first(gu):  # fused gate_up, up first (Phi3 spells up * act(gate))
    u, g = gu.split(2 * D, dim=-1)
    return u * F.silu(g)


def glu_gelu_tanh(g, u):  # Gemma's GeGLU
    return F.gelu(g, approximate="tanh") * u


# -- RoPE -----------------------------------------------------------------------------------
HEADS, HEAD_DIM = 4, 32


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_neox_chunk(q, cos, sin):  # ESM's rotate_half: the halves from chunk
    q1, q2 = q.chunk(2, dim=-1)
    return q * cos + torch.cat((-q2, q1), dim=-1) * sin


def _cos_sin(dtype, dim=HEAD_DIM):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.arange(T).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _q_cos_sin(dtype):
    q = torch.randn(2, HEADS, T, HEAD_DIM).to(dtype)
    return (q, *_cos_sin(dtype))


def rope_neox(q, cos, sin):
    return q * cos + _rotate_half(q) * sin


def rope_neox_commuted(q, cos, sin):
    return sin * _rotate_half(q) + cos * q


def _interleaved_cos_sin(dtype):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = torch.arange(T).float()[:, None] * inv_freq[None, :]
    emb = freqs.repeat_interleave(2, dim=-1)
    q = torch.randn(2, HEADS, T, HEAD_DIM).to(dtype)
    return q, emb.cos().to(dtype), emb.sin().to(dtype)


def rope_gptj(q, cos, sin):
    x1, x2 = q[..., ::2], q[..., 1::2]
    return q * cos + torch.stack((-x2, x1), dim=-1).flatten(-2) * sin


ROT = HEAD_DIM // 2


def _partial(dtype):
    q = torch.randn(2, HEADS, T, HEAD_DIM).to(dtype)
    return (q, *_cos_sin(dtype, ROT))


def rope_partial(q, cos, sin):
    q_rot, q_pass = q[..., :ROT], q[..., ROT:]
    return torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q_pass), dim=-1)


def _q_k_positions(dtype):
    q = torch.randn(2, HEADS, T, HEAD_DIM).to(dtype)
    k = torch.randn(2, HEADS, T, HEAD_DIM).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    return q, k, inv_freq, torch.arange(T)


def rope_hf(q, k, inv_freq, positions):
    """HF's rotary: cos/sin computed in fp32, rounded to the activation dtype, used by q and k."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rope_hf_reference(q, k, inv_freq, positions):
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return ref.rope(q, emb.cos(), emb.sin()), ref.rope(k, emb.cos(), emb.sin())


def rope_hf_upcast_inside(q, k, inv_freq, positions):
    """The tables rounded from fp32 outside, the sites upcasting them (one shared upcast) and
    q/k inside: the sites read the fp32 tables (found by the fuzzer: was left rounded)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    cos, sin = cos.float(), sin.float()
    qf, kf = q.float(), k.float()
    return (qf * cos + _rotate_half(qf) * sin).to(q.dtype), (kf * cos + _rotate_half(kf) * sin).to(k.dtype)


def _q_half_cos_sin(dtype):
    q = torch.randn(2, HEADS, T, HEAD_DIM).to(dtype)
    cos, sin = _cos_sin(dtype)
    return q, cos[..., : HEAD_DIM // 2], sin[..., : HEAD_DIM // 2]


def rope_deepseek(q, cos, sin):  # HF DeepSeek-V3 apply_rotary_pos_emb_interleave: all bf16
    q1, q2 = q[..., 0::2], q[..., 1::2]
    return torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)


def rope_halves(q, cos, sin):  # GPT-OSS style: halves, no rotate_half
    q1, q2 = torch.chunk(q, 2, dim=-1)
    return torch.cat((q1 * cos - q2 * sin, q2 * cos + q1 * sin), dim=-1)


def norm_functional(x, w):  # F.rms_norm: one fp32 computation, one rounding
    return F.rms_norm(x, (D,), w, EPS)


def residual_norm_module(h, r, w):  # torchtitan: h = x + attn; ffn_norm(h) with nn.RMSNorm's math
    s = h + r
    return s, F.rms_norm(s, (D,), w, EPS)


def norm_torchtune(x, w):  # torchtune: F.rms_norm(x.float(), bf16 scale): eps added in place
    return F.rms_norm(x.float(), (D,), w, EPS).to(x.dtype)


def norm_olmo_core(x, w):  # OLMo-core RMSNorm: weight.type_as(x) * x in fp32, one rounding
    og = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return (w.type_as(x) * x).to(og)


def norm_olmo_core_qwen(x, w):  # OLMo-core QwenRMSNorm: rounds before the weight, type_as
    og = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    x = x.to(og)
    return x * w.type_as(x)


def rope_neox_unbind(q, cos, sin):  # OLMo-core: halves via view(..., 2, h/2).unbind(-2)
    B, nh, t, hs = q.size()
    q1, q2 = q.view(B, nh, t, 2, hs // 2).unbind(dim=-2)
    return ((q * cos) + (torch.cat((-q2, q1), dim=-1) * sin)).to(q.dtype)


def rope_neox_select(q, cos, sin):  # the same halves picked with select
    B, nh, t, hs = q.size()
    halves = q.view(B, nh, t, 2, hs // 2)
    return q * cos + torch.cat((-halves[..., 1, :], halves[..., 0, :]), dim=-1) * sin


def residual_norm_post_norm(h, r, w, m1, m2):  # OLMo2's post-norm block: h feeds its MLP, then the add
    u1, u2 = F.linear(h, m1), F.linear(h, m2)
    return u1, u2, norm_olmo_core(h + r, w)


def residual_norm_post_norm_reference(h, r, w, m1, m2):
    u1, u2 = F.linear(h, m1), F.linear(h, m2)
    return u1, u2, ref.residual_rmsnorm(h, r, w, eps=EPS)[1]


# Not in CASES: h's gradient sums three bf16 contributions outside the site, which Inductor
# (unpinned) adds in fp32; tests/test_sites.py checks it on eager kernels.
POST_NORM = Case("residual_norm_post_norm", "residual_rmsnorm", residual_norm_post_norm,
                 lambda d: _post_norm(d), residual_norm_post_norm_reference, grads=(0, 1, 2, 3, 4))


def _post_norm(dtype):
    x, w = _x_w(dtype)
    return x, (torch.randn(2, T, D) * 3).to(dtype), w, *(0.2 * torch.randn(2, D, D)).to(dtype).unbind(0)


def residual_norm_gemma(h, r, w):  # Gemma's decoder layer: bf16 add, (1 + w) norm of the rounded sum
    s = h + r
    sf = s.float()
    return s, (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + w.float())).to(h.dtype)


def residual_norm_gemma_reference(h, r, w):
    s = h.float() + r.float()
    return s.to(h.dtype), ref.rmsnorm(s, w, EPS, gemma=True, out_dtype=h.dtype)


def _complex(x, freqs):  # torchtitan / Meta Llama: a complex multiply, complex64 inside
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs).flatten(-2).type_as(x)


def _q_freqs(dtype):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = torch.arange(T).float()[:, None] * inv_freq[None, :]
    return torch.randn(2, HEADS, T, HEAD_DIM).to(dtype), torch.polar(torch.ones_like(freqs), freqs)


def rope_complex_reference(q, freqs):  # the contract for a complex rotation: its fp32 formula, one rounding
    return rope_rotated_pairs_reference(q, freqs.real, freqs.imag)


def rope_gpt_fast(q, cos, sin):  # gpt-fast / torchtune Llama 3: pairs of columns, fp32, bf16 cache
    xs = q.float().reshape(*q.shape[:-1], -1, 2)
    c, s = cos.float(), sin.float()
    out = torch.stack([xs[..., 0] * c - xs[..., 1] * s, xs[..., 1] * c + xs[..., 0] * s], -1)
    return out.flatten(-2).type_as(q)


def rope_gpt_fast_reference(q, cos, sin):
    return ref.rope_pairs(q, cos, sin, layout="interleaved").reshape(*q.shape[:-1], 2, -1).transpose(-1, -2).flatten(-2)


# -- logits ------------------------------------------------------------------------------------
V = 96  # vocabulary


def _h_w(dtype):
    return (torch.randn(2, T, D) * 2).to(dtype), (0.3 * torch.randn(V, D)).to(dtype)


def head_logprobs(h, w):  # HF: bf16 logits, upcast for the loss; returned rounded to compare dtypes
    return torch.log_softmax(F.linear(h, w).float(), -1).to(h.dtype)


def head_logprobs_reference(h, w):
    return torch.log_softmax(ref.logits(h, w), -1).to(h.dtype)


def head_softcapped(h, w):  # Gemma 2: tanh soft-capping in bf16 before the upcast
    return torch.log_softmax((torch.tanh(F.linear(h, w) / 30.0) * 30.0).float(), -1).to(h.dtype)


def head_softcapped_reference(h, w):
    return torch.log_softmax(ref.logits(h, w, softcap=30.0), -1).to(h.dtype)


def head_gathered(h, w, tokens):  # an RL trainer's logprob of the sampled token
    logp = F.linear(h, w).float().log_softmax(-1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1).to(h.dtype)


def head_gathered_reference(h, w, tokens):
    return ref.logits(h, w).log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1).to(h.dtype)


class _Projection(torch.nn.Module):
    def forward(self, h, w):
        return F.linear(h, w)


class NamedHead(torch.nn.Module):
    """A head known by its name only (litgpt, torchtitan: the loss runs outside the graph);
    its logits leave the graph in fp32. `softcap`: Gemma 2's tanh soft-capping after it."""

    def __init__(self, softcap=None):
        super().__init__()
        self.lm_head, self.softcap = _Projection(), softcap

    def forward(self, h, w):
        y = self.lm_head(h, w)
        return y if self.softcap is None else torch.tanh(y / self.softcap) * self.softcap


def head_upcast(h, w):  # the logits upcast, then used without a log-softmax in the graph
    return F.linear(h, w).float() * 1.0


def _h_w_tokens(dtype):
    return (*_h_w(dtype), torch.randint(0, V, (2, T)))


CASES = [
    Case("norm_llama", "rmsnorm", norm_llama, _x_w, ref.rmsnorm, grads=(0, 1)),
    Case("norm_spelled", "rmsnorm", norm_spelled, _x_w, ref.rmsnorm, grads=(0, 1)),
    Case("norm_pow", "rmsnorm", norm_pow, _x_w, ref.rmsnorm, grads=(0, 1)),
    Case("norm_div", "rmsnorm", norm_div, _x_w, ref.rmsnorm, grads=(0, 1)),
    Case("norm_bf16", "rmsnorm", norm_bf16, _x_w, ref.rmsnorm, grads=(0, 1)),
    Case("norm_gemma_rounding", "rmsnorm", norm_gemma_rounding, _gemma_w,
         lambda x, w: ref.rmsnorm(x, w, gemma=True), grads=(0, 1)),
    Case("norm_gemma_aligned", "rmsnorm", norm_gemma_aligned, _gemma_w,
         lambda x, w: ref.rmsnorm(x, w, gemma=True), status="already_aligned", grads=(0, 1)),
    Case("norm_weightless", "rmsnorm", norm_weightless, lambda d: _x_w(d)[:1], ref.rmsnorm,
         status="already_aligned", grads=(0,)),
    Case("norm_weightless_bf16", "rmsnorm", norm_weightless_bf16, lambda d: _x_w(d)[:1], ref.rmsnorm, grads=(0,)),
    Case("residual_norm_hf", "residual_rmsnorm", residual_norm_hf,
         lambda d: (*_x_w(d)[:1], (torch.randn(2, T, D) * 3).to(d), _x_w(d)[1]),
         ref.residual_rmsnorm, grads=(0, 1, 2)),
    Case("glu_silu", "swiglu", glu_silu, _g_u, ref.gated, grads=(0, 1)),
    Case("glu_module_commuted", "swiglu", glu_module_commuted, _g_u, ref.gated, grads=(0, 1)),
    # The rewrite moves roundings only; it keeps the fp32 formula as written (x * sigmoid(x)).
    Case("glu_sigmoid", "swiglu", glu_sigmoid, _g_u, lambda g, u: ref.gated(g, u, "x_sigmoid"), grads=(0, 1)),
    Case("glu_fused_chunk", "swiglu", glu_fused_chunk, _gu,
         lambda gu: ref.gated(*gu.chunk(2, dim=-1)), grads=(0,)),
    Case("glu_fused_split_up_first", "swiglu", glu_fused_split_up_first, _gu,
         lambda gu: ref.gated(*reversed(gu.split(2 * D, dim=-1))), grads=(0,)),
    Case("glu_gelu_tanh", "swiglu", glu_gelu_tanh, _g_u, lambda g, u: ref.gated(g, u, "gelu_tanh"), grads=(0, 1)),
    Case("rope_neox", "rope", rope_neox, _q_cos_sin, ref.rope, grads=(0, 1, 2)),
    Case("rope_neox_commuted", "rope", rope_neox_commuted, _q_cos_sin, ref.rope, grads=(0, 1, 2)),
    Case("rope_neox_chunk", "rope", rope_neox_chunk, _q_cos_sin, ref.rope, grads=(0, 1, 2)),
    Case("rope_gptj", "rope", rope_gptj, _interleaved_cos_sin,
         lambda q, c, s: ref.rope(q, c, s, style="gptj"), grads=(0, 1, 2)),
    Case("rope_partial", "rope", rope_partial, _partial,
         lambda q, c, s: ref.rope(q, c, s, rotary_dim=ROT), grads=(0, 1, 2)),
    Case("norm_functional", "rmsnorm", norm_functional, _x_w, ref.rmsnorm, status="already_aligned", grads=(0, 1)),
    Case("residual_norm_functional", "residual_rmsnorm", residual_norm_module,
         lambda d: (*_x_w(d)[:1], (torch.randn(2, T, D) * 3).to(d), _x_w(d)[1]),
         ref.residual_rmsnorm, grads=(0, 1, 2)),
    Case("rope_deepseek_pairs", "rope", rope_deepseek, _q_half_cos_sin, ref.rope_pairs, grads=(0, 1, 2)),
    Case("rope_halves", "rope", rope_halves, _q_half_cos_sin,
         lambda q, c, s: ref.rope_pairs(q, c, s, layout="halves"), grads=(0, 1, 2)),
    Case("rope_hf_fp32_cos_sin", "rope", rope_hf, _q_k_positions, rope_hf_reference, count=2, grads=(0, 1)),
    Case("rope_hf_upcast_inside", "rope", rope_hf_upcast_inside, _q_k_positions, rope_hf_reference, count=2,
         grads=(0, 1)),
    Case("norm_torchtune", "rmsnorm", norm_torchtune, _x_w, ref.rmsnorm, status="already_aligned", grads=(0, 1)),
    Case("norm_olmo_core", "rmsnorm", norm_olmo_core, _x_w, ref.rmsnorm, status="already_aligned", grads=(0, 1)),
    Case("norm_olmo_core_qwen", "rmsnorm", norm_olmo_core_qwen, _x_w, ref.rmsnorm, grads=(0, 1)),
    Case("rope_neox_unbind", "rope", rope_neox_unbind, _q_cos_sin, ref.rope, grads=(0, 1, 2)),
    Case("rope_neox_select", "rope", rope_neox_select, _q_cos_sin, ref.rope, grads=(0, 1, 2)),
    Case("residual_norm_gemma", "residual_rmsnorm", residual_norm_gemma,
         lambda d: (*_gemma_w(d)[:1], (torch.randn(2, T, D) * 3).to(d), _gemma_w(d)[1]),
         residual_norm_gemma_reference, grads=(0, 1, 2)),
    Case("rope_complex", "rope", _complex, _q_freqs, rope_complex_reference, status="already_aligned", grads=(0,)),
    Case("rope_gpt_fast", "rope", rope_gpt_fast, _q_half_cos_sin, rope_gpt_fast_reference,
         status="already_aligned", grads=(0, 1, 2)),
    Case("head_named", "logits", NamedHead(), _h_w, ref.logits, grads=(0, 1)),
    Case("head_named_softcapped", "logits", NamedHead(softcap=30.0), _h_w,
         lambda h, w: ref.logits(h, w, softcap=30.0), grads=(0, 1)),
    Case("head_upcast", "logits", head_upcast, _h_w, ref.logits, grads=(0, 1)),
    Case("head_logprobs", "logits", head_logprobs, _h_w, head_logprobs_reference, grads=(0, 1)),
    Case("head_softcapped", "logits", head_softcapped, _h_w, head_softcapped_reference, grads=(0, 1)),
    Case("head_gathered", "logits", head_gathered, _h_w_tokens, head_gathered_reference, grads=(0, 1)),
]


def rope_matrix(q, cos, sin):  # consecutive pairs times 2x2 rotation matrices, rounded bf16 products
    rotation = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)  # [T, d/2, 2, 2]
    pairs = q.view(*q.shape[:-1], -1, 1, 2)
    return (pairs * rotation.to(q.dtype)).sum(-1).flatten(-2)


def rope_matrix_reference(q, cos, sin):
    """The site reads q and the model's bf16 matrix R (built outside it, where cos's two entries'
    gradients add up in bf16): y = R @ pair per pair, in fp32, rounded once."""
    r = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2).to(q.dtype).float()
    x1, x2 = q.float()[..., 0::2], q.float()[..., 1::2]
    y1 = x1 * r[..., 0, 0] + x2 * r[..., 0, 1]
    y2 = x1 * r[..., 1, 0] + x2 * r[..., 1, 1]
    return torch.stack((y1, y2), dim=-1).flatten(-2).to(q.dtype)


def rope_matrix_fp32_table(q, inv_freq, positions):  # the table built in fp32 from positions, cast once
    angles = positions[:, None].float() * inv_freq[None, :]
    return rope_matrix(q, angles.cos(), angles.sin())


def rope_matrix_fp32_table_reference(q, inv_freq, positions):
    angles = positions[:, None].float() * inv_freq[None, :]
    return rope_rotated_pairs_reference(q, angles.cos(), angles.sin())


def rope_rotated_pairs_reference(q, cos, sin):  # the contract for consecutive pairs, rotated in place
    x1, x2 = q.float()[..., 0::2], q.float()[..., 1::2]
    c, s = cos.float(), sin.float()
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).to(q.dtype)


def _q_inv_freq_positions(dtype):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    return torch.randn(2, HEADS, T, HEAD_DIM).to(dtype), inv_freq, torch.arange(T)


CASES += [
    # q's gradient only: cos and sin each enter R twice, and their two gradients add up outside
    # the site, in bf16 on eager kernels and in fp32 where unpinned Inductor fuses the sum
    # (POST_NORM's case); on eager kernels they match the reference too (test_sites.py).
    Case("rope_matrix", "rope", rope_matrix, _q_half_cos_sin, rope_matrix_reference, grads=(0,)),
    Case("rope_matrix_fp32_table", "rope", rope_matrix_fp32_table, _q_inv_freq_positions,
         rope_matrix_fp32_table_reference, grads=(0,)),
]


# -- attention (opt-in) ---------------------------------------------------------------------------
KV_HEADS = 2
SCALE = HEAD_DIM**-0.5  # not a power of two: where it is applied changes the bits


def _causal_keep():
    return torch.ones(T, T, dtype=torch.bool).tril()


def _q_k_v(dtype, kv_heads=HEADS):
    return (torch.randn(2, HEADS, T, HEAD_DIM).to(dtype), torch.randn(2, kv_heads, T, HEAD_DIM).to(dtype),
            torch.randn(2, kv_heads, T, HEAD_DIM).to(dtype))


def _q_k_v_mask(dtype, kv_heads=HEADS):  # HF's additive causal mask: 0 or the dtype's min
    mask = torch.zeros(T, T).masked_fill(~_causal_keep(), torch.finfo(dtype).min).to(dtype)
    return (*_q_k_v(dtype, kv_heads), mask[None, None].expand(2, 1, T, T).contiguous())


def _q_k_v_bool(dtype):
    keep = _causal_keep() | (torch.rand(T, T) < 0.3)  # causal plus a few extra keys: every row keeps one
    return (*_q_k_v(dtype), keep[None, None].expand(2, 1, T, T).contiguous())


def _repeat_kv(x, groups):  # HF's repeat_kv
    b, h, s, e = x.shape
    return x[:, :, None, :, :].expand(b, h, groups, s, e).reshape(b, h * groups, s, e)


def attn_eager(q, k, v, mask, softcap=None):  # HF eager_attention_forward
    k, v = _repeat_kv(k, q.shape[1] // k.shape[1]), _repeat_kv(v, q.shape[1] // v.shape[1])
    scores = torch.matmul(q, k.transpose(2, 3)) * SCALE
    if softcap is not None:  # Gemma 2
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    p = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    p = F.dropout(p, p=0.0, training=False)
    return torch.matmul(p, v)


def attn_softcapped(q, k, v, mask):
    return attn_eager(q, k, v, mask, softcap=50.0)


def attn_where(q, k, v, keep):  # a boolean mask applied with where, the dtype's min as the fill
    scores = (q @ k.transpose(-2, -1)) / HEAD_DIM**0.5
    scores = torch.where(keep, scores, torch.finfo(q.dtype).min)
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def attn_masked_fill(q, k, v, keep):
    scores = (q @ k.transpose(-2, -1)) * SCALE
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def attn_mT(q, k, v):  # the key transposed with .mT (litgpt)
    return torch.softmax((q @ k.mT) * SCALE, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def attn_q_scaled(q, k, v):  # q scaled before q·kᵀ, softmax in the activation dtype
    return torch.softmax((q * SCALE) @ k.transpose(-2, -1), dim=-1) @ v


def attn_sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attn_sdpa_causal_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.1)


def attn_flash_cpu(q, k, v):  # the ATen op SDPA lowers to on CPU, called directly
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]


def attn_math(q, k, v, mask):  # SDPA's math path
    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask)[0]


def attn_sdpa_merged_heads(q, k, v):  # torchtune's: a view that relies on SDPA's output layout, [B, T, H, D]
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))  # heads from a [B, T, H * D] projection
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).contiguous().view(q.shape[0], q.shape[2], -1)


def attn_sdpa_merged_heads_reference(q, k, v):
    return ref.attention(q, k, v, causal=True).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def attn_rounded_inputs(q, k, v):  # q and k computed in fp32 and rounded before it (OLMo's, Cohere's RoPE)
    q, k = (q.float() * 1.5).to(q.dtype), (k.float() * 1.5).to(k.dtype)
    return torch.softmax(torch.matmul(q, k.transpose(2, 3)) * SCALE, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def attn_rounded_inputs_reference(q, k, v):  # the site reads the rounded q and k: that rounding is not its own
    return ref.attention((q.float() * 1.5).to(q.dtype), (k.float() * 1.5).to(k.dtype), v)


_QKV = (0, 1, 2)
CASES += [
    Case("attn_eager", "attention", attn_eager, _q_k_v_mask, ref.attention, grads=_QKV),
    Case("attn_eager_grouped", "attention", attn_eager, lambda d: _q_k_v_mask(d, KV_HEADS),
         lambda q, k, v, m: ref.attention(q, k, v, m, groups=HEADS // KV_HEADS), grads=_QKV),
    Case("attn_softcapped", "attention", attn_softcapped, _q_k_v_mask,
         lambda q, k, v, m: ref.attention(q, k, v, m, softcap=50.0), grads=_QKV),
    Case("attn_softcapped_grouped", "attention", attn_softcapped, lambda d: _q_k_v_mask(d, KV_HEADS),  # Gemma 2
         lambda q, k, v, m: ref.attention(q, k, v, m, softcap=50.0, groups=HEADS // KV_HEADS), grads=_QKV),
    Case("attn_where", "attention", attn_where, _q_k_v_bool,
         lambda q, k, v, m: ref.attention(q, k, v, m, fill=torch.finfo(q.dtype).min), grads=_QKV),
    Case("attn_masked_fill", "attention", attn_masked_fill, _q_k_v_bool, ref.attention, grads=_QKV),
    Case("attn_q_scaled", "attention", attn_q_scaled, _q_k_v, ref.attention, grads=_QKV),
    Case("attn_mT", "attention", attn_mT, _q_k_v, ref.attention, grads=_QKV),
    Case("attn_sdpa", "attention", attn_sdpa, _q_k_v_mask, ref.attention, grads=_QKV),
    Case("attn_sdpa_bool", "attention", attn_sdpa, _q_k_v_bool, ref.attention, grads=_QKV),
    Case("attn_sdpa_causal_gqa", "attention", attn_sdpa_causal_gqa, lambda d: _q_k_v(d, KV_HEADS),
         lambda q, k, v: ref.attention(q, k, v, scale=0.1, causal=True, groups=HEADS // KV_HEADS), grads=_QKV),
    Case("attn_flash_cpu", "attention", attn_flash_cpu, _q_k_v, lambda q, k, v: ref.attention(q, k, v, causal=True),
         grads=_QKV),
    Case("attn_math", "attention", attn_math, _q_k_v_mask, ref.attention, grads=_QKV),
    Case("attn_sdpa_merged_heads", "attention", attn_sdpa_merged_heads, _q_k_v, attn_sdpa_merged_heads_reference,
         grads=_QKV),
]

# -- MoE: the router and the expert combine ----------------------------------------------------
EXPERTS, TOP_K = 8, 3  # k > 2: the order of the weighted sum shows (two terms add alike either way)


def _h_router(dtype):
    return (torch.randn(T, D) * 2).to(dtype), (0.3 * torch.randn(EXPERTS, D)).to(dtype)


def _h_router_bias(dtype):
    return (*_h_router(dtype), (0.1 * torch.randn(EXPERTS)).to(dtype))


def _h_router_correction(dtype):  # DeepSeek-V3's correction bias is an fp32 buffer
    return (*_h_router(dtype), 0.05 * torch.randn(EXPERTS))


def router_qwen3(h, w):  # HF Qwen3-MoE / OLMoE: bf16 logits, fp32 softmax, renormalised, weights rounded
    logits = F.linear(h, w)
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top, ids = torch.topk(probs, TOP_K, dim=-1)
    top /= top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def router_mixtral(h, w):  # HF Mixtral: softmax of the upcast logits, renormalised, weights left fp32
    logits = F.linear(h, w)
    top, ids = torch.topk(F.softmax(logits.float(), dim=-1), TOP_K, dim=-1)
    return top / top.sum(dim=-1, keepdim=True), ids


def router_gpt_oss(h, w, b):  # HF GPT-OSS: top-k of the (biased) bf16 logits, a softmax over the k in bf16
    logits = F.linear(h, w, b)
    top, ids = torch.topk(logits, TOP_K, dim=-1)
    return F.softmax(top, dim=1, dtype=top.dtype), ids


def router_qwen2(h, w):  # HF Qwen2-MoE / Qwen3-MoE with norm_topk_prob=False: not renormalised
    logits = F.linear(h, w)
    top, ids = torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), TOP_K, dim=-1)
    return top.to(logits.dtype), ids


GROUPS, TOP_GROUPS = 4, 2


def router_deepseek(h, w, correction):  # DeepSeek-V3's group-limited routing (HF's), on bf16 logits
    scores = F.linear(h, w).sigmoid()
    choice = scores + correction
    group_scores = choice.view(-1, GROUPS, EXPERTS // GROUPS).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=TOP_GROUPS, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, GROUPS, EXPERTS // GROUPS).reshape(-1, EXPERTS)
    ids = torch.topk(choice.masked_fill(~score_mask.bool(), 0.0), TOP_K, dim=-1, sorted=False)[1]
    top = scores.gather(1, ids)
    top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return (top * 2.5).to(h.dtype), ids


def _probs_experts(dtype):  # the router's fp32 scores (an input here) and each (token, slot)'s expert output
    return torch.softmax(torch.randn(T, EXPERTS) * 2, dim=-1), (torch.randn(T * TOP_K, D) * 2).to(dtype)


def _top(probs, dtype):  # the weights as HF's router hands them on: rounded to the activation dtype
    top, ids = torch.topk(probs, TOP_K, dim=-1)
    return top.to(dtype), ids


def combine_batched(probs, experts):  # HF batched_mm experts: the k products viewed per token and summed
    top, _ = _top(probs, experts.dtype)
    return (experts * top.reshape(-1).unsqueeze(-1)).view(T, TOP_K, D).sum(dim=1)


def combine_grouped(probs, experts):  # HF grouped_mm experts: rows sorted by expert, put back, summed
    top, ids = _top(probs, experts.dtype)
    order = torch.sort(ids.reshape(-1)).indices
    weighted = experts[order] * top.reshape(-1)[order].unsqueeze(-1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return weighted[inverse].view(T, TOP_K, D).sum(dim=1)


def combine_index_add(probs, experts):  # each (token, slot) row added into its token's row
    top, _ = _top(probs, experts.dtype)
    rows = torch.arange(T).repeat_interleave(TOP_K)
    return torch.zeros(T, D, dtype=experts.dtype).index_add(0, rows, experts * top.reshape(-1, 1))


def combine_scatter_add(probs, experts):
    top, _ = _top(probs, experts.dtype)
    rows = torch.arange(T).repeat_interleave(TOP_K).unsqueeze(-1).expand(-1, D)
    return torch.zeros(T, D, dtype=experts.dtype).scatter_add(0, rows, experts * top.reshape(-1, 1))


def combine_reference(probs, experts):
    return ref.expert_combine(experts.view(T, TOP_K, D), torch.topk(probs, TOP_K, dim=-1)[0])


CASES += [
    Case("router_qwen3", "router", router_qwen3, _h_router,
         lambda h, w: ref.router(h, w, TOP_K, renormalize=True, out_dtype=h.dtype), grads=(0, 1)),
    Case("router_mixtral", "router", router_mixtral, _h_router,
         lambda h, w: ref.router(h, w, TOP_K, renormalize=True), grads=(0, 1)),
    Case("router_gpt_oss", "router", router_gpt_oss, _h_router_bias,
         lambda h, w, b: ref.router(h, w, TOP_K, bias=b, topk_of_logits=True, out_dtype=h.dtype), grads=(0, 1, 2)),
    Case("router_qwen2", "router", router_qwen2, _h_router, lambda h, w: ref.router(h, w, TOP_K, out_dtype=h.dtype),
         grads=(0, 1)),
    Case("router_deepseek", "router", router_deepseek, _h_router_correction,
         lambda h, w, c: ref.router(h, w, TOP_K, scoring="sigmoid", renormalize=True, correction=c, scale=2.5,
                                    groups=(GROUPS, TOP_GROUPS), out_dtype=h.dtype), grads=(0, 1)),
    Case("combine_batched", "expert_combine", combine_batched, _probs_experts, combine_reference, grads=(0, 1)),
    Case("combine_grouped", "expert_combine", combine_grouped, _probs_experts, combine_reference, grads=(0, 1)),
    Case("combine_index_add", "expert_combine", combine_index_add, _probs_experts, combine_reference, grads=(0, 1)),
    Case("combine_scatter_add", "expert_combine", combine_scatter_add, _probs_experts, combine_reference,
         grads=(0, 1)),
]

# Not in CASES: the rounding of q and k before the site is the model's, not a site's, and unpinned
# Inductor fuses it into the site's upcast and drops it (emulate_precision_casts=False);
# tests/test_sites.py checks it on eager kernels and pinned.
ROUNDED_INPUTS = Case("attn_rounded_inputs", "attention", attn_rounded_inputs, _q_k_v, attn_rounded_inputs_reference,
                      grads=_QKV)
