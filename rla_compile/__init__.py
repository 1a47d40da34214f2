"""rla_compile: rounding-location alignment as a torch.compile graph rewrite.

RMSNorm, residual RMSNorm, SwiGLU/GeGLU and RoPE are found in any compiled graph and
rewritten so their intermediates stay in fp32 and each output is rounded once (the rounding
contract, docs/contract.md). Importing this package has no side effects: the `rla` backend is
registered through the `torch_dynamo_backends` entry point.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .backend import Backend, align_function, backend, dynamo_backend, inspect, rla_backend  # noqa: E402
from .debug import Rewrite  # noqa: E402
from .config import OptionError, Options  # noqa: E402
from .engine import align  # noqa: E402
from .report import GraphReport, NearMiss, SiteReport  # noqa: E402
from .sites import DEFAULT_SITES, SITE_KINDS  # noqa: E402

__all__ = [
    "Backend",
    "GraphReport",
    "NearMiss",
    "OptionError",
    "Rewrite",
    "Options",
    "DEFAULT_SITES",
    "SITE_KINDS",
    "SiteReport",
    "align",
    "backend",
    "align_function",
    "inspect",
    "dynamo_backend",
    "rla_backend",
    "__version__",
]
