"""The two sides of a mismatch measurement: a training stack (HF transformers, training-mode
forward with autograd on, as a trainer computes π) and an inference stack (vLLM, or HF in
inference mode), each with rla on some sites or off. Every stack scores the same token
sequences teacher-forced and returns full log-distributions, so any two can be compared."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..site_names import check_site_names, default_sites

if TYPE_CHECKING:
    import torch

__all__ = ["Stack", "hf_runner", "hf_logits", "hf_logprobs", "vllm_logprobs", "score", "has_vllm", "require_vllm"]

HF_COMPILERS = ("eager", "aot_eager", "inductor")
# torch is imported where a stack runs, not where one is read: the command line checks labels first
DTYPES = ("bfloat16", "float16", "float32")  # torch.<name>
VLLM_COMPILERS = ("eager", "inductor")


@dataclass(frozen=True)
class Stack:
    """One way to run the model. `sites` are the sites rla aligns (None: rla off; "+rla" in a
    label is `DEFAULT_SITES`, "+rla[...]" names them, e.g. `+rla[rmsnorm,residual_rmsnorm,swiglu,rope,logits]`).

    engine "hf": compiler "eager" (no torch.compile), "aot_eager" (compiled, eager kernels) or
    "inductor"; `train` runs the training-mode forward with autograd on.
    engine "vllm": compiler "inductor" (vLLM's compiled path) or "eager" (enforce_eager);
    `decode` scores the sampled part of each sequence as RL sees it: the logprobs vLLM returns
    while it generates it (the prompt's prefill, then one decode step per token, every sequence
    in one batch, KV cache), each step forced to the sequence's token; without it, vLLM
    scores the whole sequence as one prompt (prefill, `prompt_logprobs`).
    `rounding`: (site kind, mode) pairs for rla's option `rounding`, written `kind~mode` in the
    label's site list (`+rla[rope,attention~toward_zero]`); `paired` fills them in for an HF
    trainer compared with vLLM, as measured on this machine.
    `experts_paired` (HF, written `:experts_paired`): an MoE model's experts compute vLLM-CPU's
    fused MoE kernel (`integrations.experts_vllm_cpu.pair_experts`); `paired` sets it for an HF
    trainer compared with vLLM when a selected site asks for it (`expert_combine`, as the TRL
    integration pairs a policy); a dense model is left as it is.
    """

    engine: str
    compiler: str
    sites: tuple[str, ...] | None = None
    train: bool = False
    dtype: str = "bfloat16"  # the weights' and activations' dtype
    rounding: tuple[tuple[str, str], ...] = ()
    decode: bool = False
    experts_paired: bool = False

    def __post_init__(self):
        compilers = {"hf": HF_COMPILERS, "vllm": VLLM_COMPILERS}.get(self.engine)
        if compilers is None:
            raise ValueError(f"unknown engine {self.engine!r}: use 'hf' or 'vllm'")
        if self.compiler not in compilers:
            raise ValueError(f"engine {self.engine!r} has no compiler {self.compiler!r}: use one of {compilers}")
        if self.sites is not None:
            check_site_names(self.sites, f"+rla[...] of stack {self.engine}-{self.compiler}")
            if self.compiler == "eager":
                fix = "'aot_eager' (compiled, eager kernels)" if self.engine == "hf" else "'inductor'"
                raise ValueError(f"rla is a torch.compile rewrite: {self.engine} with compiler 'eager' cannot align sites; "
                                 f"use compiler {fix}")
        if self.rounding:
            from ..config import Options, OptionError

            try:
                Options(sites=self.sites or (), rounding=dict(self.rounding))
            except OptionError as error:
                raise ValueError(f"stack {self.engine}-{self.compiler}: {error}") from None
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: use one of {list(DTYPES)}")
        if self.train and self.engine != "hf":
            raise ValueError("train=True is a training-mode forward: only engine 'hf' has one")
        if self.experts_paired and self.engine != "hf":
            raise ValueError("experts_paired pairs an HF model's experts with vLLM-CPU's fused MoE kernel: only engine "
                             "'hf' has them to pair (vLLM runs its own kernel)")
        if self.decode and self.engine != "vllm":
            raise ValueError("decode=True scores through vLLM's decode steps: only engine 'vllm' has them "
                             "(an HF stack scores every position in one forward)")

    def with_sites(self, sites) -> "Stack":
        sites = None if sites is None else tuple(sites)
        return replace(self, sites=sites, rounding=tuple((k, m) for k, m in self.rounding if k in (sites or ())))

    def paired(self, other: "Stack") -> "Stack":
        """This stack as the trainer paired with `other`: an HF stack compared with vLLM rounds
        each selected site whose engine half is vLLM's own kernel as that kernel does here
        (`integrations.vllm.paired_rounding`, measured); any other pair is returned unchanged."""
        if self.engine != "hf" or other.engine != "vllm" or not self.sites:
            return self
        from .. import sites as registry
        from ..config import Options
        from ..integrations.trl import pair_experts_with_engine
        from ..integrations.vllm_kernels import paired_rounding

        rounding = paired_rounding(Options(sites=self.sites, rounding=dict(self.rounding)))
        # the sites whose TRL policy hook pairs the experts with the engine's kernel pair them here too
        experts = any(pair_experts_with_engine.__name__ in site.policy_hooks for site in registry.selected(self.sites))
        return replace(self, rounding=tuple(sorted((k, m) for k, m in rounding.items() if m != "nearest")),
                       experts_paired=self.experts_paired or experts)

    @property
    def label(self) -> str:
        """`engine-compiler[+rla[sites]][:dtype][:train|:decode][:experts_paired]`, the form `parse` reads."""
        modes = dict(self.rounding)
        listed = ",".join(f"{s}~{modes[s]}" if s in modes else s for s in self.sites or ())
        rla = ("" if self.sites is None else "+rla" if set(self.sites) == set(default_sites()) and not modes
               else f"+rla[{listed}]")
        dtype = "" if self.dtype == "bfloat16" else f":{self.dtype}"
        return (f"{self.engine}-{self.compiler}{rla}{dtype}{':train' if self.train else ''}{':decode' if self.decode else ''}"
                f"{':experts_paired' if self.experts_paired else ''}")

    @classmethod
    def parse(cls, text: str) -> "Stack":
        """'hf-inductor', 'hf-aot_eager+rla', 'hf-inductor+rla[rope,swiglu]:train', 'vllm-inductor+rla',
        'hf-eager:float32', 'hf-inductor+rla[rope,attention~toward_zero]:train', 'vllm-inductor+rla:decode',
        'hf-inductor+rla[router,expert_combine]:train:experts_paired'."""
        head, *flags = text.split(":")
        unknown = [f for f in flags if f not in ("train", "decode", "experts_paired") and f not in DTYPES]
        engine, _, rest = head.partition("-")
        compiler, plus, rla = rest.partition("+")
        if unknown or not compiler or (plus and not (rla == "rla" or (rla.startswith("rla[") and rla.endswith("]")))):
            raise ValueError(f"cannot read stack {text!r}: write engine-compiler[+rla[sites]][:dtype][:train|:decode]"
                             "[:experts_paired], "
                             "e.g. hf-inductor+rla:train, hf-aot_eager, vllm-inductor+rla[rope,swiglu], hf-eager:float32, "
                             "vllm-inductor+rla:decode")
        items = [] if not plus or rla == "rla" else [s for s in rla[4:-1].split(",") if s]
        sites = None if not plus else default_sites() if rla == "rla" else tuple(s.partition("~")[0] for s in items)
        rounding = tuple((kind, mode) for kind, _, mode in (s.partition("~") for s in items) if mode)
        dtype = next((f for f in flags if f in DTYPES), "bfloat16")
        return cls(engine, compiler, sites, train="train" in flags, dtype=dtype, rounding=rounding,
                   decode="decode" in flags, experts_paired="experts_paired" in flags)


def has_vllm() -> bool:
    """Whether vLLM is installed, found without importing it (seconds): an install that is there
    but fails to import fails where it is used, with vLLM's own error, rather than being passed over."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def require_vllm(what: str) -> None:
    """Fail early, with the one install advice, when `what` needs vLLM and it is not installed."""
    if not has_vllm():
        from ..integrations import VLLM_INSTALL

        raise ImportError(f"{what} needs vLLM: {VLLM_INSTALL}")


def score(stack: Stack, model_dir: Path, sequences: torch.Tensor, workdir: Path | None = None,
          prompt_tokens: int | None = None, routes: bool = False) -> dict:
    """{"logprobs": [B, T-1, V] fp32 log-distributions of positions 1..T-1, "reports": [...],
    "routes": with `routes`, the expert ids each MoE layer chose per sequence, [positions, layers,
    k] (a [B, T, layers, k] tensor from an HF stack; a list of [T, ...] from a vLLM stack, [T-1,
    ...] from a decode stack, whose last token is drawn, never fed); else None}.
    A `decode` stack generates each sequence after its first `prompt_tokens` (required there)."""
    if stack.engine == "hf":
        return hf_logprobs(stack, model_dir, sequences, routes)
    return vllm_logprobs(stack, model_dir, sequences, workdir, prompt_tokens, routes)


def hf_runner(stack: Stack, model):
    """The callable that runs `model` as `stack` says, and the rla backend (None when off)."""
    import torch

    from ..backend import Backend

    model.train(stack.train)
    model.requires_grad_(stack.train)
    if stack.experts_paired:
        from ..integrations import experts_vllm_cpu

        if experts_vllm_cpu.has_experts(model):
            experts_vllm_cpu.pair_experts(model)
    if stack.sites is not None:
        rla = Backend(compiler=stack.compiler, sites=list(stack.sites), rounding=dict(stack.rounding))
        return torch.compile(model, backend=rla), rla
    if stack.compiler == "eager":
        return model, None
    return torch.compile(model, backend=stack.compiler), None


def hf_logits(stack: Stack, runner, sequences: torch.Tensor) -> torch.Tensor:
    """One forward of `runner` (from `hf_runner`) with the stack's grad mode; Dynamo's caches are
    cleared before and after so no other stack's compiled graph is reused."""
    import torch

    torch._dynamo.reset()
    try:
        with torch.set_grad_enabled(stack.train):
            return runner(sequences, use_cache=False).logits
    finally:
        torch._dynamo.reset()


class RoutesNotFound(RuntimeError):
    """The model's MoE routers do not hand out their expert ids where `recorded_routes` looks."""


@dataclass
class RecordedRoutes:
    """What `recorded_routes` recorded: one [tokens, k] id tensor per router call, in call order."""
    layers: int  # the model's routers, one per MoE layer
    calls: list

    def of_batch(self, batch: int) -> torch.Tensor:
        """The ids of one forward over `batch` equal-length sequences: [B, T, layers, k]."""
        import torch

        if len(self.calls) != self.layers:
            raise RoutesNotFound(f"recorded {len(self.calls)} router calls in one forward of a model with {self.layers} routers")
        ids = torch.stack(self.calls, dim=1)  # [B*T, layers, k]
        return ids.reshape(batch, -1, *ids.shape[1:]).long()


@contextlib.contextmanager
def recorded_routes(model):
    """Record which experts `model`'s MoE routers choose, compiled or not (forward hooks, which
    Dynamo traces): yields a `RecordedRoutes`, routers in layer order. A router is a module whose
    class HF names `...TopKRouter` (Qwen2/3-MoE, Mixtral, OLMoE, gpt-oss, ...); its ids are the
    integer tensor among its outputs. RoutesNotFound where the model has none such (a family
    whose top-k runs outside its router module, e.g. DeepSeek-V3's)."""
    import torch

    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
    if not routers:
        raise RoutesNotFound(f"{type(model).__name__} has no HF `...TopKRouter` module whose output holds expert ids")
    recorded = RecordedRoutes(len(routers), [])

    def record(module, _inputs, out):
        ids = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor) and not o.is_floating_point()]
        if not ids:
            raise RoutesNotFound(f"{type(module).__name__} returns no expert ids (its top-k runs outside it)")
        recorded.calls.append(ids[-1].detach())

    handles = [r.register_forward_hook(record) for r in routers]
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


