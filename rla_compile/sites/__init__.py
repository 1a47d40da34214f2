"""The site registry. The engine, backend and reports iterate it and never name a site.

Order matters: a matcher that claims a larger region (residual RMSNorm: add + norm) runs
before the one it extends (RMSNorm), so the same norm is one site, not two.
"""

from __future__ import annotations

from .base import Match, Miss, SiteMatcher
from .opaque import OpaqueNormMatcher
from .residual_rmsnorm import ResidualRMSNormMatcher
from .rmsnorm import RMSNormMatcher
from .rope import RoPEMatcher
from .swiglu import GatedMLPMatcher

__all__ = ["MATCHERS", "SITE_KINDS", "Match", "Miss", "SiteMatcher"]

MATCHERS: tuple[SiteMatcher, ...] = (
    ResidualRMSNormMatcher(),
    RMSNormMatcher(),
    GatedMLPMatcher(),
    RoPEMatcher(),
    OpaqueNormMatcher(),  # finds no site: reports norms hidden in one op as near misses
)

SITE_KINDS: tuple[str, ...] = ("rmsnorm", "residual_rmsnorm", "swiglu", "rope")
assert set(SITE_KINDS) == {m.kind for m in MATCHERS}
