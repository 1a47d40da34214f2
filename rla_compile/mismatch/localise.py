"""Where do two execution strategies of one model part? Run both on the same tokens while
recording the outputs of each layer's sites and blocks, and compare them point by point:
the largest distance in ulps (units in the last place of the tensors' dtype) and the fraction
of elements that differ, in execution order, the first divergence first.

Points recorded per decoder layer (HF models): every RMSNorm's output ("rmsnorm"), the query
and key after RoPE ("rope", through the model's `apply_rotary_pos_emb`), attention's output
("attention": not a site), the input of the MLP's down projection ("swiglu": the gated
activation), and the layer's output ("residual": the residual stream); then the logits.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .stacks import DTYPES, Stack, hf_logits, hf_runner

__all__ = ["Point", "Localisation", "localise", "ulp_distance"]


MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of the larger of |a|, |b| in their dtype, elementwise
    (float64). 1 means neighbours; values of opposite sign near zero are not counted as the
    tens of thousands of representable values between them."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"compare tensors of one dtype and shape, got {a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)}")
    if a.dtype not in MANTISSA_BITS:
        raise ValueError(f"ulp distance needs a floating dtype, got {a.dtype}")
    x, y = a.double(), b.double()
    _, exponent = torch.frexp(torch.maximum(x.abs(), y.abs()))
    tiny = torch.finfo(a.dtype).smallest_normal * 2.0 ** -MANTISSA_BITS[a.dtype]
    ulp = torch.clamp(torch.ldexp(torch.ones_like(x), exponent - 1 - MANTISSA_BITS[a.dtype]), min=tiny)
    return torch.where(x == y, torch.zeros_like(x), (x - y).abs() / ulp)


@dataclass(frozen=True)
class Point:
    name: str  # e.g. model.layers.0.mlp.down_proj (input)
    kind: str  # rmsnorm, rope, attention, swiglu, residual, logits
    dtype: str
    max_ulp: float
    differing: float  # fraction of elements that differ

    @property
    def equal(self) -> bool:
        return self.max_ulp == 0


@dataclass
class Localisation:
    a: str
    b: str
    points: list[Point] = field(default_factory=list)

    @property
    def first_divergence(self) -> Point | None:
        return next((p for p in self.points if not p.equal), None)

    def table(self) -> str:
        first = self.first_divergence
        lines = [f"{self.a} vs {self.b}: " + (f"first divergence at {first.name} ({first.kind})" if first
                                                 else "bitwise identical at every point")]
        lines.append(f"{'point':<46}{'kind':<11}{'dtype':<10}{'max ulp':>9}{'differ':>9}")
        for p in self.points:
            mark = "  <- first" if p is first else ""
            lines.append(f"{p.name:<46}{p.kind:<11}{p.dtype:<10}{p.max_ulp:>9.3g}{p.differing:>9.2%}{mark}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        first = self.first_divergence
        return {"a": self.a, "b": self.b, "first_divergence": first.name if first else None,
                "points": [p.__dict__ | {"equal": p.equal} for p in self.points]}


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
        if "RMSNorm" in cls:
            handles.append(module.register_forward_hook(keep(name, "rmsnorm")))
        elif name.endswith("mlp.down_proj"):
            handles.append(module.register_forward_pre_hook(
                lambda module, args, name=name: record.append((f"{name} (input)", "swiglu", args[0]))))
        elif name.endswith("self_attn"):
            handles.append(module.register_forward_hook(keep(name, "attention")))
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(keep(f"model.layers.{index}", "residual")))
        modeling = sys.modules[type(layer.self_attn).__module__]
        if hasattr(modeling, "apply_rotary_pos_emb") and not patched:
            original = modeling.apply_rotary_pos_emb

            def rope(q, k, *args, _original=original, **kwargs):
                q, k = _original(q, k, *args, **kwargs)
                record.append(("rope (query)", "rope", q))
                record.append(("rope (key)", "rope", k))
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


def _capture(stack: Stack, model_dir: Path, sequences: torch.Tensor) -> list[tuple[str, str, torch.Tensor]]:
    from ..bundled import load

    if stack.engine != "hf":
        raise ValueError(f"localise compares HF execution strategies; {stack.label} is not one (vLLM's modules differ)")
    model = load(DTYPES[stack.dtype], model_dir)
    record: list = []
    with _recording(model, record):
        logits = hf_logits(stack, hf_runner(stack, model)[0], sequences)
    record.append(("logits", "logits", logits))
    # RoPE points are recorded without their layer: number them in order
    layer_of_rope, named = 0, []
    for name, kind, tensor in record:
        if kind == "rope":
            name = f"model.layers.{layer_of_rope // 2}.self_attn.{name}"
            layer_of_rope += 1
        named.append((name, kind, tensor.detach()))
    return named


def localise(a: Stack, b: Stack, sequences: torch.Tensor, model_dir: str | Path | None = None) -> Localisation:
    """Compare two HF execution strategies point by point on `sequences` ([B, T] token ids)."""
    from .. import bundled

    model_dir = Path(model_dir or bundled.MODEL_DIR)
    first, second = _capture(a, model_dir, sequences), _capture(b, model_dir, sequences)
    if [n for n, _, _ in first] != [n for n, _, _ in second]:
        raise RuntimeError(f"{a.label} and {b.label} recorded different points; cannot compare them")
    result = Localisation(a.label, b.label)
    for (name, kind, x), (_, _, y) in zip(first, second):
        distance = ulp_distance(x, y)
        result.points.append(Point(name, kind, str(x.dtype).removeprefix("torch."), float(distance.max()),
                                   float((distance > 0).double().mean())))
    return result
