"""Tensor parallelism on one process: the arithmetic of every rank, written out with plain
tensors, so a tensor-parallel run can be compared bit for bit with a single-process one.

Tensor parallelism changes the model's arithmetic outside the sites, and rla does not touch
it: a row-wise projection sums the ranks' bf16 partial products (all-reduce or
reduce-scatter), and a gradient that several ranks contribute to is summed across ranks after
each rank summed its own contributions. `shard_like_tp(model, plan)` rebuilds that in one
process, on an ordinary (HF) model:

- a column-wise projection computes each rank's output shard from its weight shard and
  concatenates them (the all-gather of `Shard(-1)` outputs; per-head attention and the
  element-wise SwiGLU do not care that the shards are computed together);
- a row-wise projection adds the ranks' partial products, rank 0 first;
- the input a column-wise projection reads is one alias per rank (`x.view_as(x)`): autograd
  sums a rank's own gradient contributions on its alias first, then the ranks' sums, as the
  collective does. Under the plain plan every projection converts its input separately
  (`DTensor.from_local` per projection: one all-reduce each); under sequence parallelism
  the projections of one module share the gathered input (one reduce-scatter);
- a sequence-parallel norm normalises each rank's sequence shard separately, so its weight
  gradient is the sum of the ranks' bf16 gradients.

Values on the residual stream are kept whole: a sequence shard of an element-wise value is
the same numbers. Sites are left to whatever runs them: the contract reference
(`hf_reference.contract_sites`) for the reference, rla for "rla on one rank".
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

RANKS = 2
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


class RankAliases:
    """The per-rank copies of a projection's input (see the module docstring)."""

    def __init__(self, shared: bool):
        self.shared = shared
        self._last: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    def __call__(self, x: torch.Tensor, ranks: int) -> list[torch.Tensor]:
        if not self.shared:  # one conversion (one collective) per projection
            alias = x.view_as(x)
            return [alias] * ranks
        if self._last is None or self._last[0] is not x:  # one gathered input, one copy per rank
            self._last = (x, [x.view_as(x) for _ in range(ranks)])
        return self._last[1]


class ShardedLinear(nn.Module):
    """`linear` split over `ranks` like ColwiseParallel (dim 0) or RowwiseParallel (dim 1)."""

    def __init__(self, linear: nn.Linear, rowwise: bool, aliases: RankAliases | None, ranks: int = RANKS):
        super().__init__()
        assert linear.bias is None, "the tiny Llama's projections have no bias"
        self.rowwise, self.aliases, self.ranks = rowwise, aliases, ranks
        self.shards = nn.ParameterList(
            nn.Parameter(w.clone()) for w in linear.weight.detach().chunk(ranks, dim=1 if rowwise else 0)
        )

    def forward(self, x):
        if self.rowwise:  # each rank's partial product of its input shard; the collective adds them
            parts = [F.linear(xr, w) for xr, w in zip(x.chunk(self.ranks, dim=-1), self.shards, strict=True)]
            return functools.reduce(torch.add, parts)
        inputs = self.aliases(x, self.ranks)
        return torch.cat([F.linear(xr, w) for xr, w in zip(inputs, self.shards, strict=True)], dim=-1)

    def full_grad(self) -> torch.Tensor:
        return torch.cat([w.grad for w in self.shards], dim=1 if self.rowwise else 0)


class SequenceShardedNorm(nn.Module):
    """A norm run on each rank's sequence shard (dim 1) separately, like SequenceParallel."""

    def __init__(self, norm: nn.Module, ranks: int = RANKS):
        super().__init__()
        self.norm, self.ranks = norm, ranks

    def forward(self, x):
        mode = _contract_mode()
        s = mode.fp32_sum(x) if mode is not None else None
        pieces = []
        for i, piece in enumerate(x.chunk(self.ranks, dim=1)):
            if s is not None:  # the reference's residual norm reads the fp32 sum of its shard
                mode.sums[id(piece)] = (piece, s.chunk(self.ranks, dim=1)[i])
            pieces.append(self.norm(piece))
        return torch.cat(pieces, dim=1)


def _contract_mode():
    for mode in torch.overrides._get_current_function_mode_stack():
        if hasattr(mode, "fp32_sum"):
            return mode
    return None


def shard_like_tp(model, sequence_parallel: bool, ranks: int = RANKS):
    """Replace `model`'s projections (and, with `sequence_parallel`, torchtitan's plan: norms,
    the head) by their per-rank arithmetic, in place; `grads(model)` reads the gradients back
    under the unsharded model's parameter names."""
    for layer in model.model.layers:
        attn, mlp = RankAliases(sequence_parallel), RankAliases(sequence_parallel)
        for name in COLWISE + ROWWISE:
            parent, attr = layer.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
            aliases = attn if name.startswith("self_attn") else mlp
            setattr(parent, attr, ShardedLinear(getattr(parent, attr), name in ROWWISE, aliases, ranks))
        if sequence_parallel:
            layer.input_layernorm = SequenceShardedNorm(layer.input_layernorm, ranks)
            layer.post_attention_layernorm = SequenceShardedNorm(layer.post_attention_layernorm, ranks)
    if sequence_parallel:  # the embedding's vocabulary shards add zeros elsewhere: exact
        model.model.norm = SequenceShardedNorm(model.model.norm, ranks)
        model.lm_head = ShardedLinear(model.lm_head, False, RankAliases(True), ranks)
    return model


def grads(model) -> dict[str, torch.Tensor]:
    """Every parameter gradient under the names of the unsharded model, shards concatenated."""
    out, done = {}, set()
    for name, module in model.named_modules():
        if isinstance(module, ShardedLinear):
            out[f"{name}.weight"] = module.full_grad()
            done.update(id(p) for p in module.parameters())
        elif isinstance(module, SequenceShardedNorm):
            out[f"{name}.weight"] = module.norm.weight.grad
            done.add(id(module.norm.weight))
    out.update({name: p.grad for name, p in model.named_parameters() if id(p) not in done})
    return out
