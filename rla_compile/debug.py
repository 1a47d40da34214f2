"""Debug output: one folder per compiled graph, an index first, and torch's own channels.

    <dir>/index.txt                 one line per graph, in compile order: folder, summary
    <dir>/<graph>/before.py         the pre-dispatch ATen graph before the rewrite, as Python
                                    (dtype and shape on every node)
    <dir>/<graph>/after.py          the same after it
    <dir>/<graph>/before.txt        rla's stable one-line-per-node form, before ...
    <dir>/<graph>/after.txt         ... and after (site roundings marked `# rla: round <kind>`)
    <dir>/<graph>/diff.txt          unified diff of the two .txt files
    <dir>/<graph>/report.txt        the site table and near misses
    <dir>/<graph>/report.json       the same, as JSON

The same report and graphs go to `TORCH_TRACE` (tlparse) as artifacts `rla_report`,
`rla_graph_before` and `rla_graph_after`; `TORCH_LOGS=+rla_compile` shows the summary lines.

Both compiled paths (the backend, vLLM's pass) do the same around `align`:

    before = snapshot(gm) if wants_graphs(options.debug_dir) else None
    report = align(gm, options, ...)
    if before is not None:
        record(report, before, gm, options.debug_dir)   # dump + TORCH_TRACE; returns the Rewrite
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from torch.fx import GraphModule

from .printer import format_graph
from .report import GraphReport

__all__ = ["Rewrite", "Snapshot", "dump", "python_source", "record", "snapshot", "trace_artifacts", "tracing",
           "wants_graphs"]


@dataclass(frozen=True)
class Rewrite:
    """One compiled graph: its report, and its text before and after the rewrite (rla's
    stable form in `before`/`after`, torch's Python form in `before_py`/`after_py`)."""

    report: GraphReport
    before: str
    after: str
    before_py: str
    after_py: str


@dataclass(frozen=True)
class Snapshot:
    """A graph's text at one moment: rla's stable form and torch's Python form."""

    text: str
    python: str


def python_source(gm: GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)


def snapshot(gm: GraphModule) -> Snapshot:
    return Snapshot(format_graph(gm), python_source(gm))


def wants_graphs(debug_dir: Path | None) -> bool:
    """Whether anything will read the graphs' text: a dump directory, or TORCH_TRACE."""
    return debug_dir is not None or tracing()


def record(report: GraphReport, before: Snapshot, gm: GraphModule, debug_dir: Path | None) -> Rewrite:
    """`gm`'s rewrite since `before`: dumped under `debug_dir` (when set) and sent to TORCH_TRACE."""
    after = snapshot(gm)
    rewrite = Rewrite(report, before.text, after.text, before.python, after.python)
    if debug_dir is not None:
        dump(debug_dir, rewrite)
    trace_artifacts(rewrite)
    return rewrite


def _folder(directory: Path, graph: str) -> Path:
    base = "graph_" + re.sub(r"[^0-9A-Za-z_.-]+", "_", graph).strip("_")
    folder, n = directory / base, 1
    while folder.exists():  # compile ids restart after torch._dynamo.reset(): never overwrite
        folder, n = directory / f"{base}-{n}", n + 1
    return folder


def dump(directory: Path, material: Rewrite) -> Path:
    directory = Path(directory)
    folder = _folder(directory, material.report.graph)
    folder.mkdir(parents=True)
    files = {
        "before.py": material.before_py,
        "after.py": material.after_py,
        "before.txt": material.before,
        "after.txt": material.after,
        "diff.txt": "".join(
            difflib.unified_diff(
                [line + "\n" for line in material.before.splitlines()],
                [line + "\n" for line in material.after.splitlines()],
                fromfile="before.txt",
                tofile="after.txt",
            )
        ),
        "report.txt": str(material.report),
        "report.json": material.report.to_json(),
    }
    for name, text in files.items():
        (folder / name).write_text(text if text.endswith("\n") or not text else text + "\n")
    with open(directory / "index.txt", "a") as index:
        index.write(f"{folder.name}\t{material.report.summary()}\n")
    return folder


def trace_artifacts(material: Rewrite) -> None:
    """Send the report and graphs to TORCH_TRACE (a no-op unless tracing is on)."""
    from torch._logging import trace_structured

    for name, encoding, payload in (
        ("rla_report", "json", material.report.to_json),
        ("rla_graph_before", "string", lambda: material.before),
        ("rla_graph_after", "string", lambda: material.after),
    ):
        trace_structured(
            "artifact",
            metadata_fn=lambda name=name, encoding=encoding: {"name": name, "encoding": encoding},
            payload_fn=payload,
        )


def tracing() -> bool:
    """Whether TORCH_TRACE is collecting (so rendering graphs is worth it)."""
    from torch._logging._internal import trace_log

    return bool(trace_log.handlers)


