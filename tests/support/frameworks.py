"""Tiny models from training frameworks other than HF transformers, built from their own code:
litgpt, torchtune, torchtitan and OLMo-core (docs/coverage.md, `tox -e frameworks`).

Each builder returns a bf16 model whose forward maps token ids (2 x T) to logits, and the
sites its config implies, counted here from the config, independently of rla's reports.
A framework that is not installed is reported by `missing()`; the tests skip its rows with
that reason (the `frameworks` tox env installs all four).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, SEQ = 128, 64, 2, 4, 2, 16, 128, 64

PACKAGES = {"litgpt": "litgpt", "torchtune": "torchtune", "torchtitan": "torchtitan", "olmo-core": "olmo_core"}


@dataclass
class Model:
    name: str
    framework: str
    build: object  # () -> torch.nn.Module in bf16
    expected: dict[str, int]
    notes: list[str] = field(default_factory=list)


def _counts(layers: int = LAYERS, qk_norm: bool = False, sandwich: bool = False, post_norm: bool = False) -> dict[str, int]:
    """The sites of a decoder, from its architecture.

    Pre-norm (Llama): a norm before attention and before the MLP of every layer; each reads a
    residual sum (a residual norm) except the first layer's attention norm, which reads the
    embeddings; the final norm reads the last sum. Gemma 2's sandwich norms add two plain
    norms per layer (after attention, after the MLP); QK-norm adds two per layer (q, k).
    Post-norm (OLMo 2): the norms sit on the attention and MLP outputs (plain norms, two per
    layer) and only the final norm reads a residual sum. One gated MLP and two RoPE sites
    (q, k) per layer."""
    plain, residual = (2 * layers, 1) if post_norm else (1, 2 * layers)
    plain += 2 * layers * (qk_norm + sandwich)
    return {"rmsnorm": plain, "residual_rmsnorm": residual, "swiglu": layers, "rope": 2 * layers}


def _bf16(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    return model.to(torch.bfloat16).eval()


# -- litgpt ------------------------------------------------------------------------------------
def _litgpt(name: str):
    def build():
        from litgpt import GPT, Config

        overrides = dict(n_layer=LAYERS, n_embd=DIM, n_head=HEADS, n_query_groups=KV_HEADS, head_size=HEAD_DIM,
                         intermediate_size=HIDDEN, padded_vocab_size=VOCAB, vocab_size=VOCAB, block_size=SEQ)
        torch.manual_seed(0)
        return _bf16(GPT(Config.from_name(name, **overrides)))

    return build


# -- torchtune ---------------------------------------------------------------------------------
def _torchtune(builder: str):
    def build():
        module = importlib.import_module(f"torchtune.models.{builder}._component_builders")
        kwargs = dict(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                      embed_dim=DIM, max_seq_len=SEQ, intermediate_dim=HIDDEN)
        torch.manual_seed(0)
        return _bf16(getattr(module, builder)(**kwargs))

    return build


# -- torchtitan --------------------------------------------------------------------------------
class _Titan(torch.nn.Module):
    """torchtitan's decoders take positions next to the tokens (its trainer builds them). Its
    language models accept only flex or varlen attention, and flex attention has no backward
    on CPU, so the inner attention (outside every site) becomes torchtitan's own causal SDPA."""

    def __init__(self, model):
        super().__init__()
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for module in model.modules():
            if hasattr(module, "inner_attention"):
                module.inner_attention = ScaledDotProductAttention(ScaledDotProductAttention.Config())
        self.model = model

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)
        return self.model(ids, positions, None)


def _torchtitan_llama3():
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    torch.manual_seed(0)
    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_llama3_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=HIDDEN, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=HEAD_DIM, max_seq_len=SEQ, theta=500000.0),
        ),
    )
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return _bf16(_Titan(model))


def _torchtitan_qwen3():
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _qwen3_norm

    torch.manual_seed(0)
    config = Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_qwen3_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
            hidden_dim=HIDDEN, attn_backend="flex", rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=SEQ, theta=1e6),
        ),
    )
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return _bf16(_Titan(model))


# -- OLMo-core ---------------------------------------------------------------------------------
class _Logits(torch.nn.Module):
    """OLMo-core's Transformer returns logits from `forward(input_ids)` already; this only pins
    the call signature the tests use."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids)


def _olmo_core(preset: str, **kwargs):
    def build():
        from olmo_core.nn.transformer import TransformerConfig

        if preset == "olmo2":
            config = TransformerConfig.olmo2_1M(vocab_size=VOCAB, **kwargs)
        elif preset == "qwen3":  # TransformerConfig.qwen3_0_6B's choices at a tiny size
            from olmo_core.nn.layer_norm import LayerNormType

            config = TransformerConfig.llama_like(
                d_model=DIM, vocab_size=VOCAB, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS,
                head_dim=HEAD_DIM, rope_theta=1_000_000, rope_full_precision=False, layer_norm_eps=1e-6,
                layer_norm_name=LayerNormType.qwen_rms, qk_norm=True, use_head_qk_norm=True)
        else:
            config = TransformerConfig.llama_like(d_model=DIM, vocab_size=VOCAB, n_layers=LAYERS, n_heads=HEADS,
                                                  n_kv_heads=KV_HEADS, **kwargs)
        torch.manual_seed(0)
        model = config.build(init_device="cpu")
        model.init_weights(device=torch.device("cpu"))
        return _bf16(_Logits(model))

    return build


def models() -> list[Model]:
    return [
        Model("litgpt llama3", "litgpt", _litgpt("Llama-3.2-1B"), _counts()),
        Model("litgpt qwen3", "litgpt", _litgpt("Qwen3-0.6B"), _counts(qk_norm=True)),
        Model("litgpt gemma2", "litgpt", _litgpt("Gemma-2-2b"), _counts(sandwich=True)),
        Model("torchtune llama3_2", "torchtune", _torchtune("llama3_2"), _counts()),
        Model("torchtune qwen2", "torchtune", _torchtune("qwen2"), _counts()),
        Model("torchtitan llama3", "torchtitan", _torchtitan_llama3, _counts()),
        Model("torchtitan qwen3", "torchtitan", _torchtitan_qwen3, _counts(qk_norm=True)),
        Model("olmo-core olmo2", "olmo-core", _olmo_core("olmo2"), _counts(layers=4, qk_norm=True, post_norm=True),
              ["TransformerConfig.olmo2_1M: 4 layers, d_model 12"]),
        Model("olmo-core llama-like", "olmo-core", _olmo_core("llama"), _counts()),
        Model("olmo-core qwen3-like", "olmo-core", _olmo_core("qwen3"), _counts(qk_norm=True)),
    ]


def missing(framework: str) -> str | None:
    package = PACKAGES[framework]
    if importlib.util.find_spec(package) is None:
        return f"{framework} is not installed (tox -e frameworks installs it)"
    return None
