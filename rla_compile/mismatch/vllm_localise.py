"""Runs in its own process for `localise` with a vLLM stack: starts the engine with forward
hooks on its model, scores the sequences teacher-forced (as `vllm_worker` does) and saves
every recorded point in HF's layout, named as `localise` names HF's points. A `decode` stack
generates each sequence after its prompt instead (`vllm_worker.decode_logprobs`: the prefill,
then one decode step per token, all sequences in one batch), and its points are gathered
from every step (`regather_decode`).

    python -m rla_compile.mismatch.vllm_localise REQUEST.json

The hooks go on right after the weights load, before vLLM's warm-up compiles the model.
Eager (`vllm-eager`): they fire like any module hook. Compiled (`vllm-inductor`): Dynamo
traces each hook where it inlines the module, so every recorded tensor is an extra output of
the graph vLLM compiles (the rla pass included) and the values are what that compiled graph
computed. An extra output makes Inductor store that value to memory, and a stored bf16 value
is rounded where a fused kernel might have kept it in fp32; so the worker also says whether
the engine's logprobs equal an unrecorded engine's (`localise` checks, bit for bit).

vLLM runs a batch flattened, [tokens, hidden]; the embedding's input ids give each sequence's
offset, and every point is regathered to HF's [B, T, ...] (RoPE's to [B, heads, T, head_dim]).
Logits are what vLLM computed for the prompt logprobs (positions 0..T-2, one call per
sequence), matched to their sequence by their input rows.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def _install(record: list, hook=None) -> None:
    """Hook every model vLLM loads in this process (one engine: one model): `hook(model, record)`,
    by default every localisation point (`_hook`)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    load = BaseModelLoader.load_model

    def load_model(self, *args, **kwargs):
        model = load(self, *args, **kwargs)
        (hook or _hook)(model, record)
        return model

    BaseModelLoader.load_model = load_model


def _recorder(model, record: list, what: str) -> tuple:
    """(the decoder, the list its hooks append to): each forward's input ids go first; a hook on
    the whole model moves the list into `record` after each forward. Dynamo replays a traced
    append to an outside list as an assignment of the list's whole contents, so across decode
    steps the compiled graph would otherwise leave only the last forward's points."""
    decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise ValueError(f"{what} needs a decoder model with `.model.layers`; {type(model).__name__} has none")
    inner: list = []

    def flush(module, args, out):
        record.extend(inner)
        inner.clear()

    model.register_forward_hook(flush)
    decoder.embed_tokens.register_forward_pre_hook(lambda module, args: inner.append(("input ids", "tokens", args[0].clone())))
    return decoder, inner


def _hook(model, record: list) -> None:
    """Forward (pre-)hooks that append (name, kind, tensor) to `record`, cloned: eager vLLM
    normalises and rotates in place. The hooks inside the decoder (the module vLLM compiles)
    write to `_recorder`'s list."""
    decoder, inner = _recorder(model, record, "localise")

    def keep(name, kind, pick=lambda out: out[0] if isinstance(out, tuple) else out):
        return lambda module, args, out: inner.append((name, kind, pick(out).clone()))

    def heads(x, size):  # [tokens, heads * head_dim] -> [tokens, heads, head_dim]
        return x.reshape(x.shape[0], -1, size).clone()

    def keep_input(name, kind):
        return lambda module, args: inner.append((name, kind, args[0].clone()))

    rotaries = []
    for i, layer in enumerate(decoder.layers):
        p, attn = f"model.layers.{i}", layer.self_attn
        layer.input_layernorm.register_forward_hook(keep(f"{p}.input_layernorm", "norm"))
        attn.qkv_proj.register_forward_hook(keep(f"{p}.self_attn.q_proj (output)", "matmul",
                                                 lambda out, q=attn.q_size: out[0][..., :q]))
        attn.qkv_proj.register_forward_hook(keep(f"{p}.self_attn.v_proj (output)", "matmul",
                                                 lambda out, q=attn.q_size, kv=attn.kv_size: out[0][..., q + kv:]))
        if not any(attn.rotary_emb is r for r in rotaries):  # one module may serve every layer: number its calls
            rotaries.append(attn.rotary_emb)
            attn.rotary_emb.register_forward_hook(
                lambda module, args, out: inner.extend([("rope (query)", "rotary", heads(out[0], module.head_size)),
                                                        ("rope (key)", "rotary", heads(out[1], module.head_size))]))
        attn.o_proj.register_forward_pre_hook(keep_input(f"{p}.self_attn.o_proj (input)", "attn"))
        attn.register_forward_hook(keep(f"{p}.self_attn", "matmul"))
        layer.post_attention_layernorm.register_forward_hook(keep(f"{p}.post_attention_layernorm", "norm"))
        layer.mlp.down_proj.register_forward_pre_hook(keep_input(f"{p}.mlp.down_proj (input)", "activation"))
        layer.mlp.register_forward_hook(keep(f"{p}.mlp", "matmul"))
    decoder.norm.register_forward_hook(keep("model.norm", "norm"))
    model.logits_processor.register_forward_hook(
        lambda module, args, out: record.append(("lm_head", "head", (args[1].clone(), out.clone()))))


