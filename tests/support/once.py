"""A file built once per test run and shared by the pytest-xdist workers."""

from __future__ import annotations

import os
from pathlib import Path


def once_per_run(tmp_path_factory, name: str, build) -> Path:
    """The file (or folder) `name`, built once per test run and shared by the pytest-xdist
    workers: the first worker to ask builds it, `build(path)`, under a file lock; the others
    wait, then read it. For module fixtures that take minutes (the FSDP/TP probes, the coverage
    collection, the vLLM engine probes), which each worker would otherwise build again: the
    workers are separate processes, and pytest-xdist's `--dist loadgroup` does not keep a group
    on one worker with pytest 9.2 (measured: two tests marked with one group ran on both)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    path = root / name
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            partial = root / f"{name}.partial"
            build(partial)
            partial.rename(path)
    return path
