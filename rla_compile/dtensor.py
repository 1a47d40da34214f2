"""Tensor-parallel graphs: re-tracing a Dynamo graph whose values are DTensors.

Under tensor parallelism (`parallelize_module` with Colwise/Rowwise/SequenceParallel styles)
Dynamo's graph takes DTensor parameters and converts between DTensors and their local shards
with `DTensor.from_local`, `.to_local()` and `.redistribute()`:

    input_tensor = DTensor.from_local(hidden_states_2, mesh, (Replicate(),), run_check=False)
    linear = torch._C._nn.linear(input_tensor, l_..._q_proj_parameters_weight_, None)
    outputs = linear.redistribute(placements=(Shard(dim=-1),), async_op=True)
    hook_result = outputs.to_local()

The pre-dispatch tracer follows ATen ops on a DTensor (it has a proxy like any input), but
not these conversions: they build a new DTensor (or a local tensor) around an inner tensor
the tracer never saw, and the next op on it fails ("Unable to cast NotImplemented to
Tensor"). `SubclassAwareInterpreter` runs each conversion as one opaque node of the traced
graph instead, so the result is the same pre-dispatch ATen graph as without tensor
parallelism, with DTensor values where the model has them. Sites are matched and rewritten
there, on the DTensor level, before AOTAutograd desugars the subclass into local ops and
collectives: the backward (the collectives' too) is derived from the aligned forward, as for
any other graph.

Only the conversions DTensor's public API offers are run opaquely (`CONVERSIONS`); any other
call on a DTensor is traced as usual. Where the re-trace still fails, the backend compiles the
graph as written and its report gives the error (docs/training.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx import Node
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, get_proxy_slot, track_tensor_tree

__all__ = ["CONVERSIONS", "SubclassAwareInterpreter", "conversion_name"]

# DTensor <-> local-shard conversions, by the name Dynamo's graph calls them with. All of them
# are views, except `redistribute` (a collective: all-gather, reduce-scatter, all-reduce) and
# `full_tensor` (an all-gather).
CONVERSIONS = frozenset({"from_local", "to_local", "redistribute", "full_tensor"})


def conversion_name(node: Node) -> str | None:
    """The DTensor conversion `node` (of Dynamo's graph) calls, or None."""
    if node.op == "call_method" and node.target in CONVERSIONS:
        return node.target
    if node.op == "call_function":
        name = getattr(node.target, "__name__", None)
        module = getattr(node.target, "__module__", "") or ""
        if name in CONVERSIONS and module.startswith("torch.distributed.tensor"):
            return name
    return None


class SubclassAwareInterpreter(torch.fx.Interpreter):
    """Runs Dynamo's graph under pre-dispatch `make_fx`, DTensor conversions as opaque nodes."""

    def run_node(self, node: Node) -> Any:
        name = conversion_name(node)
        if name is None:
            return super().run_node(node)
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        if node.op == "call_method":
            call = _method(name)
        else:
            call = node.target
        return _trace_opaque(name, call, args, kwargs)


def _method(name: str) -> Callable:
    def call(self, *args, **kwargs):
        return getattr(self, name)(*args, **kwargs)

    return call


def _trace_opaque(name: str, call: Callable, args: tuple, kwargs: dict) -> Any:
    """Call `call` on the (fake) values, and record it in the traced graph as one node whose
    inputs are the tensor arguments; everything else (mesh, placements) is bound in."""
    mode = get_proxy_mode()
    if mode is None:  # not tracing: just run it
        return call(*args, **kwargs)
    tracer = mode.tracer
    flat, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, value in enumerate(flat) if isinstance(value, torch.Tensor)]
    symbolic = [value for value in flat if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))]
    if symbolic:  # they would be bound into the node as the values of this trace
        raise NotImplementedError(
            f"rla: DTensor.{name} takes symbolic sizes ({', '.join(map(str, symbolic))}); "
            "re-tracing it under dynamic shapes is not supported"
        )
    with disable_proxy_modes_tracing():
        out = call(*args, **kwargs)
    proxies = []
    for i in positions:
        slot = get_proxy_slot(flat[i], tracer, None)
        if slot is None:
            raise RuntimeError(
                f"rla: the tensor argument {i} of DTensor.{name} was not produced by the traced graph; "
                "cannot re-trace this tensor-parallel graph"
            )
        proxies.append(slot.proxy)
    target = _bound(name, call, flat, spec, positions)
    proxy = tracer.create_proxy("call_function", target, tuple(proxies), {}, name=name)
    track_tensor_tree(out, proxy, constant=None, tracer=tracer)
    return out


def _bound(name: str, call: Callable, flat: list, spec: pytree.TreeSpec, positions: list[int]) -> Callable:
    """`call` as a function of its tensor arguments only, named after the conversion (so that
    the graph reads `to_local(linear)` and `fx.op_name` sees the conversion's name)."""

    def conversion(*tensors):
        values = list(flat)
        for i, tensor in zip(positions, tensors, strict=True):
            values[i] = tensor
        args, kwargs = pytree.tree_unflatten(values, spec)
        return call(*args, **kwargs)

    conversion.__name__ = conversion.__qualname__ = name
    conversion.__module__ = __name__
    return conversion
