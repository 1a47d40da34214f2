"""Where do two execution strategies of one model part? Run both on the same tokens while
recording the outputs of each layer's sites and blocks, and compare them point by point:
the largest distance in ulps (units in the last place of the tensors' dtype) and the fraction
of elements that differ, in execution order, the first divergence first.

Points recorded per decoder layer, in execution order: the output of the two RMSNorms on the
residual stream ("norm"; not the per-head q/k norms, see UNRECORDED), the query and value
projections' outputs ("matmul"), the query and key after RoPE ("rotary"), attention's
output before o_proj ("attn"), o_proj's output ("matmul"), the input of the
MLP's down projection ("activation": the gated activation) and the MLP's output ("matmul"; not
the layer's output, see UNRECORDED); then the final norm, the logits ("lm_head", kind "head") and the
fp32 logprobs at positions 0..T-2 (those that predict a token of the sequence).

HF stacks are recorded with forward hooks and a wrapper around the modeling module's
`apply_rotary_pos_emb`; vLLM stacks in a fresh engine process with hooks on vLLM's modules
(`vllm_localise`), regathered to HF's layout. Recording adds graph outputs to a compiled
stack, so each stack is also run unrecorded and the table says whether its logprobs stayed
bit for bit the same (`Localisation.unchanged`).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..ops import dtype_name
from .metrics import ulp_distance
from .stacks import Stack, hf_logits, hf_runner, run_vllm_worker, score

__all__ = ["Point", "Localisation", "localise", "ulp_distance"]


# Not recorded, because recording changes what Inductor compiles (measured on the shipped model,
# hf-inductor+rla:train): the per-head q/k norms feed RoPE in one fused kernel, in fp32, and
# recording them stored them as bf16 (logits moved by up to 0.375); the layers' outputs (the
# residual stream) are not stored between layers either (recording them: up to 0.19).
UNRECORDED = ("self_attn.q_norm", "self_attn.k_norm")


@dataclass(frozen=True)
class Point:
    name: str  # e.g. model.layers.0.mlp.down_proj (input)
    kind: str  # rmsnorm, matmul, rope, attention, swiglu, logits, logprobs
    dtype: str
    max_ulp: float
    differing: float  # fraction of elements that differ
    max_abs: float  # largest |a - b|
    # max ulp of each stack's output against eager ATen recomputing it from that stack's own
    # recorded input (matmuls, attention, logits, logprobs); None: not replayed
    a_replay: float | None = None
    b_replay: float | None = None

    @property
    def equal(self) -> bool:
        return self.max_ulp == 0


@dataclass
class Localisation:
    a: str
    b: str
    points: list[Point] = field(default_factory=list)
    # per stack label: did recording leave its logprobs bit for bit those of an unrecorded run?
    unchanged: dict[str, bool] = field(default_factory=dict)

    @property
    def first_divergence(self) -> Point | None:
        return next((p for p in self.points if not p.equal), None)

    def table(self) -> str:
        first = self.first_divergence
        lines = [f"{self.a} vs {self.b}: " + (f"first divergence at {first.name} ({first.kind})" if first
                                                 else "bitwise identical at every point")]
        lines.append(f"{'point':<46}{'kind':<11}{'dtype':<10}{'max ulp':>9}{'differ':>9}{'max |Δ|':>10}{'A/ref':>8}{'B/ref':>8}")
        for p in self.points:
            mark = "  <- first" if p is first else ""
            replay = "".join(f"{'-' if r is None else format(r, '.3g'):>8}" for r in (p.a_replay, p.b_replay))
            lines.append(f"{p.name:<46}{p.kind:<11}{p.dtype:<10}{p.max_ulp:>9.3g}{p.differing:>9.2%}{p.max_abs:>10.3g}{replay}{mark}")
        for label, same in self.unchanged.items():
            lines.append(f"recorded {label}: logprobs " + ("bit for bit those of an unrecorded run" if same else
                         "DIFFER from an unrecorded run's: recording changed what was compiled; read its points with care"))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        first = self.first_divergence
        return {"a": self.a, "b": self.b, "first_divergence": first.name if first else None,
                "points": [p.__dict__ | {"equal": p.equal} for p in self.points], "unchanged": self.unchanged}


@contextmanager
def _recording(model, record: list):
    """Hooks (and a wrapper around the modeling module's apply_rotary_pos_emb) that append
    (name, kind, tensor) to `record`; torch.compile traces them as graph outputs."""
    handles, patched = [], []
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ValueError(f"localise needs an HF decoder model with `.model.layers`; {type(model).__name__} has none")

    def keep(name, kind):
        return lambda module, args, out: record.append((name, kind, out[0] if isinstance(out, tuple) else out))

    for name, module in model.named_modules():
        cls = type(module).__name__
        if "RMSNorm" in cls and not name.endswith(UNRECORDED):
            handles.append(module.register_forward_hook(keep(name, "norm")))
        elif name.endswith("mlp.down_proj"):
            handles.append(module.register_forward_pre_hook(
                lambda module, args, name=name: record.append((f"{name} (input)", "activation", args[0]))))
        elif name.endswith("self_attn.q_proj") or name.endswith("self_attn.v_proj"):
            handles.append(module.register_forward_hook(keep(f"{name} (output)", "matmul")))
        elif name.endswith("self_attn.o_proj"):
            handles.append(module.register_forward_pre_hook(
                lambda module, args, name=name: record.append((f"{name} (input)", "attn", args[0]))))
        elif name.endswith("self_attn") or name.endswith(".mlp"):
            handles.append(module.register_forward_hook(keep(name, "matmul")))
    for layer in layers:
        modeling = sys.modules[type(layer.self_attn).__module__]
        if hasattr(modeling, "apply_rotary_pos_emb") and not patched:
            original = modeling.apply_rotary_pos_emb

            def rope(q, k, *args, _original=original, **kwargs):
                q, k = _original(q, k, *args, **kwargs)
                record.append(("rope (query)", "rotary", q))
                record.append(("rope (key)", "rotary", k))
                return q, k

            modeling.apply_rotary_pos_emb = rope
            patched.append((modeling, original))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for modeling, original in patched:
            modeling.apply_rotary_pos_emb = original


def _references(model, points: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Eager ATen recomputing each projection, attention, the logits and the logprobs from the
    same stack's recorded inputs, with the checkpoint's weights: what an op gives on that
    stack's own input, so its distance says whether the stack's op is eager ATen's."""
    import torch.nn.functional as F

    refs = {}
    for i, layer in enumerate(model.model.layers):
        p, attn = f"model.layers.{i}", layer.self_attn
        x = points.get(f"{p}.input_layernorm")
        for proj in ("q_proj", "v_proj"):
            if x is not None and f"{p}.self_attn.{proj} (output)" in points:
                refs[f"{p}.self_attn.{proj} (output)"] = F.linear(x, getattr(attn, proj).weight, getattr(attn, proj).bias)
        q, k, v = (points.get(f"{p}.self_attn.{n}") for n in ("rope (query)", "rope (key)", "v_proj (output)"))
        modeling = sys.modules[type(attn).__module__]
        if None not in (q, k, v) and hasattr(modeling, "eager_attention_forward"):
            length = q.shape[2]
            mask = torch.full((length, length), torch.finfo(q.dtype).min, dtype=q.dtype).triu(1)[None, None]
            v = v.unflatten(-1, (-1, q.shape[-1])).transpose(1, 2)
            out, _ = modeling.eager_attention_forward(attn, q, k, v, mask, scaling=attn.scaling, dropout=0.0)
            refs[f"{p}.self_attn.o_proj (input)"] = out.reshape(*out.shape[:2], -1)
        for point, source, linear in ((f"{p}.self_attn", f"{p}.self_attn.o_proj (input)", attn.o_proj),
                                      (f"{p}.mlp", f"{p}.mlp.down_proj (input)", layer.mlp.down_proj)):
            if source in points:
                refs[point] = F.linear(points[source], linear.weight, linear.bias)
    if "model.norm" in points:  # the positions whose logits the stack computed: 0..T-2
        scored = points["lm_head"].shape[1] if "lm_head" in points else points["model.norm"].shape[1] - 1
        refs["lm_head"] = model.get_output_embeddings()(points["model.norm"][:, :scored])
    if "lm_head" in points:
        refs["logprobs"] = torch.log_softmax(points["lm_head"].float(), -1)
    return refs


def _capture(stack: Stack, model_dir: Path, sequences: torch.Tensor,
             prompt_tokens: int | None = None) -> tuple[list, torch.Tensor]:
    """The stack's points [(name, kind, tensor)] in HF's layout and order, and its logprobs."""
    if stack.engine == "vllm":
        out = run_vllm_worker("rla_compile.mismatch.vllm_localise", stack, model_dir, sequences,
                              prompt_tokens=prompt_tokens)
        return out["points"], out["logprobs"]
    from ..bundled import load

    model = load(stack.dtype, model_dir)
    record: list = []
    with _recording(model, record):
        logits = hf_logits(stack, hf_runner(stack, model)[0], sequences)[:, :-1].detach()
    logprobs = torch.log_softmax(logits.float(), -1)  # as stacks.hf_logprobs scores
    record += [("lm_head", "head", logits), ("logprobs", "logprobs", logprobs)]
    # RoPE points are recorded without their layer: number them in order
    layer_of_rope, named = 0, []
    for name, kind, tensor in record:
        if kind == "rotary":
            name = f"model.layers.{layer_of_rope // 2}.self_attn.{name}"
            layer_of_rope += 1
        named.append((name, kind, tensor.detach()))
    return named, logprobs


def _ulps(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`ulp_distance` in the wider of the two dtypes: a point one side keeps in fp32 where the
    other rounds it (the logits site's head in one stack only) is compared exactly, upcast."""
    wide = torch.promote_types(x.dtype, y.dtype)
    return ulp_distance(x.to(wide), y.to(wide))


def localise(a: Stack, b: Stack, sequences: torch.Tensor, model_dir: str | Path | None = None,
             check_unchanged: bool = True, prompt_tokens: int | None = None) -> Localisation:
    """Compare two stacks (HF or vLLM, any pair) point by point on `sequences` ([B, T] token
    ids); an HF stack compared with vLLM is `Stack.paired` with it. With `check_unchanged`, each stack is also scored without recording, and
    `Localisation.unchanged` says whether recording left its logprobs bit for bit the same.

    A `decode` stack (vLLM) generates each sequence after its first `prompt_tokens` and is
    recorded at every step (the prefill, then one decode step per token): its points cover
    positions 0..T-2 (the last token is sampled, never fed), and the other stack's are compared
    there."""
    from .. import bundled

    length = sequences.shape[1]
    for stack in (a, b):
        if stack.decode and not (prompt_tokens and 0 < prompt_tokens < length):
            raise ValueError(f"localise records {stack.label} while it generates each sequence after its prompt: give "
                             f"prompt_tokens between 1 and {length - 1} (`--prompt-tokens`), got {prompt_tokens!r}")
    a, b = a.paired(b), b.paired(a)  # an HF trainer's sites round as vLLM's own kernels for them do here
    model_dir = Path(model_dir or bundled.MODEL_DIR)
    first, lp_a = _capture(a, model_dir, sequences, prompt_tokens)
    second, lp_b = _capture(b, model_dir, sequences, prompt_tokens)
    if a.decode or b.decode:  # compare where the decode stack has points: positions 0..T-2
        first, second = (_positions(side, length - 1) for side in (first, second))
    if [n for n, _, _ in first] != [n for n, _, _ in second]:
        missing = sorted({n for n, _, _ in first} ^ {n for n, _, _ in second})
        raise RuntimeError(f"{a.label} and {b.label} recorded different points ({missing[:4]}...); cannot compare them")
    from ..bundled import load

    model = load(a.dtype, model_dir).eval()
    with torch.no_grad():
        refs = [_references(model, {n: t for n, _, t in side}) for side in (first, second)]
    result = Localisation(a.label, b.label)
    for (name, kind, x), (_, _, y) in zip(first, second):
        distance = _ulps(x, y)
        replay = [float(_ulps(t, ref[name]).max()) if name in ref else None for t, ref in ((x, refs[0]), (y, refs[1]))]
        result.points.append(Point(name, kind, dtype_name(torch.promote_types(x.dtype, y.dtype)), float(distance.max()),
                                   float((distance > 0).double().mean()), float((x.double() - y.double()).abs().max()),
                                   *replay))
    if check_unchanged:
        for stack, recorded in ((a, lp_a), (b, lp_b)):
            unrecorded = score(stack, model_dir, sequences, prompt_tokens=prompt_tokens)["logprobs"]
            result.unchanged[stack.label] = torch.equal(unrecorded, recorded)
    return result


def _positions(points: list, length: int) -> list:
    """Each point cut to its first `length` positions (dim 2 for RoPE's [B, heads, T, head_dim],
    else dim 1)."""
    return [(name, kind, tensor.narrow(2 if kind == "rotary" else 1, 0, min(length, tensor.shape[2 if kind == "rotary" else 1])))
            for name, kind, tensor in points]
