"""A mismatch measurement's result: one row per configuration, the machine it ran on, and the
change of each row against "rla off" with a bootstrap interval, so a claim like "k3 -22%"
comes with its uncertainty."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..machine import describe
from .. import sites as registry
from .metrics import Metrics, Routing, k3_rows
from .stacks import Stack

__all__ = ["MismatchReport", "Row", "change_interval", "legend", "STAND_IN"]


def legend() -> str:
    """The report's key: the metrics, and the stacks' names with the sites they align."""
    opt_in = "; ".join(f"{site.kind}: {site.summary}" for site in registry.selected(registry.OPT_IN_SITES))
    return (
        "δ = log π_trainer − log μ_inference per sampled token. k3 KL = mean(e^δ−1−δ), k1 = mean(−δ), |Δlp| = |δ|, "
        "|Δp| = |π−μ| at the token, RMS δ, E exp|δ| = mean e^|δ|, KL full = exact KL(μ‖π) over the vocabulary, "
        "bitwise= = tokens with identical fp32 logprobs.\n"
        "Stacks are engine-compiler[+rla[sites]][:dtype][:train|:decode]: hf-inductor:train = HF's training forward under "
        "torch.compile (Inductor), hf-aot_eager = HF with eager kernels, vllm-inductor = vLLM's compiled path "
        "(scoring the sequences as prompts; :decode = the logprobs vLLM returns while generating them); +rla = "
        f"rla aligns the default sites ({', '.join(registry.DEFAULT_SITES)}); +rla[...] names them, opt-in sites "
        f"included ({opt_in})."
    )


BASELINE = "rla off"
# the note `default_stacks` adds when HF stands in for vLLM (kept in the report's notes, so in its JSON)
STAND_IN = "vLLM is not installed: the inference side is HF with eager kernels (aot_eager), not vLLM"


@dataclass
class Row:
    label: str
    trainer: Stack
    inference: Stack
    metrics: Metrics
    delta: list[float]  # log π - log μ per scored token, sequence by sequence, for plots and intervals
    routing: Routing | None = None  # an MoE model: how often the two stacks' routers chose the same experts

    def to_dict(self) -> dict:
        return {"label": self.label, "trainer": self.trainer.label, "inference": self.inference.label,
                "metrics": self.metrics.to_dict(), "delta": self.delta,
                "routing": self.routing.to_dict() if self.routing else None}

    @classmethod
    def from_dict(cls, data: dict) -> "Row":
        routing = data.get("routing")
        return cls(data["label"], Stack.parse(data["trainer"]), Stack.parse(data["inference"]),
                   Metrics(**data["metrics"]), data["delta"], Routing(**routing) if routing else None)


def _mean_abs(delta: torch.Tensor) -> torch.Tensor:
    return delta.abs().mean(-1)


INTERVAL_METRICS = {"k3": k3_rows, "mean|Δlp|": _mean_abs}


def change_interval(delta: list[float], baseline: list[float], sequences: int, metric: str = "k3",
                    resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(ratio, low, high): metric(delta) / metric(baseline) on the same tokens, with a 95%
    percentile-bootstrap interval that resamples whole sequences (tokens within a sequence are
    not independent), the two rows resampled together (paired)."""
    fn = INTERVAL_METRICS[metric]
    a = torch.tensor(delta, dtype=torch.float64).reshape(sequences, -1)
    b = torch.tensor(baseline, dtype=torch.float64).reshape(sequences, -1)
    pick = torch.randint(0, sequences, (resamples, sequences), generator=torch.Generator().manual_seed(seed))
    ratios = fn(a[pick].flatten(1)) / fn(b[pick].flatten(1))
    low, high = torch.quantile(ratios, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return float(fn(a.flatten()) / fn(b.flatten())), low, high


@dataclass
class MismatchReport:
    model: str
    sequences: int
    prompt_tokens: int
    scored_tokens: int
    rows: list[Row] = field(default_factory=list)
    sites: dict[str, dict[str, int]] = field(default_factory=dict)  # stack label -> sites per kind
    notes: list[str] = field(default_factory=list)  # what was skipped or stood in, and why
    machine: dict = field(default_factory=dict)  # rla_compile.machine.machine(): the digits depend on it

    def row(self, label: str) -> Row:
        for row in self.rows:
            if row.label == label:
                return row
        raise KeyError(f"no row {label!r}: rows are {[r.label for r in self.rows]}")

    def stack_pairs(self) -> list[tuple[str, str]]:
        """(trainer, inference) stack labels without their rla sites, one pair per pair compared."""
        return sorted({(r.trainer.with_sites(None).label, r.inference.with_sites(None).label) for r in self.rows})

    @property
    def stand_in(self) -> bool:
        """Whether the inference side is HF standing in for vLLM (not installed)."""
        return any(n.startswith(STAND_IN) for n in self.notes)

    def changes(self, metric: str = "k3") -> dict[str, tuple[float, float, float]]:
        """Per row (but the baseline): (ratio, low, high) of `metric` against "rla off"."""
        if not any(r.label == BASELINE for r in self.rows):
            return {}
        base = self.row(BASELINE).delta
        if not any(base):
            return {}  # no mismatch to begin with: nothing to be relative to
        return {r.label: change_interval(r.delta, base, self.sequences, metric) for r in self.rows if r.label != BASELINE}

    def in_plain_words(self, row: str = "rla on both") -> str:
        """One sentence on what `row` does to the average logprob gap, with its uncertainty."""
        changes = self.changes("mean|Δlp|")
        if row not in changes:
            return f"In plain words: there is no '{BASELINE}' mismatch to compare '{row}' with."
        ratio, low, high = changes[row]
        n = self.sequences
        if high < 1:
            return (f"In plain words: with {row.removeprefix('rla on ')} sides aligned, the trainer's and the inference "
                    f"engine's logprobs of the sampled tokens differ {1 - ratio:.0%} less on average than without rla "
                    f"(95% interval: {1 - high:.0%} to {1 - low:.0%} less, over {n} sequences); the rest comes from "
                    "what that configuration leaves to each stack (the matmuls, and any opt-in site it does not "
                    "select).")
        if low > 1:
            return (f"In plain words: '{row}' makes the average logprob gap {ratio - 1:.0%} larger than rla off "
                    f"(95% interval: {low - 1:+.0%} to {high - 1:+.0%}, over {n} sequences).")
        return (f"In plain words: '{row}' changes the average logprob gap by {ratio - 1:+.0%}, but over {n} sequences "
                f"the 95% interval ({low - 1:+.0%} to {high - 1:+.0%}) includes no change: score more sequences "
                "(--prompts) to tell.")

    def table(self) -> str:
        width = max(len("configuration"), *(len(r.label) for r in self.rows)) + 2
        routed = any(r.routing for r in self.rows)
        head = f"{'configuration':<{width}}" + "".join(f"{title:>11}" for _, title in Metrics.COLUMNS)
        lines = [head + (f"{'routing=':>11}" if routed else "")]
        for row in self.rows:
            m = row.metrics
            cells = [f"{getattr(m, name):>11.1%}" if name == "bitwise_equal" else f"{getattr(m, name):>11.3e}"
                     for name, _ in Metrics.COLUMNS]
            if routed:
                cells.append(f"{row.routing.agreement:>11.3%}" if row.routing else f"{'—':>11}")
            lines.append(f"{row.label:<{width}}" + "".join(cells))
        changes = {metric: self.changes(metric) for metric in INTERVAL_METRICS}
        if changes["k3"]:
            lines += ["", f"change vs {BASELINE} (95% bootstrap interval over the {self.sequences} sequences):"]
            for label in changes["k3"]:
                cells = [f"{metric} {_pct(*changes[metric][label])}" for metric in INTERVAL_METRICS]
                lines.append(f"  {label:<{width}}" + "   ".join(cells))
        lines.append("")
        lines += [f"trainer {t} vs inference {i}; {self.sequences} sequences, {self.scored_tokens} sampled tokens scored"
                  for t, i in self.stack_pairs()]
        if self.machine:
            lines.append(f"machine: {describe(self.machine)} (the digits depend on its kernels)")
        lines += [f"note: {n}" for n in self.notes]
        if routed:
            lines += ["", "routing= (an MoE model): per (token, MoE layer), the share of the k experts both stacks' routers "
                          "chose, over every position of the sequences; per MoE layer, first to last:"]
            lines += [f"  {r.label:<{width}}" + " ".join(f"{x:.3%}" for x in r.routing.per_layer) for r in self.rows if r.routing]
        lines += ["", legend()]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"model": self.model, "sequences": self.sequences, "prompt_tokens": self.prompt_tokens,
                "scored_tokens": self.scored_tokens, "rows": [r.to_dict() for r in self.rows],
                "sites": self.sites, "notes": self.notes, "machine": self.machine}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> "MismatchReport":
        """A report saved with `to_json` (e.g. to plot or tabulate it again)."""
        rows = [Row.from_dict(r) for r in data["rows"]]
        return cls(data["model"], data["sequences"], data["prompt_tokens"], data["scored_tokens"], rows,
                   data["sites"], data["notes"], data.get("machine", {}))

    def plot(self, path: str | Path) -> Path:
        from .plot import plot_report

        return plot_report(self, Path(path))


def _pct(ratio: float, low: float, high: float) -> str:
    return f"{ratio - 1:+.0%} [{low - 1:+.0%}, {high - 1:+.0%}]"
