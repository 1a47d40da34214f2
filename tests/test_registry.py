"""The registry is the one place a site kind is listed: a site declared in a module of its own
and registered (`sites.registered`) is seen by the options, the engine, the reports, the
mismatch tool's rows and legend, and the integrations' settings, with no other file changed."""

from __future__ import annotations

import pytest
import torch
from torch.fx import Node

import rla_compile
from rla_compile import sites
from rla_compile.config import OptionError, Options
from rla_compile.mismatch import measurement, report
from rla_compile.sites import Match, Site


class TanhMatcher:
    """A toy site: a low-precision tanh, computed in fp32 and rounded once."""

    kind = "toy_tanh"

    def candidates(self, graph):
        return [n for n in graph.nodes if n.op == "call_function" and "tanh" in str(n.target)]

    def match(self, anchor: Node):
        return Match(self.kind, anchor, frozenset({anchor}), "tanh", {"x": anchor.args[0]})


TOY = Site(kind="toy_tanh", matcher=TanhMatcher(), summary="tanh in fp32", opt_in="a toy",
           engine_overrides={"toy_dtype": "float32"}, engine_env={"TOY_SPLIT": "0"})


def _block(x):
    return torch.tanh(x * 3) * 2


def test_a_registered_site_is_aligned_reported_and_measured():
    from rla_compile import mismatch

    with sites.registered(TOY):
        assert sites.SITE_KINDS[-1] == "toy_tanh" and "toy_tanh" in sites.OPT_IN_SITES
        # the package's and the mismatch tool's lists are the registry's, read when used
        assert rla_compile.SITE_KINDS == mismatch.SITE_KINDS == sites.SITE_KINDS
        assert "toy_tanh" not in Options().sites  # opt-in: not a default
        backend = rla_compile.Backend(sites=[*sites.DEFAULT_SITES, "toy_tanh"], compiler="aot_eager")
        x = torch.randn(64, 33, dtype=torch.bfloat16)
        torch._dynamo.reset()
        got = torch.compile(_block, backend=backend)(x)
        (site,) = backend.reports[0].sites
        assert (site.kind, site.status) == ("toy_tanh", "rewritten")
        want = torch.tanh((x * 3).float()).to(torch.bfloat16) * 2  # the contract: fp32 inside, rounded once
        assert torch.equal(got, want)
        rows = [label for label, *_ in measurement.configurations(ablation=True)]
        assert "rla on both + toy_tanh" in rows and "toy_tanh only, both sides" in rows
        assert "toy_tanh: tanh in fp32" in report.legend()
    assert "toy_tanh" not in sites.SITE_KINDS and "toy_tanh" not in rla_compile.SITE_KINDS
    with pytest.raises(OptionError, match="unknown site"):
        Options(sites=["toy_tanh"])


def test_a_registered_sites_engine_settings_reach_vllm(monkeypatch):
    """The vLLM integration applies a site's declared engine settings: its `hf_overrides` (the
    user's own values win) and its environment, for engines started from this process."""
    from rla_compile.integrations import vllm as rla_vllm

    import os

    assert "TOY_SPLIT" not in os.environ
    with sites.registered(TOY):
        opts = Options(sites=frozenset({"toy_tanh"}))
        assert rla_vllm._engine_overrides(opts, None) == {"toy_dtype": "float32"}
        assert rla_vllm._engine_overrides(opts, {"toy_dtype": "bfloat16"}) is None  # the user's value wins
        assert rla_vllm._engine_overrides(opts, {"x": 1}) == {"x": 1, "toy_dtype": "float32"}
        assert rla_vllm._engine_overrides(Options(), None) is None  # not selected: nothing
        rla_vllm._prepare_process(opts)
        try:
            assert os.environ["TOY_SPLIT"] == "0"
        finally:
            rla_vllm.undo()
    assert "TOY_SPLIT" not in os.environ  # undo() restores the environment too: nothing leaks into later tests


def test_every_declared_hook_is_implemented():
    """A site names the hooks it needs; each integration has every one of them."""
    from rla_compile.integrations import trl as rla_trl
    from rla_compile.integrations import vllm as rla_vllm
    from rla_compile.integrations import vllm_kernels

    for site in sites.SITES:
        assert set(site.engine_hooks) <= set(rla_vllm.ENGINE_HOOKS), site.kind
        assert set(site.trainer_hooks) <= set(rla_trl.TRAINER_HOOKS), site.kind
        assert set(site.policy_hooks) <= set(rla_trl.POLICY_HOOKS), site.kind
        assert not site.engine_rounding or site.engine_rounding in vllm_kernels.ROUNDING_PROBES, site.kind


def test_a_kind_registers_once():
    with pytest.raises(ValueError, match="'rope' already registered"):
        with sites.registered(Site(kind="rope", matcher=TanhMatcher(), summary="")):
            pass


def test_only_the_registry_names_the_sites():
    """No code outside `sites/` holds a site kind as a string (`"rope" in opts.sites`): each
    iterates the registry. (Usage examples in docstrings and messages may name one.) The
    exception is `site_names.py`, the names the command line checks before importing torch,
    which the registry checks against itself when it loads (test below)."""
    import ast
    import pathlib

    root = pathlib.Path(rla_compile.__file__).parent
    spelled = []
    for path in sorted(root.rglob("*.py")):
        if "sites" in path.relative_to(root).parts or path.name == "site_names.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in sites.SITE_KINDS:
                spelled.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    assert spelled == []


def test_the_names_checked_before_torch_are_the_registrys():
    """`site_names` answers from the registry once it is loaded (custom sites included), and
    its built-in list is the registry's: the registry refuses to load otherwise."""
    from rla_compile import site_names

    assert site_names.BUILT_IN == sites.SITE_KINDS and site_names.OPT_IN == sites.OPT_IN_SITES
    assert site_names.kinds() is sites.SITE_KINDS and site_names.default_sites() is sites.DEFAULT_SITES
    toy = sites.Site(kind="toy_names", matcher=sites.MATCHERS[0], summary="a name only", opt_in="a test")
    with sites.registered(toy):
        assert site_names.check_site_names(["toy_names"], "here") == {"toy_names"}
    with pytest.raises(ValueError, match="unknown site"):
        site_names.check_site_names(["toy_names"], "here")
