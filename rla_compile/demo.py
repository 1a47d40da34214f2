"""`rla-compile demo`: the README's main job, on the model rla_compile ships (no download).

1. The sites: the shipped low-entropy Qwen3 compiled with `backend="rla"`, and the report of
   every site of the default ones (`DEFAULT_SITES`) it found and rewrote.
2. The mismatch: the same sampled sequences scored by a trainer (HF, training-mode forward,
   torch.compile) and an inference engine (vLLM compiled when installed; otherwise HF with
   eager kernels stands in, and the demo says so), with rla off, on one side, and on both.

As `rla-compile mismatch`: progress lines go to `say` (stderr), results to `show` (stdout).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import bundled
from .backend import Backend
from .mismatch import MismatchReport, measure
from .progress import say_progress, timed

__all__ = ["run_demo"]


def run_demo(inference: str | None = None, say: Callable[[str], None] = say_progress,
             show: Callable[[str], None] = print, **sizes) -> MismatchReport:
    with timed(say, f"loading the shipped model ({bundled.MODEL_DIR.name}, bf16) and compiling it with backend='rla'"):
        model = bundled.load(torch.bfloat16)
        found = Backend(compiler="aot_eager")
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend=found)(torch.tensor(bundled.prompts(1, 16)), use_cache=False)
        torch._dynamo.reset()
    show("")  # the blank lines set the results apart from the progress lines in a terminal
    show(str(found.reports[0]))
    show("")
    report = measure(inference=inference, say=say, **sizes)
    show("")
    show(report.table())
    show("")
    show(report.in_plain_words())
    return report
