"""The rounding contract inside vLLM's compiled path.

    from rla_compile.integrations import vllm as rla_vllm
    llm = LLM(model, compilation_config=rla_vllm.compilation_config())       # same options as the backend

or, with no code change to whatever builds the engine (TRL, a server, a script):

    RLA_VLLM=1 RLA_VLLM_OPTIONS='{"sites": ["rope", "swiglu"]}' python train.py

(the `vllm.general_plugins` entry point wraps `EngineArgs.create_engine_config`, through which
every vLLM engine gets its config, so that each engine built while RLA_VLLM=1 gets the
`compilation_config()` settings merged into its own; an explicit `compilation_config` that
already has rla's pass wins).

What it does:
- a post-grad Inductor pass (`RlaPass`) that runs the same engine as the torch.compile backend
  on vLLM's inference graphs (their casts are `prims.convert_element_type`, SiLU is decomposed
  to `x / (1 + exp(-x))`, RMSNorm arrives as plain ATen because vLLM-CPU turns the IR
  op's torch wrapping off; `compilation_config` turns it off on GPUs too; left on, each norm
  is one opaque `vllm_ir` node, reported as a near miss saying so). vLLM hands the
  pass to Inductor (CPU) or to its own pass manager (GPU, where it must be vLLM's
  `InductorPass`: the class derives from it when vLLM has one). Its `uuid()` is the options'
  key, so vLLM's compile cache and Inductor's change when rla's options do.
- fp32 RoPE tables: vLLM builds the cos/sin cache in fp32 and rounds it to the model dtype at
  load time. With `rope` aligned, the cache stays fp32: each rotary layer, when it is built,
  reads the config of the engine building it (vLLM's current config) and keeps the table fp32
  when that config holds rla's pass with `rope` selected; engine and worker processes get the
  pass pickled, and unpickling it sets the rotary layers up there too. (RLA_VLLM_FP32_ROPE=1
  forces it for layers built outside an engine, e.g. tests.) vLLM then casts the table per
  call, a rounding the engine bypasses, so the sites read fp32 cos/sin as the contract says.

Every change to vLLM's classes goes through `patching` and is undone by `undo()` (which
`rla_compile.integrations.trl.disable()` calls too).

Supported: vLLM >= 0.32, < 0.34 (checked with packaging.version).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from packaging.version import Version

from .. import sites as registry
from ..config import OptionError, Options
from ..graph_pass import align_and_record
from ..lowering import keep_site_roundings
from ..report import GraphReport
from . import VLLM_INSTALL, patching
from .vllm_kernels import (  # noqa: F401 (public here)
    check_attention_kernel, cpu_attention_kernel, paired_attention_form, paired_rounding, use_fp32_attention_kernel,
)

__all__ = [
    "compilation_config", "engine_kwargs", "make_pass", "register", "install", "undo", "options_from_env",
    "environment", "engine_env", "injected", "paired_rounding", "paired_attention_form", "cpu_attention_kernel", "SUPPORTED", "FP32_ROPE_ENV", "ENABLE_ENV", "OPTIONS_ENV",
]

log = logging.getLogger(__name__)

SUPPORTED = (Version("0.32"), Version("0.34"))  # [min, max)
FP32_ROPE_ENV = "RLA_VLLM_FP32_ROPE"  # 1: rotary layers keep fp32 tables whatever the engine's config
ENABLE_ENV = "RLA_VLLM"  # 1: every engine built in this process gets rla's pass
OPTIONS_ENV = "RLA_VLLM_OPTIONS"  # JSON object of rla's options, e.g. {"sites": ["rope"]}
INSTALL = VLLM_INSTALL


def _vllm():
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"rla_compile.integrations.vllm needs vLLM: {INSTALL}") from error
    version = Version(Version(vllm.__version__).base_version)
    if not SUPPORTED[0] <= version < SUPPORTED[1]:
        raise RuntimeError(
            f"vLLM {vllm.__version__} is not supported by rla_compile: supported >= {SUPPORTED[0]}, < {SUPPORTED[1]}"
        )
    return vllm


def _pass_base() -> type:
    try:  # vLLM's pass manager (the GPU path) accepts only its own InductorPass
        from vllm.compilation.passes.inductor_pass import InductorPass
    except ImportError:
        try:
            from vllm.compilation.inductor_pass import InductorPass
        except ImportError:
            from torch._inductor.custom_graph_pass import CustomGraphPass as InductorPass
    return InductorPass


def make_pass(options: Options):
    """The post-grad pass object for vLLM's `inductor_compile_config`; `.reports` keeps a report
    per compiled graph (vLLM compiles the whole model once on CPU, piecewise on GPU)."""
    return _pass_class()(options)


_PASS_CLASS: type | None = None


def _pass_class() -> type:
    """One RlaPass class per process (so `isinstance` finds rla's pass in any config)."""
    global _PASS_CLASS
    if _PASS_CLASS is not None:
        return _PASS_CLASS
    base = _pass_base()

    class RlaPass(base):
        def __init__(self, options: Options):
            self.options = options
            self.reports: list[GraphReport] = []

        def __call__(self, graph) -> None:
            report, _ = align_and_record(graph.owning_module, self.options, f"vllm_{len(self.reports)}", post_grad=True)
            keep_site_roundings(graph)  # as the backend's Inductor does
            self.reports.append(report)

        def uuid(self) -> str:
            # A cache hit skips post-grad passes entirely (no report, no dump). So debug, which
            # must never be lost to a hit, is part of the key; plain reports are best effort
            # and empty after a hit (logged by `compilation_config`'s docs).
            debug = self.options.debug_dir
            return "rla_compile:" + self.options.uuid() + (f":debug={debug.resolve()}" if debug else "")

        # vLLM copies its config; every copy is this pass, so the reports land in one place.
        def __deepcopy__(self, memo):
            return self

        def __copy__(self):
            return self

        # Engine-core and worker processes get the config pickled: a fresh pass, same options
        # (its reports stay in that process, and go to its `rla_compile` logger), set up there
        # as `compilation_config()` sets up this process.
        def __reduce__(self):
            return _unpickle_pass, (self.options,)

        def __repr__(self) -> str:
            return f"RlaPass({self.options})"

    RlaPass.__module__ = __name__
    _PASS_CLASS = RlaPass
    return RlaPass


def _unpickle_pass(options: Options):
    try:
        _prepare_process(options)
    except ImportError:  # no vLLM in this process: no rotary layers to set up
        pass
    return make_pass(options)


def is_rla_pass(value: Any) -> bool:
    return _PASS_CLASS is not None and isinstance(value, _PASS_CLASS)


def compilation_config(**options: Any) -> dict[str, Any]:
    """vLLM's `compilation_config` with rla's pass; keyword arguments are rla's options
    (`inductor` patches and `pin_rounding` go to vLLM's Inductor config, as the backend's do).

    The returned dict's pass is at `["inductor_compile_config"]["post_grad_custom_post_pass"]`
    and keeps the reports (`.reports`). A warm Inductor cache serves the compiled graph without
    running any post-grad pass, so `.reports` stays empty then; with `debug` set the cache key
    includes the dump directory, so a dump is never lost to a cache hit.
    """
    _vllm()
    return _settings(Options.from_dict(options))


def _settings(opts: Options) -> dict[str, Any]:
    """The one place that turns rla's options into vLLM compilation settings (used by
    `compilation_config()` and by the environment switch); sets up fp32 RoPE tables."""
    _prepare_process(opts)
    inductor = {**opts.inductor_settings(), "post_grad_custom_post_pass": make_pass(opts)}
    return {
        "inductor_compile_config": inductor,
        # GPU: RMSNorm reaches passes as an opaque vllm_ir op unless its torch wrapping is off.
        "ir_enable_torch_wrap": False,
    }


def _prepare_process(opts: Options) -> None:
    """What a process that builds models for engines with `opts` needs besides the config: the
    selected sites' engine hooks (`Site.engine_hooks`, e.g. fp32 RoPE tables) and environment
    (`Site.engine_env`: vLLM reads its settings from the environment of the processes it starts
    and of this one)."""
    for site in registry.selected(opts.sites):
        for name, value in site.engine_env.items():
            if os.environ.get(name) != value:
                log.info("rla's %s site: %s=%s for vLLM engines started from this process", site.kind, name, value)
                patching.setenv(name, value)  # undo() restores it
        for hook in site.engine_hooks:
            ENGINE_HOOKS[hook]()


def engine_kwargs(**options: Any) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM(...)` / `EngineArgs`: `compilation_config` (rla's pass)
    and the `hf_overrides` the selected sites need (`Site.engine_overrides`; the logits site:
    `{"head_dtype": "float32"}`).

        llm = LLM(model, **rla_vllm.engine_kwargs(sites=["rmsnorm", "residual_rmsnorm", "swiglu", "rope", "logits"]))

    vLLM computes the logits outside its compiled graph, in its LogitsProcessor; with
    head_dtype float32 that projects from fp32 hidden states and weights and keeps the logits in
    fp32 (`F.linear(h.float(), W.float())` on CPU, an fp32-accumulating GEMM on CUDA): the
    contract's logits site, which rla's graph pass cannot reach there.
    """
    _vllm()
    opts = Options.from_dict(options)
    kwargs: dict[str, Any] = {"compilation_config": _settings(opts)}
    overrides = _engine_overrides(opts, None)
    if overrides is not None:
        kwargs["hf_overrides"] = overrides
    return kwargs


def _engine_overrides(opts: Options, current: Any) -> Any:
    """`hf_overrides` with what the selected sites need (`Site.engine_overrides`; the user's own
    values win); None when nothing needs changing."""
    wanted = {key: value for site in registry.selected(opts.sites) for key, value in site.engine_overrides.items()}
    if not wanted:
        return None
    if current is None:
        return wanted
    if isinstance(current, Mapping):
        missing = {key: value for key, value in wanted.items() if key not in current}
        return {**current, **missing} if missing else None
    log.warning("rla: hf_overrides is a function, so %s is not added; set it yourself for the inference half "
                "of the selected sites", wanted)
    return None


# --- switching it on from the environment -------------------------------------------------

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")

injected: list = []  # the passes put into engines by the environment switch, oldest first


def options_from_env(environ: Mapping[str, str] | None = None) -> Options | None:
    """rla's options from RLA_VLLM / RLA_VLLM_OPTIONS, or None when switched off.

    RLA_VLLM=1 switches it on with the default options; RLA_VLLM_OPTIONS (a JSON object of
    rla's options) sets them and switches it on too, unless RLA_VLLM=0. Bad values raise
    `OptionError` naming the variable."""
    environ = os.environ if environ is None else environ
    flag = environ.get(ENABLE_ENV)
    raw = environ.get(OPTIONS_ENV)
    if flag is not None and flag.strip().lower() not in _TRUE + _FALSE:
        raise OptionError(f"{ENABLE_ENV}={flag!r}: expected 1 (on) or 0 (off)")
    if flag is not None and flag.strip().lower() in _FALSE:
        return None
    if raw is None or not raw.strip():
        return Options() if flag is not None else None
    try:
        options = json.loads(raw)
    except json.JSONDecodeError as error:
        raise OptionError(
            f"{OPTIONS_ENV} is not valid JSON ({error}): {raw!r}; "
            f"""expected a JSON object of rla options, e.g. {OPTIONS_ENV}='{{"sites": ["rope", "swiglu"]}}'"""
        ) from None
    if not isinstance(options, dict):
        raise OptionError(
            f"{OPTIONS_ENV} must be a JSON object of rla options, got {raw!r}; "
            f"""e.g. {OPTIONS_ENV}='{{"sites": ["rope", "swiglu"]}}'"""
        )
    try:
        return Options.from_dict(options)
    except OptionError as error:
        raise OptionError(f"{OPTIONS_ENV}: {error}") from None


def _with_rla(compilation_config, opts: Options):
    """A copy of vLLM's CompilationConfig with rla's settings merged in; the config itself when
    it already has a post-grad pass (rla's, or the user's own: theirs wins)."""
    current = compilation_config.inductor_compile_config.get("post_grad_custom_post_pass")
    if current is not None:
        if not is_rla_pass(current):
            log.warning("%s=1: this engine's compilation_config already has a post_grad_custom_post_pass (%r); "
                        "rla's pass is not added", ENABLE_ENV, current)
        return compilation_config
    settings = _settings(opts)
    merged = copy.deepcopy(compilation_config)
    # rla's Inductor settings, then the user's own on top (theirs win), then rla's pass
    merged.inductor_compile_config = {**settings["inductor_compile_config"], **merged.inductor_compile_config}
    merged.inductor_compile_config["post_grad_custom_post_pass"] = settings["inductor_compile_config"]["post_grad_custom_post_pass"]
    if merged.ir_enable_torch_wrap is None:  # not chosen by the user
        merged.ir_enable_torch_wrap = settings["ir_enable_torch_wrap"]
    injected.append(merged.inductor_compile_config["post_grad_custom_post_pass"])
    log.info("%s=1: rla's pass added to the engine's compilation_config (%s)", ENABLE_ENV, opts)
    return merged


def environment(opts: Options) -> dict[str, str]:
    """RLA_VLLM and RLA_VLLM_OPTIONS that switch rla on with `opts` in the vLLM processes and
    servers started from this environment (`options_from_env` reads them back)."""
    return {ENABLE_ENV: "1", OPTIONS_ENV: json.dumps(opts.to_dict(), default=str)}


def engine_env(cache: str | os.PathLike, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment (`environ`, default this process's) for a vLLM engine in a fresh process
    that must run rla's pass, as rla's tools and tests start one:

    - vLLM's compile cache in `cache` (VLLM_CACHE_ROOT): a hit there loads a compiled graph
      without running Inductor's passes. Its `modelinfos` folder is the one of the cache root
      `environ` names (default ~/.cache/vllm), linked: vLLM records there what it learns by
      importing a model's class in a subprocess, keyed by a hash of the class's source, and
      without it each engine start repeats that (9.6 s of the 42 s one start took here);
    - Inductor's FX-graph and AOTAutograd caches off: a hit skips the post-grad passes, so rla's
      pass would leave no report and no debug dump (measured: an empty report after a hit);
    - Inductor's kernel cache (TORCHINDUCTOR_CACHE_DIR, default Inductor's own) shared: a
      compiled kernel is looked up by its source and compiler flags, never by a graph, so
      reusing one cannot change what an engine computes. On this 2-core CPU an engine start on
      the shipped model took 44 s with no compiled kernels, 32 s with them;
    - vLLM-CPU's settings for one in-process engine with a small KV cache, unless set.
    """
    env = dict(os.environ if environ is None else environ)
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    _share_model_infos(Path(cache), Path(env.get("VLLM_CACHE_ROOT") or home / ".cache" / "vllm"))
    env.update(VLLM_CACHE_ROOT=os.fspath(cache), TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    for key, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                       ("VLLM_USE_AOT_COMPILE", "0")):
        env.setdefault(key, value)
    return env


def _share_model_infos(cache: Path, shared_root: Path) -> None:
    """`cache`/modelinfos a link to `shared_root`/modelinfos (vLLM checks each entry's hash
    against its model's source before using it); left alone when `cache` has its own already."""
    if cache.resolve() == shared_root.resolve():
        return
    shared = shared_root / "modelinfos"
    shared.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    link = cache / "modelinfos"
    if not link.exists() and not link.is_symlink():
        link.symlink_to(shared, target_is_directory=True)


def install(options: Options | None = None) -> None:
    """Wrap `vllm.engine.arg_utils.EngineArgs.create_engine_config` (where LLM, AsyncLLM and
    `vllm serve` turn their arguments into a VllmConfig) so that each engine's compilation config
    gets rla's settings: those of `options` when given (`rla_trl.enable()` passes the options it
    parsed), else those of RLA_VLLM / RLA_VLLM_OPTIONS, read per engine (so the variables may be
    set after import; while they are off, engines are stock). Installing again replaces rla's
    wrapper (wrappers never stack), except that without `options` an installed wrapper is kept;
    `undo()` restores vLLM's own method."""
    _vllm()
    from vllm.engine.arg_utils import EngineArgs

    if options is None and getattr(EngineArgs.create_engine_config, "__rla_wrapped__", False):
        return
    original = patching.original(EngineArgs, "create_engine_config")

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        opts = options_from_env() if options is None else options
        if opts is None:
            return original(self, *args, **kwargs)
        users, users_overrides = self.compilation_config, self.hf_overrides
        self.compilation_config = _with_rla(users, opts)
        overrides = _engine_overrides(opts, users_overrides)
        if overrides is not None:
            self.hf_overrides = overrides
        try:
            return original(self, *args, **kwargs)
        finally:  # the EngineArgs object is left as it was given
            self.compilation_config, self.hf_overrides = users, users_overrides

    create_engine_config.__rla_wrapped__ = True
    patching.patch(EngineArgs, "create_engine_config", create_engine_config)


def undo() -> None:
    """Give every class rla patched its own methods back (vLLM's, and TRL's and transformers'
    too: `rla_trl.disable()` calls this). Engines already built keep what they were built with."""
    patching.undo_all()


def keep_rope_tables_fp32() -> None:
    """Make vLLM's rotary layers keep their cos/sin cache in fp32 when the engine building them
    aligns `rope` (its config holds rla's pass with `rope` selected) or RLA_VLLM_FP32_ROPE=1.

    The stock layer computes the cache in fp32 and rounds it to the model dtype when it is
    built; the wrapper rebuilds it unrounded right after, only for such engines, so the others
    are stock. Idempotent; `undo()` restores vLLM's own `__init__`."""
    import torch
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original_init = patching.original(RotaryEmbedding, "__init__")

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        cache = getattr(self, "cos_sin_cache", None)
        if isinstance(cache, torch.Tensor) and cache.dtype != torch.float32 and _engine_keeps_fp32_rope():
            self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache().to(cache.device), persistent=False)

    patching.patch(RotaryEmbedding, "__init__", __init__)


def _engine_keeps_fp32_rope() -> bool:
    if os.environ.get(FP32_ROPE_ENV) == "1":
        return True
    return _engine_selects("fp32_rope_tables")


def route_in_fp32() -> None:
    """The router site's engine half on vLLM-CPU, for engines that align `router`: the gate's
    logits from fp32 h and Wg (vLLM computes them in bf16, with oneDNN), and `CPURouter`'s
    softmax routing as the contract computes it — a softmax of all E logits in fp32, the top-k
    of the probabilities, renormalised in fp32 — where vLLM takes the top-k of the bf16 logits and
    a softmax over those k, rounded to bf16. The weights reach vLLM's fused kernel in fp32 as
    before; its experts and weighted sum are its own (docs/contract.md#mixture-of-experts-opt-in).

    Three patches: GateLinear's constructor notes whether its engine aligns the router; the CPU
    GEMM dispatch keeps such a gate's weight in fp32 before it packs (and drops) the bf16 one;
    its forward and CPURouter's softmax routing then compute in fp32. Other engines, and the
    grouped, sigmoid and custom routings, are vLLM's. Idempotent; `undo()` restores vLLM's."""
    import torch
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.layers.fused_moe.router import cpu_router
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    init, dispatch = patching.original(GateLinear, "__init__"), patching.original(layer_utils, "dispatch_cpu_unquantized_gemm")
    forward, routing = patching.original(GateLinear, "forward"), patching.original(cpu_router.CPURouter, "_compute_routing")

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.rla_fp32 = _engine_selects("route_in_fp32")

    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        if getattr(layer, "rla_fp32", False) and not layer.weight.is_meta:
            layer.rla_weight_fp32 = layer.weight.detach().to(torch.float32).clone()
            # probed here, at load time: the gate runs inside vLLM's compiled graph
            layer.rla_row_block = _row_block(*layer.weight.shape, torch.get_num_threads())
        return dispatch(layer, remove_weight)

    def gate_forward(self, x):
        weight = getattr(self, "rla_weight_fp32", None)
        if weight is None:
            return forward(self, x)
        logits = linear_rows_as_in_a_batch(x.to(torch.float32), weight, block=getattr(self, "rla_row_block", None))
        return (logits, None) if self.return_bias else logits

    def _compute_routing(self, hidden_states, router_logits, indices_type, **kwargs):
        contract = (router_logits.dtype == torch.float32 and not self.use_grouped_topk
                    and self.scoring_func == "softmax" and self.custom_routing_function is None)
        if not contract:
            return routing(self, hidden_states, router_logits, indices_type, **kwargs)
        probs = torch.softmax(router_logits, dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.contiguous(), ids.to(torch.int32).contiguous()

    patching.patch(GateLinear, "__init__", __init__)
    patching.patch(layer_utils, "dispatch_cpu_unquantized_gemm", dispatch_cpu_unquantized_gemm)
    patching.patch(GateLinear, "forward", gate_forward)
    patching.patch(cpu_router.CPURouter, "_compute_routing", _compute_routing)


def fp32_head_rows() -> None:
    """The logits site's engine half on vLLM-CPU, beside `head_dtype=float32`: each token's fp32
    logits computed as in a batch of many tokens (`linear_rows_as_in_a_batch`), as the trainer
    computes them for a whole sequence. vLLM's own fp32 head is `F.linear(h.float(), W.float())`
    over the tokens of the step, and a decode step's few rows take other paths through the CPU
    GEMM. Other engines (CUDA: vLLM's fp32-accumulating GEMM) are vLLM's. Idempotent; `undo()`
    restores vLLM's."""
    import torch
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    apply_head = patching.original(LogitsProcessor, "_apply_head")

    def _apply_head(self, lm_head, hidden_states, embedding_bias):
        if (self.head_dtype != torch.float32 or hidden_states.dtype == torch.float32 or hidden_states.is_cuda
                or not hasattr(lm_head, "weight") or not getattr(self, "rla_rows", False)):
            return apply_head(self, lm_head, hidden_states, embedding_bias)
        bias = None if embedding_bias is None else embedding_bias.to(torch.float32)
        return linear_rows_as_in_a_batch(hidden_states.to(torch.float32), lm_head.weight.to(torch.float32), bias)

    init = patching.original(LogitsProcessor, "__init__")

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.rla_rows = _engine_selects("fp32_head_rows")

    patching.patch(LogitsProcessor, "__init__", __init__)
    patching.patch(LogitsProcessor, "_apply_head", _apply_head)


_ROW_BLOCKS = (1, 4, 8, 16, 32, 64)


@functools.cache
def _row_block(n: int, k: int, threads: int) -> int:
    """How many rows an fp32 `F.linear` with `n` outputs of inner size `k` must see, here, for
    each row's result not to depend on how many rows it came with: the smallest of `_ROW_BLOCKS`
    such that every count of rows from 1 to 48, padded up to a multiple of it, gives each row the
    bits it gets among 256 rows (probed with min(n, 256) outputs, every window of the 256 rows). Measured on a 2-core AVX-512
    EPYC (torch 2.13's CPU GEMM, 64-1000 outputs): 1 to 3 rows differ with one thread; 1-3, 5-7 and
    9-11 with 2 or 8 threads; multiples of 4, and 12 rows or more, never (8 outputs: 1 row only).
    `threads`: torch's intra-op threads, which the answer depends on."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, k, generator=gen).to(torch.bfloat16).float()
    w = torch.randn(min(n, 256), k, generator=gen).to(torch.bfloat16).float()
    full = torch.nn.functional.linear(x, w)
    def holds(block: int) -> bool:  # every window of m rows, so a few outputs still give many samples
        return all(torch.equal(_padded_linear(x[j:j + m], w, None, block), full[j:j + m])
                   for m in range(1, 49) for j in range(0, 256 - m + 1, m))

    for block in _ROW_BLOCKS:
        if holds(block):
            return block
    log.warning("rla: no padding of up to %d rows gives an fp32 GEMM (%d x %d) the bits it has in a large batch on "
                "this machine (%d threads); a decode step's logits may differ from the trainer's in the last bits",
                _ROW_BLOCKS[-1], n, k, threads)
    return _ROW_BLOCKS[-1]


def _padded_linear(x, weight, bias, block: int):
    """`F.linear` of the rows of `x` padded with zero rows up to a multiple of `block`, unpadded.
    No branch on the row count: vLLM's compiled graph calls it with a symbolic one."""
    import torch

    rows = x.shape[0]
    x = torch.cat([x, x.new_zeros((-rows) % block, x.shape[1])])
    return torch.nn.functional.linear(x, weight, bias)[:rows]


def linear_rows_as_in_a_batch(x, weight, bias=None, block: int | None = None):
    """`F.linear(x, weight, bias)` in fp32, each row of `x` getting the bits it gets in a large
    batch: the rows padded with zero rows up to what this machine's CPU GEMM needs for that
    (`block`; by default `_row_block`, probed once per shape and thread count: at most 63 extra
    rows, none where it needs none). A trainer scores whole sequences (many rows at once) while an
    engine's decode step has one row per running request, so rows must not depend on their count
    for the two to agree (docs/vllm.md). Inside a compiled graph pass `block` (probed beforehand)."""
    import torch

    flat = x.reshape(-1, x.shape[-1])
    if block is None:
        block = _row_block(weight.shape[0], flat.shape[1], torch.get_num_threads())
    return _padded_linear(flat, weight, bias, block).reshape(*x.shape[:-1], weight.shape[0])


def repack_moe_experts(model) -> int:
    """Pack the MoE expert weights of a vLLM-CPU `model` for its fused MoE kernel again, after an
    in-place reload (`model_runner.reload_weights`, as RL weight syncs do); returns how many MoE
    layers were packed.

    Why: vLLM-CPU (0.32) packs each MoE layer's expert weights once, while the kernel is set up
    (`CPUUnquantizedExperts.process_weights_after_loading`); on a weight update vLLM copies the
    reloaded weights in but sets the kernel up only on the first call, so they stay in the
    checkpoint's layout while the kernel reads them as packed. Measured on a tiny Qwen3-MoE:
    reloading the very weights it was loaded with moved its prompt logprobs by up to 0.07; packed
    again, by 0 (`tests/test_vllm.py`). Dense models, and other engines and kernels, are left as
    they are."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    packed = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(getattr(kernel, "impl", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)  # pads and packs (zentorch: a no-op)
            packed += 1
    return packed


def _engine_selects(hook: str) -> bool:
    """Whether the engine vLLM is building now aligns a site that asks for `hook`."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()  # set by vLLM while it builds an engine's model
    rla = None if config is None else config.compilation_config.inductor_compile_config.get("post_grad_custom_post_pass")
    return is_rla_pass(rla) and any(hook in site.engine_hooks for site in registry.selected(rla.options.sites))


# The hooks a site may ask for by name (`Site.engine_hooks`), run by `_prepare_process`.
ENGINE_HOOKS = {"fp32_rope_tables": keep_rope_tables_fp32, "fp32_attention_kernel": use_fp32_attention_kernel,
                "check_attention_kernel": check_attention_kernel, "route_in_fp32": route_in_fp32,
                "fp32_head_rows": fp32_head_rows}


def register() -> None:
    """`vllm.general_plugins` entry point: runs in every vLLM process (workers included), when
    the first EngineArgs is made, i.e. before any engine config exists. Installs the
    environment switch when RLA_VLLM / RLA_VLLM_OPTIONS are set (a bad value fails here,
    naming the variable), and the fp32 RoPE tables in processes that build the model (worker
    processes get them from the pickled pass too)."""
    opts = options_from_env()
    if opts is not None:
        install()
        _prepare_process(opts)
    if os.environ.get(FP32_ROPE_ENV) == "1":
        keep_rope_tables_fp32()
