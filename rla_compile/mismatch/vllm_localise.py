"""Runs in its own process for `localise` with a vLLM stack: starts the engine with forward
hooks on its model, scores the sequences teacher-forced (as `vllm_worker` does) and saves
every recorded point in HF's layout, named as `localise` names HF's points.

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


def _install(record: list) -> None:
    """Hook every model vLLM loads in this process (one engine: one model)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    load = BaseModelLoader.load_model

    def load_model(self, *args, **kwargs):
        model = load(self, *args, **kwargs)
        _hook(model, record)
        return model

    BaseModelLoader.load_model = load_model


def _hook(model, record: list) -> None:
    """Forward (pre-)hooks that append (name, kind, tensor) to `record`, cloned: eager vLLM
    normalises and rotates in place."""
    decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise ValueError(f"localise needs a decoder model with `.model.layers`; {type(model).__name__} has none")

    def keep(name, kind, pick=lambda out: out[0] if isinstance(out, tuple) else out):
        return lambda module, args, out: record.append((name, kind, pick(out).clone()))

    def heads(x, size):  # [tokens, heads * head_dim] -> [tokens, heads, head_dim]
        return x.reshape(x.shape[0], -1, size).clone()

    def keep_input(name, kind):
        return lambda module, args: record.append((name, kind, args[0].clone()))

    decoder.embed_tokens.register_forward_pre_hook(keep_input("input ids", "tokens"))
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
                lambda module, args, out: record.extend([("rope (query)", "rotary", heads(out[0], module.head_size)),
                                                         ("rope (key)", "rotary", heads(out[1], module.head_size))]))
        attn.o_proj.register_forward_pre_hook(keep_input(f"{p}.self_attn.o_proj (input)", "attn"))
        attn.register_forward_hook(keep(f"{p}.self_attn", "matmul"))
        layer.post_attention_layernorm.register_forward_hook(keep(f"{p}.post_attention_layernorm", "norm"))
        layer.mlp.down_proj.register_forward_pre_hook(keep_input(f"{p}.mlp.down_proj (input)", "activation"))
        layer.mlp.register_forward_hook(keep(f"{p}.mlp", "matmul"))
    decoder.norm.register_forward_hook(keep("model.norm", "norm"))
    model.logits_processor.register_forward_hook(
        lambda module, args, out: record.append(("lm_head", "head", (args[1].clone(), out.clone()))))


def order(layers: int, names: set[str]) -> list[str]:
    """The points in HF's execution order (the order `localise` records HF's in)."""
    per_layer = ["input_layernorm", "self_attn.q_proj (output)", "self_attn.v_proj (output)", "self_attn.rope (query)",
                 "self_attn.rope (key)", "self_attn.o_proj (input)", "self_attn", "post_attention_layernorm",
                 "mlp.down_proj (input)", "mlp"]
    every = [f"model.layers.{i}.{p}" for i in range(layers) for p in per_layer]
    return [n for n in every + ["model.norm", "lm_head", "logprobs"] if n in names]


def regather(record: list, sequences: list[list[int]], logprobs: torch.Tensor) -> list[tuple[str, str, torch.Tensor]]:
    """The first forward's points, in HF's layout and order."""
    batch, length = len(sequences), len(sequences[0])
    forwards = [i for i, (_, kind, _) in enumerate(record) if kind == "tokens"]
    if len(forwards) != 1:
        raise RuntimeError(f"expected one forward over the whole batch, vLLM ran {len(forwards)} (chunked prefill?)")
    ids = record[0][2]
    offsets, used = [], set()
    for seq in sequences:  # each sequence's start in the flattened batch
        seq = torch.tensor(seq, dtype=ids.dtype)
        start = next((o for o in range(len(ids) - length + 1) if o not in used and torch.equal(ids[o:o + length], seq)), None)
        if start is None:
            raise RuntimeError("a sequence is not contiguous in vLLM's batch; cannot map its tokens")
        offsets.append(start)
        used.add(start)
    rows = torch.cat([torch.arange(o, o + length) for o in offsets])

    def layout(tensor):  # [tokens, ...] -> [B, T, ...]
        return tensor[rows].reshape(batch, length, *tensor.shape[1:])

    points, rope_calls, final = {}, 0, None
    for name, kind, tensor in record[1:]:
        if kind == "head":
            continue
        if kind == "rotary":
            name = f"model.layers.{rope_calls // 2}.self_attn.{name}"
            rope_calls += 1
            tensor = layout(tensor).transpose(1, 2)  # HF's [B, heads, T, head_dim]
        else:
            tensor = layout(tensor)
        points[name] = (kind, tensor)
        if name == "model.norm":
            final = tensor
    logits = torch.empty(batch, length - 1, logprobs.shape[-1], dtype=final.dtype)
    found = [False] * batch
    for _, kind, value in record[1:]:
        if kind == "head":
            hidden, out = value
            for b in range(batch):
                if not found[b] and hidden.shape[0] == length - 1 and torch.equal(hidden, final[b, :-1]):
                    logits[b], found[b] = out, True
                    break
    if not all(found):
        raise RuntimeError("could not match vLLM's prompt logits to every sequence")
    points["lm_head"] = ("head", logits)
    points["logprobs"] = ("logprobs", logprobs)
    layers = 1 + max(int(n.split(".")[2]) for n in points if n.startswith("model.layers."))
    return [(n, *points[n]) for n in order(layers, set(points))]


def main(request_path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the hooks live in this process: so must the model
    request = json.loads(open(request_path).read())
    record: list = []
    _install(record)
    from .vllm_worker import engine, prompt_logprobs, reports

    llm, config = engine(request)
    record.clear()  # the warm-up's and the compile's runs
    logprobs = prompt_logprobs(llm, request["sequences"])
    points = regather(record, request["sequences"], logprobs)
    torch.save({"points": points, "logprobs": logprobs, "reports": reports(config)}, request["out"])


if __name__ == "__main__":
    main(sys.argv[1])
