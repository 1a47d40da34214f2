"""The site kinds by name, without importing torch.

The command line checks `--sites` and stack labels against these before any slow import
(`import torch` alone takes seconds on a small machine). The registry (`sites/__init__.py`)
is the authority: it checks at import that its built-in sites are exactly `BUILT_IN`, opt-in
ones `OPT_IN`, and once it is loaded, `kinds()` answers from it, sites registered with
`sites.registered(...)` included.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

__all__ = ["BUILT_IN", "OPT_IN", "check_site_names", "default_sites", "kinds"]

# In SITE_KINDS order (the order options, errors and reports list them).
BUILT_IN: tuple[str, ...] = ("rmsnorm", "residual_rmsnorm", "swiglu", "rope", "logits", "attention", "router",
                             "expert_combine")
OPT_IN: tuple[str, ...] = ("logits", "attention", "router", "expert_combine")


def _registry():
    """The registry module when something has imported it (never imported from here)."""
    return sys.modules.get("rla_compile.sites")


def kinds() -> tuple[str, ...]:
    """Every site kind: the registry's when loaded (custom sites included), else the built-in ones."""
    registry = _registry()
    return registry.SITE_KINDS if registry is not None else BUILT_IN


def default_sites() -> tuple[str, ...]:
    """What `sites` means when not given: every kind that is not opt-in."""
    registry = _registry()
    return registry.DEFAULT_SITES if registry is not None else tuple(k for k in BUILT_IN if k not in OPT_IN)


def check_site_names(sites: object, where: str, error: type[Exception] = ValueError) -> frozenset[str]:
    """`sites` (site names, or one comma-separated string) as a set; otherwise `error` saying
    what is wrong, where the names came from (`where`) and the valid names."""
    known = kinds()
    valid = ", ".join(known)
    if isinstance(sites, str):
        sites = [s.strip() for s in sites.split(",") if s.strip()]
    if not isinstance(sites, Iterable):
        raise error(f"{where} takes a list of site names; valid: {valid}")
    sites = list(sites)
    not_names = [s for s in sites if not isinstance(s, str)]
    if not_names:
        raise error(f"{where} takes site names (strings), got {', '.join(map(repr, not_names))}; valid: {valid}")
    unknown = sorted(set(sites) - set(known))
    if unknown:
        raise error(f"unknown site(s) {', '.join(map(repr, unknown))} in {where}; valid: {valid}")
    return frozenset(sites)
