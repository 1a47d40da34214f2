"""Dynamo's graph -> pre-dispatch ATen: the graph the rewrite runs on, before autograd.

Most of Dynamo's graph is traced through to normalised ATen ops. Three kinds of call are
kept whole instead, because tracing through them would change what the graph computes:

- **custom autograd Functions.** Dynamo calls one as the higher-order op
  `autograd_function_apply(fwd_body, bwd_body, *args)`:

      %fwd_body_0 = get_attr[target=fwd_body_0]
      %bwd_body_0 = get_attr[target=bwd_body_0]
      %autograd_function_apply = call_function[target=autograd_function_apply](
          args = (%fwd_body_0, %bwd_body_0, %w, %x), kwargs = {saved_for_backward_idx: [0, 1], ...})

  Traced through, the tracer records the forward body under its `_set_grad_enabled(False)`
  and never sees the backward: the output no longer requires grad and every parameter
  behind it silently gets no gradient. The op stays in the traced graph as it is, so
  AOTAutograd runs the Function's own forward and backward, as for any compiled graph. Its
  body is a kernel boundary: a site inside is not rewritten (`function_bodies`), and the
  report says so (`backend`).
- **activation checkpoints** (`tag_activation_checkpoint`): the body is traced with this
  same interpreter, so that a Function inside keeps its backward too (checkpoint.py says
  how the sites inside are aligned).
- **DTensor conversions** (dtensor.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, make_fx, track_tensor_tree

from . import checkpoint, dtensor

__all__ = ["pre_dispatch", "function_bodies", "FUNCTION_APPLY"]

FUNCTION_APPLY = torch.ops.higher_order.autograd_function_apply
_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


def pre_dispatch(gm: GraphModule, example_inputs: Sequence[Any]) -> GraphModule:
    """Dynamo's torch-level graph -> normalised pre-dispatch ATen, node provenance kept."""
    context = torch._guards.TracingContext.try_get()
    fake_mode = context.fake_mode if context is not None else None
    if fake_mode is None:
        fake_mode = torch._guards.detect_fake_mode(example_inputs) or torch._subclasses.FakeTensorMode()
    fake = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]

    def run(*args):
        return _Retracer(gm).run(*args)

    with fake_mode, fx_traceback.preserve_node_meta(), checkpoint.vanilla_context_fn(gm):
        aten_gm = make_fx(run, tracing_mode="real", pre_dispatch=True, decomposition_table=_opaque_sites())(*fake)
    checkpoint.strip_context_fn(aten_gm)
    return aten_gm


def function_bodies(gm: GraphModule) -> list[tuple[Node, GraphModule]]:
    """(the `autograd_function_apply` node, its forward body traced to pre-dispatch ATen) for
    every custom autograd Function `gm` calls: what the engine would have found inside, for
    the report. The traced bodies are copies; the graph keeps the Function's own."""
    found = []
    for node in gm.graph.find_nodes(op="call_function", target=FUNCTION_APPLY):
        forward = getattr(gm, node.args[0].target)
        inputs = [a.meta.get("val") if isinstance(a, Node) else a for a in node.args[2:]]
        fake_mode = torch._guards.detect_fake_mode([v for v in inputs if isinstance(v, torch.Tensor)])
        with fake_mode or torch._subclasses.FakeTensorMode(), fx_traceback.preserve_node_meta():
            body = make_fx(torch.fx.Interpreter(forward).run, tracing_mode="real", pre_dispatch=True,
                           decomposition_table=_opaque_sites())(*inputs)
        found.append((node, body))
    return found


class _Retracer(dtensor.SubclassAwareInterpreter):
    """Runs Dynamo's graph under pre-dispatch `make_fx`, keeping custom autograd Functions as
    they are and tracing checkpoint bodies with itself."""

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target is FUNCTION_APPLY and get_proxy_mode() is not None:
            return _keep_function(*args, **kwargs)
        if target is _CHECKPOINT and get_proxy_mode() is not None:
            return _trace_checkpoint(*args, **kwargs)
        return super().call_function(target, args, kwargs)


def _keep_function(forward: GraphModule, backward: GraphModule, *args: Any, **kwargs: Any) -> Any:
    """Record `autograd_function_apply(forward, backward, *args)` as one node of the traced
    graph, its bodies as the traced graph's submodules; return its (fake) output."""
    mode = get_proxy_mode()
    tracer = mode.tracer
    with disable_proxy_modes_tracing():
        out = FUNCTION_APPLY(forward, backward, *args, **kwargs)  # runs the forward on fake values
    bodies = []
    for prefix, body in (("fwd_body", forward), ("bwd_body", backward)):
        name = tracer.get_fresh_qualname(prefix)
        tracer.root.register_module(name, body)
        bodies.append(tracer.unwrap_proxy(body))
    proxy_args = pytree.tree_map(tracer.unwrap_proxy, args)
    proxy = tracer.create_proxy("call_function", FUNCTION_APPLY, (*bodies, *proxy_args), kwargs)
    return track_tensor_tree(out, proxy, constant=None, tracer=tracer)


def _trace_checkpoint(body: GraphModule, *args: Any, **kwargs: Any) -> Any:
    """torch's own pre-dispatch rule for `tag_activation_checkpoint`
    (torch/_higher_order_ops/wrap.py, `proxy_mode_key`), with the body traced by `_Retracer`."""
    from torch._higher_order_ops.utils import reenter_make_fx

    tracer = get_proxy_mode().tracer
    with disable_proxy_modes_tracing():
        out = _CHECKPOINT(body, *args, **kwargs)
    flat_args, _ = pytree.tree_flatten(args)
    with fx_traceback.preserve_node_meta():
        traced = reenter_make_fx(_Retracer(body).run)(*flat_args)
    traced.meta[checkpoint.CONTEXT_FN] = body.meta[checkpoint.CONTEXT_FN]
    name = tracer.get_fresh_qualname("wrap_body")
    tracer.root.register_module(name, traced)
    proxy_args = pytree.tree_map(tracer.unwrap_proxy, args)
    proxy_kwargs = pytree.tree_map(tracer.unwrap_proxy, kwargs)
    proxy = tracer.create_proxy("call_function", _CHECKPOINT, (tracer.unwrap_proxy(traced), *proxy_args), proxy_kwargs)
    return track_tensor_tree(out, proxy, constant=None, tracer=tracer)


def _opaque_sites() -> dict:
    """Ops that would hide a site inside one node at pre-dispatch level, decomposed into their
    own math (torch's own decompositions) so the matchers see them: `F.rms_norm` /
    `nn.RMSNorm` trace as one `aten.rms_norm` (then `_fused_rms_norm`) otherwise."""
    from torch._decomp import core_aten_decompositions, decomposition_table

    from .sites import SITES

    table = {**core_aten_decompositions(), **decomposition_table}
    hidden = {name for site in SITES for name in site.opaque_ops}
    return {op: fn for op, fn in table.items() if op.namespace == "aten" and op._opname in hidden}
