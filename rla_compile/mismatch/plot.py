"""A picture of a MismatchReport: the distribution of δ = log π - log μ for rla off and rla on
both (a perfectly aligned pair is a spike at 0), and each configuration's k3 and mean |Δlogprob|
relative to rla off on one axis, with 95% bootstrap intervals over sequences. The title names
the two stacks (and says when HF stands in for vLLM), each histogram's legend its row's stacks."""

from __future__ import annotations

from pathlib import Path

import torch

from ..machine import describe
from .report import BASELINE

__all__ = ["figure", "plot_report"]

SHOWN = (BASELINE, "rla on both")  # the histogram: off against both


def plot_report(report, path: Path) -> Path:
    """`figure(report)` as a PNG at `path`."""
    fig = figure(report)  # says how to install matplotlib if it is missing
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure(report):
    """The matplotlib Figure (Agg backend) of `report`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("plots need matplotlib: pip install 'rla_compile[bench]'") from error

    fig, (hist, bars) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1, 1.3]})
    # histograms of off and both (a site-by-site ablation is in the bars: 8 curves do not read)
    shown = [r for r in report.rows if r.label in SHOWN] or report.rows[:2]
    deltas = [torch.tensor(r.delta, dtype=torch.float64) for r in shown]
    span = max(float(d.abs().max()) for d in deltas) or 1e-6
    edges = torch.linspace(-span, span, 61).tolist()
    for row, delta in zip(shown, deltas):
        hist.hist(delta.tolist(), bins=edges, histtype="step", linewidth=1.4,
                  label=f"{row.label}: {row.trainer.label} vs {row.inference.label}")
    hist.set_yscale("log")
    hist.set_xlabel("δ = log π_trainer − log μ_inference, per sampled token")
    hist.set_ylabel("tokens")
    hist.set_title("where the two stacks disagree")
    hist.legend(fontsize=7)

    # every row against rla off, both metrics on one axis: 1 = no change, below 1 = less mismatch
    changes = {metric: report.changes(metric) for metric in ("k3", "mean|Δlp|")}
    labels = list(changes["k3"])
    if labels:
        x = range(len(labels))
        for offset, (metric, colour) in zip((-0.2, 0.2), (("k3", "tab:orange"), ("mean|Δlp|", "tab:blue"))):
            ratio = [changes[metric][label][0] for label in labels]
            below = [r - changes[metric][label][1] for label, r in zip(labels, ratio)]
            above = [changes[metric][label][2] - r for label, r in zip(labels, ratio)]
            bars.bar([i + offset for i in x], ratio, width=0.4, color=colour, yerr=[below, above], capsize=3,
                     label=f"{metric} / rla off")
        bars.axhline(1.0, color="black", linewidth=0.8)
        bars.set_xticks(list(x), labels, rotation=25, ha="right", fontsize=7)
        bars.set_ylabel("ratio to rla off (95% bootstrap interval over sequences)")
        bars.legend(fontsize=7)
    bars.set_title("mismatch per configuration, relative to rla off")
    machine = f"; {describe(report.machine)}" if report.machine else ""
    stand_in = " (HF stand-in: vLLM not installed)" if report.stand_in else ""
    stacks = "; ".join(f"trainer {t} vs inference {i}{stand_in}" for t, i in report.stack_pairs())
    fig.suptitle(f"{stacks}\n{Path(report.model).name}: {report.scored_tokens} sampled tokens, {report.sequences} "
                 f"sequences{machine}", fontsize=9)
    fig.tight_layout()
    return fig
