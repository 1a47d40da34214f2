"""rla_compile's options: one frozen dataclass, one door for strings and dicts."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import sites as registry
from .sites import check_site_names

__all__ = ["Options", "OptionError", "COMPILERS", "ROUNDING_MODES"]

COMPILERS = ("inductor", "aot_eager")
# How a site's one rounding rounds (option `rounding`): "nearest" (to nearest, ties to even: every
# cast in torch) or "toward_zero" (the low bits dropped: what a kernel without a rounding
# conversion instruction does, e.g. vLLM-CPU's attention on CPUs without AVX512-BF16).
ROUNDING_MODES = ("nearest", "toward_zero")


class OptionError(ValueError):
    """An option name or value rla_compile does not know; the message lists the valid ones."""


@dataclass(frozen=True)
class SiteRounding:
    """A site's one rounding, as `Options.rounding_of` resolves option `rounding`: `mode`, how
    the output rounds ("nearest" or "toward_zero"), and `form`, the engine-paired computation
    the site emits (e.g. "vllm_cpu_vec": attention in vLLM-CPU's kernel order) or None for the
    contract's own."""

    mode: str = "nearest"
    form: str | None = None


@dataclass(frozen=True)
class Options:
    """How the `rla` backend aligns a graph.

    sites: which site kinds to align, from the registry (`rla_compile.SITE_KINDS`). Not given:
        `DEFAULT_SITES`, every kind that is not opt-in; the opt-in kinds (`sites.OPT_IN_SITES`:
        the logits, returned in fp32; attention, computed in fp32) each say why (`Site.opt_in`).
    compiler: the compiler rla hands the aligned graph to: "inductor" (default) or "aot_eager"
        (AOTAutograd without codegen: eager kernels, the rewritten rounding points).
    pin_rounding: round like eager outside the sites too (Inductor's
        emulate_precision_casts). None (default): Inductor's setting as you left it (its
        global config, or `inductor={"emulate_precision_casts": ...}`), itself off unless you
        set it; True/False set it for rla's graphs. See docs/options.md for the measurements.
        The sites' own output roundings are pinned either way.
    debug: a directory to dump graphs and reports into, or True for ./rla_debug
        (False: no dump). Debug never changes the rewrite. When not given, the environment
        variable RLA_DEBUG maps onto it (a directory, or 1 for ./rla_debug).
    inductor: extra Inductor config patches, passed through to compile_fx.
    rounding: how a site's one rounding rounds, per site kind: "nearest" (the default, ties to
        even, as torch's casts) or "toward_zero" (bf16 only), to pair the trainer with an
        engine kernel that truncates (vLLM-CPU's attention on CPUs without AVX512-BF16, e.g.
        `{"attention": "toward_zero"}`; `integrations.vllm.paired_rounding` measures the
        engine's, and the TRL integration and `rla-compile mismatch` apply it). A site may
        also take an engine-paired form (`Site.engine_forms`): attention's "vllm_cpu_vec"
        computes it in the fp32 order of vLLM-CPU's kernel, rounded as that kernel rounds.
    attention_chunk_mib: the attention site's chunked form (long or dynamic sequences) computes
        blocks of query rows whose fp32 scores take at most this many MiB (default 16); smaller
        blocks trade time for memory. It changes the fp32 order of k's and v's gradients (they
        sum over blocks), so it is part of the cache key.
    """

    sites: frozenset[str] = field(default_factory=lambda: frozenset(registry.DEFAULT_SITES))
    compiler: str = "inductor"
    pin_rounding: bool | None = None
    debug: str | bool | None = None
    inductor: Mapping[str, Any] = field(default_factory=dict)
    rounding: Mapping[str, str] = field(default_factory=dict)
    attention_chunk_mib: float = 16.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "sites", check_site_names(self.sites, "option 'sites'", OptionError))
        object.__setattr__(self, "rounding", _check_rounding(self.rounding, self.sites))
        if self.compiler not in COMPILERS:
            raise OptionError(
                f"unknown compiler {self.compiler!r} in option 'compiler'; valid: {', '.join(COMPILERS)}"
            )
        if self.pin_rounding is not None and not isinstance(self.pin_rounding, bool):
            raise OptionError(
                f"option 'pin_rounding' must be True, False or None (Inductor's own setting), got {self.pin_rounding!r}"
            )
        chunk = self.attention_chunk_mib
        if isinstance(chunk, bool) or not isinstance(chunk, (int, float)) or not chunk > 0:
            raise OptionError(f"option 'attention_chunk_mib' must be a positive number of MiB (the fp32 scores of one "
                              f"block of the attention site's chunked form), got {chunk!r}")
        if self.debug is None:
            env = os.environ.get("RLA_DEBUG", "")
            object.__setattr__(self, "debug", True if env == "1" else (env or False))
        if not isinstance(self.debug, (bool, str, os.PathLike)):
            raise OptionError(f"option 'debug' must be True/False or a directory, got {self.debug!r}")
        if not isinstance(self.inductor, Mapping):
            raise OptionError(f"option 'inductor' must be a dict of Inductor config patches, got {self.inductor!r}")
        object.__setattr__(self, "inductor", dict(self.inductor))
        if self.inductor:
            _check_inductor_settings(self.inductor)
        emulate = self.inductor.get("emulate_precision_casts")
        if self.pin_rounding is not None and emulate is not None and bool(emulate) != self.pin_rounding:
            raise OptionError(
                f"option 'pin_rounding'={self.pin_rounding} contradicts inductor={{'emulate_precision_casts': {emulate!r}}}; "
                "pin_rounding is that setting: give one of them"
            )

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> Options:
        """The one door for user dicts (torch.compile's `options=`). Rejects unknown names."""
        if options is not None and not isinstance(options, Mapping):
            raise OptionError(
                f"rla options must be a dict of option names to values, got {options!r}; "
                f"e.g. options={{'sites': ['rope']}}"
            )
        options = dict(options or {})
        if "inner" in options:  # its name before 0.2
            raise OptionError(f"option 'inner' is now 'compiler' (the compiler rla hands the aligned graph to): "
                              f"compiler={options['inner']!r}")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise OptionError(
                f"unknown rla option(s) {', '.join(map(repr, unknown))}; valid: {', '.join(valid)} "
                "(Inductor settings go inside options['inductor'])"
            )
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        """The options that differ from `Options()`, as `from_dict` takes them back (sites as a
        sorted list): what another process needs to rebuild these options."""
        defaults = Options()
        changed = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if getattr(self, f.name) != getattr(defaults, f.name)}
        if "sites" in changed:
            changed["sites"] = sorted(changed["sites"])
        return changed

    @property
    def debug_dir(self) -> Path | None:
        if self.debug is False or self.debug in ("", "0"):
            return None
        return Path("rla_debug") if self.debug is True else Path(self.debug)

    def inductor_settings(self) -> dict[str, Any]:
        """The Inductor config patches for rla's graphs, in the torch.compile backend and in
        vLLM alike: the `inductor` option plus `emulate_precision_casts` only when
        `pin_rounding` is set, so a graph with nothing to rewrite compiles exactly as the
        compiler would with the user's own settings."""
        settings = dict(self.inductor)
        if self.pin_rounding is not None:
            settings["emulate_precision_casts"] = self.pin_rounding
        return settings

    def rewrite_key(self) -> dict[str, Any]:
        """The options that change the rewritten graph or its compilation (not `debug`)."""
        return {
            "sites": sorted(self.sites),
            "compiler": self.compiler,
            "pin_rounding": self.pin_rounding,
            "inductor": {k: repr(v) for k, v in sorted(self.inductor.items())},
            "rounding": dict(sorted(self.rounding.items())),
            "attention_chunk_mib": float(self.attention_chunk_mib),
        }

    def rounding_of(self, kind: str) -> SiteRounding:
        """The site `kind`'s option `rounding`, resolved: the one place it is read. A computation
        form (a name in the site's `engine_forms`) gives the form and the output rounding it
        implies here; a mode gives the mode and the contract's own form."""
        value = self.rounding.get(kind, "nearest")
        forms = registry.by_kind(kind).engine_forms
        if value in forms:
            implied = forms[value]
            return SiteRounding(implied() if callable(implied) else implied, value)
        return SiteRounding(value)

    def uuid(self) -> str:
        """Cache key: rla's version, the source of every module, and the rewrite options."""
        return hashlib.sha256(
            (_source_hash() + json.dumps(self.rewrite_key(), sort_keys=True)).encode()
        ).hexdigest()


