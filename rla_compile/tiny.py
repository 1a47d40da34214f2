"""Tiny random-weight HF causal LMs built from a config: the embedded default model for the
demo and the tests (no download). Norm weights are perturbed away from 1 (0 for Gemma-style
norms) so that where a norm rounds actually changes its result."""

from __future__ import annotations

import torch

__all__ = ["TINY_CONFIG", "tiny_causal_lm"]

TINY_CONFIG = dict(
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


def tiny_causal_lm(model_type: str = "llama", dtype: torch.dtype = torch.bfloat16, seed: int = 0, **overrides):
    """`AutoModelForCausalLM.from_config` of a tiny `model_type`, seeded, eager attention."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as error:
        raise ImportError("the tiny models need transformers: pip install 'rla_compile[hf]'") from error

    _check_model_type(model_type)
    config = AutoConfig.for_model(model_type, **(TINY_CONFIG | overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def _check_model_type(model_type: str) -> None:
    """A short error for a type transformers has no causal LM for (its own lists ~700 types)."""
    import difflib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    close = difflib.get_close_matches(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ValueError(f"unknown model type {model_type!r} for the tiny model: {hint}"
                     "use a transformers causal-LM model type such as llama, qwen3, mistral, gemma2")
