"""The site registry. The engine, backend and reports iterate it and never name a site.

Order matters: a matcher that claims a larger region (residual RMSNorm: add + norm) runs
before the one it extends (RMSNorm), so the same norm is one site, not two.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from . import attention, expert_combine, logits, residual_rmsnorm, rmsnorm, rope, router, swiglu
from .. import site_names
from ..site_names import check_site_names
from .base import Match, Miss, Site, SiteMatcher
from .opaque import OpaqueNormMatcher

__all__ = ["DEFAULT_SITES", "MATCHERS", "OPT_IN_SITES", "SITES", "SITE_KINDS", "Match", "Miss", "Site", "SiteMatcher",
           "by_kind", "registered", "selected", "check_site_names"]

# The one list of site kinds: adding a site is one line here (and its module).
SITES: tuple[Site, ...] = (
    residual_rmsnorm.SITE,
    rmsnorm.SITE,
    swiglu.SITE,
    rope.SITE,
    logits.SITE,
    attention.SITE,
    router.SITE,
    expert_combine.SITE,
)

MATCHERS: tuple[SiteMatcher, ...] = ()
SITE_KINDS: tuple[str, ...] = ()  # every kind, in the order options, errors and reports list them
OPT_IN_SITES: tuple[str, ...] = ()  # aligned only when asked for (each says why: `Site.opt_in`)
DEFAULT_SITES: tuple[str, ...] = ()  # what `sites` means when not given


def _derive() -> None:
    """The names above, from `SITES`. The plain norm comes first in SITE_KINDS: the residual
    norm's matcher runs before it only so that the larger region wins."""
    global MATCHERS, SITE_KINDS, OPT_IN_SITES, DEFAULT_SITES
    MATCHERS = (*(site.matcher for site in SITES), OpaqueNormMatcher(SITES))  # the last finds no site: near misses
    SITE_KINDS = tuple(sorted((s.kind for s in SITES), key=lambda kind: kind != rmsnorm.SITE.kind))
    OPT_IN_SITES = tuple(s.kind for s in SITES if s.opt_in)
    DEFAULT_SITES = tuple(kind for kind in SITE_KINDS if kind not in OPT_IN_SITES)


_derive()
# The names the command line checks before importing torch (site_names.py) must be these.
if SITE_KINDS != site_names.BUILT_IN or OPT_IN_SITES != site_names.OPT_IN:
    raise ImportError(f"rla_compile.site_names lists {site_names.BUILT_IN} (opt-in {site_names.OPT_IN}), the registry "
                      f"{SITE_KINDS} (opt-in {OPT_IN_SITES}): add the new site's name there too")


@contextlib.contextmanager
def registered(*sites: Site) -> Iterator[None]:
    """Add site kinds to the registry for the duration (after the built-in ones): a site of your
    own, tried without editing this package; everything that iterates the registry (options,
    the engine, reports, the mismatch tool, the integrations) sees it."""
    global SITES
    clash = sorted({s.kind for s in sites} & {s.kind for s in SITES})
    if clash:
        raise ValueError(f"site kind(s) {', '.join(map(repr, clash))} already registered")
    before = SITES
    SITES = (*SITES, *sites)
    _derive()
    try:
        yield
    finally:
        SITES = before
        _derive()


def by_kind(kind: str) -> Site:
    return next(s for s in SITES if s.kind == kind)


def selected(kinds: Iterable[str]) -> list[Site]:
    """The declarations of the `kinds` selected, in registry order."""
    kinds = set(kinds)
    return [s for s in SITES if s.kind in kinds]
