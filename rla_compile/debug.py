"""Debug dumps: one folder per compiled graph, an index first.

    <dir>/index.txt                 one line per graph: folder, summary
    <dir>/<graph>/before.txt        the pre-dispatch ATen graph before the rewrite
    <dir>/<graph>/after.txt         after it (site roundings marked `# rla: round <kind>`)
    <dir>/<graph>/diff.txt          unified diff of the two
    <dir>/<graph>/report.txt/.json  the site report
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from torch.fx import GraphModule

from .printer import format_graph
from .report import GraphReport

__all__ = ["dump"]


def dump(directory: Path, report: GraphReport, before: str, after: GraphModule) -> Path:
    folder_name = "graph_" + re.sub(r"[^0-9A-Za-z_.-]+", "_", report.graph).strip("_")
    folder = Path(directory) / folder_name
    folder.mkdir(parents=True, exist_ok=True)
    after_text = format_graph(after)
    (folder / "before.txt").write_text(before + "\n")
    (folder / "after.txt").write_text(after_text + "\n")
    diff = difflib.unified_diff(
        before.splitlines(keepends=True) and [l + "\n" for l in before.splitlines()],
        [l + "\n" for l in after_text.splitlines()],
        fromfile="before.txt",
        tofile="after.txt",
    )
    (folder / "diff.txt").write_text("".join(diff))
    (folder / "report.txt").write_text(str(report) + "\n")
    (folder / "report.json").write_text(report.to_json() + "\n")
    with open(Path(directory) / "index.txt", "a") as index:
        index.write(f"{folder_name}\t{report.summary()}\n")
    return folder
