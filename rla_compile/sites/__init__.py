"""The site registry. The engine, backend and reports iterate it and never name a site.

Order matters: a matcher that claims a larger region (residual RMSNorm: add + norm) runs
before the one it extends (RMSNorm), so the same norm is one site, not two.
"""

from __future__ import annotations

from collections.abc import Iterable

from .attention import AttentionMatcher
from .base import Match, Miss, SiteMatcher
from .logits import LogitsMatcher
from .opaque import OpaqueNormMatcher
from .residual_rmsnorm import ResidualRMSNormMatcher
from .rmsnorm import RMSNormMatcher
from .rope import RoPEMatcher
from .swiglu import SwiGLUMatcher

__all__ = ["DEFAULT_SITES", "MATCHERS", "OPT_IN_SITES", "SITE_KINDS", "Match", "Miss", "SiteMatcher", "check_site_names"]

MATCHERS: tuple[SiteMatcher, ...] = (
    ResidualRMSNormMatcher(),
    RMSNormMatcher(),
    SwiGLUMatcher(),
    RoPEMatcher(),
    LogitsMatcher(),
    AttentionMatcher(),
    OpaqueNormMatcher(),  # finds no site: reports norms hidden in one op as near misses
)

# Every kind the registry finds, once, in the order options, errors and reports list them: the
# registry's, except that the plain norm comes first (the residual norm's matcher runs before
# it only so that the larger region wins).
SITE_KINDS: tuple[str, ...] = tuple(sorted(dict.fromkeys(m.kind for m in MATCHERS if m.kind), key=lambda kind: kind != "rmsnorm"))
# Sites aligned only when asked for. The logits site changes the dtype of the logits the model
# returns (fp32) and only helps with the inference engine's head in fp32 too
# (docs/contract.md#logits). Attention replaces fused kernels by fp32 matmul-softmax-matmul,
# [B, H, L, S] fp32 scores in memory (docs/contract.md#attention): opt-in until its cost is measured.
OPT_IN_SITES: tuple[str, ...] = ("logits", "attention")
# What `sites` means when not given.
DEFAULT_SITES: tuple[str, ...] = tuple(kind for kind in SITE_KINDS if kind not in OPT_IN_SITES)


def check_site_names(sites: object, where: str, error: type[Exception] = ValueError) -> frozenset[str]:
    """`sites` (site names, or one comma-separated string) as a set; otherwise `error` saying
    what is wrong, where the names came from (`where`) and the valid names."""
    valid = ", ".join(SITE_KINDS)
    if isinstance(sites, str):
        sites = [s.strip() for s in sites.split(",") if s.strip()]
    if not isinstance(sites, Iterable):
        raise error(f"{where} takes a list of site names; valid: {valid}")
    sites = list(sites)
    not_names = [s for s in sites if not isinstance(s, str)]
    if not_names:
        raise error(f"{where} takes site names (strings), got {', '.join(map(repr, not_names))}; valid: {valid}")
    unknown = sorted(set(sites) - set(SITE_KINDS))
    if unknown:
        raise error(f"unknown site(s) {', '.join(map(repr, unknown))} in {where}; valid: {valid}")
    return frozenset(sites)