def hook_routes(model, record: list) -> None:
    """Record which experts each MoE router of `model` chooses: vLLM's own capture callback
    (`set_capture_fn`, called with the logical expert ids, [tokens, k], before any EPLB mapping)
    on every MoE layer's router, set before the model compiles so Dynamo traces it (an extra
    integer output of the compiled graph: no floating-point value changes); each forward's
    input ids first, as `_hook` records them. The routes are `("model.layers.{i}.mlp (expert
    ids)", "routes", ids as float)`: exact for any expert count below 2**24, and `_assemble`'s
    NaN marks what no forward computed."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runners = [m for m in model.modules() if isinstance(m, MoERunner)]
    if not runners:
        raise ValueError(f"{type(model).__name__} has no MoE layer (vLLM's MoERunner) whose routes could be recorded")
    unsupported = [type(r.router).__name__ for r in runners if not isinstance(r.router, BaseRouter)]
    if unsupported:
        raise ValueError(f"the MoE routers {sorted(set(unsupported))} take no capture callback (vLLM's BaseRouter does)")
    _, inner = _recorder(model, record, "recording routes")
    for runner in runners:
        name = f"model.layers.{runner.layer_id}.mlp (expert ids)"
        runner.router.set_capture_fn(lambda ids, name=name: inner.append((name, "routes", ids.to(torch.float32))))


def routes(points: dict[str, tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The recorded routes of `_assemble`'s points as expert ids, [B, T, MoE layers, k] (int64),
    layers in order."""
    named = sorted((int(n.split(".")[2]), t) for n, (kind, t) in points.items() if kind == "routes")
    if not named:
        raise RuntimeError("no MoE router was called in vLLM's forwards")
    return torch.stack([t for _, t in named], dim=2).long()


def order(layers: int, names: set[str]) -> list[str]:
    """The points in HF's execution order (the order `localise` records HF's in)."""
    per_layer = ["input_layernorm", "self_attn.q_proj (output)", "self_attn.v_proj (output)", "self_attn.rope (query)",
                 "self_attn.rope (key)", "self_attn.o_proj (input)", "self_attn", "post_attention_layernorm",
                 "mlp.down_proj (input)", "mlp"]
    every = [f"model.layers.{i}.{p}" for i in range(layers) for p in per_layer]
    return [n for n in every + ["model.norm", "lm_head", "logprobs"] if n in names]


def _forwards(record: list) -> list[tuple[torch.Tensor, list]]:
    """The record split per model forward: (its input ids, its points in order, RoPE's
    numbered by layer, the head's calls included)."""
    forwards: list[tuple[torch.Tensor, list]] = []
    for name, kind, tensor in record:
        if kind == "tokens":
            forwards.append((tensor, []))
            rope_calls = 0
        elif not forwards:
            raise RuntimeError(f"{name} was recorded before any forward's input ids")
        else:
            if kind == "rotary":
                name = f"model.layers.{rope_calls // 2}.self_attn.{name}"
                rope_calls += 1
            forwards[-1][1].append((name, kind, tensor))
    return forwards


def _offsets(ids: torch.Tensor, prompts: list[list[int]]) -> list[int]:
    """Each prompt's start in a forward's flattened batch."""
    offsets, used = [], set()
    for prompt in prompts:
        prompt = torch.tensor(prompt, dtype=ids.dtype)
        start = next((o for o in range(len(ids) - len(prompt) + 1)
                      if o not in used and torch.equal(ids[o:o + len(prompt)], prompt)), None)
        if start is None:
            raise RuntimeError("a sequence is not contiguous in vLLM's batch; cannot map its tokens")
        offsets.append(start)
        used.add(start)
    return offsets


