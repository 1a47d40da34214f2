"""Activation-checkpointed regions: `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`
(HF's `gradient_checkpointing_enable()` too) reaches the backend as a call of the
`tag_activation_checkpoint` higher-order op on a body subgraph:

    %wrap_body_0 = get_attr[target=wrap_body_0]
    %tag_activation_checkpoint = call_function[target=tag_activation_checkpoint](args = (%wrap_body_0, %x, ...))

The op has to stay (AOTAutograd recomputes what it tags in the backward), so the sites inside
are aligned in the body graph itself. Values that cross a body's boundary are what they were
in the model (bf16 tensors): a residual sum made in one checkpointed layer and normalised in
the next is read rounded, like across a graph break (docs/training.md).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch.fx import GraphModule

__all__ = ["CONTEXT_FN", "bodies", "strip_context_fn", "vanilla_context_fn"]

_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
CONTEXT_FN = "_checkpoint_context_fn"


def bodies(gm: GraphModule) -> list[GraphModule]:
    """The checkpointed bodies `gm` calls, in call order."""
    return [getattr(gm, node.args[0].target) for node in gm.graph.find_nodes(op="call_function", target=_CHECKPOINT)]


def _vanilla_context():
    """What torch runs for a checkpoint without `context_fn`: recompute everything."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(lambda *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE)


class _DropContextFnWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed" not in record.getMessage()


@contextlib.contextmanager
def vanilla_context_fn(gm: GraphModule) -> Iterator[None]:
    """Let a pre-dispatch trace run plain checkpoints.

    torch 2.13's pre-dispatch rule for the op reads `body.meta["_checkpoint_context_fn"]`,
    which Dynamo sets only when the user passed a `context_fn` (KeyError otherwise). Give
    such bodies the context torch itself uses for a plain checkpoint while tracing (without
    torch's "context_fn is passed" warning, which would be about our stand-in), and take it
    off the traced bodies afterwards (`strip_context_fn`) so they stay plain checkpoints.
    """
    added = [body for body in bodies(gm) if CONTEXT_FN not in body.meta]
    for body in added:
        body.meta[CONTEXT_FN] = _vanilla_context
    wrap_log, quiet = logging.getLogger("torch._higher_order_ops.wrap"), _DropContextFnWarning()
    wrap_log.addFilter(quiet)
    try:
        yield
    finally:
        wrap_log.removeFilter(quiet)
        for body in added:
            del body.meta[CONTEXT_FN]


def strip_context_fn(gm: GraphModule) -> None:
    """Undo `vanilla_context_fn`'s stand-in on the traced graph's bodies."""
    for body in bodies(gm):
        if body.meta.get(CONTEXT_FN) is _vanilla_context:
            del body.meta[CONTEXT_FN]

