"""How Inductor lowers an aligned graph: the policy both compiled paths (the torch.compile
backend, vLLM's post-grad pass) apply after the rewrite so that Inductor computes the contract.

- every site rounding carries Inductor's rounding barrier (fusion would otherwise drop it);
- unpinned, a rounded site output that a widening cast reads in the same generated kernel is
  rounded there, written out in fp32 (`round_in_kernel`), or the rounding is stored before the kernel boundary that its reader waits
  for (`_kernel_apart`); RoPE's cos/sin tables run on ATen (`position_tables`), as an engine
  computes its table;
- pinned (`pin_rounding`, Inductor's `emulate_precision_casts`), the fp32 math a rounding reads
  runs on ATen's kernels (`pin_eager_math`), LayerNorm, softmax and GELU included (eager_kernels.py).
"""

from __future__ import annotations

import math

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph

from . import eager_kernels, ops
from . import sites as registry
from .config import Options
from .ops import is_site_rounding

__all__ = ["KeepSiteRounding", "keep_site_roundings", "round_in_kernel", "upcast_on_aten", "eager_math_nodes",
           "pin_eager_math", "position_tables"]


class KeepSiteRounding(CustomGraphPass):
    """Post-grad pass: keep every site's output rounding through Inductor's fusion and, with
    `pin_rounding`, round the same fp32 value as eager kernels do.

    With `emulate_precision_casts=False` Inductor computes fused pointwise chains in fp32 and
    drops in-kernel casts, including a site's output rounding when its consumer fuses into
    the same kernel. The per-node barrier makes the lowering round at exactly these nodes.

    With `pin_rounding`, the fp32 reductions and transcendentals that a rounding reads (a
    site's or, in a graph with a site, the model's own), and LayerNorm, softmax and GELU, also run
    on ATen's kernels, as under `compiler="aot_eager"` (`pin_eager_math`): each rounding then
    rounds the same fp32 value whatever the compiler.
    """

    def __init__(self, options: Options):
        self._uuid = options.uuid()  # covers pin_rounding; Inductor's own key covers emulate_precision_casts

    def __call__(self, graph: Graph) -> None:
        keep_site_roundings(graph)

    def uuid(self) -> str:
        return self._uuid


def keep_site_roundings(graph: Graph) -> None:
    """What both compiled paths (this backend, vLLM's pass) do to a post-grad graph so that
    Inductor computes the contract: every site rounding carries the rounding barrier; unpinned,
    a rounded site output that an upcast reads in the same kernel is rounded there, written out
    in fp32 (`_upcasts_of`, `round_in_kernel`; `upcast_on_aten` where that cannot apply);
    pinned, the fp32 math a rounding reads runs on ATen (`pin_eager_math`)."""
    from torch._inductor import config as inductor_config

    pinned = inductor_config.emulate_precision_casts  # pin_rounding, or the user's own setting
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op == "call_function" and is_site_rounding(node):  # not a saved rounding read by the backward
            node.meta["low_precision_pointwise_barrier"] = True
            if not pinned:
                for upcast in _upcasts_of(node):
                    if _kernel_apart(node, upcast, position):
                        node.meta["inductor_realize_to_strides"] = True  # stored once, in bf16
                    elif not round_in_kernel(node):
                        upcast_on_aten(graph, upcast)
    if pinned:
        pin_eager_math(graph)
    else:
        for table in position_tables(graph):
            table.meta["should_fallback"] = True


def position_tables(graph: Graph) -> list:
    """The cos/sin a site rounding reads (RoPE's tables, computed in the graph from positions),
    to run on ATen even unpinned: an engine computes its table once, eagerly (vLLM's
    `cos_sin_cache`), so the trainer's tables must be ATen's values too. Inductor's vectorised
    cos/sin differ from ATen's in the last fp32 bit on ~10-30% of a table's entries (shipped
    model, 96 positions), and RoPE's one rounding flips on a few elements there (trainer vs
    vLLM-CPU, every site on both sides: the first divergence, at layer 1; docs/mismatch.md)."""
    return [n for n in eager_math_nodes(graph) if ops.op_name(n) in ("cos", "sin")]