def hf_logprobs(stack: Stack, model_dir: Path, sequences: torch.Tensor, routes: bool = False) -> dict:
    """`routes`: also the expert ids the model's routers chose, [B, T, MoE layers, k]."""
    import torch

    from ..bundled import load

    model = load(stack.dtype, model_dir)
    runner, rla = hf_runner(stack, model)
    with recorded_routes(model) if routes else contextlib.nullcontext() as recorded:
        logits = hf_logits(stack, runner, sequences)
    logprobs = torch.log_softmax(logits.detach()[:, :-1].float(), -1)
    return {"logprobs": logprobs, "reports": [r.to_dict() for r in rla.reports] if rla else [],
            "routes": recorded.of_batch(sequences.shape[0]) if routes else None}


def vllm_logprobs(stack: Stack, model_dir: Path, sequences: torch.Tensor, workdir: Path | None = None,
                  prompt_tokens: int | None = None, routes: bool = False) -> dict:
    """Score in a fresh process: each engine gets its own vLLM compile cache and environment (the
    fp32 RoPE tables are switched per process), and vLLM's globals never leak between stacks."""
    return run_vllm_worker("rla_compile.mismatch.vllm_worker", stack, model_dir, sequences, workdir, prompt_tokens,
                           routes=routes)


def run_vllm_worker(module: str, stack: Stack, model_dir: Path, sequences: torch.Tensor,
                    workdir: Path | None = None, prompt_tokens: int | None = None, routes: bool = False,
                    sample: dict | None = None) -> dict:
    """Run `python -m module REQUEST.json` for `stack` in a fresh process (an in-process engine,
    its environment from `engine_env`: a fresh vLLM cache, Inductor's compiled kernels shared)
    and return what it saved. `sequences`: a [B, T] tensor, or a list of token lists of
    different lengths (prompt scoring, or prompts to `sample` from: {"tokens": N, "seed": S},
    `vllm_worker.sample`). `routes`: also the expert ids the engine's MoE routers chose
    (`vllm_worker.recorded_routes`)."""
    rows = sequences.tolist() if hasattr(sequences, "tolist") else [list(map(int, s)) for s in sequences]
    if stack.decode and not (prompt_tokens and all(0 < prompt_tokens < len(s) for s in rows)):
        raise ValueError(f"the decode stack {stack.label} generates each sequence after its prompt: give "
                         f"prompt_tokens between 1 and {min(map(len, rows)) - 1}, got {prompt_tokens!r}")
    require_vllm("the vLLM stack")
    import torch

    from ..integrations.vllm import engine_env

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        tmp = Path(tmp)
        request = {"model_dir": str(model_dir), "sequences": rows, "compiled": stack.compiler == "inductor",
                   "dtype": stack.dtype,
                   "sites": None if stack.sites is None else list(stack.sites), "out": str(tmp / "out.pt"),
                   "decode_after": prompt_tokens if stack.decode else None, "routes": routes, "sample": sample}
        (tmp / "request.json").write_text(json.dumps(request))
        env = engine_env(tmp / "vllm_cache")
        env.pop("RLA_VLLM_FP32_ROPE", None)
        done = subprocess.run([sys.executable, "-m", module, str(tmp / "request.json")],
                              capture_output=True, text=True, env=env)
        if done.returncode:
            raise RuntimeError(f"the vLLM stack {stack.label} failed:\n{done.stderr[-4000:]}")
        return torch.load(tmp / "out.pt")
