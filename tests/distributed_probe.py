"""Train a tiny model under backend="rla" on 2 CPU processes (gloo) and save what rank 0 saw.

    python tests/distributed_probe.py OUT.pt

Scenarios, each a few AdamW steps of tiny Llama (bf16) on the same batch on every rank:
- fsdp_per_layer: FSDP2 `fully_shard` on every decoder layer and on the root (the usual setup)
- fsdp_root: FSDP2 `fully_shard` on the root only (one FSDP unit)
- tp: tensor parallel (DTensor) attention and MLP projections, Colwise/Rowwise

For each: the losses, the full parameters after training (gathered from the shards) and the
rla reports. tests/test_training.py compares them with a single-process contract reference.
Every rank gets the same batch, so FSDP's gradient reduce-scatter averages two identical
gradients: (g + g) / 2 == g exactly, and the result can be compared bit for bit.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
STEPS = 3
LR = 1e-2


def batch() -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def optimizer(params):
    return torch.optim.AdamW(params, lr=LR)


def _train(model, backend) -> list[float]:
    compiled = torch.compile(model, backend=backend)
    opt, ids, losses = optimizer(model.parameters()), batch(), []
    for _ in range(STEPS):
        loss = compiled(ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full_state(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name.replace("_orig_mod.", "")] = full.detach().clone()
    return out


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ColwiseParallel(), RowwiseParallel()
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    return {**{n: col for n in names}, "self_attn.o_proj": row, "mlp.down_proj": row}


def _scenario(name: str, mesh) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import rla_compile
    from rla_compile.tiny import tiny_causal_lm

    torch._dynamo.reset()
    model = tiny_causal_lm("llama")
    if name == "fsdp_per_layer":
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif name == "fsdp_root":
        fully_shard(model, mesh=mesh)
    else:
        for layer in model.model.layers:
            parallelize_module(layer, mesh, _tp_plan())
    backend = rla_compile.backend(inner="aot_eager")
    losses = _train(model, backend)
    return {"losses": losses, "params": _full_state(model), "reports": [r.to_dict() for r in backend.reports]}


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    try:
        results = {name: _scenario(name, mesh) for name in ("fsdp_per_layer", "fsdp_root", "tp")}
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    mp.spawn(_worker, args=(_free_port(), sys.argv[1]), nprocs=WORLD)
