"""A mismatch measurement, start to end: sample the sequences once, score them with each
configuration's trainer and inference stacks, compare (`measure`; `rla_compile.mismatch`
re-exports everything here)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from pathlib import Path

import torch

from ..machine import machine
from ..progress import timed
from ..report import GraphReport
from .. import sites as registry
from .metrics import compare_logprobs, routing_agreement
from .report import STAND_IN, MismatchReport, Row
from .stacks import Stack, has_vllm, require_vllm, score

__all__ = ["TRAINER", "configurations", "default_stacks", "measure", "sample"]


TRAINER = Stack("hf", "inductor", train=True)  # HF's training forward under torch.compile's default


def sample(model_dir: Path, prompts: list[list[int]], new_tokens: int, seed: int = 0) -> torch.Tensor:
    """Prompts + continuations sampled (temperature 1) from the bf16 model in eager mode: a
    sampler outside every stack under test. [B, prompt + new_tokens]."""
    from ..bundled import load

    model = load(torch.bfloat16, model_dir).eval()
    ids = torch.tensor(prompts)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)
    return out


def default_stacks(inference: str | None = None) -> tuple[Stack, Stack, str | None]:
    """The trainer (HF, training forward, Inductor) and the inference stack: vLLM compiled when
    installed, otherwise HF with eager kernels standing in (returned note says so)."""
    trainer = TRAINER
    if inference is None:
        inference = "vllm" if has_vllm() else "hf"
    if inference == "vllm":
        require_vllm("inference stack 'vllm'")
        return trainer, Stack("vllm", "inductor"), None
    if inference == "hf":
        from ..integrations.vllm import INSTALL

        note = None if has_vllm() else f"{STAND_IN}; install vLLM for the real thing: {INSTALL}"
        return trainer, Stack("hf", "aot_eager"), note
    raise ValueError(f"unknown inference stack {inference!r}: use 'vllm' or 'hf'")


def configurations(ablation: bool, config: Any = None) -> list[tuple[str, tuple | None, tuple | None]]:
    """(label, trainer sites, inference sites) per row; None is rla off. rla off, on one side,
    on both (the default sites), on both with each opt-in site too, and with all of them; with `ablation` also each
    site alone on both sides. With the model's (HF) `config`, only the sites such a model can
    have (`Site.in_model`: the MoE sites for a model with experts)."""
    def present(kinds: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(k for k in kinds if config is None or registry.by_kind(k).in_model(config))

    every, opt_in = tuple(registry.DEFAULT_SITES), present(registry.OPT_IN_SITES)
    rows = [("rla off", None, None), ("rla on trainer only", every, None), ("rla on inference only", None, every),
            ("rla on both", every, every)]
    rows += [(f"rla on both + {kind}", every + (kind,), every + (kind,)) for kind in opt_in]
    if len(opt_in) > 1:
        everything = every + opt_in
        rows.append((f"rla on both + {' + '.join(opt_in)}", everything, everything))
    if ablation:
        rows += [(f"{kind} only, both sides", (kind,), (kind,)) for kind in present(registry.SITE_KINDS)]
    return rows


def measure(model_dir: str | Path | None = None, trainer: Stack | str | None = None, inference: Stack | str | None = None,
            ablation: bool = False, rows: list[tuple[str, tuple | None, tuple | None]] | None = None,
            prompts: int = 8, prompt_tokens: int = 32, new_tokens: int = 64, seed: int = 0,
            say: Callable[[str], None] = lambda _: None) -> MismatchReport:
    """Score the same sequences with `trainer` and `inference` under each configuration (rla
    off / one side / both, or per site with `ablation`; or your own `rows` of (label, trainer
    sites, inference sites), where a side may also be a whole `Stack`, e.g. an fp32 trainer
    `Stack.parse("hf-inductor:float32:train")`) and compare them. Stacks are `Stack`s or their labels
    ('hf-inductor:train'); `inference` may also be just 'vllm' or 'hf'. The rla setting of the
    given stacks is replaced by each row's."""
    from .. import bundled

    # everything that can be wrong is checked before the first slow step
    model_dir = bundled.check_model_dir(model_dir or bundled.MODEL_DIR)
    if inference is None or inference in ("vllm", "hf"):
        default_trainer, inference, note = default_stacks(inference)
    else:
        default_trainer, note = TRAINER, None
        inference = Stack.parse(inference) if isinstance(inference, str) else inference
    trainer = Stack.parse(trainer) if isinstance(trainer, str) else trainer or default_trainer
    rows = rows or configurations(ablation, bundled.config_of(model_dir))
    if new_tokens < 1:
        raise ValueError(f"new_tokens={new_tokens}: sample at least 1 token per sequence")
    prompt_ids = bundled.prompts(prompts, prompt_tokens)
    stacks = [trainer, inference, *(side for row in rows for side in row[1:] if isinstance(side, Stack))]
    cast = bundled.cast_note(model_dir, {"bfloat16", *(s.dtype for s in stacks)})  # the sampler runs bf16
    notes = [n for n in (cast, note) if n]
    if cast:
        say(cast)
    report = MismatchReport(str(model_dir), prompts, prompt_tokens, prompts * new_tokens, notes=notes,
                            machine=machine())
    with timed(say, f"sampling {prompts} continuations of {new_tokens} tokens from {model_dir.name} (HF, eager)"):
        sequences = sample(model_dir, prompt_ids, new_tokens, seed)
    # the scored positions: each sampled token, predicted from everything before it
    scored = slice(prompt_tokens - 1, None)
    tokens = sequences[:, 1:][:, scored].reshape(-1)
    cache: dict[Stack, torch.Tensor] = {}
    # an MoE model: each stack also says which experts its routers chose at positions 0..T-2 (the
    # ones that predict a token of the sequence; a decode stack never feeds the last)
    routes = _has_experts(model_dir)
    chosen: dict[Stack, list] = {}

    def logprobs(stack: Stack) -> torch.Tensor:
        if stack not in cache:
            with timed(say, f"scoring with {stack.label}" + (" (engine start + compile)" if stack.engine == "vllm" else "")):
                result = score(stack, model_dir, sequences, prompt_tokens=prompt_tokens, routes=routes)
            cache[stack] = result["logprobs"][:, scored].reshape(-1, result["logprobs"].shape[-1])
            if routes:
                chosen[stack] = [r[:sequences.shape[1] - 1] for r in result["routes"]]
            if stack.sites is not None:
                reports = [GraphReport.from_dict(r) for r in result["reports"]]
                report.sites[stack.label] = GraphReport("all", [s for r in reports for s in r.sites]).counts("rewritten")
        return cache[stack]

    for label, train_sites, infer_sites in rows:
        # a row's side is sites for the given stack, or a whole Stack of its own (e.g. an fp32 trainer)
        t = train_sites if isinstance(train_sites, Stack) else trainer.with_sites(train_sites)
        i = infer_sites if isinstance(infer_sites, Stack) else inference.with_sites(infer_sites)
        t = t.paired(i)  # an HF trainer's sites round as vLLM's own kernels for them do here
        lp_t, lp_i = logprobs(t), logprobs(i)
        metrics = compare_logprobs(lp_t, lp_i, tokens)
        delta = (lp_t.gather(-1, tokens[:, None]) - lp_i.gather(-1, tokens[:, None]))[:, 0].double()
        routing = routing_agreement(chosen[t], chosen[i]) if routes else None
        report.rows.append(Row(label, t, i, metrics, delta.tolist(), routing))
    return report


def _has_experts(model_dir: Path) -> bool:
    from .. import bundled
    from ..sites import router

    return router.SITE.in_model(bundled.config_of(model_dir))  # a number of experts in its config