def _decode_rows(ids: torch.Tensor, tokens: list[int], expected: list[int]) -> list[int]:
    """The row of each sequence in a decode step's batch: the one fed the sequence's token at
    this position; where several sequences feed the same token, the row the sequence had at
    the step before (`expected`: vLLM keeps its persistent batch in order)."""
    rows, taken = [None] * len(tokens), set()
    candidates = [[r for r in range(len(ids)) if int(ids[r]) == t] for t in tokens]
    for b, found in sorted(enumerate(candidates), key=lambda item: len(item[1])):
        free = [r for r in found if r not in taken]
        if not free:
            raise RuntimeError(f"sequence {b}'s token is not in the decode step's batch; cannot map its rows")
        row = free[0] if len(free) == 1 else (expected[b] if expected[b] in free else None)
        if row is None:
            raise RuntimeError(f"sequence {b} could feed any of rows {free} of a decode step; cannot map it")
        rows[b] = row
        taken.add(row)
    return rows


def _assemble(forwards: list, placements: list[list[tuple[torch.Tensor, torch.Tensor]]], batch: int,
              length: int, lengths: list[int] | None = None) -> dict[str, tuple[str, torch.Tensor]]:
    """Every point but the head's in HF's layout [B, length, ...] (RoPE's [B, heads, length,
    head_dim]): `placements[f][b]` = (rows of forward f, positions they hold) for sequence b.
    `lengths`: sequence b's points cover positions 0..lengths[b]-1 (default all `length`); a
    shorter sequence's positions past its end stay NaN."""
    points: dict[str, tuple[str, torch.Tensor]] = {}
    for (_, recorded), placed in zip(forwards, placements, strict=True):
        for name, kind, tensor in recorded:
            if kind == "head":
                continue
            if name not in points:
                points[name] = (kind, torch.full((batch, length, *tensor.shape[1:]), float("nan"), dtype=tensor.dtype))
            out = points[name][1]
            for b, (rows, positions) in enumerate(placed):
                out[b, positions] = tensor[rows]
    lengths = lengths or [length] * batch
    for name, (kind, tensor) in points.items():
        if any(tensor[b, :n].isnan().any() for b, n in enumerate(lengths)):
            raise RuntimeError(f"{name}: vLLM's forwards did not compute every position of every sequence")
        if kind == "rotary":
            points[name] = (kind, tensor.transpose(1, 2))  # HF's [B, heads, T, head_dim]
    return points


def _logits(forwards: list, final: torch.Tensor, vocab: int) -> torch.Tensor:
    """The head's output at every position of `final` ([B, T, hidden], the final norm's output),
    matched to its position by its input rows: prompt logprobs and sampling call each other."""
    batch, length = final.shape[:2]
    waiting: dict[bytes, list[tuple[int, int]]] = {}
    for b in range(batch):
        for pos in range(length):
            waiting.setdefault(final[b, pos].contiguous().view(torch.uint8).numpy().tobytes(), []).append((b, pos))
    logits = torch.full((batch, length, vocab), float("nan"))
    found = torch.zeros(batch, length, dtype=torch.bool)
    for _, recorded in forwards:
        for _, kind, value in recorded:
            if kind != "head":
                continue
            hidden, out = value
            logits = logits.to(out.dtype)
            for row in range(hidden.shape[0]):
                places = waiting.get(hidden[row].contiguous().view(torch.uint8).numpy().tobytes())
                if places:
                    b, pos = places.pop(0)
                    logits[b, pos], found[b, pos] = out[row], True
    if not found.all():
        raise RuntimeError("could not match vLLM's logits to every position of every sequence")
    return logits


def _ordered(points: dict, logprobs: torch.Tensor) -> list[tuple[str, str, torch.Tensor]]:
    points["logprobs"] = ("logprobs", logprobs)
    layers = 1 + max(int(n.split(".")[2]) for n in points if n.startswith("model.layers."))
    return [(n, *points[n]) for n in order(layers, set(points))]