def round_in_kernel(rounding) -> bool:
    """Make `rounding` (fp32 -> bf16 or fp16) `rla::rounding`, which Inductor lowers to the
    rounding written out in fp32 (`_rounded_in_fp32`) before the cast, in the generated kernel
    (C++ and Triton alike). Returns False, changing nothing, where that does not apply (a
    rounding from another dtype than fp32): the caller runs the upcast on ATen instead.

    Why: unpinned, a widening cast that reads the rounded value in the same kernel (Qwen3's q/k
    norm into RoPE) gets the fp32 value the rounding came from. Inductor's C++ kernels compute
    bf16/fp16 values in fp32, and the `to_dtype` that its loop-body legalisation inserts before a
    low-precision store caches "upcast of the stored value = the fp32 value"
    (torch/_inductor/codegen/cpp.py, `cache_dtype_convert`), off only under
    `emulate_precision_casts`. Here the value before that cast is already the rounded one, so
    whatever the kernel hands the reader is the contract's. Before, the upcast ran on ATen
    (`upcast_on_aten`): an extra call and kernel per upcast, the host time a GPU waits on
    (docs/performance.md#host-time)."""
    source = rounding.args[0] if rounding.args else None
    if rounding.target is torch.ops.rla.rounding.default:
        return True
    dtype = ops.dtype_of(rounding)
    if dtype not in ops.LOW_PRECISION or ops.dtype_of(source) != torch.float32 or not ops.is_cast(rounding):
        return False
    rounding.target, rounding.args, rounding.kwargs = torch.ops.rla.rounding.default, (source, dtype), {}
    return True


def _rounded_in_fp32(value, dtype: torch.dtype):
    """fp32 `value` rounded to `dtype`'s precision (bf16 or fp16) to nearest, ties to even,
    still in fp32, as Inductor ops: ATen's conversion (c10's `round_to_nearest_even`, the CPU's
    conversion instructions), NaN kept, subnormals and overflow to inf included.

    On the bits: add 0x7FFF (bf16; fp16: 0xFFF) plus the lowest kept bit, clear the dropped 16
    (13) bits; the carry moves the exponent, and for bf16 (fp32's exponent range) makes overflow
    inf. fp16 has its own range: above its largest finite value (65504) the result is inf, and
    below its smallest normal (2^-14) the quantum is 2^-24 whatever the exponent, so there the
    value is scaled by 2^24 (exact), rounded to an integer, ties to even, and scaled back."""
    from torch._inductor.virtualized import ops as kernel

    def const(v, type_=torch.int32):
        return kernel.constant(v, type_)

    dropped = 16 if dtype == torch.bfloat16 else 13
    bits = kernel.to_dtype_bitcast(value, torch.int32, torch.float32)
    kept_lsb = kernel.bitwise_and(kernel.bitwise_right_shift(bits, const(dropped)), const(1))
    bits = kernel.add(kernel.add(bits, const((1 << (dropped - 1)) - 1)), kept_lsb)
    rounded = kernel.to_dtype_bitcast(kernel.bitwise_and(bits, const(-(1 << dropped))), torch.float32, torch.int32)
    if dtype == torch.float16:
        magnitude = kernel.abs(value)
        subnormal = kernel.mul(kernel.round(kernel.mul(value, const(2.0 ** 24, torch.float32))),
                               const(2.0 ** -24, torch.float32))
        rounded = kernel.where(kernel.lt(magnitude, const(2.0 ** -14, torch.float32)), subnormal, rounded)
        overflow = kernel.gt(kernel.abs(rounded), const(65504.0, torch.float32))
        rounded = kernel.where(overflow, kernel.mul(value, const(math.inf, torch.float32)), rounded)
    return kernel.where(kernel.ne(value, value), value, rounded)


def _lower_round(x, dtype):
    """Inductor's lowering of `rla::rounding` (bf16 or fp16 out of fp32): a pointwise node like
    any cast, which fuses with its neighbours."""
    from torch._inductor import ir

    load = x.make_loader()

    def inner_fn(index):
        from torch._inductor.virtualized import ops as kernel

        return kernel.to_dtype(_rounded_in_fp32(load(index), dtype), dtype, src_dtype=torch.float32)

    return ir.Pointwise.create(device=x.get_device(), dtype=dtype, inner_fn=inner_fn, ranges=list(x.get_size()))


def _register_round_lowering() -> None:
    from torch._inductor.lowering import register_lowering

    register_lowering(torch.ops.rla.rounding.default, type_promotion_kind=None)(_lower_round)


