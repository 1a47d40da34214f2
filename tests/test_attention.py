"""The opt-in attention site on whole tiny HF models (site spellings: test_sites.py's attn_*
cases; look-alikes and near misses: test_negative.py).

Every layer's attention is found and rewritten, under `attn_implementation` "eager" and "sdpa",
and the model under rla with only the attention site selected equals the same model run
eagerly with its attention function swapped, through HF's `AttentionInterface`, for the
contract reference (`contract_reference.attention`), bit for bit on eager kernels.
"""

from __future__ import annotations

import pytest
import torch

import contract_reference as ref
import rla_compile

transformers = pytest.importorskip("transformers")
from rla_compile.tiny import tiny_causal_lm  # noqa: E402

FAMILIES = ["llama", "qwen3", "gemma2", "olmo"]  # OLMo: q and k rounded from fp32 RoPE just before attention
IMPLEMENTATIONS = ["eager", "sdpa"]
VARIANTS = {
    ("llama", "eager"): {"eager, add mask, grouped"},
    ("qwen3", "eager"): {"eager, add mask, grouped"},
    ("gemma2", "eager"): {"eager, soft-capped, add mask, grouped"},
    ("olmo", "eager"): {"eager, add mask, grouped"},
    **{(family, "sdpa"): {"sdpa, bool mask, grouped"} for family in FAMILIES},  # HF's sdpa ignores soft-capping
}


from hf_reference import contract_attention  # noqa: E402  (registers rla_contract_eager / _sdpa)


def _model(family: str, implementation: str):
    # Gemma 2: soft-capped scores (its default cap, 50) and sliding-window layers shorter than the input
    model = tiny_causal_lm(family, **({"sliding_window": 6} if family == "gemma2" else {})).eval()
    model.set_attn_implementation(implementation)
    return model


def _ids():
    return torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def _compiled_logits(model, sites):
    backend = rla_compile.Backend(compiler="aot_eager", sites=sites)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            logits = torch.compile(model, backend=backend)(_ids(), use_cache=False).logits
    finally:
        torch._dynamo.reset()
    return logits, backend.reports


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_is_rewritten_and_equals_the_contract_reference(family, implementation):
    model = _model(family, implementation)
    every, reports = _compiled_logits(model, [*rla_compile.DEFAULT_SITES, "attention"])
    layers = model.config.num_hidden_layers
    assert sum(r.count("attention", "rewritten") for r in reports) == layers, "\n".join(map(str, reports))
    variants = {s.variant for r in reports for s in r.sites if s.kind == "attention"}
    assert variants == VARIANTS[family, implementation], variants
    # with the other sites: attention reads q and k as RoPE's site rounded them (the bf16 the
    # engine caches), not RoPE's fp32 value from before its rounding
    model.set_attn_implementation(f"rla_contract_{implementation}")
    others, _ = _compiled_logits(model, list(rla_compile.DEFAULT_SITES))
    model.set_attn_implementation(implementation)
    assert torch.equal(every, others)

    got, reports = _compiled_logits(model, ["attention"])
    assert sum(r.count("attention", "rewritten") for r in reports) == layers
    with torch.no_grad():
        stock = model(_ids(), use_cache=False).logits
        model.set_attn_implementation(f"rla_contract_{implementation}")
        want = model(_ids(), use_cache=False).logits
    assert torch.equal(got, want)
    assert not torch.equal(got, stock)  # the stock attention rounds elsewhere: the comparison can fail


def test_attention_is_opt_in():
    model = _model("llama", "sdpa")
    _, reports = _compiled_logits(model, list(rla_compile.DEFAULT_SITES))
    assert all(r.count("attention") == 0 for r in reports)
    assert not any(m.kind == "attention" for r in reports for m in r.near_misses)


