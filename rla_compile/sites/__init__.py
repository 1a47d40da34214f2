"""The site registry. The engine, backend and reports iterate it and never name a site.

Order matters: a matcher that claims a larger region (residual RMSNorm: add + norm) runs
before the one it extends (RMSNorm), so the same norm is one site, not two.
"""

from __future__ import annotations

from .base import Match, Miss, SiteMatcher
from .logits import LogitsMatcher
from .opaque import OpaqueNormMatcher
from .residual_rmsnorm import ResidualRMSNormMatcher
from .rmsnorm import RMSNormMatcher
from .rope import RoPEMatcher
from .swiglu import GatedMLPMatcher

__all__ = ["DEFAULT_SITES", "MATCHERS", "SITE_KINDS", "Match", "Miss", "SiteMatcher"]

MATCHERS: tuple[SiteMatcher, ...] = (
    ResidualRMSNormMatcher(),
    RMSNormMatcher(),
    GatedMLPMatcher(),
    RoPEMatcher(),
    LogitsMatcher(),
    OpaqueNormMatcher(),  # finds no site: reports norms hidden in one op as near misses
)

SITE_KINDS: tuple[str, ...] = ("rmsnorm", "residual_rmsnorm", "swiglu", "rope", "logits")
# What `sites` means when not given. The logits site is opt-in: it changes the dtype of the
# logits the model returns (fp32) and only helps with the inference engine's head in fp32 too
# (docs/contract.md#logits).
DEFAULT_SITES: tuple[str, ...] = ("rmsnorm", "residual_rmsnorm", "swiglu", "rope")
assert set(SITE_KINDS) == {m.kind for m in MATCHERS}
