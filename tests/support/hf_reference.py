"""An HF model run eagerly with every site replaced by the contract reference
(tests/support/contract_reference.py), without rewriting the model's code:

- RMSNorm modules: `forward` replaced by the reference norm; when the input is a residual sum
  made inside the layer, by the residual reference (the norm reads the fp32 sum).
- gated MLPs, dense or MoE experts: the `act_fn` / `activation_fn` module marks its output, and
  the multiply by the up projection computes `round(act(g) * u)` in fp32.
- RoPE: the rotary module returns fp32 cos/sin (the contract's bypass) and the modeling
  module's `apply_rotary_pos_emb` (or DeepSeek's interleaved version) is the reference.
- MoE (kind "router"): the router module computes the contract's router and hands the experts
  fp32 weights, so their combine multiplies and sums in fp32, rounded once.

A `TorchFunctionMode` sees the adds and multiplies. A bf16 add of two same-shape tensors is
computed as round(s), s = fp32(h) + fp32(r) — the same value a bf16 add gives, and the
contract's residual stream — and s is kept so a norm that reads the sum reads s (one autograd
node for both, as in the contract's residual site, so their gradients meet in fp32).
"""

from __future__ import annotations

import contextlib
import importlib
import types

import torch
from torch.overrides import TorchFunctionMode

import contract_reference as ref

ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
LOWP = (torch.bfloat16, torch.float16)
ADDS = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
MULS = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}


class ContractMode(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.sums: dict[int, tuple] = {}  # id(round(s)) -> (round(s), s): residual adds
        self.acts: dict[int, tuple] = {}  # id(act(g)) -> (act(g), g, act)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MULS and len(args) == 2 and not kwargs:
            a, b = args
            for act_out, up in ((a, b), (b, a)):
                entry = self.acts.get(id(act_out))
                if entry is not None and entry[0] is act_out and isinstance(up, torch.Tensor) and up.shape == act_out.shape:
                    return ref.gated(entry[1], up, entry[2])
        if func in ADDS and len(args) == 2 and not kwargs:
            h, r = args
            if all(isinstance(t, torch.Tensor) and t.dtype in LOWP for t in (h, r)) and h.shape == r.shape:
                s = h.to(torch.float32) + r.to(torch.float32)
                out = s.to(h.dtype)
                self.sums[id(out)] = (out, s)
                return out
        return func(*args, **kwargs)

    def fp32_sum(self, x):
        entry = self.sums.get(id(x))
        return entry[1] if entry is not None and entry[0] is x else None


def _norm_forward(module, mode: ContractMode, gemma: bool):
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))

    def forward(self, x):
        s = mode.fp32_sum(x)  # the norm of a residual sum reads it unrounded
        return ref.rmsnorm(x if s is None else s, self.weight, eps, gemma=gemma, out_dtype=x.dtype)

    return types.MethodType(forward, module)


def _act_forward(module, mode: ContractMode, act: str):
    original = module.forward

    def forward(self, g):
        out = original(g)
        mode.acts[id(out)] = (out, g, act)
        return out

    return types.MethodType(forward, module)


def _router_forward(module, renormalize: bool):
    """An MoE top-k router (Qwen3-MoE's, Mixtral's) computing the contract: fp32 logits, scores,
    top-k and weights, the weights left fp32 for the experts, whose combine then multiplies
    and sums in fp32 (HF's grouped_mm and batched_mm experts promote to the weights' dtype and
    round the sum once); its logits, for readers outside, rounded once."""
    def forward(self, hidden_states):
        h = hidden_states.reshape(-1, self.hidden_dim)
        weights, ids = ref.router(h, self.weight, self.top_k, renormalize=renormalize)
        return ref.logits(h, self.weight).to(h.dtype), weights, ids

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


