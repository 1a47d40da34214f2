"""Tiny HF models built offline from configs (no download), bf16, norm weights perturbed away
from 1 (or 0 for Gemma-style) so that cast-order differences show."""

from __future__ import annotations

import torch

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=64,
    pad_token_id=0,
)


def tiny_causal_lm(model_type: str, dtype=torch.bfloat16, seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **(TINY | overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def expected_sites(config) -> dict[str, int]:
    """Sites per kind, derived from a Llama-family config (not read off a report).

    Every layer has two norms that read a residual sum except the first layer's input norm;
    the final norm reads the last sum. RoPE rotates q and k per layer; one gated MLP per layer;
    Qwen3-style q/k norms add two plain norms per layer.
    """
    layers = config.num_hidden_layers
    qk_norms = 2 * layers if config.model_type in ("qwen3", "qwen3_moe") else 0
    return {
        "rmsnorm": 1 + qk_norms,
        "residual_rmsnorm": 2 * layers,
        "swiglu": layers,
        "rope": 2 * layers,
    }
