"""Small, IR-agnostic helpers over ATen FX graphs.

The engine and the site matchers run on two IRs: the pre-dispatch ATen graph the ``rla``
backend re-traces (``aten.to.dtype``, ``aten.type_as``, ``aten.square``, ...) and Inductor's
post-grad graph (``prims.convert_element_type``, decomposed ops). Helpers therefore look at
an op's *name* (its overload packet), never at one exact overload, so a matcher written once
reads both.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch
from torch.fx import Graph, Node

__all__ = [
    "LOW_PRECISION",
    "op_name",
    "is_op",
    "dtype_of",
    "shape_of",
    "is_low_precision",
    "is_cast",
    "strip_casts",
    "widens",
    "casts_between",
    "moves_data",
    "constant",
    "same_value",
    "normalize_dim",
    "module_path",
    "describe",
    "source_line",
    "call_nodes",
    "dtype_name",
]

LOW_PRECISION = (torch.bfloat16, torch.float16)

# Printed graphs and site tables say bf16[2, 8, 64]; reports and notes torch's own bfloat16.
_SHORT_DTYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "bool",
}


def dtype_name(dtype: torch.dtype | str, short: bool = False) -> str:
    """"bfloat16" (torch's name, as reports keep it) or, `short`, "bf16" (printed graphs, site
    tables). `dtype` may also be such a name, e.g. a report's."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), dtype)
    name = str(dtype).removeprefix("torch.")
    return _SHORT_DTYPE_NAMES.get(dtype, name) if short else name

# Ops that only change dtype. `type_as` and `to.other` take their dtype from a second tensor;
# all of them read the value to convert from args[0].
_CAST_OPS = frozenset({"to", "_to_copy", "type_as", "convert_element_type", "_to_dtype"})

# Ops that move or alias data without arithmetic: rounding commutes with them exactly.
_VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "unsqueeze",
        "squeeze",
        "expand",
        "transpose",
        "permute",
        "t",
        "slice",
        "select",
        "clone",
        "contiguous",
        "alias",
        "flatten",
        "unflatten",
        "expand_as",
        "view_as",
    }
)


def op_name(node: Node) -> str | None:
    """`aten.mul.Tensor` -> "mul", `prims.convert_element_type.default` -> "convert_element_type"."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    target = node.target
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        return target._opname
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", None)


def is_op(node: object, *names: str) -> bool:
    return isinstance(node, Node) and op_name(node) in names


def _val(node: object):
    if not isinstance(node, Node):
        return None
    val = node.meta.get("val", node.meta.get("example_value"))
    return val if isinstance(val, torch.Tensor) else None


def dtype_of(node: object) -> torch.dtype | None:
    val = _val(node)
    return val.dtype if val is not None else None


def shape_of(node: object) -> tuple | None:
    val = _val(node)
    return tuple(val.shape) if val is not None else None


def is_low_precision(node: object) -> bool:
    return dtype_of(node) in LOW_PRECISION


def is_cast(node: object) -> bool:
    """A node that changes only the floating dtype of args[0] (same shape, float in and out)."""
    if not is_op(node, *_CAST_OPS):
        return False
    src = node.args[0]
    src_dtype, dst_dtype = dtype_of(src), dtype_of(node)
    if src_dtype is None or dst_dtype is None:
        return False
    if not (src_dtype.is_floating_point and dst_dtype.is_floating_point):
        return False
    if shape_of(src) != shape_of(node):
        return False
    val, src_val = _val(node), _val(src)
    return val.device == src_val.device


def widens(node: object) -> bool:
    """A cast that keeps the value exactly (bf16/fp16 -> fp32, fp32 -> fp64, a same-dtype copy)."""
    if not is_cast(node):
        return False
    src, dst = dtype_of(node.args[0]), dtype_of(node)
    return src == dst or torch.finfo(dst).bits > torch.finfo(src).bits


def strip_casts(node: object) -> object:
    """Follow exact upcasts back to the value they convert. A rounding (fp32 -> bf16) is a value
    of its own: `y.to(bf16).float()` is the rounded y, not y, so the walk stops at it."""
    while widens(node):
        node = node.args[0]
    return node


def casts_between(node: object, source: object) -> set[Node]:
    """The cast nodes on the chain node -> ... -> source (empty when node is source)."""
    found = set()
    while node is not source and is_cast(node):
        found.add(node)
        node = node.args[0]
    return found


# Ops that only move data from args[0] (views, gathers, splits): rounding commutes with them.
_MOVE_OPS = _VIEW_OPS | {"index", "index_select", "gather", "split", "split_with_sizes", "chunk", "unbind", "getitem"}


def moves_data(node: object) -> bool:
    """Whether node's result is a rearrangement of args[0]'s elements (no arithmetic)."""
    return is_op(node, *_MOVE_OPS) and isinstance(node.args[0], Node)


def same_value(a: object, b: object, depth: int = 8) -> bool:
    """a and b compute the same value: the same node, or the same data movement (views,
    splits, getitems, casts) of the same values — graphs repeat `x[..., :h]` or a reshape
    per use instead of sharing one node."""
    if a is b:
        return True
    if depth == 0 or not (isinstance(a, Node) and isinstance(b, Node)):
        return False
    if a.target != b.target or not (moves_data(a) or is_cast(a)) or len(a.args) != len(b.args):
        return False
    if a.kwargs != b.kwargs:
        return False
    for x, y in zip(a.args, b.args):
        if isinstance(x, Node) or isinstance(y, Node):
            if not same_value(x, y, depth - 1):
                return False
        elif x != y:
            return False
    return True


def constant(arg: object) -> float | None:
    """A Python scalar argument (FX keeps scalars inline), else None."""
    if isinstance(arg, bool):
        return None
    if isinstance(arg, (int, float)):
        return float(arg)
    return None


def normalize_dim(dims: object, ndim: int) -> list[int] | None:
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
        return None
    return sorted(d % ndim for d in dims)


def module_path(node: Node) -> str:
    """Dotted path of the innermost module that created the node, e.g. `model.layers.0.mlp`."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _clean_module_path(path)