def _apply_rotary_interleave(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(unsqueeze_dim), sin[..., :half].unsqueeze(unsqueeze_dim)
    return ref.rope_pairs(q, cos, sin), ref.rope_pairs(k, cos, sin)


SOFTMAX_ROUTERS = ("Qwen3MoeTopKRouter", "MixtralTopKRouter")  # softmax, top-k, weights rounded or not


@contextlib.contextmanager
def contract_sites(model, kinds=("rmsnorm", "swiglu", "rope"), skip=()):
    """kinds: which sites to replace; "rmsnorm" covers plain and residual norms, "router" the
    MoE router and with it the experts' combine (`_router_forward`). skip: modules left as
    written (e.g. a norm outside the compiled graphs)."""
    config = model.config
    gemma = config.model_type.startswith("gemma")
    act = ACTS[getattr(config, "hidden_activation", None) or config.hidden_act]
    mode = ContractMode()
    patched = []
    skipped = {id(m) for root in skip for m in root.modules()}
    for module in model.modules():
        if id(module) in skipped:
            continue
        name = type(module).__name__
        if name.endswith("RMSNorm") and "rmsnorm" in kinds:
            patched.append((module, "forward", _norm_forward(module, mode, gemma)))
        elif name.endswith("RotaryEmbedding") and "rope" in kinds:
            patched.append((module, "forward", _rotary_forward(module)))
        elif name in SOFTMAX_ROUTERS and "router" in kinds:
            renormalize = getattr(config, "norm_topk_prob", True)  # Mixtral always renormalises
            patched.append((module, "forward", _router_forward(module, renormalize)))
        for attr in ("act_fn", "activation_fn"):
            fn = getattr(module, attr, None)
            if isinstance(fn, torch.nn.Module) and "swiglu" in kinds:
                patched.append((fn, "forward", _act_forward(fn, mode, act)))
    modeling = importlib.import_module(type(model).__module__)
    if "rope" in kinds:
        patched.append((modeling, "apply_rotary_pos_emb", _apply_rotary))
    if "rope" in kinds and hasattr(modeling, "apply_rotary_pos_emb_interleave"):
        patched.append((modeling, "apply_rotary_pos_emb_interleave", _apply_rotary_interleave))
    with patched_under(mode, patched):
        yield model


@contextlib.contextmanager
def patched_under(mode: ContractMode, patches: list[tuple[object, str, object]]):
    """Set each (object, attribute, value) and run under `mode`; put everything back after."""
    saved = [(obj, attr, obj.__dict__.get(attr)) for obj, attr, _ in patches]
    try:
        for obj, attr, value in patches:
            setattr(obj, attr, value)
        with mode:
            yield
    finally:
        for obj, attr, value in saved:
            if value is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, value)


# -- attention: HF's attention-function interface, computing the contract -------------------------
def contract_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                       ignore_softcap=False, rounding="nearest", **kwargs):
    """HF's attention-function signature, computing the contract (no dropout: eval).
    `ignore_softcap`: as HF's sdpa_attention_forward, which drops Gemma 2's soft-cap;
    `rounding`: the one rounding's mode (test_rounding.py)."""
    softcap = None if ignore_softcap else softcap
    groups = query.shape[1] // key.shape[1]
    mask, causal = attention_mask, False
    if mask is not None:
        mask = mask[:, :, :, : key.shape[-2]]
    elif kwargs.get("sliding_window"):  # HF hands a function of its own no mask, and the window
        rows, cols = torch.arange(query.shape[2])[:, None], torch.arange(key.shape[2])[None, :]
        mask = (cols <= rows) & (rows - cols < kwargs["sliding_window"])
    else:  # no mask: causal unless the module says it is not (an encoder's)
        causal = query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = ref.attention(query, key, value, mask=mask, scale=scaling, causal=causal, softcap=softcap, groups=groups,
                        rounding=rounding)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    """Register `contract_attention` with transformers' `AttentionInterface`: a model's
    `set_attn_implementation("rla_contract_eager")` (or "_sdpa", which drops Gemma 2's soft-cap
    as HF's sdpa does) runs the contract reference in place of its attention."""
    import functools

    import transformers

    transformers.AttentionInterface.register("rla_contract_eager", contract_attention)
    transformers.AttentionInterface.register("rla_contract_sdpa", functools.partial(contract_attention, ignore_softcap=True))


_register()
