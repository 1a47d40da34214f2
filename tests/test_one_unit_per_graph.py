"""The test suite builds each graph's Inductor CPU kernels as one C++ unit
(tests/support/one_unit_per_graph.py, installed by conftest.py): the same bits as Inductor's own
kernel-by-kernel build, forward and backward, with every unit built (none fell back)."""

from __future__ import annotations

import pytest
import torch
from torch._inductor import codecache
from torch._inductor import config as inductor_config

import one_unit_per_graph
import rla_compile
from models import tiny_causal_lm

pytest.importorskip("transformers")


def _step(model, tokens):
    torch._dynamo.reset()
    model.zero_grad()
    compiled = torch.compile(model, backend=rla_compile.Backend(sites=rla_compile.SITE_KINDS, pin_rounding=True))
    logits = compiled(tokens, use_cache=False).logits
    logits.float().square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_one_unit_per_graph_computes_inductors_bits(monkeypatch):
    model = tiny_causal_lm("qwen3_moe", num_hidden_layers=1)
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    del one_unit_per_graph.FALLBACKS[:]
    units, kernels = one_unit_per_graph.BUILT["units"], one_unit_per_graph.BUILT["kernels"]
    with inductor_config.patch(fx_graph_cache=False):
        logits, grads = _step(model, tokens)
        assert not one_unit_per_graph.FALLBACKS, one_unit_per_graph.FALLBACKS
        # the forward and the backward graph, each one unit of several kernels
        assert one_unit_per_graph.BUILT["units"] - units >= 2
        assert one_unit_per_graph.BUILT["kernels"] - kernels >= 2 * (one_unit_per_graph.BUILT["units"] - units)
        # the reference builds every kernel on its own (nothing reused from the run above)
        codecache.PyCodeCache.modules_no_attr.clear()
        codecache.CppPythonBindingsCodeCache.cache.clear()
        built_alone = []
        load = codecache.CppPythonBindingsCodeCache.load_pybinding
        monkeypatch.setattr(codecache.CppPythonBindingsCodeCache, "load_pybinding",
                            lambda *a, **k: built_alone.append(1) or load(*a, **k))
        with one_unit_per_graph.kernel_by_kernel():
            ref_logits, ref_grads = _step(model, tokens)
        assert len(built_alone) >= one_unit_per_graph.BUILT["kernels"] - kernels
    assert torch.equal(logits, ref_logits)
    assert len(grads) == len(ref_grads) > 0
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)