_register_round_lowering()


def upcast_on_aten(graph: Graph, upcast) -> None:
    """Run `upcast` as an ATen call: a kernel of its own, which reads the stored low-precision
    values and writes an fp32 copy for the reader. (An ATen bf16 copy of the rounded value,
    upcast in the reader's kernel, moves fewer bytes but measured no faster at Qwen3-0.6B's
    width, within the benchmark's resolution: benchmarks/upcasts_before_after.py.)

    The call is `rla::upcast` (ATen's `_to_copy` behind an op Inductor has no lowering for, so
    it stays a call; eager_kernels.py), not a per-node fallback of the post-grad graph's
    `prims.convert_element_type`: a prim runs its Python reference implementation on every
    call, 0.1-0.6 ms of host time each, which left a GPU waiting on every layer
    (3.1x the inference wall time at Qwen3-0.6B's width, the same kernels; docs/performance.md#gpu)."""
    source, dtype = upcast.args[0], ops.dtype_of(upcast)
    upcast.target, upcast.args, upcast.kwargs = torch.ops.rla.upcast.default, (source, dtype), {}


def _upcasts_of(rounding) -> list:
    """The widening casts that read a site's rounded output, through views: where one site's
    output enters the next (RMSNorm -> RoPE). Unpinned, Inductor's CPU code generator caches
    the fp32 value a low-precision store came from and hands it to a load + upcast of that
    buffer in the same kernel, skipping the rounding (torch/_inductor/codegen/cpp.py,
    `to_dtype`'s "cse cache trick", off only under emulate_precision_casts). Running these
    upcasts as ATen calls makes them read the stored bf16 values."""
    found, stack = [], list(rounding.users)
    while stack:
        user = stack.pop()
        if ops.moves_data(user):
            stack.extend(user.users)
        elif ops.widens(user):
            found.append(user)
    return found


# Ops Inductor runs as kernels of their own (extern GEMMs on CPU; on CUDA a GEMM template may
# fuse an epilogue, never a prologue holding another kernel's store); sites add theirs
# (`Site.kernel_boundaries`: attention's fused kernels).
_GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_int_mm", "_scaled_mm", "convolution"})


def kernel_boundaries() -> frozenset[str]:
    return _GEMMS | {op for site in registry.SITES for op in site.kernel_boundaries}


def _kernel_apart(rounding, upcast, position: dict) -> bool:
    """Whether `upcast` of a site's rounded output can stay in Inductor's generated code
    instead of running on ATen (which writes an fp32 copy of the tensor: the residual stream
    entering the next residual site, once per layer), provided the rounding is stored.

    True when the upcast's one reader (the upcast is then inlined into the reader's kernel)
    also depends on a kernel boundary (a GEMM, attention) that depends on the value the
    rounding rounds: the reader's kernel runs after that boundary. The caller then makes
    Inductor store the rounding (`inductor_realize_to_strides`, read in `GraphLowering.run_node`)
    in the kernel that computes it, before the boundary: the reader's kernel loads the bf16
    values, which the cache trick cannot bypass (it only serves a store in the same kernel).
    Left unstored, Inductor would inline the rounding into the reader's kernel and the trick
    would drop it. The residual stream: the next residual add also reads the block output, a
    GEMM of the normalised stream. Walks only the nodes between the two: linear in depth."""
    if len(upcast.users) != 1:
        return False
    (reader,) = upcast.users
    source, end = rounding.args[0], position[reader]
    downstream, stack = set(), [source]
    while stack:  # what depends on the rounded value, up to the reader
        for user in stack.pop().users:
            if user not in downstream and position.get(user, end) < end:
                downstream.add(user)
                stack.append(user)
    names = kernel_boundaries()
    boundaries = {n for n in downstream if ops.op_name(n) in names}
    if not boundaries:
        return False
    seen, stack = set(), [n for n in reader.all_input_nodes if n is not upcast]
    while stack:  # what the reader depends on, back to the rounded value
        node = stack.pop()
        if node in boundaries:
            return True
        if node in seen or position.get(node, -1) <= position[source]:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return False


