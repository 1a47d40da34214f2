"""The attention site across every causal-LM family transformers builds from a config: the
table in docs/coverage.md ("Attention across HF's causal LMs"), regenerated.

For each family (the list, tiny configs and skips of tests/support/family_sweep.py): a tiny model
with HF's eager attention, compiled with `sites=["attention"]` on eager kernels (`aot_eager`);
how many attention calls rla rewrote, its near misses and their reasons; and its logits against
the same model run eagerly with its attention function swapped, through HF's
`AttentionInterface`, for the contract reference (`hf_reference.contract_attention`), bit for
bit. A family that writes attention inline (not through the interface) cannot be swapped: its
rewrites are counted, not checked.

    python -m benchmarks.attention_sweep --jobs 2                 # every family (about 15 min on 2 cores)
    python -m benchmarks.attention_sweep --families llama,bloom --json /tmp/a.json --no-docs
    python -m benchmarks.attention_sweep --from-json benchmarks/results/attention_sweep_cpu.json   # docs only
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUPPORT = ROOT / "tests" / "support"
DOCS = ROOT / "docs" / "coverage.md"
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "attention_sweep_cpu.json"
START, END = "<!-- attention-sweep:start -->", "<!-- attention-sweep:end -->"
TIMEOUT_S = 600

# How each family comes out (`classify`), in the table's order.
STATUSES = {
    "exact": "every attention call rewritten, logits equal to the swapped contract reference bit for bit",
    "differs": "every attention call rewritten, logits differ from the swapped reference",
    "partly": "some attention calls rewritten, the others near misses (reasons below)",
    "near miss": "no call rewritten, each reported with its reason",
    "silent": "attention calls neither rewritten nor reported: a defect of the rule that a softmax over q·kᵀ is "
              "aligned or reported",
    "inline": "attention written inline (not through HF's AttentionInterface): rewritten, counted, not checked",
    "no attention": "no attention call, no site and no near miss (state-space and recurrent models)",
}


# Why a family's rewritten attention differs from the swapped reference: the reference, not rla.
KNOWN = {
    "doge": "Doge builds its dynamic mask from the mask HF hands the attention function, which differs for a "
            "registered function: the swapped reference is not the model's attention",
    "bigbird_pegasus": "not localised yet: every layer rewritten, the logits differ from the swapped reference",
}


def _support():
    if str(SUPPORT) not in sys.path:
        sys.path.insert(0, str(SUPPORT))
    import family_sweep

    return family_sweep


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160]}" if text else type(error).__name__


def _general(reason: str) -> str:
    """A near miss's reason without its layer: "softmax_1 at model.layers.1.attn: ... baddbmm_1 at
    model.layers.1.attn (baddbmm) ..." -> "... baddbmm ...", so each reason is listed once."""
    body = reason.split(": ", 1)[-1]
    return re.sub(r"\b\w+ at [\w.]+ \((\w+)\)", r"\1", body)


def classify(result: dict) -> str:
    calls, rewritten, misses = result["calls"], result["rewritten"], result["near_misses"]
    if calls == 0:
        return "inline" if rewritten else "near miss" if misses else "no attention"
    if rewritten == 0:
        return "near miss" if misses else "silent"
    if rewritten < calls:
        return "partly"
    return "exact" if result["differing_logits"] == 0 else "differs"


def run_family(family: str) -> dict:
    """One family, in this process."""
    family_sweep = _support()
    import torch

    import hf_reference
    import rla_compile
    from rla_compile.tiny import tiny_causal_lm

    family_sweep._quiet()
    start = time.perf_counter()
    result = {"family": family, "status": "skipped", "reason": family_sweep.build_problem(family)}
    if result["reason"] is not None:
        return result | {"seconds": round(time.perf_counter() - start, 1)}
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return hf_reference.contract_attention(*args, **kwargs)

    import transformers

    transformers.AttentionInterface.register("rla_contract_counted", counted)
    ids = family_sweep.inputs(1)[0]
    try:
        model = tiny_causal_lm(family, vocab_size=family_sweep.VOCAB, **family_sweep.OVERRIDES.get(family, {})).eval()
        model.set_attn_implementation("eager")
        kwargs = {"use_cache": False}
        with torch.no_grad():
            try:
                model(ids, **kwargs)
            except TypeError:
                kwargs = {}
                model(ids)
    except Exception as error:  # noqa: BLE001 - any failure is the reason recorded
        return result | {"reason": f"does not run with eager attention at tiny size ({_first_line(error)})",
                         "seconds": round(time.perf_counter() - start, 1)}
    backend = rla_compile.Backend(compiler="aot_eager", sites=["attention"])
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend=backend, dynamic=False)(ids, **kwargs).logits
    torch._dynamo.reset()
    rewritten = sum(r.count("attention", "rewritten") for r in backend.reports)
    misses = sorted({_general(m.reason) for r in backend.reports for m in r.near_misses if m.kind == "attention"})
    variants = sorted({s.variant for r in backend.reports for s in r.sites if s.kind == "attention"})
    differing = None
    try:
        model.set_attn_implementation("rla_contract_counted")
        with torch.no_grad():
            want = model(ids, **kwargs).logits
        differing = int((got != want).sum())
    except Exception as error:  # noqa: BLE001
        result["swap_error"] = _first_line(error)
    result.update(status="compared", reason="", calls=len(calls), rewritten=rewritten, near_misses=misses,
                  variants=variants, differing_logits=differing if calls else None, logits=got.numel(),
                  graphs=len(backend.reports), seconds=round(time.perf_counter() - start, 1))
    result["outcome"] = classify(result)
    return result


