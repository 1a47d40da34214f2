"""rla_compile: rounding-location alignment as a torch.compile graph rewrite.

The sites — RMSNorm, residual RMSNorm, SwiGLU/GeGLU and RoPE by default, the logits and
attention when asked for — are found in any compiled graph and rewritten so their
intermediates stay in fp32 and each output is rounded once (the rounding contract,
docs/contract.md). The registry (`rla_compile.sites`) is the list: `SITE_KINDS` every kind,
`DEFAULT_SITES` those aligned when `sites` is not given. Importing this package has no side effects: the `rla` backend is
registered through the `torch_dynamo_backends` entry point.

The public names load on first use (PEP 562): importing the package does not import torch, so
`rla-compile --help` and its argument errors answer at once.
"""

from __future__ import annotations

import importlib
import importlib.util

__version__ = "0.3.4"

# public name -> the submodule that defines it
_PUBLIC = {
    "Backend": "backend",
    "GraphReport": "report",
    "NearMiss": "report",
    "OptionError": "config",
    "Rewrite": "debug",
    "Options": "config",
    "DEFAULT_SITES": "sites",
    "SITE_KINDS": "sites",
    "SiteReport": "report",
    "align": "engine",
    "align_function": "backend",
    "dynamo_backend": "backend",
}

__all__ = [*_PUBLIC, "__version__"]
_REGISTRY_LISTS = {"DEFAULT_SITES", "SITE_KINDS"}


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a submodule: rla_compile.backend
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    if name not in _REGISTRY_LISTS:  # the registry's lists are read from it each time (sites.registered)
        globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
