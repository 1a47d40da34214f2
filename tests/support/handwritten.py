"""Models written without transformers, the way people write them. Each runs either as
written (`forward`) or with its sites replaced by the contract reference
(`forward_contract`, from tests/support/contract_reference.py, independent of rla_compile).

- GptFast: gpt-fast's model.py: `_norm(x.float()).type_as(x) * weight` (rounds mid-site), a
  RoPE cache stored in bf16 applied per pair in fp32 (already one rounding), SwiGLU.
- Titan: torchtitan's Llama: nn.RMSNorm, complex RoPE with freqs_cis, SwiGLU.
- NanoSwiGLU: nanoGPT-like with a SwiGLU MLP, RMSNorm written in bf16 without any upcast, and
  neox RoPE with cos/sin computed in fp32 then rounded (HF style).
All: `h = x + attn(norm1(x)); x = h + mlp(norm2(h))`, a final norm, an lm head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import contract_reference as ref


@dataclass(frozen=True)
class Config:
    vocab: int = 128
    dim: int = 64
    layers: int = 2
    heads: int = 4
    hidden: int = 128
    seq: int = 32
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


class Block(nn.Module):
    def __init__(self, c: Config, norm: type):
        super().__init__()
        self.norm1, self.norm2 = norm(c.dim, c.eps), norm(c.dim, c.eps)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(c.dim, c.dim, bias=False) for _ in range(4))
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)


class Decoder(nn.Module):
    norm: type  # the model's RMSNorm module

    def __init__(self, c: Config = Config()):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(Block(c, type(self).norm) for _ in range(c.layers))
        self.final_norm = type(self).norm(c.dim, c.eps)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        with torch.no_grad():
            for module in self.modules():
                if hasattr(module, "weight") and module.weight is not None and module.weight.ndim == 1:
                    module.weight.add_(0.1 * torch.randn_like(module.weight))

    # model-specific: RoPE as written and as the contract computes it; q, k: [B, S, H, Dh]
    def rope(self, q, k, positions):
        raise NotImplementedError

    def rope_contract(self, q, k, positions):
        raise NotImplementedError

    def _attention(self, block, normed, rope):
        b, s, _ = normed.shape
        q, k, v = (w(normed).view(b, s, self.c.heads, self.c.head_dim) for w in (block.wq, block.wk, block.wv))
        q, k = rope(q, k, torch.arange(s))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return block.wo(y.transpose(1, 2).reshape(b, s, -1))

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            h = x + self._attention(block, block.norm1(x), self.rope)
            normed = block.norm2(h)
            x = h + block.w2(F.silu(block.w1(normed)) * block.w3(normed))
        return self.head(self.final_norm(x))

    def forward_contract(self, idx):
        """Every site by the contract: norms read the fp32 residual sum, each output rounded once."""
        eps = self.c.eps
        stream, update = self.embed(idx), None
        for block in self.blocks:
            if update is None:
                normed = ref.rmsnorm(stream, block.norm1.weight, eps)
            else:
                stream, normed = ref.residual_rmsnorm(stream, update, block.norm1.weight, eps)
            attn = self._attention(block, normed, self.rope_contract)
            stream, normed = ref.residual_rmsnorm(stream, attn, block.norm2.weight, eps)
            update = block.w2(ref.gated(block.w1(normed), block.w3(normed)))
        _, normed = ref.residual_rmsnorm(stream, update, self.final_norm.weight, eps)
        return self.head(normed)

    def expected_sites(self) -> dict[str, int]:
        """The first block's first norm reads the embedding; every other norm reads a residual sum;
        one attention per block."""
        layers = self.c.layers
        return {"rmsnorm": 1, "residual_rmsnorm": 2 * layers, "swiglu": layers, "rope": 2 * layers, "logits": 1,
                "attention": layers, "router": 0, "expert_combine": 0}  # dense: no experts


# -- gpt-fast ---------------------------------------------------------------------------------
class GptFastRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


def gpt_fast_rotary(x, freqs_cis):  # x [B, S, H, Dh]; freqs_cis [S, Dh/2, 2]
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    return x_out2.flatten(3).type_as(x)


class GptFast(Decoder):
    norm = GptFastRMSNorm

    def __init__(self, c: Config = Config()):
        super().__init__(c)
        freqs = 1.0 / (10000 ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        angles = torch.outer(torch.arange(c.seq).float(), freqs)
        # gpt-fast builds the cache in fp32 and `model.to(bf16)` rounds it: a bf16 buffer
        self.register_buffer("freqs_cis", torch.stack([angles.cos(), angles.sin()], -1), persistent=False)

    def rope(self, q, k, positions):
        cache = self.freqs_cis[positions]
        return gpt_fast_rotary(q, cache), gpt_fast_rotary(k, cache)

    def rope_contract(self, q, k, positions):  # already one fp32 computation of the bf16 cache
        cache = self.freqs_cis[positions].float()
        return gpt_fast_rotary(q, cache), gpt_fast_rotary(k, cache)


# -- torchtitan -------------------------------------------------------------------------------
def titan_rotary(x, freqs_cis):  # x [B, S, H, Dh]; freqs_cis complex [S, Dh/2]
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs_cis[None, :, None, :]).flatten(3).type_as(x)


class Titan(Decoder):
    norm = nn.RMSNorm

    def rope(self, q, k, positions):
        freqs = 1.0 / (10000 ** (torch.arange(0, self.c.head_dim, 2).float() / self.c.head_dim))
        freqs_cis = torch.polar(torch.ones(len(positions), len(freqs)), torch.outer(positions.float(), freqs))
        return titan_rotary(q, freqs_cis), titan_rotary(k, freqs_cis)

    rope_contract = rope  # complex64 math, one rounding: already the contract


# -- nanoGPT with SwiGLU ----------------------------------------------------------------------
class Bf16RMSNorm(nn.Module):  # written without any upcast: every op rounds
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


class NanoSwiGLU(Decoder):
    norm = Bf16RMSNorm

    def _cos_sin(self, positions):
        freqs = 1.0 / (10000 ** (torch.arange(0, self.c.head_dim, 2).float() / self.c.head_dim))
        emb = torch.outer(positions.float(), freqs).repeat(1, 2)[None, :, None, :]
        return emb.cos(), emb.sin()

    def rope(self, q, k, positions):
        cos, sin = (t.to(q.dtype) for t in self._cos_sin(positions))
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def rope_contract(self, q, k, positions):
        cos, sin = self._cos_sin(positions)  # the contract reads the fp32 cos/sin
        return ref.rope(q, cos, sin), ref.rope(k, cos, sin)


HANDWRITTEN = {"gpt-fast": GptFast, "torchtitan": Titan, "nanogpt-swiglu": NanoSwiGLU}

# What each site is in these models as written (the coverage table's expectation).
STATUSES = {
    "gpt-fast": {"rmsnorm": "rewritten", "residual_rmsnorm": "rewritten", "swiglu": "rewritten", "rope": "already_aligned"},
    "torchtitan": {"rmsnorm": "already_aligned", "residual_rmsnorm": "rewritten", "swiglu": "rewritten", "rope": "already_aligned"},
    "nanogpt-swiglu": {"rmsnorm": "rewritten", "residual_rmsnorm": "rewritten", "swiglu": "rewritten", "rope": "rewritten"},
}


def build(name: str, dtype=torch.bfloat16) -> Decoder:
    torch.manual_seed(0)
    return HANDWRITTEN[name]().to(dtype)
