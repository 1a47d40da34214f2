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
"""

from __future__ import annotations

from ..progress import timed
from ..sites import DEFAULT_SITES, SITE_KINDS
from .localise import Localisation, localise
from .measurement import TRAINER, configurations, default_stacks, measure, sample
from .metrics import Metrics, compare_logprobs
from .report import MismatchReport, Row, change_interval
from .stacks import Stack

__all__ = ["DEFAULT_SITES", "Localisation", "Metrics", "MismatchReport", "Row", "SITE_KINDS", "Stack", "change_interval", "compare_logprobs",
           "configurations", "default_stacks", "localise", "measure", "sample", "timed"]
