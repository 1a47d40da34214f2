"""Test-side knowledge of the tiny models: what a config implies, written independently of
the report."""

from __future__ import annotations

from rla_compile.tiny import tiny_causal_lm  # noqa: F401  (re-exported for the tests)


def expected_sites(config) -> dict[str, int]:
    """Sites per kind for a Llama-family config.

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
