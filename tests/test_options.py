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
    assert options.sites == frozenset(rla_compile.SITE_KINDS)
    assert (options.inner, options.pin_rounding, options.debug_dir) == ("inductor", False, None)


@pytest.mark.parametrize(
    "options,message",
    [
        ({"bogus": 1}, "unknown rla option(s) 'bogus'; valid: sites, inner, pin_rounding, debug, inductor"),
        ({"sites": ["rmsnorm", "layernorm"]}, "unknown site(s) 'layernorm' in option 'sites'; valid: rmsnorm, residual_rmsnorm, swiglu, rope"),
        ({"inner": "eager"}, "unknown inner backend 'eager' in option 'inner'; valid: inductor, aot_eager"),
        ({"pin_rounding": "yes"}, "option 'pin_rounding' must be True or False"),
        ({"inductor": 3}, "option 'inductor' must be a dict"),
    ],
)
def test_bad_options_name_the_valid_ones(options, message):
    with pytest.raises(OptionError) as error:
        Options.from_dict(options)
    assert message in str(error.value)


def test_bad_option_through_torch_compile():
    compiled = torch.compile(lambda x: x + 1, backend="rla", options={"sitez": ["rope"]})
    with pytest.raises(Exception) as error:
        compiled(torch.ones(3))
    assert "unknown rla option(s) 'sitez'" in str(error.value)


def test_sites_accepts_a_comma_separated_string():
    assert Options.from_dict({"sites": "rope, swiglu"}).sites == {"rope", "swiglu"}


def test_entry_point_needs_no_import_and_import_has_no_side_effects():
    code = (
        "import sys, torch\n"
        "out = torch.compile(lambda x: x * 2, backend='rla', options={'inner': 'aot_eager'})(torch.ones(2))\n"
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
    assert Options(inner="aot_eager").uuid() != base
    assert Options(inductor={"max_autotune": True}).uuid() != base
    monkeypatch.setattr(rla_config, "_SOURCE_HASH", "edited source")
    assert Options().uuid() != base
