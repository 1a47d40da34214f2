"""What a site matcher returns, and the protocol every site module implements."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch.fx import Graph, Node


@dataclass(frozen=True, eq=False)  # identity: a match is one place in one graph
class Match:
    """A site found in the graph.

    `nodes` is the region the contract computes in fp32: everything between the site's
    inputs (upcast on entry) and its outputs (rounded once on exit). A trailing cast to the
    low-precision dtype is *not* part of the region: it is the site's one rounding.
    `roles` names the interesting inputs (`x`, `weight`, `gate`, `up`, `cos`, ...).
    `rounds_outputs=False`: the outputs leave in fp32, not rounded (the logits site).
    `recompute`: input roles whose fp32 upcast the backward recomputes from the low-precision
    value instead of saving the fp32 copy (the head's h and W); see `rewriter.mark_recompute`.
    `save`: roles whose output rounding the backward reads saved instead of recomputing it (the
    residual stream); see `rewriter.mark_save`.
    `note`: what the report adds to the site's status, whatever it is.
    `computes`: for a site whose contract computes differently from the graph (attention), a
    callable `(emitter, roles) -> fp32 value` that emits the contract's computation from the
    roles with an `emit.Emitter`; the engine replaces the region by it, rounded once
    (`rewriter.Rewriter.replace`). None: the region's own ops, re-typed to fp32.
    """

    kind: str
    anchor: Node
    nodes: frozenset[Node]
    variant: str
    roles: dict[str, Node] = field(default_factory=dict)
    rounds_outputs: bool = True
    recompute: tuple[str, ...] = ()
    save: tuple[str, ...] = ()
    note: str = ""  # said in the report with the site's status (e.g. where RoPE's tables came from)
    computes: Callable[..., Node] | None = None


@dataclass(frozen=True, eq=False)
class Miss:
    """A candidate the matcher looked at and rejected, with the condition that failed."""

    kind: str
    anchor: Node
    reason: str


class SiteMatcher(Protocol):
    kind: str | None  # None: a matcher that only reports near misses (sites/opaque.py)

    def candidates(self, graph: Graph) -> Iterable[Node]:
        """Anchor nodes worth a closer look (cheap filter by op)."""

    def match(self, anchor: Node) -> Match | Miss | None:
        """A Match, a Miss saying why not, or None when the anchor is not this site's business."""


@dataclass(frozen=True)
class Site:
    """A site kind, declared in its own module: its matcher, and everything the rest of the
    system needs to know about it. The registry (`sites/__init__.py`) lists these; the engine,
    backends, integrations, mismatch tool and benchmarks iterate it and never name a kind.

    `opt_in`: why the site is aligned only when asked for ("" for a default site).
    `summary`: what aligning it changes, in a few words (legends, help texts).
    `opaque_ops`: ops that compute the whole site in one node, out of the matcher's reach
    (`opaque.OpaqueNormMatcher` reports them as near misses; the backend decomposes the ATen
    ones before matching). `kernel_boundaries`: ops of the site that Inductor runs as kernels
    of their own (lowering.py). `engine_overrides` / `engine_env`: the `hf_overrides` and the
    environment a vLLM engine needs for its half of the site; `engine_hooks` / `trainer_hooks`:
    hooks, by name, that the vLLM / TRL integrations run when the site is selected (each
    integration maps every name to its implementation; a test checks that none is missing);
    `policy_hooks`: hooks, by name, that the TRL integration runs on the trained model itself
    when training starts, with the trainer's arguments (`integrations.trl.POLICY_HOOKS`).
    `engine_rounding`: for a site whose engine half is a kernel of the engine's own, the probe
    (`integrations.vllm_kernels.ROUNDING_PROBES`) that measures how that kernel rounds its
    output; the trainer's site is paired with it (`paired_rounding`, option `rounding`).
    `engine_forms`: modes of option `rounding` beyond how the output rounds: the site computed
    in the fp32 order of an engine's kernel (attention: "vllm_cpu_vec"), each with the output
    rounding it implies (a mode, or a function of no arguments that says it for this machine,
    as the kernel's build does); `Options.rounding_of` resolves option `rounding` into a mode
    and a form, and `Match.computes` receives the form and emits it.
    `config_keys`: see `in_model`.
    """

    kind: str
    matcher: SiteMatcher
    summary: str
    opt_in: str = ""
    opaque_ops: tuple[str, ...] = ()
    kernel_boundaries: tuple[str, ...] = ()
    engine_overrides: Mapping[str, Any] = field(default_factory=dict)
    engine_env: Mapping[str, str] = field(default_factory=dict)
    engine_hooks: tuple[str, ...] = ()
    trainer_hooks: tuple[str, ...] = ()
    policy_hooks: tuple[str, ...] = ()
    engine_rounding: str = ""
    engine_forms: Mapping[str, str] = field(default_factory=dict)
    config_keys: tuple[str, ...] = ()

    def in_model(self, config: Any) -> bool:
        """Whether a model with this (HF) config can have the site: `config_keys` names config
        attributes of which one must be set above 0 (MoE: a number of experts); none: any model.
        The mismatch tool measures a site's own row only where it can be found."""
        return not self.config_keys or any((getattr(config, key, 0) or 0) > 0 for key in self.config_keys)
