"""Test-side knowledge of the tiny models: what a config implies, written independently of
the report."""

from __future__ import annotations

from rla_compile.tiny import tiny_causal_lm  # noqa: F401  (re-exported for the tests)


def moe_layers(config) -> int:
    """How many of a config's layers route tokens to experts (Qwen3-MoE's sparse step and
    MLP-only layers, DeepSeek-V3's first dense layers, every layer of Mixtral)."""
    layers, kind = config.num_hidden_layers, config.model_type
    if kind == "qwen3_moe":
        return sum(1 for i in range(layers) if i not in config.mlp_only_layers and config.num_experts > 0
                   and (i + 1) % config.decoder_sparse_step == 0)
    if kind == "deepseek_v3":
        return layers - config.first_k_dense_replace
    return layers if kind in ("mixtral", "qwen2_moe", "olmoe", "gpt_oss") else 0


def expected_sites(config, logits: bool = False, attention: bool = False, moe: bool = False) -> dict[str, int]:
    """Sites per kind for a tiny HF config: the default sites, with `logits` the head too,
    with `attention` each layer's attention and with `moe` each MoE layer's router and expert
    combine.

    Every layer has two norms that read a residual sum except the first layer's input norm;
    the final norm reads the last sum. RoPE rotates q and k per layer; one gated MLP per layer;
    Qwen3-style q/k norms add two plain norms per layer.
    """
    layers, kind = config.num_hidden_layers, config.model_type
    counts = {"rmsnorm": 1, "residual_rmsnorm": 2 * layers, "swiglu": layers, "rope": 2 * layers}
    if kind in ("qwen3", "qwen3_moe"):
        counts["rmsnorm"] += 2 * layers  # q_norm, k_norm per head before RoPE
    if kind == "gemma2":
        counts["rmsnorm"] += 2 * layers  # sandwich: post-attention and post-feedforward norms
    if kind == "deepseek_v3":
        counts["rmsnorm"] += 2 * layers  # q_a_layernorm, kv_a_layernorm on the MLA latents
        dense = config.first_k_dense_replace
        counts["swiglu"] = dense + (layers - dense) * (1 + (config.n_shared_experts > 0))
    if logits:
        counts["logits"] = 1
    if attention:
        counts["attention"] = layers
    if moe:
        counts["router"] = counts["expert_combine"] = moe_layers(config)
    return counts