def prompt_placements(forwards: list, sequences: list[list[int]]) -> list:
    """Where prompt scoring's one forward over the whole batch puts each sequence, for `_assemble`."""
    if len(forwards) != 1:
        raise RuntimeError(f"expected one forward over the whole batch, vLLM ran {len(forwards)} (chunked prefill?)")
    offsets = _offsets(forwards[0][0], sequences)
    return [[(torch.arange(o, o + len(s)), torch.arange(len(s))) for o, s in zip(offsets, sequences)]]


def regather(record: list, sequences: list[list[int]], logprobs: torch.Tensor) -> list[tuple[str, str, torch.Tensor]]:
    """The points of one forward over the whole batch (prompt scoring), in HF's layout and order."""
    batch, length = len(sequences), len(sequences[0])
    forwards = _forwards(record)
    points = _assemble(forwards, prompt_placements(forwards, sequences), batch, length)
    points["lm_head"] = ("head", _logits(forwards, points["model.norm"][1][:, :-1], logprobs.shape[-1]))
    return _ordered(points, logprobs)


def decode_placements(forwards: list, sequences: list[list[int]], prompt_lengths: list[int]) -> list:
    """Where a generation's forwards (`_forwards`) put each sequence, for `_assemble`: the
    prompts' prefill in one forward (sequence b's first prompt_lengths[b] tokens), then one decode
    step per generated token but the last, each feeding every sequence its next token."""
    generated = {len(s) - p for s, p in zip(sequences, prompt_lengths, strict=True)}
    if len(generated) != 1 or min(prompt_lengths) < 1:
        raise ValueError(f"every sequence generates as many tokens after a prompt of at least one token; got "
                         f"prompts of {prompt_lengths} tokens in sequences of {[len(s) for s in sequences]}")
    steps = generated.pop() - 1
    if len(forwards) != 1 + steps:
        raise RuntimeError(f"expected the prompts' prefill in one forward and {steps} decode steps; vLLM ran "
                           f"{len(forwards)} forwards (chunked prefill?)")
    offsets = _offsets(forwards[0][0], [s[:p] for s, p in zip(sequences, prompt_lengths)])
    placed = [[(torch.arange(o, o + p), torch.arange(p)) for o, p in zip(offsets, prompt_lengths)]]
    rows = sorted(range(len(sequences)), key=offsets.__getitem__)  # the prefill's order: the first step's guess
    expected = [rows.index(b) for b in range(len(sequences))]
    for step, (ids, _) in enumerate(forwards[1:]):
        expected = _decode_rows(ids, [s[p + step] for s, p in zip(sequences, prompt_lengths)], expected)
        placed.append([(torch.tensor([r]), torch.tensor([p + step])) for r, p in zip(expected, prompt_lengths)])
    return placed


def regather_decode(record: list, sequences: list[list[int]], prompt_tokens: int,
                    logprobs: torch.Tensor) -> list[tuple[str, str, torch.Tensor]]:
    """The points of a generation (`vllm_worker.decode_logprobs`): the prompts' prefill, then one
    decode step per token, each feeding every sequence's last token. In HF's layout and order,
    at positions 0..T-2: the last token is sampled, never fed, so it has no points."""
    batch, length = len(sequences), len(sequences[0])
    forwards = _forwards(record)
    points = _assemble(forwards, decode_placements(forwards, sequences, [prompt_tokens] * batch), batch, length - 1)
    points["lm_head"] = ("head", _logits(forwards, points["model.norm"][1], logprobs.shape[-1]))
    return _ordered(points, logprobs)


def main(request_path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the hooks live in this process: so must the model
    request = json.loads(open(request_path).read())
    record: list = []
    _install(record)
    from .vllm_worker import decode_logprobs, engine, prompt_logprobs, reports

    llm, config = engine(request)
    record.clear()  # the warm-up's and the compile's runs
    if request.get("decode_after"):
        logprobs = decode_logprobs(llm, request["sequences"], request["decode_after"])
        points = regather_decode(record, request["sequences"], request["decode_after"], logprobs)
    else:
        logprobs = prompt_logprobs(llm, request["sequences"])
        points = regather(record, request["sequences"], logprobs)
    torch.save({"points": points, "logprobs": logprobs, "reports": reports(config)}, request["out"])


if __name__ == "__main__":
    main(sys.argv[1])