def _check_rounding(rounding: Any, sites: frozenset[str]) -> dict[str, str]:
    """`rounding` as {selected site kind: mode}; otherwise OptionError naming what is wrong."""
    if not isinstance(rounding, Mapping):
        raise OptionError(f"option 'rounding' takes a dict of site kind to mode, e.g. {{'attention': 'toward_zero'}}; "
                          f"got {rounding!r}")
    kinds = check_site_names(list(rounding), "option 'rounding'", OptionError)
    unselected = sorted(kinds - sites)
    if unselected:
        raise OptionError(f"option 'rounding' names {', '.join(map(repr, unselected))}, not among the selected sites "
                          f"({', '.join(sorted(sites))}); select it in 'sites' or drop it from 'rounding'")
    for kind, mode in rounding.items():
        valid = (*ROUNDING_MODES, *registry.by_kind(kind).engine_forms)
        if mode not in valid:
            raise OptionError(f"option 'rounding': unknown mode {mode!r} for site {kind!r}; valid: {', '.join(valid)}")
    return dict(rounding)  # "nearest" kept: a mode the user set wins over a paired one


def _check_inductor_settings(patches: Mapping[str, Any]) -> None:
    """Unknown Inductor settings fail here, naming the option, not later inside compile_fx."""
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    unknown = sorted(str(k) for k in patches if k not in known)
    if unknown:
        raise OptionError(
            f"unknown Inductor setting(s) {', '.join(map(repr, unknown))} in option 'inductor'; "
            "the names are torch._inductor.config's (e.g. 'max_autotune', 'triton.cudagraphs')"
        )


_SOURCE_HASH: str | None = None


def _source_hash() -> str:
    global _SOURCE_HASH  # computed once per process: the package's files do not change under it
    if _SOURCE_HASH is None:
        from . import __version__

        digest = hashlib.sha256(__version__.encode())
        root = Path(__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
        _SOURCE_HASH = digest.hexdigest()
    return _SOURCE_HASH
