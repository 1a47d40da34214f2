"""rla on both sides of an RL trainer: the policy the trainer differentiates and the vLLM
engine that samples for it. Two lines in a stock TRL script:

    import rla_compile.integrations.trl as rla_trl
    rla_trl.enable()                                  # before building the trainer

`enable(**options)` (rla's options, e.g. `sites=["rope", "swiglu"]`, the same on both sides):

- **vLLM**: every engine built in this process (TRL's colocated `LLM(...)`, which takes no
  `compilation_config`) gets rla's pass and fp32 RoPE tables (`rla_compile.integrations.vllm`);
  RLA_VLLM=1 and RLA_VLLM_OPTIONS are set so that a `vllm serve` started from this
  environment does the same for server mode.
- **trainer**: every `transformers.Trainer` built afterwards (TRL's trainers derive from it)
  gets an `RlaCallback`, which compiles the model in place with the `rla` backend when
  training starts. (`TrainingArguments(torch_compile_backend="rla")` cannot do this:
  accelerate accepts only the backend names of its own `DynamoBackend` enum and raises
  `'RLA' is not a valid DynamoBackend`.)
- **the engine's own kernels**: a selected site whose engine half is a vLLM kernel
  (attention) has the trainer round as that kernel does on this machine, measured, when the
  trainer samples with vLLM (`use_vllm`): `paired_with_engine`.
- **positions of left-padded prompts**: `positions_from_mask()`, see there (the callback adds it
  when the trainer samples with vLLM: the policy numbers each sequence's tokens from its first,
  as the engine does).
- **gradient checkpointing's hooks**: `fix_checkpointing_hooks()`, see there (without it the
  compiled policy falls back to eager, without rla, after 8 steps of TRL).
- **weight sync on vLLM-CPU**: `fix_weight_sync()`, see there.
- **logits** (only with `sites` including "logits"): TRL scores completions with its own
  chunked LM-head function, outside the compiled graph, in bf16 tiles; `align_logprob_head()`
  makes it read fp32 hidden states, so every tile is projected from fp32 inputs and never
  rounded — the contract's logits site, matching vLLM's head_dtype=float32, which the
  environment switch sets.

`disable()` undoes all of it: every patched function is the library's own again.

`enable()` returns an `Enabled`: what it switched on, and what it did not and why (TRL or vLLM
not installed); the same goes to this module's logger, as a warning when a part is off.

Without `enable()`, each part on its own: `compile_policy(model)` (or `callbacks=[RlaCallback()]`)
for the trainer, the environment variables for vLLM, `fix_weight_sync()` for vLLM-CPU.
Checked with TRL 1.16.0 and vLLM-CPU 0.32.0 (`tests/test_rl.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

from .. import sites as registry
from ..backend import Backend
from ..config import Options
from . import patching

__all__ = ["EagerFallbacks", "Enabled", "RlaCallback", "align_logprob_head", "compile_policy", "disable", "enable",
           "fix_checkpointing_hooks", "fix_weight_sync", "paired_with_engine", "positions_from_mask"]

log = logging.getLogger(__name__)

INSTALL_TRL = "pip install 'rla_compile[rl]'"


def compile_policy(model, options: Options | dict | None = None, **kwargs: Any) -> Backend:
    """Compile `model` in place with the rla backend (`model.compile`): it keeps its class,
    `forward` and signature, which trainers read and TRL patches. Returns the backend, whose
    `.reports` get one report per compiled graph. Compiling twice is a no-op (same backend)."""
    existing = getattr(model, "_rla_backend", None)
    if existing is not None:
        return existing
    opts = options if isinstance(options, Options) else Options.from_dict({**(options or {}), **kwargs})
    backend = Backend(opts)
    model.compile(backend=backend)
    model._rla_backend = backend
    return backend


def _callback_base() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError as error:
        raise ImportError("RlaCallback needs transformers: pip install 'rla_compile[hf]'") from error
    return TrainerCallback


class EagerFallbacks(logging.Handler):
    """Dynamo's "hit config.recompile_limit" warnings while it is attached to Dynamo's logger:
    from such a warning on, the function it names runs eagerly, without the rla backend.
    The first for each function is kept (`.hits`: the warning's text) and said again on rla's
    logger, with what it means for the sites."""

    LOGGER = "torch._dynamo.convert_frame"

    def __init__(self):
        super().__init__(logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "torch._dynamo hit config." not in message or "recompile_limit" not in message:
            return
        lines = [line.strip() for line in message.splitlines()]
        function = next((line for line in lines if line.startswith("function:")), "function: ?")
        reason = next((line for line in lines if line.startswith("last reason:")), "last reason: ?")
        if any(function in hit for hit in self.hits):
            return  # Dynamo says it again at every call of that function: once is enough
        self.hits.append(message)
        log.warning("rla: Dynamo stopped compiling the policy's %s (its recompile limit; %s): from here on it runs "
                    "eagerly, WITHOUT rla's sites. TORCH_LOGS=recompiles says why it recompiled.", function, reason)

    def __enter__(self) -> "EagerFallbacks":
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger(self.LOGGER).removeHandler(self)


class RlaCallback(_callback_base()):
    """A `TrainerCallback` that compiles the trained model in place with the rla backend when
    training starts (HF `Trainer` and every TRL trainer): `callbacks=[RlaCallback()]`.
    `.backend.reports` has the reports; each graph's summary also goes to the `rla_compile`
    logger. While training runs, Dynamo giving up on the policy (its recompile limit: the
    model then runs eagerly, without rla) is said on rla's logger as a warning and kept in
    `.eager_fallbacks.hits`. When the trainer samples with vLLM (`args.use_vllm`), the sites
    are paired with the engine's kernels (`paired_with_engine`) and left-padded prompts get the
    engine's positions (`positions_from_mask`) until training ends."""

    def __init__(self, options: Options | None = None, /, **kwargs: Any):
        # RlaCallback(sites=[...]) or, options already parsed, RlaCallback(Options(...))
        self.options = Options.from_dict(kwargs) if options is None else options
        self.backend: Backend | None = None
        self.eager_fallbacks = EagerFallbacks()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise RuntimeError("RlaCallback: the Trainer passed no model to on_train_begin")
        options = paired_with_engine(self.options, args, _colocated_engine(getattr(self, "trainer", None)))
        for site in registry.selected(options.sites):
            for hook in site.policy_hooks:
                POLICY_HOOKS[hook](_unwrap(model), args)
        self.backend = compile_policy(_unwrap(model), options)
        if getattr(args, "use_vllm", False):
            self._positions = positions_from_mask(_unwrap(model))
        self.eager_fallbacks.__enter__()
        log.info("rla: the trained model is compiled in place with the rla backend (%s)", options)

    def on_train_end(self, args, state, control, **kwargs):
        self.eager_fallbacks.__exit__(None, None, None)
        if getattr(self, "_positions", None) is not None:
            self._positions.remove()
            self._positions = None


def _colocated_engine(trainer) -> Any:
    """The vLLM engine a TRL trainer samples with in its own process (`vllm_mode="colocate"`:
    `trainer.vllm_generation.llm.llm_engine`), or None."""
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    return getattr(llm, "llm_engine", None)


def positions_from_mask(model):
    """Give `model` (a HF causal LM) the positions a vLLM engine gives each token: counted from
    its sequence's first token, not from the padded batch's first column. Returns the hook's
    handle (`.remove()` takes it off), or None where `model.forward` takes no `position_ids`.

    Why: TRL (1.16) scores a batch of prompts left-padded to one length, calling the policy with
    `input_ids` and `attention_mask` only; transformers then numbers the positions 0..T-1 across
    the padded row, so the tokens of a prompt padded by p sit at positions p, p+1, ... while vLLM,
    which never pads, puts them at 0, 1, ... RoPE is relative in exact arithmetic, not in
    floating point: the rotated q and k of every token of a padded sequence round differently
    from the engine's. transformers' own `generate()` derives the positions from the mask; this
    forward pre-hook does the same (`attention_mask.cumsum(-1) - 1`, 0 at the padding) for every
    call that passes a 2-D `attention_mask` and no `position_ids`. Unpadded and right-padded
    rows keep the positions they had."""
    import inspect

    if "position_ids" not in inspect.signature(model.forward).parameters:
        return None

    def positions(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is None or mask.dim() != 2 or kwargs.get("position_ids") is not None or len(args) > 1:
            return None
        if kwargs.get("past_key_values") is not None:
            return None  # decoding with a cache: transformers counts on from the cache
        return args, {**kwargs, "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0)}

    return model.register_forward_pre_hook(positions, with_kwargs=True)


def paired_with_engine(options: Options, args: Any, engine: Any = None) -> Options:
    """`options` for a trainer that samples with vLLM (`args.use_vllm`, TRL's config): the
    selected sites whose engine half is one of vLLM's own kernels round as that kernel does on
    this machine, measured (`vllm_kernels.paired_rounding`; attention on vLLM-CPU without
    AVX512-BF16: toward zero); a `rounding` the user set wins. Otherwise `options` unchanged.

    `engine`, the colocated engine (vLLM's `LLMEngine`, whose `vllm_config` says its device and
    attention backend): on CUDA the attention site takes the form that pairs with the engine's
    backend (`vllm_kernels.paired_attention_form`: "vllm_triton" for TRITON_ATTN), or stays the
    contract's with a warning that says which setting would pair it."""
    if not getattr(args, "use_vllm", False):
        return options
    from .. import sites as registry

    if not any(site.engine_rounding and site.kind not in options.rounding for site in registry.selected(options.sites)):
        return options  # nothing to measure
    config = getattr(engine, "vllm_config", None)
    if config is not None and str(getattr(config.device_config, "device_type", "")) == "cuda":
        from .vllm_kernels import paired_attention_form

        form, why = paired_attention_form(config)
        if form is None:
            log.warning("rla: the trainer's attention is not paired with the engine's: %s", why)
            return options
        log.info("rla: the trainer's attention runs as the engine's (%s): %s", form, why)
        return dataclasses.replace(options, rounding={registry.attention.SITE.kind: form, **options.rounding})
    if getattr(args, "vllm_mode", "colocate") != "colocate":
        log.warning("rla: the trainer samples from a vLLM server (vllm_mode=%r): how its attention kernel rounds is "
                    "measured where it runs, not here; run `rla_compile.integrations.vllm.cpu_attention_kernel()` "
                    "there and pass its mode as rla's option rounding={'attention': ...} (the trainer rounds to "
                    "nearest until then)", getattr(args, "vllm_mode", None))
        return options
    from .vllm_kernels import paired_rounding

    rounding = paired_rounding(options)
    if rounding == options.rounding:
        return options
    log.info("rla: the trainer's %s rounds as vLLM's own kernel does here (measured): %s",
             ", ".join(sorted(rounding.keys() - options.rounding.keys())), rounding)
    return dataclasses.replace(options, rounding=rounding)


def pair_experts_with_engine(model, args: Any) -> int:
    """The `expert_combine` site's policy hook: when the trainer samples from a colocated vLLM
    engine on CPU (`args.use_vllm`, vllm_mode "colocate"), the policy's MoE experts compute that
    engine's fused MoE kernel (`experts_vllm_cpu.pair_experts`: its GEMM order, SiLU and weighted
    sum, forward bit for bit; backward the fp32 form's gradient), as its attention is paired
    with the engine's attention kernel. Returns how many experts modules were paired: 0 for a
    dense model, an engine elsewhere (a server: said as a warning), or a GPU engine, whose fused
    MoE kernel is not paired (the site's fp32 contract form runs)."""
    if not getattr(args, "use_vllm", False):
        return 0
    from . import experts_vllm_cpu

    if not experts_vllm_cpu.has_experts(model):
        return 0
    if getattr(args, "vllm_mode", "colocate") != "colocate":
        log.warning("rla: the trainer samples from a vLLM server (vllm_mode=%r): its experts are not paired with the "
                    "server's fused MoE kernel; on a vLLM-CPU server call "
                    "rla_compile.integrations.experts_vllm_cpu.pair_experts(model) before training",
                    getattr(args, "vllm_mode", None))
        return 0
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        log.info("rla: vLLM runs on %s: the policy's experts keep the contract's fp32 form (only vLLM-CPU's fused "
                 "MoE kernel is paired)", current_platform.device_name)
        return 0
    paired = experts_vllm_cpu.pair_experts(model)
    log.info("rla: the policy's %d experts modules compute vLLM-CPU's fused MoE kernel (pair_experts)", paired)
    return paired


# The hooks a site may run on the trained model when training starts (`Site.policy_hooks`).
POLICY_HOOKS = {"pair_experts_with_engine": pair_experts_with_engine}


def _unwrap(model):
    # DDP / FSDP1 wrappers forward to `.module`; in-place compilation belongs on the model itself
    while hasattr(model, "module") and not hasattr(model, "config"):
        model = model.module
    return model


def _add_callback_to_every_trainer(options: Options) -> None:
    from transformers import Trainer

    original = patching.original(Trainer, "__init__")

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        handler = getattr(self, "callback_handler", None)
        if handler is not None and not any(isinstance(c, RlaCallback) for c in handler.callbacks):
            self.add_callback(RlaCallback(options))
        for callback in getattr(handler, "callbacks", ()):
            if isinstance(callback, RlaCallback):
                callback.trainer = self  # its colocated vLLM engine, read when training starts

    patching.patch(Trainer, "__init__", __init__)  # again: the newest options, never two callbacks


def fix_weight_sync() -> bool:
    """Make TRL's colocated weight sync work on vLLM-CPU; returns whether it was needed (False
    off the CPU platform, or without TRL or vLLM).

    Why: TRL (1.16) pushes the trained weights into its colocated engine with
    `model.load_weights([(name, param)])`, one parameter at a time. vLLM-CPU repacks linear
    weights for oneDNN after loading and leaves bare parameters behind, so the per-layer weight
    loaders are gone and the first sync raises `'Parameter' object has no attribute
    'weight_loader'`. vLLM's in-place `model_runner.reload_weights(weights_iterator=...,
    is_checkpoint_format=True)` loads checkpoint-format weights and repacks them again; after
    `llm.reset_prefix_cache()` (TRL's own last step) the engine samples from the trainer's
    weights. An MoE model's expert weights are packed again after the reload
    (`integrations.vllm.repack_moe_experts`: vLLM-CPU packs them only when its kernel is first
    set up, and without this the engine's experts read the reloaded weights in the wrong
    layout). Only the CPU platform repacks, so only there is `VLLMGeneration.sync_weights`
    replaced (colocate mode; server mode is TRL's own code). The parameters are TRL's own
    iterator (`_iter_named_params`: names, FSDP / DeepSpeed gathering and PEFT merging as TRL
    does them)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu():
        return False
    try:
        from trl.generation.vllm_generation import VLLMGeneration
    except ImportError:  # no TRL: no TRL weight sync to fix
        return False

    from .vllm import repack_moe_experts

    original = patching.original(VLLMGeneration, "sync_weights")

    @functools.wraps(original)
    def sync_weights(self):
        if self.mode != "colocate":
            return original(self)
        if self.enable_sleep_mode:  # as TRL: map the weights before writing them
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
        runner.reload_weights(weights_iterator=self._iter_named_params(), is_checkpoint_format=True)
        repack_moe_experts(runner.model)
        self.llm.reset_prefix_cache()

    patching.patch(VLLMGeneration, "sync_weights", sync_weights)
    return True


def fix_checkpointing_hooks() -> bool:
    """Keep a compiled policy compiled under TRL's gradient checkpointing; returns whether
    transformers' function was found and patched.

    Why: transformers (checked: 5.19) has `gradient_checkpointing_enable()` call
    `enable_input_require_grads()`, which adds a forward hook to the input embeddings and
    forgets the hooks an earlier call added, while `gradient_checkpointing_disable()` removes
    them only for PEFT models. TRL (1.16) switches checkpointing off and on around its
    no-grad scoring every step, so every step adds one more hook. A compiled model's guards
    count the module's hooks: each step recompiles, and after Dynamo's `recompile_limit`
    (8) it runs the model eagerly for the rest of training — no Inductor and no rla, and the
    only sign is one warning in the log (measured with TRL GRPO: rla's gap came back at step
    5). The fix: `enable_input_require_grads` first removes the hooks its previous call
    added, so the model has one such hook, as after the first call. Applies to every
    `PreTrainedModel`; `disable()` undoes it."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    original = patching.original(PreTrainedModel, "enable_input_require_grads", None)
    if original is None or not hasattr(PreTrainedModel, "disable_input_require_grads"):
        log.warning("rla: transformers' PreTrainedModel has no enable/disable_input_require_grads (a transformers "
                    "other than 5.x?); gradient checkpointing's input hooks are left as transformers adds them")
        return False

    @functools.wraps(original)
    def enable_input_require_grads(self):
        self.disable_input_require_grads()  # the hooks the previous call added (no-op the first time)
        return original(self)

    patching.patch(PreTrainedModel, "enable_input_require_grads", enable_input_require_grads)
    return True


def align_logprob_head() -> bool:
    """The trainer half of the logits site for TRL; returns whether TRL's function was found.

    Why: TRL (1.16) computes the policy's per-token logprobs with `ChunkedLogProbFunction`
    (trl/kernels/chunked_logprob.py) on the hidden states the (compiled) backbone returns,
    after a graph break, so rla's graph rewrite never sees the head. The function projects in
    the hidden states' dtype: bf16 tiles, rounded before its fp32 log-softmax. Handing it fp32
    hidden states (autocast off) makes it upcast each weight chunk and project in fp32: logits
    from fp32 inputs, never rounded. The weights stay bf16 (TRL's own `cast_lm_head_to_fp32`
    instead trains an fp32 copy of the head, which then differs from the bf16 weights vLLM
    holds). Gradients flow back through the upcast, rounded to bf16 once, as at any site."""
    try:
        import trl.trainer.utils as trl_utils
    except ImportError:
        return False
    original = patching.original(trl_utils, "_ChunkedLogProbFunction", None)
    if original is None:
        log.warning("rla's logits site: TRL has no _ChunkedLogProbFunction in trl.trainer.utils (a TRL other "
                    "than 1.16?); its logprob head is left as TRL computes it")
        return False
    import torch

    class Fp32LogProbHead:
        """`_ChunkedLogProbFunction` fed fp32 hidden states (rla's logits site)."""

        wrapped = original

        @staticmethod
        def apply(hidden, weight, *args):
            with torch.autocast(hidden.device.type, enabled=False):
                return original.apply(hidden.float(), weight, *args)

    patching.patch(trl_utils, "_ChunkedLogProbFunction", Fp32LogProbHead)
    return True


@dataclass
class Enabled:
    """What `enable()` switched on, and what it did not and why (a part that was not asked for
    is in neither)."""

    on: list[str] = field(default_factory=list)
    off: dict[str, str] = field(default_factory=dict)  # part -> why it is not on

    def __str__(self) -> str:
        line = "rla: switched on: " + ("; ".join(self.on) or "nothing")
        return line + "".join(f"; NOT switched on: {part} ({why})" for part, why in self.off.items())


def _has_trl() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def enable(trainer: bool = True, vllm: bool = True, **options: Any) -> Enabled:
    """Switch rla on for every trainer and vLLM engine built afterwards in this process.

    trainer: add `RlaCallback(**options)` to every `transformers.Trainer` (TRL's included).
    vllm: set RLA_VLLM=1 and RLA_VLLM_OPTIONS (JSON of `options`) for every vLLM engine, and
        replace TRL's weight sync on vLLM-CPU (`fix_weight_sync`).
    options: rla's options (`Options`: sites, compiler, pin_rounding, debug, inductor, rounding, attention_chunk_mib), the same on both
        sides (`compiler` only matters to the trainer). Invalid ones raise `OptionError` here.

    Returns what was switched on and what was not, and why (TRL or vLLM not installed), and
    logs it: a warning when a part asked for is off, else at info level.
    """
    opts = Options.from_dict(options)  # the one parse: both sides get this object
    status = Enabled()
    trl = _has_trl()
    if trainer:
        _add_callback_to_every_trainer(opts)
        status.on.append("RlaCallback on every transformers.Trainer built afterwards")
        if fix_checkpointing_hooks():
            status.on.append("one input-grad hook under gradient checkpointing (fix_checkpointing_hooks: "
                             "the policy stays compiled)")
        if trl:
            status.on.append("TRL's trainers (they derive from transformers.Trainer)")
        else:
            status.off["TRL's trainers"] = f"TRL is not installed: {INSTALL_TRL}"
        for site in registry.selected(opts.sites):
            for hook in site.trainer_hooks:
                apply, what = TRAINER_HOOKS[hook]
                if apply():
                    status.on.append(f"{what} (the {site.kind} site)")
                else:
                    why = "TRL has no such function" if trl else "TRL is not installed"
                    status.off[f"{what} (the {site.kind} site)"] = why
    if vllm:
        from . import vllm as rla_vllm

        engine = dataclasses.replace(opts, compiler=Options.compiler)  # vLLM compiles with its own Inductor
        for name, value in rla_vllm.environment(engine).items():  # for vLLM processes started from here
            patching.setenv(name, value)  # disable() restores each as it was
        status.on.append(f"{rla_vllm.ENABLE_ENV}=1 and {rla_vllm.OPTIONS_ENV} for vLLM engines and servers "
                         "started from this environment")
        try:
            import vllm  # noqa: F401
        except ImportError:
            status.off["rla in this process's vLLM engines"] = f"vLLM is not installed: {rla_vllm.INSTALL}"
        else:
            rla_vllm.install(engine)  # this process's engines: these options, also when vLLM's plugins loaded before
            status.on.append("rla in this process's vLLM engines")
            if fix_weight_sync():
                status.on.append("TRL's weight sync on vLLM-CPU (fix_weight_sync)")
    (log.warning if status.off else log.info)("%s", status)
    return status


# The hooks a site may ask for by name (`Site.trainer_hooks`): (apply it -> whether it could, what it does).
TRAINER_HOOKS = {"fp32_logprob_head": (align_logprob_head, "TRL's logprob head in fp32")}


def disable() -> None:
    """Undo `enable()` and every other patch rla made (`fix_weight_sync`, `align_logprob_head`,
    vLLM's environment switch and rotary layers): transformers', TRL's and vLLM's own functions
    are back, and every environment variable rla set (RLA_VLLM, RLA_VLLM_OPTIONS, the sites'
    engine settings) is as it was before. Models already compiled and engines
    already built stay as they are (call `fix_weight_sync()` again to keep syncing into a
    colocated vLLM-CPU engine)."""
    patching.undo_all()
