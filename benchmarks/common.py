"""Shared by the benchmarks: the workloads (tiny Llama configs), the compared variants, and
the machine description written next to every result."""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

import rla_compile
from rla_compile.machine import machine
from rla_compile.tiny import tiny_causal_lm

ROOT = Path(__file__).resolve().parent.parent  # run the benchmarks from here: python -m benchmarks.<name>
RESULTS = ROOT / "benchmarks" / "results"

SIZES = {
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, batch=2, seq=32),
    "medium": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=32, vocab_size=512, max_position_embeddings=256, batch=4, seq=128),
}
VARIANTS = {
    "inductor": lambda: "inductor",
    "rla": lambda: rla_compile.Backend(),
    "rla pinned": lambda: rla_compile.Backend(pin_rounding=True),
}


_CODES = itertools.count()


def own_code(model):
    """A function calling `model`, with a code object of its own. Dynamo keeps its compiled
    entries per code object and checks their guards in turn on each call: compiled as
    `torch.compile(model)`, every variant shares the model class's `forward` and a step pays
    for the guards of the variants tried before its own (plain Inductor compiled twice, the
    second copy measured 1.04-1.11x the first at 1 ms a step: benchmarks/upcasts_before_after.py)."""
    namespace: dict = {}
    exec(f"def forward_{next(_CODES)}(*args, **kwargs):\n    return model(*args, **kwargs)", {"model": model}, namespace)
    return next(iter(namespace.values()))


def model_and_tokens(size: str, device: str = "cpu", **overrides):
    cfg = dict(SIZES[size]) | overrides
    batch, seq, model_type = cfg.pop("batch"), cfg.pop("seq"), cfg.pop("model_type", "llama")
    model = tiny_causal_lm(model_type, **cfg).to(device)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, ids.to(device)


def train_step(compiled, model, ids):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        compiled(ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def saved_bytes_of(step) -> int:
    """Bytes autograd saves for the backward while `step()` runs its forward (saved-tensor
    hooks); `step` returns the loss, which is then backpropagated."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return total


def ratio_cell(result: dict, name: str) -> str:
    """A variant's ratio to plain Inductor in a `runtime.measure` result, with the quartiles of
    its per-round ratio: "1.014 (1.01-1.02)"."""
    low, high = result["round_ratio_quartiles"][name]
    return f"{result['ratio_vs_inductor'][name]:.3f} ({low:.2f}-{high:.2f})"


def module_command(module: str, *args) -> list[str]:
    """The command that runs `module` (a benchmark: "benchmarks.runtime") in a fresh process."""
    return [sys.executable, "-m", module, *map(str, args)]


def module_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) with the repository root first on
    PYTHONPATH, so that `python -m benchmarks.<name>` runs from any working directory."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def fresh_process_runs(module: str, argv: list[str], runs: int) -> list:
    """Run `module` with `argv` (less its --runs and --json) once per run, each in a fresh
    process, and return each run's "results": on a shared CPU a ratio moves more between
    processes than between repetitions in one."""
    import subprocess
    import tempfile

    passed = [a for i, a in enumerate(argv) if a not in ("--runs", "--json") and (i == 0 or argv[i - 1] not in ("--runs", "--json"))]
    results = []
    for run in range(runs):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            print(f"-- run {run + 1} of {runs} (fresh process)", flush=True)
            subprocess.run(module_command(module, *passed, "--json", out.name), check=True, env=module_env())
            results.append(json.loads(Path(out.name).read_text())["results"])
    return results


def write(path: str | None, results, device: str = "cpu") -> None:
    if path:
        Path(path).write_text(json.dumps({"machine": machine(device), "results": results}, indent=2) + "\n")
