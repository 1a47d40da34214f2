"""Emit new ATen nodes into a graph, each with its fake-tensor `meta["val"]`.

The sites that only move roundings re-type the graph's own nodes (engine.py). A site whose
contract computes differently from what the graph wrote (attention: a fused SDPA kernel
becomes matmul-softmax-matmul in fp32) emits its replacement with an `Emitter`: every call
inserts one node before a fixed point of the graph and computes its value on the graph's fake
tensors, so later passes (AOTAutograd, Inductor) read dtypes and shapes as for a traced node.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.fx import Graph, Node

__all__ = ["Emitter", "EAGER_KERNEL_TAG", "is_eager_kernel"]

aten = torch.ops.aten

# node.meta["custom"][EAGER_KERNEL_TAG] = site kind: an emitted op whose fp32 result a site
# rounding reads only further on (attention's softmax, read by P · V). With `pin_rounding` it
# runs as ATen's kernel (backend.pin_eager_math), as the model's own rounded softmaxes do; the
# tag survives AOTAutograd and Inductor's decomposition like the rounding tag.
EAGER_KERNEL_TAG = "rla_eager_kernel"


def is_eager_kernel(node: Node) -> bool:
    return EAGER_KERNEL_TAG in (node.meta.get("custom") or {})


class Emitter:
    """Inserts nodes before `before`; `post_grad`: casts are `prims.convert_element_type`
    (Inductor's post-grad IR), else `aten._to_copy` (pre-dispatch ATen)."""

    def __init__(self, graph: Graph, before: Node, post_grad: bool = False):
        self.graph, self.before, self.post_grad = graph, before, post_grad
        self.meta = {k: v for k, v in before.meta.items() if k in ("nn_module_stack", "stack_trace")}
        self.emitted: list[Node] = []
        self.note = ""  # what the emitted computation says about itself in the site's report

    def call(self, target, *args, name: str | None = None, **kwargs) -> Node:
        """`target(*args, **kwargs)` as a new node (named `name` when given, made unique by
        FX); its value computed on the fake inputs."""
        def val(a):
            return a.meta["val"] if isinstance(a, Node) else a

        fake_args = torch.utils._pytree.tree_map(val, (args, kwargs))
        tensors = [v for v in torch.utils._pytree.tree_leaves(fake_args) if isinstance(v, torch.Tensor)]
        fake_mode = torch._guards.detect_fake_mode(tensors)
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            value = target(*fake_args[0], **fake_args[1])
        with self.graph.inserting_before(self.before):
            node = self.graph.create_node("call_function", target, tuple(args), kwargs, name=name)
        node.meta.update(self.meta)
        node.meta["val"] = value
        self.emitted.append(node)
        return node

    # -- the few ops sites need ------------------------------------------------------------
    def cast(self, value: Node, dtype: torch.dtype, name: str | None = None) -> Node:
        if self.post_grad:
            return self.call(torch.ops.prims.convert_element_type.default, value, dtype, name=name)
        return self.call(aten._to_copy.default, value, dtype=dtype, name=name)

    def round(self, value: Node, dtype: torch.dtype, mode: str = "nearest", name: str | None = None) -> Node:
        """fp32 `value` rounded to `dtype` (config.ROUNDING_MODES): "nearest" is the cast;
        "toward_zero" (bf16) first clears the 16 bits bf16 drops, so the cast that follows is
        exact. The gradient passes as through the cast: value + (cleared - value).detach()."""
        if mode == "nearest":
            return self.cast(value, dtype, name)
        if mode != "toward_zero" or dtype != torch.bfloat16:
            raise NotImplementedError(f"rounding {mode!r} to {dtype} is not implemented (toward_zero: bf16 only)")
        bits = self.call(aten.view.dtype, value, torch.int32)
        cleared = self.call(aten.view.dtype, self.call(aten.bitwise_and.Scalar, bits, -65536), torch.float32)
        dropped = self.call(aten.detach.default, self.call(aten.sub.Tensor, cleared, value))
        return self.cast(self.add(value, dropped, name=f"{value.name}_toward_zero"), dtype, name)

    def fp32(self, value: Node) -> Node:
        """`value` upcast to fp32 (unchanged when it is fp32 already, or not floating)."""
        dtype = value.meta["val"].dtype
        if dtype == torch.float32 or not dtype.is_floating_point:
            return value
        return self.cast(value, torch.float32, f"{value.name}_fp32")

    def mul(self, a: Node, b: Node | float, name: str | None = None) -> Node:
        return self.call(aten.mul.Tensor, a, b, name=name)

    def div(self, a: Node, b: Node | float, name: str | None = None) -> Node:
        return self.call(aten.div.Tensor, a, b, name=name)

    def add(self, a: Node, b: Node | float, name: str | None = None) -> Node:
        return self.call(aten.add.Tensor, a, b, name=name)

    def tanh(self, a: Node) -> Node:
        return self.call(aten.tanh.default, a)

    def matmul(self, a: Node, b: Node, name: str | None = None) -> Node:
        return self.call(aten.matmul.default, a, b, name=name)

    def transpose_last(self, a: Node) -> Node:
        """aᵀ over the last two dims."""
        return self.call(aten.transpose.int, a, -2, -1)

    def softmax(self, a: Node, dim: int = -1, kind: str = "") -> Node:
        """fp32 softmax; `kind`: the site whose rounding reads it, tagged for `pin_rounding`
        to run it as ATen's kernel (`EAGER_KERNEL_TAG`)."""
        node = self.call(aten._softmax.default, a, dim, False, name="probs")
        if kind:
            node.meta["custom"] = {**(node.meta.get("custom") or {}), EAGER_KERNEL_TAG: kind}
        return node

    def masked_fill(self, a: Node, mask: Node, value: float) -> Node:
        return self.call(aten.masked_fill.Scalar, a, mask, value)

    def where(self, cond: Node, a: Node, b: Node | float) -> Node:
        if isinstance(b, Node):
            return self.call(aten.where.self, cond, a, b)
        return self.call(aten.where.ScalarOther, cond, a, b)

    def logical_not(self, a: Node) -> Node:
        return self.call(aten.logical_not.default, a)

    def repeat_heads(self, x: Node, groups: int | Node) -> Node:
        """[B, H, S, E] -> [B, H * groups, S, E], each head `groups` times in a row (HF's
        repeat_kv: unsqueeze, expand, reshape; SDPA's enable_gqa: repeat_interleave). Sizes
        other than `groups` stay -1 and the flatten infers them: dynamic shapes need no
        size nodes (`groups` itself may be one: the graph's own)."""
        if isinstance(groups, int) and groups == 1:
            return x
        wide = self.call(aten.expand.default, self.call(aten.unsqueeze.default, x, 2), [-1, -1, groups, -1, -1])
        return self.call(aten.flatten.using_ints, wide, 1, 2, name=f"{x.name}_repeated")

    def laid_out_like(self, value: Node, like: Any) -> Node:
        """`value` with the memory layout (stride order) of `like`, the value it replaces: the
        graph may rely on it — a `.transpose(1, 2).contiguous()` that Dynamo dropped because
        SDPA's output was already laid out [B, T, H, D], then a `view`. A permute, a
        contiguous copy and the inverse permute; nothing when the layouts agree or a stride
        is symbolic (dynamic shapes: the graph then does not rely on a static layout)."""
        new = value.meta.get("val")
        if not isinstance(like, torch.Tensor) or not isinstance(new, torch.Tensor) or like.dim() != new.dim():
            return value
        strides = like.stride()
        if not all(isinstance(x, int) for x in (*strides, *like.shape)) or tuple(new.stride()) == tuple(strides):
            return value
        order = sorted(range(like.dim()), key=lambda d: (-strides[d], d))  # outermost in memory first
        if order == list(range(like.dim())):
            return value
        physical = self.call(aten.permute.default, value, order)
        dense = self.call(aten.clone.default, physical, memory_format=torch.contiguous_format)
        return self.call(aten.permute.default, dense, [order.index(d) for d in range(like.dim())])

    def above_diagonal(self, rows: int, cols: int, device: torch.device) -> Node:
        """bool[rows, cols], True strictly above the diagonal: what a causal mask removes
        (SDPA's is_causal: top-left aligned)."""
        ones = self.call(aten.ones.default, [rows, cols], dtype=torch.bool, device=device)
        return self.call(aten.triu.default, ones, 1)