def _clean_module_path(path: str) -> str:
    # Dynamo spells module paths as L['self'].model.layers[0].mlp or L['self']._modules['x'].
    for junk in ("L['self'].", "L['self']", "G['", "L['"):
        path = path.replace(junk, "")
    path = path.replace("_modules['", "").replace("']", "").replace("['", ".")
    path = path.replace("[", ".").replace("]", "")
    return path.strip(".")


def describe(node: Node) -> str:
    """`rsqrt at model.layers.0.input_layernorm`: how near misses name a node."""
    return f"{node.name} at {module_path(node) or 'top level'}"


def source_line(node: Node) -> str:
    """`file.py:123 in fn` of the user code that created the node, when the graph kept it."""
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.strip().splitlines() if line.strip().startswith("File ")]
    # The innermost frame outside torch itself: `F.rms_norm(...)` names the caller, not functional.py.
    outside_torch = [f for f in frames if "/torch/" not in f.split(",")[0]]
    for line in reversed(outside_torch or frames):
        if line.startswith("File "):
            # File "/path/to/file.py", line 123, in forward
            parts = line.split(",")
            path = parts[0][len('File "') : -1]
            lineno = parts[1].strip().removeprefix("line ") if len(parts) > 1 else "?"
            fn = parts[2].strip().removeprefix("in ") if len(parts) > 2 else ""
            return f"{path.rsplit('/', 1)[-1]}:{lineno} in {fn}".strip()
    return ""


def call_nodes(graph: Graph, *names: str) -> Iterator[Node]:
    for node in graph.nodes:
        if node.op == "call_function" and (not names or op_name(node) in names):
            yield node


# -- the tag on every site rounding -----------------------------------------------------------

ROUNDING_TAG = "rla_round"  # node.meta["custom"][ROUNDING_TAG] = site kind, on every output rounding


def is_site_rounding(node: Node) -> bool:
    return ROUNDING_TAG in (node.meta.get("custom") or {})


def tag_rounding(node: Node, kind: str) -> None:
    """Mark `node` as a `kind` site's output rounding, which Inductor must keep."""
    node.meta["custom"] = {**(node.meta.get("custom") or {}), ROUNDING_TAG: kind}
    # Read by Inductor's pointwise lowering: round here even when the consumer fuses.
    node.meta["low_precision_pointwise_barrier"] = True
