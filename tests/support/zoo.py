"""The model zoo the coverage suite runs: tiny HF families built offline from configs, MoE in
both expert implementations, and the hand-written models. Expected site counts are derived
from each config here, independently of what the reports say."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import handwritten
from models import expected_sites
from rla_compile.tiny import tiny_causal_lm

MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": dict(num_experts=4, decoder_sparse_step=1, mlp_only_layers=[], **MOE),
    "gemma": {},
    "gemma2": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=32),
    "phi3": {},
    "granite": dict(residual_multiplier=0.5, embedding_multiplier=2.0),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(
        n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        head_dim=8, num_key_value_heads=4, **MOE,
    ),
}
# MoE experts also run as a Python loop over the experts that got tokens: data-dependent, so
# Dynamo breaks the graph inside each expert's MLP (the "partial site" case).
LOOP_EXPERTS = {"qwen3_moe_loop": "qwen3_moe", "mixtral_loop": "mixtral"}


@dataclass
class Entry:
    name: str
    build: object  # () -> model
    expected: dict[str, int]  # sites per kind, from the config
    family: str  # "hf" or "hand-written"
    notes: list[str] = field(default_factory=list)


def _hf(family: str, **extra):
    def build():
        return tiny_causal_lm(family, **(FAMILIES[family] | extra))

    return build


def entries() -> list[Entry]:
    from transformers import AutoConfig

    from rla_compile.tiny import TINY_CONFIG

    out = []
    for family, overrides in FAMILIES.items():
        config = AutoConfig.for_model(family, **(TINY_CONFIG | overrides))
        out.append(Entry(family, _hf(family), expected_sites(config, logits=True, attention=True, moe=True), "hf"))
    for name, family in LOOP_EXPERTS.items():
        config = AutoConfig.for_model(family, **(TINY_CONFIG | FAMILIES[family]))
        expected = expected_sites(config, logits=True, attention=True, moe=True)
        expected["swiglu"] = 0  # split by graph breaks: reported as partial sites, not rewritten
        expected["expert_combine"] = 0  # each expert's index_add_ in a graph of its own, its weight an input
        out.append(Entry(name, _hf(family, experts_implementation="eager"), expected, "hf",
                         ["experts_implementation='eager'"]))
    for name in handwritten.HANDWRITTEN:
        model = handwritten.HANDWRITTEN[name]
        out.append(Entry(name, lambda name=name: handwritten.build(name), model().expected_sites(), "hand-written"))
    return out


def tokens(vocab: int = 128, length: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(0))
