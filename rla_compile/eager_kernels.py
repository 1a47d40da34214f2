"""LayerNorm, softmax and GELU as ATen's kernels again, where Inductor decomposed them and their
result is rounded (`reassemble`, used by `lowering.pin_eager_math`).

Why (issue #23, LayerNorm families: StableLM, Persimmon, GPT-NeoX): pinned rla under Inductor
gave other logits than rla on eager kernels on 9 / 2 / 4 of 40 inputs. Not at a site: the
first value that differed was always a LayerNorm's bf16 output (a residual stream's norm, one
element in ~1500) or attention's bf16 probabilities. Inductor decomposes `aten.native_layer_norm`
into its own two-pass fp32 `var_mean` and `aten._softmax` into amax/exp/sum/div with its own
vectorised exp; ATen's kernels (RowwiseMoments' Welford, its own exp and sum) land 1 fp32 ulp
away on some rows, and the op's one rounding to bf16 flips there. Plain Inductor does the same
(5 / 3 / 6 of 40 inputs), so it is not the rewrite; but it is a rounding whose fp32 value is
Inductor's math where `pin_rounding` promises eager's, and no per-node fallback reaches it: the
pieces (var_mean, exp) are not eager ops, and running them on ATen one by one would not
reproduce the fused kernel either. So the decomposition is put back together as the one ATen
call eager runs (after: 0 of 40 for all three;
tests/test_invariance.py::test_pinned_layer_norm_and_softmax_round_eager_values).

GELU (exact, erf) likewise: the sweep over every family found CPM-Ant (a GeGLU MLP, aligned as
a swiglu site) differing pinned from eager kernels on 7 of 8 inputs, first at the GELU inside the
site (30887 of 1.1M elements): Inductor's vectorised erf is not ATen's.
"""

from __future__ import annotations

import contextlib
import operator

import torch
from torch.fx import Graph

from . import ops
from .emit import is_eager_kernel

__all__ = ["reassemble"]


def reassemble(graph: Graph) -> list:
    """Each decomposed `native_layer_norm` or `_softmax` (Inductor's
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
        elif ops.is_op(node, "erf") and _piece_of(node, "gelu"):
            found = _gelu_pieces(node)
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


def _gelu_pieces(erf):
    """torch/_decomp gelu (exact, erf): y = (x32 * 0.5) * (1 + erf(x32 * M_SQRT1_2)), from its erf.
    Either the GELU of a low-precision x in x's dtype (x32 = x.float() and y.to(x.dtype) are the
    decomposition's own) or of an fp32 x32 (a GeGLU site's gate, computed in fp32).
    -> (op, args, {index: node}) or None."""
    op = "gelu"
    scaled = erf.args[0]
    if not (ops.is_op(scaled, "mul") and _piece_of(scaled, op) and ops.constant(scaled.args[1]) == 0.7071067811865476):
        return None
    x32 = scaled.args[0]
    shift = _one_user(erf, "add", op)
    y = shift and ops.constant(shift.args[1]) == 1 and _one_user(shift, "mul", op)
    if not y or ops.dtype_of(y) != torch.float32:
        return None
    half = next((a for a in y.args if a is not shift), None)
    if not (ops.is_op(half, "mul") and _piece_of(half, op) and half.args[0] is x32 and ops.constant(half.args[1]) == 0.5):
        return None
    if ops.is_cast(x32) and _piece_of(x32, op) and ops.is_low_precision(x32.args[0]):
        rounding = _rounding_of(y, ops.dtype_of(x32.args[0]), op)
        if rounding is not None:  # GELU in bf16: eager's kernel computes in fp32 and rounds once
            return torch.ops.rla.eager_gelu.default, (x32.args[0],), {None: rounding}
    return torch.ops.rla.eager_gelu.default, (x32,), {None: y}


# The ATen kernels `reassemble` calls (and `lowering.upcast_on_aten`'s widening copy), as ops
# of rla's own: Inductor refuses a post-grad call to an op it has a decomposition for
# (`aten.native_layer_norm`, `aten._softmax`, `aten._to_copy`: "both a fallback and a decomp
# for same op"), and runs an op it has neither for as a call to it. Registered on import of
# this module, which a cached compiled graph's loader imports too. Defined on a Library, not
# with `torch.library.custom_op`: they run only inside compiled graphs, after AOTAutograd, so
# they need no autograd formula, and custom_op's Python autograd wrapper costs about 0.2 ms of
# host time a call (a per-node fallback of the post-grad `prims.convert_element_type` runs its
# Python reference: 0.1-0.6 ms), which left a GPU waiting for the host (docs/performance.md#gpu).
_LIBRARY = torch.library.Library("rla", "FRAGMENT")


def _define(schema: str, kernel) -> None:
    _LIBRARY.define(schema)
    _LIBRARY.impl(schema.split("(")[0], kernel, "CompositeExplicitAutograd")


_define("eager_native_layer_norm(Tensor x, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps) "
        "-> (Tensor, Tensor, Tensor)", torch.ops.aten.native_layer_norm.default)
_define("eager_softmax(Tensor x, int dim) -> Tensor", lambda x, dim: torch.ops.aten._softmax.default(x, dim, False))
_define("eager_gelu(Tensor x) -> Tensor", lambda x: torch.ops.aten.gelu.default(x))
_define("upcast(Tensor x, ScalarType dtype) -> Tensor", lambda x, dtype: torch.ops.aten._to_copy.default(x, dtype=dtype))
# A site's rounding that a widening cast reads in the same generated kernel: `x.to(dtype)` here;
# Inductor lowers it to the rounding written out in fp32 (`lowering.round_in_kernel`).
_define("rounding(Tensor x, ScalarType dtype) -> Tensor", lambda x, dtype: torch.ops.aten._to_copy.default(x, dtype=dtype))


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
