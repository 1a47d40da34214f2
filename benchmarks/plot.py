"""Plot the committed CPU results: run-time and memory ratios, and pass time vs depth.

    python -m benchmarks.plot            # writes benchmarks/results/performance_cpu.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def main(results: Path = RESULTS) -> Path:
    runtime = json.loads((results / "runtime_cpu.json").read_text())["results"]
    memory = json.loads((results / "memory_cpu.json").read_text())["results"]
    compile_time = json.loads((results / "compile_time_cpu.json").read_text())["results"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))

    labels = [f"{r['size']}\n{r['mode']}" for r in runtime]
    for offset, name in ((-0.2, "rla"), (0.2, "rla pinned")):
        ax1.bar([i + offset for i in range(len(runtime))], [r["ratio_vs_inductor"][name] for r in runtime], 0.4, label=name)
    ax1.axhline(1.01, color="k", ls="--", lw=1, label="target 1.01")
    ax1.set_xticks(range(len(runtime)), labels)
    ax1.set_ylim(0.8, 1.2)
    ax1.set_title("run time / Inductor (median)")
    ax1.legend()

    ax2.bar([r["size"] for r in memory], [r["ratio_vs_inductor"]["rla"] for r in memory])
    ax2.axhline(1.02, color="k", ls="--", lw=1, label="target 1.02")
    ax2.set_ylim(0.9, 1.1)
    ax2.set_title("saved-for-backward bytes / Inductor")
    ax2.legend()

    layers = [r["layers"] for r in compile_time]
    ax3.plot(layers, [r["retrace_s"] for r in compile_time], "o-", label="re-trace")
    ax3.plot(layers, [r["rewrite_s"] for r in compile_time], "o-", label="rewrite")
    ax3.set_xlabel("decoder layers")
    ax3.set_ylabel("seconds")
    ax3.set_title("rla pass time vs depth (share of compile: " + ", ".join(f"{r['rla_fraction']:.1%}" for r in compile_time) + ")", fontsize=8)
    ax3.legend()

    fig.tight_layout()
    out = results / "performance_cpu.png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS)