def run_isolated(family: str, timeout: float = TIMEOUT_S) -> dict:
    """`run_family` in a fresh process: a crash or a timeout is an "error" result."""
    return _support().run_command([sys.executable, "-m", "benchmarks.attention_sweep", "--worker", family], family,
                                  timeout, cwd=ROOT)


def summary(results: list[dict]) -> dict:
    compared = [r for r in results if r["status"] == "compared"]
    counts = {status: [r["family"] for r in compared if r["outcome"] == status] for status in STATUSES}
    return {"families": len(results), "compared": len(compared),
            "skipped": sum(r["status"] == "skipped" for r in results),
            "errors": sum(r["status"] == "error" for r in results),
            "outcomes": {status: len(names) for status, names in counts.items()},
            "silent": counts["silent"], "differs": counts["differs"]}


def table(results: list[dict]) -> str:
    order = list(STATUSES)
    compared = sorted((r for r in results if r["status"] == "compared"),
                      key=lambda r: (order.index(r["outcome"]), r["family"]))
    lines = ["| family | outcome | attention calls | rewritten | form | logits differing from the swapped reference | near misses |",
             "|---|---|---|---|---|---|---|"]
    for r in compared:
        diff = "-" if r["differing_logits"] is None else f"{r['differing_logits']} of {r['logits']}"
        misses = "; ".join(m.replace("|", "\\|") for m in r["near_misses"]) or "-"
        lines.append(f"| {r['family']} | {r['outcome']} | {r['calls']} | {r['rewritten']} | "
                     f"{', '.join(r['variants']) or '-'} | {diff} | {misses} |")
    known = [r for r in compared if r["outcome"] == "differs"]
    if known:
        lines += ["", "Rewritten, but the logits differ from the swapped reference:", ""]
        lines += [f"- `{r['family']}`: {KNOWN.get(r['family'], 'not localised yet')}" for r in known]
    return "\n".join(lines + _support().not_compared(results))


def section(data: dict) -> str:
    s, info = summary(data["results"]), data["machine"]
    outcomes = ", ".join(f"{n} {status}" for status, n in s["outcomes"].items() if n)
    lines = [
        START,
        f"Measured on {info['cpu']} ({', '.join(info.get('cpu_flags', [])) or 'no AVX flags'}; {info['cpus']} cores), "
        f"torch {info['torch']}, transformers "
        f"{data['transformers']}: {s['families']} model types in transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, "
        f"{s['compared']} compared, {s['skipped']} skipped, {s['errors']} errors. Each tiny model (vocabulary 256, "
        f"2×24 tokens, HF's eager attention) compiled with `sites=[\"attention\"]` on eager kernels; its logits "
        f"against the model with its attention function swapped for the contract reference. Outcomes: {outcomes}.",
        "",
        *[f"- **{status}**: {what}" for status, what in STATUSES.items()],
        "",
        table(data["results"]),
        "",
        "Regenerate: `python -m benchmarks.attention_sweep --jobs 2` (a process per family), or `--from-json "
        "benchmarks/results/attention_sweep_cpu.json` to rewrite this section from the committed results.",
        END,
    ]
    return "\n".join(lines)


def write_docs(data: dict, path: Path = DOCS) -> None:
    _support().replace_section(path, START, END, "## Attention across HF's causal LMs", section(data))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated model types (default: every one)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    parser.add_argument("--from-json", help="rewrite the docs section from these results; run nothing")
    parser.add_argument("--no-docs", action="store_true", help="do not touch docs/coverage.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_family(args.worker)), flush=True)
        return {}
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
    else:
        import torch
        import transformers

        from rla_compile.machine import machine

        names = args.families.split(",") if args.families else _support().families()

        def one(name: str) -> dict:
            result = run_isolated(name)
            print(f"{name:28s} {result.get('outcome', result['status']):12s} {result.get('seconds', 0):6.1f}s "
                  f"{result.get('reason', '')}", file=sys.stderr, flush=True)
            return result

        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = list(pool.map(one, names))
        data = {"machine": machine() | {"torch": torch.__version__}, "transformers": transformers.__version__,
                "summary": summary(results), "results": results}
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    if not args.no_docs:
        write_docs(data)
    print(json.dumps(data["summary"]))
    return data


if __name__ == "__main__":
    main()
