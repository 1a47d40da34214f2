"""A model from tests/support/frameworks.py run eagerly with its sites replaced by the contract
reference (tests/support/contract_reference.py), written from each framework's code, not from rla:

- RMSNorm modules (every framework names its class *RMSNorm; the weight is `weight`, or
  torchtune's `scale`; litgpt's Gemma norm adds a unit offset): the reference norm, reading
  the fp32 residual sum when its input is one (hf_reference.ContractMode's adds).
- gated MLPs: `F.silu` / tanh-`F.gelu` outputs are remembered, and their multiply by the up
  projection computes `round(act(g) * u)` in fp32.
- RoPE where the framework rotates in low precision: litgpt's `apply_rope`, torchtune's
  Qwen2 rotary module and OLMo-core's `_apply_rotary_pos_emb` (used by both of its precision
  modes: fp32 inputs come back fp32 and the framework rounds them once; its sin/cos are the
  fp32 tables, the contract's bypass of their rounding). The others already
  rotate in fp32 and round once, which is the contract: torchtune's Llama3ScaledRoPE,
  torchtitan's ComplexRoPE and CosSinRoPE.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F

import contract_reference as ref
from hf_reference import ADDS, ContractMode, patched_under

_ACTS = {F.silu: "silu"}


class FrameworkContractMode(ContractMode):
    """ContractMode that also sees functional activations (frameworks call F.silu directly)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        act = _ACTS.get(func)
        if func is F.gelu and kwargs.get("approximate") == "tanh":
            act = "gelu_tanh"
        if act is not None and args and isinstance(args[0], torch.Tensor) and args[0].dtype in (torch.bfloat16, torch.float16):
            out = func(*args, **kwargs)  # the mode is off inside its own handler
            self.acts[id(out)] = (out, args[0], act)
            return out
        if func in ADDS and kwargs in ({"alpha": 1}, {"alpha": 1.0}):
            kwargs = {}  # OLMo-core's residual stream: torch.add(residual, x, alpha=1.0)
        return super().__torch_function__(func, types, args, kwargs)


def _norm_forward(module, mode: ContractMode):
    weight = getattr(module, "weight", None)
    if weight is None:
        weight = getattr(module, "scale", None)
    eps = getattr(module, "eps", 1e-6)
    gemma = bool(getattr(module, "add_unit_offset", False))

    def forward(self, x):
        s = mode.fp32_sum(x)  # the norm of a residual sum reads it unrounded
        # nn.RMSNorm(eps=None) (torchtitan) uses the input dtype's machine epsilon
        return ref.rmsnorm(x if s is None else s, weight, eps if eps is not None else torch.finfo(x.dtype).eps,
                           gemma=gemma, out_dtype=x.dtype)

    return types.MethodType(forward, module)


def _litgpt_rope(x, cos, sin):
    return ref.rope(x, cos.unsqueeze(-3) if cos.dim() == 3 else cos, sin.unsqueeze(-3) if sin.dim() == 3 else sin)


def _torchtune_qwen2_rope(module):
    def forward(self, x, input_pos=None):
        seq_len, head_dim = x.size(1), x.size(-1)
        cache = (self.cache[:seq_len] if input_pos is None else self.cache[input_pos]).view(-1, seq_len, 1, head_dim * 2)
        return ref.rope(x, cache[..., :head_dim], cache[..., head_dim:])

    return types.MethodType(forward, module)


def _olmo_core_rope(module):
    """OLMo-core computes sin/cos in fp32 and rounds them to q's dtype only to rotate (without
    full precision): the contract's bypass reads the fp32 values, so the reference does too."""

    def apply(self, pos_sin, pos_cos, t):
        positions = pos_sin.numel() // pos_sin.shape[-1]  # [1, 1, T, d] or [1, T, 1, d]
        sin, cos = (v.reshape(pos_sin.shape) for v in self._get_rotary_embedding(positions, t.device))
        assert sin.dtype == torch.float32 and torch.equal(sin.to(pos_sin.dtype), pos_sin), "not the rounded table"
        return ref.rope(t, cos, sin, rotary_dim=pos_sin.shape[-1])

    return types.MethodType(apply, module)


@contextlib.contextmanager
def contract_sites(model):
    mode = FrameworkContractMode()
    patched = []
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            patched.append((module, "forward", _norm_forward(module, mode)))
        elif name == "Qwen2RotaryPositionalEmbeddings":
            patched.append((module, "forward", _torchtune_qwen2_rope(module)))
        elif type(module).__module__ == "olmo_core.nn.rope" and hasattr(module, "_apply_rotary_pos_emb"):
            patched.append((module, "_apply_rotary_pos_emb", _olmo_core_rope(module)))
    try:
        import litgpt.model as litgpt_model
    except ImportError:
        litgpt_model = None
    if litgpt_model is not None:
        patched.append((litgpt_model, "apply_rope", _litgpt_rope))
    with patched_under(mode, patched):
        yield model
