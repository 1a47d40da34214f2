"""rla_compile: rounding-location alignment as a torch.compile graph rewrite.

RMSNorm, residual RMSNorm, SwiGLU/GeGLU and RoPE are found in any compiled graph and
rewritten so their intermediates stay in fp32 and each output is rounded once (the rounding
contract, docs/contract.md). Importing this package has no side effects: the `rla` backend is
registered through the `torch_dynamo_backends` entry point.

The public names load on first use (PEP 562): importing the package does not import torch, so
`rla-compile --help` and its argument errors answer at once.
"""

from __future__ import annotations

import importlib
import sys
import types

__version__ = "0.1.0"

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
    "backend": "backend",
    "align_function": "backend",
    "dynamo_backend": "backend",
    "rla_backend": "backend",
}
# earlier names, kept working as attributes but not exported by `from rla_compile import *`
# (`inspect` would shadow the standard module there)
_DEPRECATED = {"inspect": "backend"}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    module = _PUBLIC.get(name) or _DEPRECATED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, *_DEPRECATED})


class _Package(types.ModuleType):
    """The import system binds a submodule to its package's attribute when it first loads it:
    loading `rla_compile.backend` (the module) would hide `rla_compile.backend` (the function).
    A public name keeps meaning the public object; the module stays in `sys.modules`."""

    def __setattr__(self, name: str, value) -> None:
        if name in _PUBLIC and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
