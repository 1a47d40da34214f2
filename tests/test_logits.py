"""The logits site on whole models: which linear is the head (and which is not), the logits
and loss against the contract reference (an fp32 head over the aligned hidden states), and
the opt-in default."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import contract_reference as ref
import rla_compile
from rla_compile.tiny import tiny_causal_lm

ALL = [*rla_compile.DEFAULT_SITES, "logits"]  # attention, opt-in too, has tests of its own (test_attention.py)


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


def _aligned_hidden(model, ids) -> torch.Tensor:
    """The decoder's last hidden state with the four default sites aligned (no head)."""
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(model.model, backend=rla_compile.Backend(compiler="aot_eager"))(ids).last_hidden_state


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "mixtral"])
def test_head_logits_and_loss_follow_the_contract(family):
    model = tiny_causal_lm(family)
    ids = _ids(model.config.vocab_size)
    torch._dynamo.reset()
    be = rla_compile.Backend(compiler="aot_eager", sites=ALL)
    out = torch.compile(model, backend=be)(ids, labels=ids, use_cache=False)
    torch._dynamo.reset()
    (site,) = [s for s in be.reports[0].sites if s.kind == "logits"]  # the head only, not an MoE router
    assert (site.status, site.module) == ("rewritten", "lm_head")
    cap = getattr(model.config, "final_logit_softcapping", None)
    expected = ref.logits(_aligned_hidden(model, ids), model.lm_head.weight, softcap=cap)
    assert out.logits.dtype == torch.float32
    assert torch.equal(out.logits.detach(), expected)
    # the loss from those fp32 logits, by HF's own loss function (no rounding in between)
    assert torch.equal(out.loss.detach(), model.loss_function(expected, ids, vocab_size=model.config.vocab_size))


def test_inference_graph_head_is_found_by_its_name():
    model = tiny_causal_lm("llama")
    torch._dynamo.reset()
    be = rla_compile.Backend(compiler="aot_eager", sites=ALL)
    with torch.no_grad():
        logits = torch.compile(model, backend=be)(_ids(128), use_cache=False).logits
    torch._dynamo.reset()
    (site,) = [s for s in be.reports[0].sites if s.kind == "logits"]
    assert site.variant == "head" and logits.dtype == torch.float32


def test_logits_are_opt_in():
    assert "logits" not in rla_compile.Options().sites
    model = tiny_causal_lm("llama")
    torch._dynamo.reset()
    be = rla_compile.Backend(compiler="aot_eager")
    with torch.no_grad():
        logits = torch.compile(model, backend=be)(_ids(128), use_cache=False).logits
    torch._dynamo.reset()
    assert logits.dtype == torch.bfloat16
    assert [s for s in be.reports[0].sites if s.kind == "logits"] == []  # not asked for: not a skipped site


def projection_leaving(x, w):  # a graph break after an inner projection: its output leaves, unscored
    return F.linear(x, w)


def head_consumed_in_bf16(x, w):
    return torch.log_softmax(F.linear(x, w), -1)


@pytest.mark.parametrize("fn,reason", [
    (projection_leaving, "nothing says it is the vocabulary projection"),
    (head_consumed_in_bf16, "consumed before any fp32 upcast"),
])
def test_head_lookalikes_are_near_misses(fn, reason):
    x, w = torch.randn(2, 8, 64).bfloat16(), torch.randn(96, 64).bfloat16()
    result = rla_compile.align_function(fn, x, w, sites=ALL)
    assert result.report.sites == [] and result.after == result.before
    assert [m.kind for m in result.report.near_misses] == ["logits"]
    assert reason in result.report.near_misses[0].reason


def test_tied_head_is_found_by_its_embedding():
    def tied(ids, table):
        return F.linear(F.embedding(ids, table) * 2, table)

    result = rla_compile.align_function(tied, _ids(96), torch.randn(96, 64).bfloat16(), sites=ALL)
    assert [(s.kind, s.variant) for s in result.report.sites] == [("logits", "head, tied embedding")]


def test_the_backward_saves_bf16_h_and_w_not_their_fp32_copies():
    """The head's fp32 upcasts of h and W are recomputed in the backward (`Match.recompute`):
    it saves the bf16 values, so what the logits site adds to the saved tensors is at most
    the logits themselves in fp32 instead of bf16 (before: also an fp32 copy of W)."""
    model = tiny_causal_lm("llama", vocab_size=1024)
    ids = _ids(1024)
    saved = {}
    for name, sites in (("default", list(rla_compile.DEFAULT_SITES)), ("logits", ALL)):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=rla_compile.Backend(sites=sites))
        compiled(ids, labels=ids, use_cache=False).loss.backward()  # compile forward and backward
        tensors = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: tensors.append(t) or t, lambda t: t):
            loss = compiled(ids, labels=ids, use_cache=False).loss
        loss.backward()
        saved[name] = tensors
    torch._dynamo.reset()
    weight, hidden = model.lm_head.weight, (*ids.shape, model.config.hidden_size)

    def fp32_of_shape(name, shape):  # hidden-shaped fp32 values: the residual sums, saved by both
        return sum(t.dtype == torch.float32 and tuple(t.shape) == tuple(shape) for t in saved[name])

    assert fp32_of_shape("logits", weight.shape) == 0
    assert fp32_of_shape("logits", hidden) == fp32_of_shape("default", hidden)
    assert any(t.dtype == torch.bfloat16 and t.shape == weight.shape for t in saved["logits"])
    nbytes = {name: sum(t.numel() * t.element_size() for t in ts) for name, ts in saved.items()}
    assert 0 < nbytes["logits"] - nbytes["default"] <= ids.numel() * weight.shape[0] * 2
