"""Options: the one door, clear errors, the entry point, and a cache key that tracks the rewrite."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import rla_compile
from rla_compile import config as rla_config
from rla_compile.config import OptionError, Options


def test_defaults():
    options = Options()
    assert options.sites == frozenset(rla_compile.DEFAULT_SITES)  # logits is opt-in
    assert (options.compiler, options.pin_rounding, options.debug_dir) == ("inductor", None, None)


def test_pin_rounding_sets_inductor_only_when_given():
    assert "emulate_precision_casts" not in Options().inductor_settings()
    assert Options(pin_rounding=True).inductor_settings()["emulate_precision_casts"] is True
    assert Options(pin_rounding=False).inductor_settings()["emulate_precision_casts"] is False
    kept = Options(inductor={"emulate_precision_casts": True}).inductor_settings()
    assert kept["emulate_precision_casts"] is True
    with pytest.raises(OptionError, match="contradicts"):
        Options(pin_rounding=False, inductor={"emulate_precision_casts": True})


@pytest.mark.parametrize("how", ["global", "inductor option"])
def test_graph_without_sites_compiles_as_inductor_with_the_users_settings(how):
    """A user's emulate_precision_casts=True reaches Inductor through rla (it used to be reset
    to False): a graph with no site compiles exactly as backend="inductor" does."""
    from torch._inductor import config as inductor_config

    def f(x):  # no site: x * rsqrt(|x| + 1) is not an RMSNorm
        return x * torch.rsqrt(x.abs() + 1)

    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with inductor_config.patch(emulate_precision_casts=True, fx_graph_cache=False):
        torch._dynamo.reset()
        expected = torch.compile(f, backend="inductor")(x)
        torch._dynamo.reset()
        eager_rounding = torch.compile(f, backend="aot_eager")(x)
    assert torch.equal(expected, eager_rounding)  # the setting is what makes Inductor round like eager
    rla = rla_compile.Backend() if how == "global" else rla_compile.Backend(inductor={"emulate_precision_casts": True})
    patch = {"emulate_precision_casts": how == "global", "fx_graph_cache": False}
    with inductor_config.patch(**patch):
        torch._dynamo.reset()
        got = torch.compile(f, backend=rla)(x)
        torch._dynamo.reset()
        unpinned = torch.compile(f, backend=rla_compile.Backend(pin_rounding=False))(x)
    torch._dynamo.reset()
    assert rla.reports[0].sites == []
    assert torch.equal(got, expected)
    assert not torch.equal(unpinned, expected)  # the input does show the setting


@pytest.mark.parametrize(
    "options,message",
    [
        ({"bogus": 1}, "unknown rla option(s) 'bogus'; valid: sites, compiler, pin_rounding, debug, inductor"),
        ({"sites": ["rmsnorm", "layernorm"]}, "unknown site(s) 'layernorm' in option 'sites'; valid: rmsnorm, residual_rmsnorm, swiglu, rope, logits, attention"),
        ({"compiler": "eager"}, "unknown compiler 'eager' in option 'compiler'; valid: inductor, aot_eager"),
        ({"inner": "aot_eager"}, "option 'inner' is now 'compiler' (the compiler rla hands the aligned graph to): compiler='aot_eager'"),
        ({"pin_rounding": "yes"}, "option 'pin_rounding' must be True, False or None"),
        ({"inductor": 3}, "option 'inductor' must be a dict"),
    ],
)
def test_bad_options_name_the_valid_ones(options, message):
    with pytest.raises(OptionError) as error:
        Options.from_dict(options)
    assert message in str(error.value)


def test_bad_option_through_torch_compile():
    """As docs/usage.md says: Dynamo wraps it, the OptionError is the inner exception."""
    compiled = torch.compile(lambda x: x + 1, backend="rla", options={"sitez": ["rope"]})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as error:
        compiled(torch.ones(3))
    assert isinstance(error.value.inner_exception, OptionError)
    assert "unknown rla option(s) 'sitez'" in str(error.value.inner_exception)


def test_bad_option_in_backend_object_is_raised_before_compiling():
    with pytest.raises(OptionError, match="unknown rla option"):
        rla_compile.Backend(sitez=["rope"])


def test_sites_accepts_a_comma_separated_string():
    assert Options.from_dict({"sites": "rope, swiglu"}).sites == {"rope", "swiglu"}


def test_entry_point_needs_no_import_and_import_has_no_side_effects():
    code = (
        "import sys, torch\n"
        "out = torch.compile(lambda x: x * 2, backend='rla', options={'compiler': 'aot_eager'})(torch.ones(2))\n"
        "assert out.tolist() == [2.0, 2.0]\n"
        "print('rla' in torch._dynamo.list_backends())\n"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "True"
    code = (
        "import torch, torch._inductor.config as c\n"
        "before = (c.emulate_precision_casts, c.post_grad_custom_post_pass, dict(torch._dynamo.backends.registry._COMPILER_FNS))\n"
        "import rla_compile\n"
        "after = (c.emulate_precision_casts, c.post_grad_custom_post_pass, dict(torch._dynamo.backends.registry._COMPILER_FNS))\n"
        "print(before == after)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "True"


def test_uuid_covers_rewrite_options_and_code(monkeypatch):
    base = Options().uuid()
    assert Options().uuid() == base
    assert Options(debug=True).uuid() == base  # debug never changes the graph
    assert Options(sites=frozenset({"rope"})).uuid() != base
    assert Options(pin_rounding=True).uuid() != base
    assert Options(compiler="aot_eager").uuid() != base
    assert Options(inductor={"max_autotune": True}).uuid() != base
    monkeypatch.setattr(rla_config, "_SOURCE_HASH", "edited source")
    assert Options().uuid() != base


def test_to_dict_is_what_from_dict_takes_back(monkeypatch):
    monkeypatch.delenv("RLA_DEBUG", raising=False)
    assert Options().to_dict() == {}
    opts = Options(sites=frozenset({"swiglu", "rope"}), pin_rounding=True, inductor={"max_autotune": False})
    assert opts.to_dict() == {"sites": ["rope", "swiglu"], "pin_rounding": True, "inductor": {"max_autotune": False}}
    assert Options.from_dict(opts.to_dict()) == opts


def test_every_list_of_the_options_names_them_all():
    """The docstrings and pages that list rla's options name every one (`rounding` was missing)."""
    import dataclasses
    from pathlib import Path

    from rla_compile import backend
    from rla_compile.integrations import trl

    names = [f.name for f in dataclasses.fields(rla_compile.Options)]
    root = Path(__file__).resolve().parent.parent
    for where, text in [("Options", rla_compile.Options.__doc__), ("Backend", backend.Backend.__doc__),
                        ("integrations.trl.enable", trl.enable.__doc__),
                        ("docs/usage.md", (root / "docs/usage.md").read_text()),
                        ("docs/rl.md", (root / "docs/rl.md").read_text().split("`enable(**options)` takes")[1][:200])]:
        missing = [n for n in names if n not in text]
        assert not missing, f"{where} lists rla's options without {missing}"


def test_rounding_is_resolved_in_one_place():
    """Option `rounding` holds a mode or an engine-paired form; `Options.rounding_of` alone reads
    it: the form a site emits and the output rounding it implies on this machine."""
    from rla_compile.config import SiteRounding
    from rla_compile.sites.attention.vllm_cpu import output_rounding

    options = Options.from_dict({"sites": ["rmsnorm", "attention"], "rounding": {"attention": "vllm_cpu_vec"}})
    assert options.rounding_of("attention") == SiteRounding(output_rounding(), "vllm_cpu_vec")
    assert options.rounding_of("rmsnorm") == SiteRounding("nearest", None)
    options = Options.from_dict({"sites": ["rmsnorm"], "rounding": {"rmsnorm": "toward_zero"}})
    assert options.rounding_of("rmsnorm") == SiteRounding("toward_zero", None)
