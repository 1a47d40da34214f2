"""Invariance across every causal-LM family transformers builds from a config: the table in
docs/contract.md ("Invariance across families"), regenerated.

For each family (tests/support/family_sweep.py): a tiny model compiled once, run on --seeds
seeded inputs; how many inputs give other logits with rla (pin_rounding under Inductor vs rla on
eager kernels) and without (plain Inductor with emulate_precision_casts vs plain aot_eager).

    python -m benchmarks.invariance_sweep                    # every family, 8 inputs
    python -m benchmarks.invariance_sweep --families stablelm,llama --json /tmp/s.json --no-docs
    python -m benchmarks.invariance_sweep --from-json benchmarks/results/invariance_sweep_cpu.json   # docs only

Each family's result is appended to `<json>.partial.jsonl` as it arrives; `--resume` skips the
families already there or measured in `--json` (an interrupted sweep loses at most the families in flight), and
`--jobs`/`--part` split the list between processes or machines (about 2 hours on 2 cores
for all 178 model types; 1 family a minute).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_family_sweep():
    """tests/support/family_sweep.py, the sweep the tests run too (loaded from its file: the
    tests' support folder is not a package)."""
    path = ROOT / "tests" / "support" / "family_sweep.py"
    spec = importlib.util.spec_from_file_location("family_sweep", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


family_sweep = _load_family_sweep()

DOCS = ROOT / "docs" / "contract.md"
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "invariance_sweep_cpu.json"
START, END = "<!-- invariance-sweep:start -->", "<!-- invariance-sweep:end -->"


def machine() -> dict:
    import torch

    from rla_compile.machine import machine as base

    try:
        lscpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "")
    except OSError:
        lscpu = ""
    return base() | {"processor": platform.processor(), "lscpu_model_name": lscpu, "torch": torch.__version__}


def section(data: dict) -> str:
    results, seeds, info = data["results"], data["seeds"], data["machine"]
    s = family_sweep.summary(results)
    rla, plain = s["rla_breaks"], s["plain_breaks"]
    shared = [f for f in rla if f in plain]
    lines = [
        START,
        f"Measured on {info['lscpu_model_name'] or info['cpu']} (`platform.processor()`: "
        f"{info['processor']!r}; {info['cpus']} cores), torch {info['torch']}, transformers {data['transformers']}: "
        f"{s['families']} model types in transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, {s['compared']} compared, "
        f"{s['skipped']} skipped, {s['errors']} errors" + (f", {s['not_run']} not run" if s.get("not_run") else "")
        + f". Each tiny model (`rla_compile.tiny`, vocabulary "
        f"{family_sweep.VOCAB}) is compiled once and run on {seeds} seeded inputs of 2×{family_sweep.LENGTH} tokens. "
        f"rla rewrote sites in {s['aligned']} of them; in the others (no RMSNorm, SwiGLU or RoPE: "
        f"post-norm encoders, GPT-2 style models) it compiles the graph as Inductor does, so both columns "
        f"agree. Of the {s['aligned']} aligned families, {len(rla)} give other logits pinned than on eager kernels "
        f"on some input" + (f" ({', '.join(rla)}; {len(shared)} of them also without rla)" if rla else "")
        + f", while plain Inductor differs from plain `aot_eager` in {len(s['plain_breaks_aligned'])} of them "
        f"({len(plain)} of all {s['compared']}).",
        "",
        family_sweep.table(results, seeds),
        "",
        "Regenerate: `python -m benchmarks.invariance_sweep` (every family, in a process each; about an hour on "
        "2 cores; `--jobs N` runs N at once), or `--from-json benchmarks/results/invariance_sweep_cpu.json` to "
        "rewrite this section from the committed results. `pytest -m slow -k every_causal_lm_family` checks the "
        "rla column per family.",
        END,
    ]
    return "\n".join(lines)


def write_docs(data: dict, path: Path = DOCS) -> None:
    family_sweep.replace_section(path, START, END, "## Invariance across families", section(data))


NOT_RUN = "not run in this sweep (`python -m benchmarks.invariance_sweep --resume` runs the rest)"


def _measured(path: Path) -> dict[str, dict]:
    """The families an earlier run's results (`--json`) measured, by family ("not run" ones left out)."""
    if not path.exists():
        return {}
    return {r["family"]: r for r in json.loads(path.read_text())["results"] if r["status"] != "not run"}


def _partial(path: Path) -> dict[str, dict]:
    """The results appended so far, by family (the last one wins)."""
    if not path.exists():
        return {}
    return {r["family"]: r for r in map(json.loads, path.read_text().splitlines()) if r}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated model types (default: every one)")
    parser.add_argument("--seeds", type=int, default=family_sweep.SEEDS)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=family_sweep.TIMEOUT_S, help="seconds per family")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    parser.add_argument("--from-json", help="rewrite the docs section from these results; run nothing")
    parser.add_argument("--no-docs", action="store_true", help="do not touch docs/contract.md")
    parser.add_argument("--resume", action="store_true", help="skip the families measured in --json or <json>.partial.jsonl")
    parser.add_argument("--part", default="1/1", help="K/N: only every N-th family, starting at the K-th")
    args = parser.parse_args(argv)

    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
    else:
        import transformers

        names = args.families.split(",") if args.families else family_sweep.families()
        part, parts = (int(v) for v in args.part.split("/"))
        names = names[part - 1::parts]
        partial = Path(args.json + ".partial.jsonl")
        done = {**_measured(Path(args.json)), **_partial(partial)} if args.resume else {}
        if not args.resume:
            partial.write_text("")

        lock = threading.Lock()

        def progress(result: dict) -> None:  # called from the sweep's threads
            with lock, partial.open("a") as out:
                out.write(json.dumps(result) + "\n")
            print(f"{result['family']:28s} {result['status']:9s} {result.get('seconds', 0):6.1f}s "
                  f"rla={result.get('rla', '')} plain={result.get('plain', '')} {result.get('reason', '')}", flush=True)

        todo = [n for n in names if n not in done]
        family_sweep.sweep(todo, args.seeds, args.jobs, args.timeout, progress)
        found = {**done, **_partial(partial)}
        results = [found.get(n) or {"family": n, "status": "not run", "seconds": 0, "reason": NOT_RUN} for n in names]
        data = {"machine": machine(), "transformers": transformers.__version__, "seeds": args.seeds,
                "summary": family_sweep.summary(results), "results": results}
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    if not args.no_docs:
        write_docs(data)
    print(json.dumps(data["summary"]))
    return data


if __name__ == "__main__":
    main()
