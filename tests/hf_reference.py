"""An HF model with its RMSNorm, gated-MLP and RoPE sites replaced by the contract reference
(tests/contract_reference.py), by patching modules of the instance and the modeling module's
`apply_rotary_pos_emb`. Residual adds stay as HF writes them (inside the decoder layer), so
compare against rla with `sites=["rmsnorm", "swiglu", "rope"]`: residual norms are then
aligned as plain norms reading the rounded sum, as this reference computes them.
"""

from __future__ import annotations

import contextlib
import importlib
import types

import contract_reference as ref

ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _norm_forward(module, gemma: bool):
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))

    def forward(self, x):
        return ref.rmsnorm(x, self.weight, eps, gemma=gemma)

    return types.MethodType(forward, module)


def _mlp_forward(module, act: str):
    def forward(self, x):
        if hasattr(self, "gate_up_proj"):  # Phi3: fused, gate first
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(ref.gated(gate, up, act))

    return types.MethodType(forward, module)


def _rotary_forward(module):
    original = module.forward

    def forward(self, x, position_ids, *args, **kwargs):
        return original(x.float(), position_ids, *args, **kwargs)  # cos/sin stay fp32 (the bypass)

    return types.MethodType(forward, module)


def _apply_rotary(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]
    return ref.rope(q, cos, sin, rotary_dim=rot), ref.rope(k, cos, sin, rotary_dim=rot)


@contextlib.contextmanager
def contract_sites(model):
    config = model.config
    gemma = config.model_type.startswith("gemma")
    act = ACTS[getattr(config, "hidden_activation", None) or config.hidden_act]
    patched = []
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            patched.append((module, "forward", _norm_forward(module, gemma)))
        elif name.endswith("MLP") and (hasattr(module, "gate_proj") or hasattr(module, "gate_up_proj")):
            patched.append((module, "forward", _mlp_forward(module, act)))
        elif name.endswith("RotaryEmbedding"):
            patched.append((module, "forward", _rotary_forward(module)))
    modeling = importlib.import_module(type(model).__module__)
    patched.append((modeling, "apply_rotary_pos_emb", _apply_rotary))
    saved = [(obj, attr, obj.__dict__.get(attr)) for obj, attr, _ in patched]
    try:
        for obj, attr, value in patched:
            setattr(obj, attr, value)
        yield model
    finally:
        for obj, attr, value in saved:
            if value is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, value)