# Pointwise ops whose fp32 result IEEE arithmetic fixes (exact, or one correctly rounded
# operation), so Inductor's generated code and ATen's kernels agree bit for bit (rsqrt is
# 1/sqrt in both on CPU). Checked on CPU; on CUDA, Triton's division is approximate unless
# Inductor's `eager_numerics.division_rounding` is set.
_EXACT_POINTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "abs", "reciprocal", "sqrt", "rsqrt", "where", "clamp",
    "clamp_min", "clamp_max", "maximum", "minimum", "sign", "floor", "ceil", "round", "trunc",
    "copy", "clone", "_to_copy", "convert_element_type", "fill", "full_like", "scalar_tensor",
})
# Reductions whose result does not depend on the order in which elements are combined.
_ORDER_FREE_REDUCTIONS = frozenset({"amax", "amin", "max", "min", "argmax", "argmin", "any", "all"})


def eager_math_nodes(graph: Graph) -> list:
    """The fp32 nodes a rounding reads whose value Inductor computes differently from ATen, in
    a graph rla aligned (one with a site rounding; none otherwise: it compiles as Inductor would).

    Inductor generates its own code for reductions (its vectorised accumulation order is not
    ATen's: RMSNorm's mean(x^2)) and for transcendentals (its vectorised cos/sin are not
    ATen's: RoPE's tables, which the cast bypass hands the sites in fp32). A 1-ulp fp32
    difference there moves a site's one rounding across a boundary on some inputs; running
    the ATen op instead makes the value eager's. Basic arithmetic agrees already.

    Walked back from every rounding of an fp32 value to low precision, the sites' and the
    model's own (issue #23's sweep: the gated RMSNorms of Mamba-2 mixers and linear attention,
    NemotronH and OLMo-hybrid, which no site claims, flipped their rounding on 5 and 1 of 8
    inputs through Inductor's mean), through values wider than it (fp32); low-precision and
    integer values end the walk (rounded, or exact). Only nodes that are an eager op themselves
    are returned, never pieces of an op Inductor decomposed (silu -> exp): running a piece on
    ATen would not reproduce the eager kernel (LayerNorm, softmax and GELU: `eager_kernels.reassemble`).
    """
    found: set = set()
    if not any(is_site_rounding(n) for n in graph.nodes):
        return []
    stack = [n for n in graph.nodes if (ops.is_cast(n) or n.target is torch.ops.rla.rounding.default)
             and ops.is_low_precision(n) and _wide_float(n.args[0])]
    seen = set(stack)
    while stack:
        for value in stack.pop().all_input_nodes:
            if value in seen or value.op != "call_function" or not _wide_float(value):
                continue
            seen.add(value)
            stack.append(value)
            if _differs_from_eager(value):
                found.add(value)
    return [n for n in graph.nodes if n in found]


def pin_eager_math(graph: Graph) -> None:
    """Make Inductor run `eager_math_nodes(graph)` as calls to their ATen ops (per-node
    fallback), so each rounding reads eager's fp32 value; and, in a graph rla aligned, run the
    LayerNorms and softmaxes whose result is rounded to low precision as their ATen kernels
    (`eager_kernels.reassemble`).

    Why the second: eager_kernels.py."""
    if any(is_site_rounding(n) for n in graph.nodes):  # a graph with no site compiles as Inductor would
        for replaced in eager_kernels.reassemble(graph):
            replaced.meta["should_fallback"] = True
    for node in eager_math_nodes(graph):
        node.meta["should_fallback"] = True


def _wide_float(node) -> bool:
    """fp32/fp64 tensors (or tuples of them: var_mean): the values a site's fp32 math reads."""
    val = node.meta.get("val")
    tensors = [v for v in (val if isinstance(val, (list, tuple)) else (val,)) if isinstance(v, torch.Tensor)]
    return bool(tensors) and all(t.dtype.is_floating_point and t.dtype not in ops.LOW_PRECISION for t in tensors)


def _differs_from_eager(node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or str(node.meta.get("original_aten")) != str(target):
        return False  # not an eager op itself (compared by name: the meta may hold a copy)
    name = ops.op_name(node)
    if torch.Tag.reduction in target.tags:
        return name not in _ORDER_FREE_REDUCTIONS
    if name == "pow":  # x ** 2 is x * x in both; other exponents go through pow's own code
        return ops.constant(node.args[1] if len(node.args) > 1 else None) not in (1.0, 2.0)
    return torch.Tag.pointwise in target.tags and name not in _EXACT_POINTWISE