def _training_step(model, compiled=None):
    """Logits and every parameter's gradient after one cross-entropy step."""
    model.zero_grad()
    ids = _ids()
    logits = (compiled if compiled is not None else model)(ids, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_equals_the_contract_reference(family, implementation):
    """The backward is autograd's over the fp32 forward the site emits (the rewrite runs before
    AOTAutograd): every parameter's gradient equals the reference model's, bit for bit."""
    model = _model(family, implementation).train()
    backend = rla_compile.Backend(compiler="aot_eager", sites=["attention"])
    torch._dynamo.reset()
    try:
        got, got_grads = _training_step(model, torch.compile(model, backend=backend))
    finally:
        torch._dynamo.reset()
    assert sum(r.count("attention", "rewritten") for r in backend.reports) == model.config.num_hidden_layers
    model.set_attn_implementation(f"rla_contract_{implementation}")
    want, want_grads = _training_step(model)
    assert torch.equal(got, want)
    assert sorted(got_grads) == sorted(want_grads)
    assert [n for n in want_grads if not torch.equal(got_grads[n], want_grads[n])] == []


def test_training_step_with_every_site_equals_the_contract_reference():
    """With the default sites too, every gradient equals the model's with the default sites and
    the reference attention: q's and k's gradients pass RoPE's rounding, as its output did."""
    model = _model("qwen3", "eager").train()
    grads = []
    for implementation, sites in (("eager", [*rla_compile.DEFAULT_SITES, "attention"]),
                                  ("rla_contract_eager", list(rla_compile.DEFAULT_SITES))):
        model.set_attn_implementation(implementation)
        torch._dynamo.reset()
        try:
            backend = rla_compile.Backend(compiler="aot_eager", sites=sites)
            grads.append(_training_step(model, torch.compile(model, backend=backend)))
        finally:
            torch._dynamo.reset()
    (got, got_grads), (want, want_grads) = grads
    assert torch.equal(got, want)
    assert [n for n in want_grads if not torch.equal(got_grads[n], want_grads[n])] == []


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_dynamic_shapes(implementation):
    """torch.compile(dynamic=True): the scale becomes a run-time float and repeat_kv's group
    count a symbolic size; the site reads both from the graph (the norms are not found there:
    their eps is symbolic too, which the RMSNorm matcher does not take)."""
    model = _model("llama", implementation)
    backend = rla_compile.Backend(compiler="aot_eager", sites=["attention"])
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            got = torch.compile(model, backend=backend, dynamic=True)(_ids(), use_cache=False).logits
    finally:
        torch._dynamo.reset()
    assert {(s.variant, s.status) for r in backend.reports for s in r.sites if s.kind == "attention"} == {
        ({"eager": "eager, add mask", "sdpa": "sdpa, bool mask"}[implementation] + ", grouped", "rewritten")}
    model.set_attn_implementation(f"rla_contract_{implementation}")
    with torch.no_grad():
        assert torch.equal(got, model(_ids(), use_cache=False).logits)


def test_the_attention_sweep_table_is_current_and_no_family_is_silent():
    """docs/coverage.md's attention table is the committed sweep's (benchmarks/attention_sweep.py),
    and in it every family's attention is rewritten or reported: none silent."""
    import json

    from benchmarks import attention_sweep as sweep

    data = json.loads(sweep.DEFAULT_JSON.read_text())
    assert sweep.section(data) in sweep.DOCS.read_text(), (
        "docs/coverage.md is stale: python -m benchmarks.attention_sweep --from-json " + str(sweep.DEFAULT_JSON))
    assert data["summary"]["silent"] == [] and data["summary"]["outcomes"]["exact"] > 0


@pytest.mark.parametrize("family", ["llama", "bloom"])
def test_the_attention_sweep_reruns_as_committed(family):
    """The sweep re-run here for a family aligned bit for bit (Llama) and one reported as a near
    miss (BLOOM: its probabilities reshaped before P · V): as the committed results say."""
    import json

    from benchmarks import attention_sweep as sweep

    committed = {r["family"]: r for r in json.loads(sweep.DEFAULT_JSON.read_text())["results"]}[family]
    again = sweep.run_family(family)
    for key in ("outcome", "calls", "rewritten", "near_misses", "variants", "differing_logits"):
        assert again[key] == committed[key], key
