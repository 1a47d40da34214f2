"""Coverage of models written by other training frameworks (tests/support/frameworks.py): litgpt,
torchtune, torchtitan and OLMo-core, built from their own code at tiny sizes
(`tox -e frameworks` installs them beside the pinned torch; docs/coverage.md).

For every model: the sites its architecture implies are found in training and inference, all
rewritten or already aligned, no near miss; logits and every parameter gradient equal the
same model run eagerly with its sites replaced by the contract reference
(tests/support/framework_reference.py), bit for bit on eager kernels; the model as written differs
from that reference; and Inductor with rounding pinned gives the logits rla gives on eager
kernels (the strategy invariance).
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor import config as inductor_config

import frameworks
import rla_compile
from framework_reference import contract_sites
from gradients import mismatches, step

pytestmark = pytest.mark.frameworks

MODELS = frameworks.models()


def _model(entry):
    reason = frameworks.missing(entry.framework)
    if reason is not None:
        pytest.skip(reason)
    return entry.build()


def _ids():
    return torch.randint(0, frameworks.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def _train(model, backend=None):
    return step(model, _ids(), backend, hf=False)


def _counts(report):
    return {kind: n for kind, n in report.counts().items() if n}


@pytest.mark.parametrize("entry", MODELS, ids=lambda e: e.name)
def test_sites_match_the_architecture(entry):
    model = _model(entry)
    train = rla_compile.Backend(compiler="aot_eager")
    torch.compile(model, backend=train)(_ids())
    torch._dynamo.reset()
    infer = rla_compile.Backend(compiler="aot_eager")
    with torch.no_grad():
        torch.compile(model, backend=infer)(_ids())
    for backend in (train, infer):
        (report,) = backend.reports
        assert _counts(report) == entry.expected, str(report)
        assert {s.status for s in report.sites} <= {"rewritten", "already_aligned"}, str(report)
        assert not report.near_misses, str(report)


@pytest.mark.parametrize("entry", MODELS, ids=lambda e: e.name)
def test_equals_contract_reference(entry):
    model = _model(entry)
    got = _train(model, rla_compile.Backend(compiler="aot_eager"))
    torch._dynamo.reset()
    with contract_sites(model):
        reference = _train(model)
    assert mismatches(got, reference) == 0
    assert mismatches(_train(model), reference) > 0  # as written, the model rounds elsewhere


@pytest.mark.parametrize("entry", MODELS, ids=lambda e: e.name)
def test_fp32_model_equals_plain_compilation(entry):
    """The guard against lost gradients where no site is involved (test_coverage.py's, for the
    peer frameworks' models): in fp32, rla trains exactly as plain compilation."""
    model = _model(entry).float()
    got = _train(model, rla_compile.Backend(compiler="aot_eager"))
    torch._dynamo.reset()
    assert mismatches(got, _train(model, "aot_eager")) == 0


@pytest.mark.parametrize("entry", MODELS, ids=lambda e: e.name)
def test_inductor_pinned_gives_the_eager_kernels_logits(entry):
    model = _model(entry)
    expected = _train(model, rla_compile.Backend(compiler="aot_eager"))["logits"]
    torch._dynamo.reset()
    with inductor_config.patch(emulate_precision_casts=True, fx_graph_cache=False):
        got = _train(model, rla_compile.Backend(pin_rounding=True))["logits"]
    assert int((got != expected).sum()) == 0


def test_litgpt_qwen3_at_a_larger_size_is_invariant():
    """The shape at which the two strategies once differed (33 logits of one row: its q/k norms
    are already aligned, and Inductor computed their mean with its own reduction order)."""
    if frameworks.missing("litgpt"):
        pytest.skip(frameworks.missing("litgpt"))
    from litgpt import GPT, Config

    config = Config.from_name("Qwen3-0.6B", n_layer=4, n_embd=256, n_head=4, n_query_groups=2, head_size=64,
                              intermediate_size=512, padded_vocab_size=256, vocab_size=256, block_size=128)
    torch.manual_seed(0)
    model = GPT(config).to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    expected = torch.compile(model, backend=rla_compile.Backend(compiler="aot_eager"))(ids)
    torch._dynamo.reset()
    with inductor_config.patch(emulate_precision_casts=True, fx_graph_cache=False):
        got = torch.compile(model, backend=rla_compile.Backend(pin_rounding=True))(ids)
    assert int((got != expected).sum()) == 0


def test_docs_section_is_current():
    from coverage_table import DOC, collect, framework_table, split

    for entry in MODELS:
        if frameworks.missing(entry.framework):
            pytest.skip(frameworks.missing(entry.framework))
    assert split(DOC.read_text())[1] == framework_table([collect(m) for m in MODELS]), (
        "docs/coverage.md is stale: python tests/support/coverage_table.py --frameworks --write docs/coverage.md"
    )
