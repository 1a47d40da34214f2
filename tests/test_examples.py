"""The examples and the README's demo run as written (they are documentation that cannot rot)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_example_runs(example, tmp_path):
    subprocess.run([sys.executable, str(example)], check=True, cwd=tmp_path, capture_output=True, timeout=600)


def test_demo_shows_sites_and_removes_the_mismatch():
    done = subprocess.run(
        [sys.executable, "-m", "rla_compile.cli", "demo"], check=True, capture_output=True, text=True, timeout=600
    )
    out = done.stdout
    assert "rla report for graph" in out and "residual_rmsnorm" in out
    without = next(line for line in out.splitlines() if line.startswith("without rla")).split()
    pinned = next(line for line in out.splitlines() if line.startswith("rla on both, pin_rounding=True")).split()
    assert float(without[2]) > 0  # mean |Δ logprob| between Inductor and eager kernels
    assert pinned[-3:] == ["0.000e+00", "0.000e+00", "100.0%"]
