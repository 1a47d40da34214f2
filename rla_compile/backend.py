"""The `rla` torch.compile backend: re-trace, align, hand to the inner compiler.

    torch.compile(model, backend="rla")                          # entry point, no import needed
    torch.compile(model, backend="rla", options={"sites": ["rope"]})
    be = rla_compile.backend(pin_rounding=True); torch.compile(model, backend=be); be.reports

Training needs the rewrite before autograd: a forward-only rewrite after AOTAutograd leaves a
backward derived from the old forward (contract.md). So the backend re-traces Dynamo's graph
to pre-dispatch ATen (normalised ops, no autograd yet), aligns it, and gives the result to
`compile_fx` (or AOTAutograd with eager kernels), which derives the backward from the fp32
forward. Inductor's caches key on the rewritten graph, and on the uuid of the pass that pins
the site roundings, which covers rla's code and options. Tensor-parallel graphs (DTensor
inputs) are re-traced the same way, their DTensor conversions kept as opaque nodes (dtensor.py).
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
from dataclasses import replace
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, GraphModule

from . import checkpoint, ops
from .config import Options
from .engine import align, is_site_rounding
from .debug import Rewrite, record, snapshot, wants_graphs
from .emit import is_eager_kernel
from .report import GraphReport, SiteReport
from .retrace import function_bodies, pre_dispatch

__all__ = ["Backend", "backend", "align_function", "inspect", "dynamo_backend", "rla_backend", "KeepSiteRounding", "eager_math_nodes", "pin_eager_math"]

log = logging.getLogger(__name__)


class KeepSiteRounding(CustomGraphPass):
    """Post-grad pass: keep every site's output rounding through Inductor's fusion and, with
    `pin_rounding`, round the same fp32 value as eager kernels do.

    With `emulate_precision_casts=False` Inductor computes fused pointwise chains in fp32 and
    drops in-kernel casts, including a site's output rounding when its consumer fuses into
    the same kernel. The per-node barrier makes the lowering round at exactly these nodes.

    With `pin_rounding`, the fp32 reductions and transcendentals that a rounding reads (a
    site's or, in a graph with a site, the model's own), and LayerNorm and softmax, also run
    on ATen's kernels, as under `inner="aot_eager"` (`pin_eager_math`): each rounding then
    rounds the same fp32 value whatever the inner compiler.
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
    upcasts of a rounded site output run on ATen (`_upcasts_of`, `upcast_on_aten`); pinned,
    the fp32 math a rounding reads runs on ATen (`pin_eager_math`)."""
    from torch._inductor import config as inductor_config

    pinned = inductor_config.emulate_precision_casts  # pin_rounding, or the user's own setting
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in graph.nodes:
        if node.op == "call_function" and is_site_rounding(node):  # not a saved rounding read by the backward
            node.meta["low_precision_pointwise_barrier"] = True
            if not pinned:
                for upcast in _upcasts_of(node):
                    if _kernel_apart(node, upcast, position):
                        node.meta["inductor_realize_to_strides"] = True  # stored once, in bf16
                    else:
                        upcast_on_aten(graph, upcast)
    if pinned:
        pin_eager_math(graph)


def upcast_on_aten(graph: Graph, upcast) -> None:
    """Run `upcast` as an ATen call (per-node fallback): a kernel of its own, which reads the
    stored low-precision values and writes an fp32 copy for the reader. (An ATen bf16 copy of
    the rounded value, upcast in the reader's kernel, moves fewer bytes but measured no faster
    at Qwen3-0.6B's width, within the benchmark's resolution: benchmarks/upcasts_before_after.py.)"""
    upcast.meta["should_fallback"] = True


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


# Ops Inductor runs as kernels of their own (extern GEMMs and attention on CPU; on CUDA a GEMM
# template may fuse an epilogue, never a prologue holding another kernel's store).
_KERNEL_BOUNDARIES = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "_int_mm", "_scaled_mm", "convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
})


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
    boundaries = {n for n in downstream if ops.op_name(n) in _KERNEL_BOUNDARIES}
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
    ATen would not reproduce the eager kernel (LayerNorm and softmax: `_eager_kernel_roundings`).
    """
    found: set = set()
    if not any(is_site_rounding(n) for n in graph.nodes):
        return []
    stack = [n for n in graph.nodes if ops.is_cast(n) and ops.is_low_precision(n) and _wide_float(n.args[0])]
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
    (`_eager_kernel_roundings`).

    Why the second (issue #23, LayerNorm families: StableLM, Persimmon, GPT-NeoX): pinned
    rla under Inductor gave other logits than rla on eager kernels on 9 / 2 / 4 of 40
    inputs. Not at a site: the first value that differed was always a LayerNorm's bf16
    output (a residual stream's post-attention or final norm, one element in ~1500) or
    attention's bf16 probabilities. Inductor decomposes `aten.native_layer_norm` into its
    own two-pass fp32 `var_mean` (a vectorised sum, then a sum of squared deviations) and
    `aten._softmax` into amax/exp/sum/div with its own vectorised exp; ATen's kernels
    (RowwiseMoments' Welford, its own exp and sum) land 1 fp32 ulp away on some rows, and
    the op's one rounding to bf16 flips there. Plain Inductor does the same (5 / 3 / 6 of 40
    inputs), so it is not the rewrite; but it is a rounding whose fp32 value is Inductor's
    math where `pin_rounding` promises eager's, and no per-node fallback reaches it: the
    pieces (var_mean, exp) are not eager ops, and running them on ATen one by one would not
    reproduce the fused kernel either. So the decomposition is put back together as the
    one ATen call eager runs (after: 0 of 40 for all three;
    tests/test_invariance.py::test_pinned_layer_norm_and_softmax_round_eager_values)."""
    if any(is_site_rounding(n) for n in graph.nodes):  # a graph with no site compiles as Inductor would
        for replaced in _eager_kernel_roundings(graph):
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


def _eager_kernel_roundings(graph: Graph) -> list:
    """For `pin_eager_math`: each decomposed `native_layer_norm` or `_softmax` (Inductor's
    post-grad pieces, tagged `original_aten`) whose result is rounded to low precision,
    replaced by a call to the ATen op itself on the same inputs; returns the new calls.

    Matched strictly on the decompositions' shapes (torch/_refs `native_layer_norm`,
    torch/_decomp `_softmax`); anything else is left to Inductor."""
    replaced, erased = [], set()
    for node in list(graph.nodes):
        if node in erased or node.op != "call_function":
            continue
        if ops.is_op(node, "var_mean") and _piece_of(node, "native_layer_norm"):
            found = _layer_norm_pieces(node)
        elif ops.is_op(node, "exp") and _piece_of(node, "_softmax"):
            found = _softmax_pieces(node)
        else:
            continue
        if found is not None:
            replaced.append(_call_eager_kernel(graph, *found, erased))
    return replaced


def _piece_of(node, op: str) -> bool:
    """Whether `node` is a piece of Inductor's decomposition of aten.`op`."""
    return isinstance(node, torch.fx.Node) and str(node.meta.get("original_aten", "")).startswith(f"aten.{op}.")


def _one_user(node, name: str, op: str):
    """The one user of `node` that is aten.`name` and a piece of aten.`op`, else None."""
    users = [u for u in node.users if ops.is_op(u, name) and _piece_of(u, op)]
    return users[0] if len(users) == 1 else None


def _getitem(node, index: int):
    found = [u for u in node.users if u.target is operator.getitem and u.args[1] == index]
    return found[0] if len(found) == 1 else None


def _rounding_of(node, dtype, op: str):
    """The decomposition's own cast of `node` to `dtype` (its output rounding), else None."""
    found = [u for u in node.users if ops.is_cast(u) and ops.dtype_of(u) == dtype and _piece_of(u, op)]
    return found[0] if len(found) == 1 else None


def _layer_norm_pieces(var_mean):
    """torch/_refs native_layer_norm: var, mean = var_mean(x32, trailing dims, correction=0,
    keepdim=True); rstd = rsqrt(var + eps); y = (x32 - mean) * rstd [* w] [+ b]. Either of a
    low-precision x (x32 = x.float(); y.to(x.dtype), and on CPU mean, rstd .to(x.dtype), saved
    for the backward, are the decomposition's own) or of an fp32 x32 whose y a cast rounds
    (OLMo: F.layer_norm(x.float()).to(bf16)).
    -> (op, args, {output index: the node it replaces}) or None."""
    op = "native_layer_norm"
    x32 = var_mean.args[0]
    low = ops.is_cast(x32) and _piece_of(x32, op) and ops.is_low_precision(x32.args[0])
    if not (low or ops.dtype_of(x32) == torch.float32):
        return None
    x, shape = (x32.args[0] if low else x32), ops.shape_of(x32)
    dims = ops.normalize_dim(var_mean.args[1] if len(var_mean.args) > 1 else None, len(shape)) if shape else None
    if (not dims or dims != list(range(len(shape) - len(dims), len(shape)))
            or var_mean.kwargs.get("correction") != 0 or not var_mean.kwargs.get("keepdim")):
        return None
    var, mean = _getitem(var_mean, 0), _getitem(var_mean, 1)
    shift = var and _one_user(var, "add", op)
    rstd = shift and _one_user(shift, "rsqrt", op)
    centred = mean and _one_user(mean, "sub", op)
    y = centred and _one_user(centred, "mul", op)
    if not (rstd and y and tuple(centred.args) == (x32, mean) and set(y.args) == {centred, rstd}
            and shift.args[0] is var and (eps := ops.constant(shift.args[1])) is not None):
        return None
    normalized = tuple(shape[-len(dims):])
    weight = bias = None
    step = _one_user(y, "mul", op)
    if step is not None and step.args[0] is y:
        y, weight = step, step.args[1]
    step = _one_user(y, "add", op)
    if step is not None and step.args[0] is y:
        y, bias = step, step.args[1]
    if any(p is not None and not (isinstance(p, torch.fx.Node) and tuple(ops.shape_of(p) or ()) == normalized)
           for p in (weight, bias)):
        return None
    if not low:  # the model's own rounding of the fp32 result: the output to replace is y
        if not any(ops.is_cast(u) and ops.is_low_precision(u) for u in y.users):
            return None  # an fp32 LayerNorm that no rounding reads: nothing to flip
        return torch.ops.rla.eager_native_layer_norm.default, (x, list(normalized), weight, bias, eps), {0: y}
    rounding = _rounding_of(y, ops.dtype_of(x), op)
    if rounding is None:
        return None
    outputs = {0: rounding}
    for index, stat in ((1, mean), (2, rstd)):
        if (saved := _rounding_of(stat, ops.dtype_of(x), op)) is not None:
            outputs[index] = saved
    return torch.ops.rla.eager_native_layer_norm.default, (x, list(normalized), weight, bias, eps), outputs


def _softmax_pieces(e):
    """torch/_decomp _softmax, from its exp: p = e / sum(e, dim, keepdim) with e =
    exp(x32 - amax(x32, dim, keepdim)), or e = exp(where(finite, (x - amax(x)) * c, x32 -
    amax(x32))) where Inductor's joint-graph pattern folded a scale into softmax(x32 = x * c).
    Either the softmax of a low-precision x in x's dtype (x32 = x.float() and p.to(x.dtype)
    are the decomposition's own) or of an fp32 x32 whose result a cast rounds (HF:
    softmax(scores, dtype=float32).to(bf16)). -> (op, args, {index: node}) or None."""
    op = "_softmax"
    shifted = e.args[0]
    if ops.is_op(shifted, "where") and _piece_of(shifted, op) and len(shifted.args) == 3:
        shifted = shifted.args[2]  # the unscaled branch: x32 - amax(x32)
    if not (ops.is_op(shifted, "sub") and len(shifted.args) == 2 and ops.is_op(shifted.args[1], "amax")):
        return None
    x32, amax = shifted.args
    dims = amax.args[1] if len(amax.args) > 1 else None
    keepdim = amax.args[2] if len(amax.args) > 2 else amax.kwargs.get("keepdim", False)
    if not (amax.args[0] is x32 and isinstance(dims, (list, tuple)) and len(dims) == 1 and keepdim):
        return None
    total = _one_user(e, "sum", op)
    p = total and _one_user(total, "div", op)
    if not (p and tuple(p.args) == (e, total) and list(total.args[1]) == list(dims)
            and ops.dtype_of(p) == torch.float32 == ops.dtype_of(x32)):
        return None
    if ops.is_cast(x32) and _piece_of(x32, op) and ops.is_low_precision(x32.args[0]):
        rounding = _rounding_of(p, ops.dtype_of(x32.args[0]), op)
        if rounding is not None:  # softmax in bf16: eager's kernel computes in fp32 and rounds once
            return torch.ops.rla.eager_softmax.default, (x32.args[0], dims[0]), {None: rounding}
    if not any(ops.is_cast(u) and ops.is_low_precision(u) for u in p.users) and not is_eager_kernel(p):
        return None  # an fp32 softmax that no rounding reads (nor a site's, further on: attention's P): nothing to flip
    return torch.ops.rla.eager_softmax.default, (x32, dims[0]), {None: p}


# The ATen kernels `_eager_kernel_roundings` calls, as ops of rla's own: Inductor refuses a
# post-grad call to an op it has a decomposition for (`aten.native_layer_norm`, `aten._softmax`:
# "both a fallback and a decomp for same op"), and runs an op it has neither for as a call to
# it. Registered on import of this module, which a cached compiled graph's loader imports too.
@torch.library.custom_op("rla::eager_native_layer_norm", mutates_args=())
def _eager_native_layer_norm(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
                             bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.ops.aten.native_layer_norm.default(x, normalized_shape, weight, bias, eps)


@_eager_native_layer_norm.register_fake
def _(x, normalized_shape, weight, bias, eps):
    return torch.ops.aten.native_layer_norm.default(x, normalized_shape, weight, bias, eps)


@torch.library.custom_op("rla::eager_softmax", mutates_args=())
def _eager_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.ops.aten._softmax.default(x, dim, False)


@_eager_softmax.register_fake
def _(x, dim):
    return torch.ops.aten._softmax.default(x, dim, False)


def _call_eager_kernel(graph: Graph, target, args, outputs: dict, erased: set):
    """Insert `target(*args)` just before the node replacing output 0 (or the only output),
    which every input precedes; `outputs` maps an output index (None: a single tensor) to the
    node whose uses the output takes over (a saved statistic only if its readers come later).
    The decomposition's pieces left without readers are erased (and added to `erased`)."""
    from torch._guards import detect_fake_mode

    main = outputs.get(0, outputs.get(None))
    vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        val = target(*vals)
    with graph.inserting_before(main):
        call = graph.call_function(target, tuple(args))
    call.meta.update({k: v for k, v in main.meta.items() if k in ("stack_trace", "nn_module_stack", "original_aten")})
    call.meta["val"] = val
    position = {n: i for i, n in enumerate(graph.nodes)}
    stack = []
    for index, old in outputs.items():
        if any(position[user] < position[call] for user in old.users):
            continue
        if index is None:
            new = call
        else:
            with graph.inserting_after(call):
                new = graph.call_function(operator.getitem, (call, index))
            new.meta["val"] = val[index]
        old.replace_all_uses_with(new)
        stack.append(old)
    while stack:  # the pieces nothing reads any more, back to the op's inputs
        node = stack.pop()
        if node not in erased and node.op == "call_function" and not node.users and not node.is_impure():
            inputs = node.all_input_nodes
            graph.erase_node(node)
            erased.add(node)
            stack.extend(inputs)
    return call


def _align(gm: GraphModule, options: Options) -> GraphReport:
    """Align the graph and the bodies of its activation-checkpointed regions: one report."""
    report = align(gm, options, name=_graph_name())
    for body in checkpoint.bodies(gm):
        inner = align(body, options, name=report.graph)
        report.sites.extend(inner.sites)
        report.near_misses.extend(inner.near_misses)
    for graph in (gm, *checkpoint.bodies(gm)):
        report.sites.extend(_function_sites(graph, options))
    return report


def _function_sites(gm: GraphModule, options: Options) -> list[SiteReport]:
    """The sites inside custom autograd Functions' forward bodies, reported as skipped: the
    Function's own forward and backward run as written (retrace.py)."""
    found = []
    for node, body in function_bodies(gm):
        where = ops.source_line(node) or ops.module_path(node) or node.name
        reason = (f"inside a custom autograd.Function (applied at {where}): its own forward and backward "
                  "run as written, a kernel boundary rla does not rewrite")
        inner = align(body, options, name="function body")  # a traced copy: the graph keeps the Function's own body
        found += [replace(s, status="skipped", reason=reason, source=s.source or where) for s in inner.sites]
    return found


def _rank() -> int | None:
    """This process's rank when torch.distributed is initialised (reports are per rank)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return None


def _graph_name() -> str:
    compile_id = torch._guards.CompileContext.current_compile_id()
    return str(compile_id) if compile_id is not None else "graph"


class Backend:
    """A torch.compile backend with rla's options; `.reports` has one report per graph.

    With `keep_graphs=True`, `.rewrites` also keeps each graph's text before and after.
    """

    def __init__(self, options: Options, keep_graphs: bool = False):
        self.options = options
        self.keep_graphs = keep_graphs
        self.reports: list[GraphReport] = []
        self.rewrites: list[Rewrite] = []

    def __repr__(self) -> str:
        return f"rla_compile.Backend({self.options})"

    def __call__(self, gm: GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        start = time.perf_counter()
        try:
            aten_gm = pre_dispatch(gm, example_inputs)
        except Exception as error:
            subclass = _subclass_input(example_inputs)
            if subclass is None:
                raise
            return self._compile_unaligned(gm, example_inputs, kwargs.get("mode"), subclass, error)
        retraced = time.perf_counter()
        keep = self.keep_graphs or wants_graphs(self.options.debug_dir)
        before = snapshot(aten_gm) if keep else None
        report = _align(aten_gm, self.options)
        report.seconds = {"retrace": retraced - start, "rewrite": time.perf_counter() - retraced}
        report.rank = _rank()
        self.reports.append(report)
        log.info("%s", report.summary())
        if before is not None:
            rewrite = record(report, before, aten_gm, self.options.debug_dir)
            if self.keep_graphs:
                self.rewrites.append(rewrite)
        return self._compile(aten_gm, example_inputs, kwargs.get("mode"))

    def _compile_unaligned(
        self, gm: GraphModule, example_inputs: Sequence[Any], mode: str | None, subclass: str, error: Exception
    ) -> Callable:
        """A graph with tensor-subclass inputs (DTensor) is re-traced through its DTensor
        conversions (dtensor.py). Where that still fails (a subclass or a call rla does not
        know), compile the graph as written and say exactly why in the report rather than
        fail the training step."""
        message = str(error).strip().splitlines()
        reason = type(error).__name__ + (f": {message[0]}" if message else "")
        note = (
            f"not aligned: graph inputs are tensor subclasses ({subclass}) and rla's pre-dispatch "
            f"re-trace failed ({reason}); compiled as written"
        )
        report = GraphReport(_graph_name(), note=note, rank=_rank())
        self.reports.append(report)
        log.warning("%s", report.summary())
        return self._compile(gm, example_inputs, mode)

    def _compile(self, gm: GraphModule, example_inputs: Sequence[Any], mode: str | None) -> Callable:
        if self.options.inner == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            return aot_eager(gm, example_inputs)

        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        patches: dict[str, Any] = dict(list_mode_options(mode)) if mode else {}
        patches.update(self.options.inductor_settings())
        user_pass = patches.get("post_grad_custom_post_pass")
        pin = KeepSiteRounding(self.options)
        patches["post_grad_custom_post_pass"] = pin if user_pass is None else [*_as_list(user_pass), pin]
        return compile_fx(gm, example_inputs, config_patches=patches)


def _subclass_input(example_inputs: Sequence[Any]) -> str | None:
    """The type name of the first tensor-subclass input (DTensor), or None."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for value in example_inputs:
        if isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value):
            return type(value).__name__
    return None


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def backend(options: Options | dict | None = None, **kwargs: Any) -> Backend:
    """A backend object for `torch.compile(model, backend=...)`, keeping its reports.

    Keyword arguments are the options (see `Options`): sites, inner, pin_rounding, debug, inductor.
    """
    if isinstance(options, Options):
        if kwargs:
            raise TypeError("pass either an Options object or keyword options, not both")
        return Backend(options)
    return Backend(Options.from_dict({**(options or {}), **kwargs}))


def align_function(fn: Callable, *example_inputs: Any, **options: Any) -> Rewrite:
    """Trace `fn` (a function or module) on the inputs, align it, and return the first graph's
    report with its text before and after. Runs the rewritten graph once on eager kernels."""
    options.setdefault("inner", "aot_eager")
    be = Backend(Options.from_dict(options), keep_graphs=True)
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=be, fullgraph=True)(*example_inputs)
    finally:
        torch._dynamo.reset()
    if not be.rewrites:
        raise RuntimeError(f"torch.compile produced no graph for {fn!r}: nothing to inspect")
    return be.rewrites[0]


def dynamo_backend(gm: GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None, options: dict | None = None) -> Callable:
    """The function registered as `backend="rla"` (entry point `torch_dynamo_backends`).

    Reports go to the `rla_compile` logger (`TORCH_LOGS=+rla_compile`); use
    `rla_compile.backend(...)` to keep them on an object.
    """
    be = Backend(Options.from_dict(options))
    return be(gm, example_inputs, mode=mode)


# Earlier names, kept working: `inspect` (it shadowed the standard module on import) and the
# entry point's `rla_backend` (installed package metadata may still name it).
inspect = align_function
rla_backend = dynamo_backend
