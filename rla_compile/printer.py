"""A stable, readable text form of FX graphs: one line per node, dtype and shape, no strides,
devices or addresses. Golden tests and debug dumps use it, so it must not change with torch's
own `print_readable` formatting.

    %mul_4: bf16[2, 8, 64] = aten.mul.Tensor(%arg3_1, %to_7)
    %_to_copy: bf16[2, 8, 64] = aten._to_copy.default(%mul_4, dtype=bf16)  # rla: round rmsnorm
"""

from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node

from . import ops
from .ops import ROUNDING_TAG

__all__ = ["format_graph"]


def _arg(a: object) -> str:
    if isinstance(a, Node):
        return f"%{a.name}"
    if isinstance(a, torch.dtype):
        return ops.dtype_name(a, short=True)
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]"
    if isinstance(a, float):
        return repr(a)
    if isinstance(a, torch.device):
        return "device"
    return str(a)


def _type(node: Node) -> str:
    dtype, shape = ops.dtype_of(node), ops.shape_of(node)
    if dtype is None:
        return ""
    dims = ", ".join(str(d) for d in shape)
    return f": {ops.dtype_name(dtype, short=True)}[{dims}]"


def _target(node: Node) -> str:
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return getattr(target, "__name__", str(target))


def format_graph(graph: Graph | GraphModule, only: set[str] | None = None) -> str:
    """Text of `graph`; with `only`, just the nodes whose names are in it (and the output)."""
    graph = graph.graph if isinstance(graph, GraphModule) else graph
    lines = []
    for node in graph.nodes:
        if only is not None and node.name not in only and node.op != "output":
            continue
        if node.op == "placeholder":
            lines.append(f"%{node.name}{_type(node)} = input")
        elif node.op == "get_attr":
            lines.append(f"%{node.name}{_type(node)} = attr {node.target}")
        elif node.op == "output":
            lines.append(f"return {_arg(node.args[0])}")
        else:
            args = [_arg(a) for a in node.args]
            args += [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
            line = f"%{node.name}{_type(node)} = {_target(node)}({', '.join(args)})"
            tag = (node.meta.get("custom") or {}).get(ROUNDING_TAG)
            if tag:
                line += f"  # rla: round {tag}"
            lines.append(line)
    return "\n".join(lines)
