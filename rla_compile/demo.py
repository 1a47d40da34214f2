"""`rla-compile demo`: the sites rla finds in a tiny model, and what aligning them does to the
disagreement between two ways of running the same model.

Two execution strategies of one bf16 model stand in for a trainer and an inference engine:
Inductor (fused kernels; where it rounds depends on its fusion decisions) and AOTAutograd with
eager kernels (rounds where the graph says). Without rla their logprobs differ. With rla on
both, the sites round at the same places; what remains comes from outside the sites
(attention's scale, mask and softmax casts, which Inductor fuses away). With
`pin_rounding=True` Inductor rounds like eager there too, and the two agree bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .backend import backend as rla_backend

__all__ = ["Mismatch", "logprob_mismatch", "run_demo"]


@dataclass(frozen=True)
class Mismatch:
    mean_abs: float  # mean |Δ logprob| over the scored tokens
    max_abs: float
    equal: float  # fraction of bitwise-equal logprobs

    def row(self, label: str) -> str:
        return f"{label:<44} {self.mean_abs:>12.3e} {self.max_abs:>12.3e} {self.equal:>9.1%}"


def logprob_mismatch(logits_a: torch.Tensor, logits_b: torch.Tensor, tokens: torch.Tensor) -> Mismatch:
    """Compare the logprobs two runs give the tokens that actually come next."""
    next_tokens = tokens[:, 1:].unsqueeze(-1)
    lp_a = torch.log_softmax(logits_a[:, :-1].float(), -1).gather(-1, next_tokens)
    lp_b = torch.log_softmax(logits_b[:, :-1].float(), -1).gather(-1, next_tokens)
    delta = (lp_a - lp_b).abs()
    return Mismatch(float(delta.mean()), float(delta.max()), float((lp_a == lp_b).float().mean()))


def _step(say: Callable[[str], None], what: str):
    class _Timer:
        def __enter__(self):
            say(f"... {what}")
            self.start = time.perf_counter()

        def __exit__(self, *exc):
            if exc[0] is None:
                say(f"    done in {time.perf_counter() - self.start:.1f} s")

    return _Timer()


def run_demo(model_type: str = "llama", layers: int = 2, tokens: int = 32, say: Callable[[str], None] = print) -> dict:
    from .tiny import tiny_causal_lm

    with _step(say, f"building a tiny random {model_type} ({layers} layers, bf16) from its config"):
        model = tiny_causal_lm(model_type, num_hidden_layers=layers)
    ids = torch.randint(0, model.config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(0))

    def logits(backend) -> torch.Tensor:
        torch._dynamo.reset()
        with torch.no_grad():
            return torch.compile(model, backend=backend)(ids, use_cache=False).logits

    rla_inductor = rla_backend()
    rla_pinned = rla_backend(pin_rounding=True)
    rla_eager = rla_backend(inner="aot_eager")
    runs = {}
    with _step(say, "compiling with backend='inductor' (no rla)"):
        runs["inductor"] = logits("inductor")
    with _step(say, "compiling with backend='aot_eager' (no rla)"):
        runs["aot_eager"] = logits("aot_eager")
    with _step(say, "compiling with backend='rla' (inner inductor)"):
        runs["rla"] = logits(rla_inductor)
    with _step(say, "compiling with backend='rla', pin_rounding=True"):
        runs["rla_pinned"] = logits(rla_pinned)
    with _step(say, "compiling with backend='rla' (inner aot_eager)"):
        runs["rla_eager"] = logits(rla_eager)

    say("")
    say(str(rla_inductor.reports[0]))
    say("")
    baseline = logprob_mismatch(runs["inductor"], runs["aot_eager"], ids)
    sites = logprob_mismatch(runs["rla"], runs["rla_eager"], ids)
    pinned = logprob_mismatch(runs["rla_pinned"], runs["rla_eager"], ids)
    say(f"{'logprob mismatch, Inductor vs eager kernels':<44} {'mean |Δ|':>12} {'max |Δ|':>12} {'bitwise =':>9}")
    say(baseline.row("without rla"))
    say(sites.row("rla on both (sites aligned)"))
    say(pinned.row("rla on both, pin_rounding=True"))
    return {"report": rla_inductor.reports[0], "baseline": baseline, "sites": sites, "pinned": pinned}
