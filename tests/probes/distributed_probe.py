"""Train a tiny model under backend="rla" on 2 CPU processes (gloo) and save what rank 0 saw.

    python tests/probes/distributed_probe.py OUT.pt            # 2 ranks: FSDP2, TP
    python tests/probes/distributed_probe.py OUT.pt 2d         # 4 ranks: FSDP2 x TP
    python tests/probes/distributed_probe.py OUT.pt 1d tp_sp   # only the scenarios named

Training scenarios, each a few AdamW steps of tiny Llama (bf16) on the same batch on every rank
(the losses and the full parameters after training, gathered from the shards):
- fsdp_per_layer: FSDP2 `fully_shard` on every decoder layer and on the root (the usual setup)
- fsdp_root: FSDP2 `fully_shard` on the root only (one FSDP unit)
- fsdp_moe: fsdp_per_layer on a tiny Qwen3-MoE with the MoE sites too (`router`,
  `expert_combine`), on eager kernels (Inductor's backward of the experts' grouped matmuls
  differs from eager already without rla: tests/test_coverage.py)

Tensor-parallel scenarios, one forward and backward with a fixed cotangent (the logits and
every parameter gradient, gathered with `full_tensor()`):
- tp: attention and MLP projections Colwise/Rowwise, the rest replicated
- tp_sp: torchtitan's plan (`titan_plan`): sequence-parallel norms, vocabulary-parallel
  embedding and head, on 2 ranks
- tp_sp_as_written: tp_sp compiled with `backend="aot_eager"`, no rla
- tp_sp_inductor: tp_sp compiled by Inductor with `pin_rounding=True` (only when named)
- fsdp_tp: the same plan on the "tp" dimension of a 2 x 2 mesh, FSDP2 `fully_shard` of every
  decoder layer and the root on the "dp" dimension, each decoder layer compiled on its own
  (torchtitan's 2D and its `apply_compile`), on 4 ranks. Compiling the whole model fails in
  torch 2.13 whatever the backend (aot_eager too): the graph of the vocabulary-parallel
  embedding under FSDP2 raises "Mixing fake modes NYI".

Every scenario keeps the rla reports of every rank. tests/test_training.py compares them with
single-process references.
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


def titan_plan():
    """torchtitan's Llama plan (parallelize_llama.apply_tp) with HF's module names:
    (root plan, plan per decoder layer). The residual stream is sharded along the sequence.

    One change: the stream stays a DTensor (`use_local_output=False` where it is made), as HF's
    Llama derives the positions and the causal mask from the embedding output's shape, which
    must be the global one; torchtitan's own model passes local shards and full-length tables."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    root = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    layer = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    return root, layer


def cotangent(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def _gradients(model, backend, per_layer: bool) -> dict:
    """Logits and every parameter gradient (full tensors) of one forward and backward.
    `per_layer`: compile each decoder layer, as torchtitan does, rather than the model."""
    if per_layer:
        for layer in model.model.layers:
            layer.compile(backend=backend)
        logits = model(batch(), use_cache=False).logits
    else:
        logits = torch.compile(model, backend=backend)(batch(), use_cache=False).logits
    logits.backward(cotangent(logits.shape))
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:  # lost: the test's set comparison names it
            continue
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name.replace("_orig_mod.", "")] = grad.detach().clone()
    return {"logits": logits.detach().clone(), "grads": grads}


def _scenario(name: str, mesh) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import rla_compile
    from rla_compile.tiny import tiny_causal_lm

    torch._dynamo.reset()
    model = tiny_causal_lm("qwen3_moe" if name == "fsdp_moe" else "llama")
    backend = rla_compile.Backend(compiler="aot_eager")
    if name == "fsdp_moe":
        backend = rla_compile.Backend(compiler="aot_eager", sites=[*rla_compile.DEFAULT_SITES, *MOE_SITES])
    if name == "tp_sp_inductor":  # not in the default suite: 50-100 s of Inductor compiles
        torch._inductor.config.fx_graph_cache = False
        backend = rla_compile.Backend(pin_rounding=True)
    elif name == "tp_sp_as_written":  # without rla: checks the reference's model of TP's arithmetic
        backend = "aot_eager"
    if name in ("fsdp_per_layer", "fsdp_moe"):
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif name == "fsdp_root":
        fully_shard(model, mesh=mesh)
    elif name == "tp":
        for layer in model.model.layers:
            parallelize_module(layer, mesh, _tp_plan())
    else:  # tp_sp, tp_sp_as_written, tp_sp_inductor, fsdp_tp
        tp = mesh["tp"] if name == "fsdp_tp" else mesh
        root, per_layer = titan_plan()
        for layer in model.model.layers:
            parallelize_module(layer, tp, per_layer)
        parallelize_module(model, tp, root)
        if name == "fsdp_tp":
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
    if name.startswith("fsdp_") and name != "fsdp_tp":
        result = {"losses": _train(model, backend), "params": _full_state(model)}
    else:
        result = _gradients(model, backend, per_layer=name == "fsdp_tp")
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, [r.to_dict() for r in getattr(backend, "reports", [])])
    return result | {"reports": reports}  # per rank


SCENARIOS = {"1d": ("fsdp_per_layer", "fsdp_root", "fsdp_moe", "tp", "tp_sp", "tp_sp_as_written"), "2d": ("fsdp_tp",)}
MOE_SITES = ("router", "expert_combine")


def _worker(rank: int, world: int, port: int, out: str, which: str, names: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    if which == "2d":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    try:
        results = {name: _scenario(name, mesh) for name in names or SCENARIOS[which]}
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
    which = sys.argv[2] if len(sys.argv) > 2 else "1d"
    world = 4 if which == "2d" else 2
    names = tuple(sys.argv[3:])  # a subset of the scenarios, for debugging
    mp.spawn(_worker, args=(world, _free_port(), sys.argv[1], which, names), nprocs=world)
