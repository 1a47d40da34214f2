"""How big is the train/inference mismatch, and which site causes it?

    from rla_compile import mismatch
    report = mismatch.measure()                     # shipped model, HF trainer vs vLLM (or HF stand-in)
    print(report.table()); report.plot("mismatch.png")
    report = mismatch.measure(ablation=True)        # each site aligned alone, on both sides

The same token sequences (prompts from held-out text, continuations sampled from the model)
go through a training stack and an inference stack with rla off, on one side, or on both;
`metrics.compare_logprobs` reports what RL frameworks log (k3, k1, |Δlogprob|, |Δp|, RMS δ,
E exp|δ|), the exact full-vocabulary KL and the fraction of bitwise-equal logprobs, over the
sampled (continuation) tokens. `localise` says where two strategies first part.

    measurement.py   measure: sample once, score each configuration's two stacks, compare
    stacks.py        Stack: one way to run the model (HF or vLLM, compiler, rla sites, dtype)
    metrics.py       compare_logprobs: the metrics of two log-distributions
    report.py        MismatchReport: rows, intervals against rla off, table, JSON, plot
    localise.py      localise: where two stacks first part, per layer and point

The names load on first use (PEP 562), as the package's own: reading a stack label
(`Stack.parse`) does not import torch, so the command line checks its arguments first.
"""

from __future__ import annotations

import importlib

# public name -> the submodule that defines it
_PUBLIC = {
    "DEFAULT_SITES": "..sites", "SITE_KINDS": "..sites", "timed": "..progress",
    "Localisation": ".localise", "localise": ".localise",
    "TRAINER": ".measurement", "configurations": ".measurement", "default_stacks": ".measurement",
    "measure": ".measurement", "sample": ".measurement",
    "Metrics": ".metrics", "compare_logprobs": ".metrics",
    "MismatchReport": ".report", "Row": ".report", "change_interval": ".report",
    "Stack": ".stacks",
}

__all__ = list(_PUBLIC)
_REGISTRY_LISTS = {"DEFAULT_SITES", "SITE_KINDS"}


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    if name not in _REGISTRY_LISTS:  # the registry's lists are read from it each time (sites.registered)
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
