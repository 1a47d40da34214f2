"""Whole tiny HF models under backend="rla": the sites a config implies, and logits that do
not depend on the compiler once rounding is pinned."""

from __future__ import annotations

import pytest
import torch
from torch._inductor import config as inductor_config

import rla_compile
from models import expected_sites, tiny_causal_lm

pytest.importorskip("transformers")

TOKENS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def _logits(model, backend, emulate=False):
    torch._dynamo.reset()
    with inductor_config.patch(emulate_precision_casts=emulate), torch.no_grad():
        return torch.compile(model, backend=backend)(TOKENS, use_cache=False).logits.float()


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_tiny_model_sites_and_inner_independence(model_type, record_property):
    model = tiny_causal_lm(model_type)
    pinned = rla_compile.Backend(pin_rounding=True)
    unpinned = rla_compile.Backend()
    eager_kernels = rla_compile.Backend(compiler="aot_eager")
    logits = {
        "rla inductor pinned": _logits(model, pinned, emulate=True),
        "rla inductor unpinned": _logits(model, unpinned),
        "rla aot_eager": _logits(model, eager_kernels),
        "inductor, rounding like eager (no rla)": _logits(model, "inductor", emulate=True),
        "inductor default (no rla)": _logits(model, "inductor"),
    }
    for be in (pinned, unpinned, eager_kernels):
        (report,) = be.reports
        assert report.counts() == expected_sites(model.config), str(report)
        assert report.count(status="rewritten") == len(report.sites), str(report)

    base = logits["rla aot_eager"]
    apart = {name: int((v != base).sum()) for name, v in logits.items()}
    for name, n in apart.items():
        record_property(f"{model_type}: {name} vs rla aot_eager, differing logits", n)
        print(f"{model_type}: {name} vs rla aot_eager: {n} of {base.numel()} logits differ")

    # Without rla the compiled models round mid-site and land elsewhere.
    assert apart["inductor, rounding like eager (no rla)"] > base.numel() // 10
    # With rounding pinned, bit-identical whatever the compiler (the sites' reductions
    # and fp32 cos/sin run on ATen's kernels; many inputs: test_invariance.py). Unpinned, the
    # sites still follow the contract but the rest of the graph
    # (attention's scale/mask/softmax casts) rounds where Inductor fuses: recorded, not asserted.
    assert apart["rla inductor pinned"] == 0
