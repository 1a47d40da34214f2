"""A picture of a MismatchReport: the distribution of δ = log π - log μ per configuration (a
perfectly aligned pair is a spike at 0), and the per-token mismatch of each configuration as
bars (with an ablation, each site's share)."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["plot_report"]


def plot_report(report, path: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("plots need matplotlib: pip install 'rla_compile[bench]'") from error

    fig, (hist, bars) = plt.subplots(1, 2, figsize=(13, 4.8))
    # histograms of off / one side / both (an ablation's rows are in the bars: 8 curves do not read)
    shown = [r for r in report.rows if r.label in ("rla off", "rla on both")] or report.rows[:4]
    deltas = [torch.tensor(r.delta, dtype=torch.float64) for r in shown]
    span = max(float(d.abs().max()) for d in deltas) or 1e-6
    edges = torch.linspace(-span, span, 61).tolist()
    for row, delta in zip(shown, deltas):
        hist.hist(delta.tolist(), bins=edges, histtype="step", linewidth=1.4, label=row.label)
    hist.set_yscale("log")
    hist.set_xlabel("δ = log π_trainer − log μ_inference, per sampled token")
    hist.set_ylabel("tokens")
    hist.set_title("where the two stacks disagree")
    hist.legend(fontsize=7)

    labels = [r.label for r in report.rows]
    k3 = [r.metrics.k3 for r in report.rows]
    mean_abs = [r.metrics.mean_abs_dlogprob for r in report.rows]
    x = range(len(labels))
    bars.bar([i - 0.2 for i in x], mean_abs, width=0.4, label="mean |Δ logprob|")
    twin = bars.twinx()
    twin.bar([i + 0.2 for i in x], k3, width=0.4, color="tab:orange", label="k3 KL")
    bars.set_xticks(list(x), labels, rotation=25, ha="right", fontsize=7)
    bars.set_ylabel("mean |Δ logprob|")
    twin.set_ylabel("k3 KL")
    bars.set_title("mismatch per configuration")
    handles = bars.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    twin.legend(handles, ["mean |Δ logprob|", "k3 KL"], fontsize=7, loc="lower right", framealpha=0.95)  # on top of both
    fig.suptitle(f"{Path(report.model).name}: {report.scored_tokens} sampled tokens", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
