"""Coverage across model families and hand-written models (docs/coverage.md).

For every model: the sites its config implies are found in training and in inference, every
one is rewritten or reported already aligned, and the aligned model equals the same model
run eagerly with its sites replaced by the contract reference — logits and every parameter
gradient, bit for bit on eager kernels (`compiler="aot_eager"`)."""

from __future__ import annotations

import json

import pytest
import torch
from torch._inductor import config as inductor_config

import contract_reference as ref
import handwritten
import rla_compile
from gradients import assert_same_parameters, mismatches, step
from coverage_table import DOC, Coverage, collect, split, table
from hf_reference import contract_sites
from once import once_per_run
from rla_compile.report import GraphReport
from zoo import LOOP_EXPERTS, entries, tokens

pytest.importorskip("transformers")

ENTRIES = entries()
HF_REFERENCE = [e for e in ENTRIES if e.family == "hf" and e.name not in LOOP_EXPERTS]


class _Collected:
    """Each entry's reports, collected once per run and shared by the workers as JSON, one file
    per entry: the first worker to need an entry collects it, so the two workers collect
    different entries at once (one file for all of them kept one worker idle for 75 s)."""

    def __init__(self, tmp_path_factory):
        self.factory, self.found = tmp_path_factory, {}

    def __getitem__(self, name: str) -> Coverage:
        if name not in self.found:
            entry = next(e for e in ENTRIES if e.name == name)

            def build(path):
                c = collect(entry)
                path.write_text(json.dumps({"train": [r.to_dict() for r in c.train],
                                            "infer": [r.to_dict() for r in c.infer]}))

            data = json.loads(once_per_run(self.factory, f"coverage_{name}.json", build).read_text())
            self.found[name] = Coverage(entry, [GraphReport.from_dict(d) for d in data["train"]],
                                        [GraphReport.from_dict(d) for d in data["infer"]])
        return self.found[name]


@pytest.fixture(scope="module")
def coverage(tmp_path_factory):
    return _Collected(tmp_path_factory)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.name not in LOOP_EXPERTS], ids=lambda e: e.name)
def test_sites_match_the_config(coverage, entry):
    c = coverage[entry.name]
    assert c.counts(c.train) == entry.expected
    assert c.counts(c.infer) == entry.expected
    assert {status for _, status in c.statuses()} <= {"rewritten", "already_aligned"}


@pytest.mark.parametrize("name", list(LOOP_EXPERTS))
def test_graph_breaks_inside_experts_are_partial_sites(coverage, name):
    c = coverage[name]
    assert c.counts(c.train)["swiglu"] == 0
    assert any("graph break splits it" in p for p in c.partial())
    assert {status for _, status in c.statuses()} <= {"rewritten", "already_aligned"}


def test_docs_table_is_current(coverage):
    assert split(DOC.read_text())[0] == table([coverage[e.name] for e in ENTRIES]), (
        "docs/coverage.md is stale: python tests/support/coverage_table.py --write docs/coverage.md"
    )


def _train(model, ids, backend=None):
    return step(model, ids, backend, hf=not isinstance(model, handwritten.Decoder))


@pytest.mark.parametrize("name", list(handwritten.HANDWRITTEN))
def test_handwritten_model_equals_contract_reference(name):
    model, ids = handwritten.build(name), tokens()
    backend = rla_compile.Backend(compiler="aot_eager")
    got = _train(model, ids, backend)
    model.forward = model.forward_contract
    reference = _train(model, ids)
    assert mismatches(got, reference) == 0
    statuses = {(s.kind, s.status) for s in backend.reports[0].sites}
    assert statuses == set(handwritten.STATUSES[name].items())


def test_handwritten_model_under_inductor_pinned():
    model, ids = handwritten.build("nanogpt-swiglu"), tokens()
    with inductor_config.patch(emulate_precision_casts=True):
        got = _train(model, ids, rla_compile.Backend(pin_rounding=True))
    model.forward = model.forward_contract
    reference = _train(model, ids)
    assert_same_parameters(got, reference)
    assert torch.equal(got["logits"], reference["logits"])  # logits bit for bit
    ref.within_one_ulp([got[k] for k in reference if k != "logits"], [v for k, v in reference.items() if k != "logits"])


@pytest.mark.parametrize("entry", HF_REFERENCE, ids=lambda e: e.name)
def test_hf_family_equals_contract_reference(entry):
    """Every site, residual and MoE experts included: tests/support/hf_reference.py."""
    model, ids = entry.build(), tokens()
    got = _train(model, ids, rla_compile.Backend(compiler="aot_eager"))
    torch._dynamo.reset()
    with contract_sites(model):
        reference = _train(model, ids)
    assert mismatches(got, reference) == 0
    assert mismatches(_train(model, ids), reference) > 0  # as written, the model rounds elsewhere


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_moe_sites_equal_contract_reference(name):
    """The router and expert-combine sites in a whole MoE model, trained one step: logits and
    every parameter's gradient (the router's weight too) bit for bit against the model run
    eagerly with its sites, router included, replaced by the contract reference."""
    entry = next(e for e in ENTRIES if e.name == name)
    model, ids = entry.build(), tokens()
    sites = [*rla_compile.DEFAULT_SITES, "router", "expert_combine"]
    got = _train(model, ids, rla_compile.Backend(compiler="aot_eager", sites=sites))
    torch._dynamo.reset()
    with contract_sites(model, kinds=("rmsnorm", "swiglu", "rope", "router")):
        reference = _train(model, ids)
    assert mismatches(got, reference) == 0
    without = _train(model, ids, rla_compile.Backend(compiler="aot_eager"))  # the default sites only
    assert mismatches(without, reference) > 0


# Not the MoE families: Inductor's backward of the experts' grouped matmuls differs from eager
# already without rla (mixtral: 23787 of one expert weight gradient's elements), outside the sites.
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_hf_family_under_inductor_pinned(name):
    entry = next(e for e in ENTRIES if e.name == name)
    model, ids = entry.build(), tokens()
    with inductor_config.patch(emulate_precision_casts=True):
        got = _train(model, ids, rla_compile.Backend(pin_rounding=True))
    torch._dynamo.reset()
    with contract_sites(model):
        reference = _train(model, ids)
    assert_same_parameters(got, reference)
    ref.within_one_ulp([got[k] for k in reference], list(reference.values()))


# The MoE families take 35-45 s each here (their grouped-matmul fallback): in `tox -e slow`.
FP32_PLAIN = [pytest.param(e, marks=pytest.mark.slow) if e.name in ("qwen3_moe", "mixtral", "deepseek_v3") else e
              for e in ENTRIES if e.name not in LOOP_EXPERTS]


@pytest.mark.parametrize("entry", FP32_PLAIN, ids=lambda e: e.name)
def test_fp32_model_equals_plain_compilation(entry):
    """The guard against lost gradients where no site is involved: in fp32 no site has a
    rounding to move, so rla's graph must train exactly as plain compilation's, with the same
    parameters getting gradients (in bf16 the contract tests above check the same set)."""
    model, ids = entry.build().float(), tokens()
    got = _train(model, ids, rla_compile.Backend(compiler="aot_eager"))
    torch._dynamo.reset()
    assert mismatches(got, _train(model, ids, "aot_eager")) == 0
