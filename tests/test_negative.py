"""What must not be rewritten (graphs without sites, look-alikes, fp32 models), and bad input:
integers, mixed dtypes, fp32 weights, fp16 models, invalid options (docs/reliability.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import contract_reference as ref
import rla_compile
from models import expected_sites, tiny_causal_lm
from site_cases import norm_llama

X = torch.randn(4, 16, 64).bfloat16()
Y = torch.randn(4, 16, 64).bfloat16()
Z = torch.randn(4, 16, 64).bfloat16()


def no_sites(x, w):
    return (x @ w).relu() + 1


def rsqrt_not_a_norm(x):  # rsqrt of something that is not mean(x^2)
    return x * torch.rsqrt(x.abs() + 1)


def rms_over_wrong_dim(x):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(0, keepdim=True) + 1e-6)).to(x.dtype)


def times_rms(x):  # scales by the RMS: a bare sqrt multiplied in does not normalise
    return x * torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def layernorm_by_hand(x):  # mean-centred: a LayerNorm, not an RMSNorm
    xf = x.float()
    c = xf - xf.mean(-1, keepdim=True)
    return (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def cat_not_a_rotation(x):  # negates the wrong half
    h = x.shape[-1] // 2
    return x * 2 + torch.cat((-x[..., :h], x[..., h:]), dim=-1) * 3


def rotation_not_added(x, c, s):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1) * s, x * c


def silu_not_gated(x):
    return F.silu(x) * x


def sigmoid_gate(a, b):  # Qwen3-Next's output gate: a * sigmoid(b) is not SiLU
    return a * torch.sigmoid(b)


W = (1 + 0.2 * torch.randn(64)).bfloat16()


def weight_outside_a_shared_norm(x, w):  # the rounded norm also leaves the graph: its weight
    xf = x.float()                          # multiply cannot join the site, and rounds on its own
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    return y * w, y


NEAR_MISSES = [
    (weight_outside_a_shared_norm, (X, W), "rmsnorm", "scaled by a per-channel weight"),
    (rsqrt_not_a_norm, (X,), "rmsnorm", "not a mean or sum/D"),
    (rms_over_wrong_dim, (X,), "rmsnorm", "not the last dim"),
    (layernorm_by_hand, (X,), "rmsnorm", "LayerNorm"),
    (times_rms, (X,), "rmsnorm", "not multiplied by its own input"),
    (cat_not_a_rotation, (X,), "rope", "not a rotation"),
    (rotation_not_added, (X, Y, Z), "rope", "not added to x * cos"),
    (silu_not_gated, (X,), "swiglu", "not gated"),
    (sigmoid_gate, (X, Y), "swiglu", "a gate, not SiLU"),
]


def half_scaled_not_negated(x, c, s):  # cat((x2 * 0.5, x1)): a swap with a scale is not rotate_half
    h = x.shape[-1] // 2
    return x * c + torch.cat((x[..., h:] * 0.5, x[..., :h]), dim=-1) * s


def half_added_not_negated(x, c, s):  # cat((x2 + 1, x1))
    h = x.shape[-1] // 2
    return x * c + torch.cat((x[..., h:] + 1, x[..., :h]), dim=-1) * s


@pytest.mark.parametrize("fn", [half_scaled_not_negated, half_added_not_negated], ids=lambda f: f.__name__)
def test_rope_lookalike_without_negation_is_left_alone(fn):
    result = rla_compile.align_function(fn, X, Y, Z)
    assert result.report.sites == [], str(result.report)
    assert result.after == result.before


def test_graph_without_sites_is_unchanged():
    w = torch.randn(64, 64).bfloat16()
    result = rla_compile.align_function(no_sites, X, w)
    assert result.report.sites == [] and result.report.near_misses == []
    assert result.after == result.before


@pytest.mark.parametrize("fn,args,kind,reason", NEAR_MISSES, ids=[f.__name__ for f, *_ in NEAR_MISSES])
def test_near_miss_is_reported_not_rewritten(fn, args, kind, reason):
    result = rla_compile.align_function(fn, *args)
    assert result.report.sites == [], str(result.report)
    assert result.after == result.before
    assert [m.kind for m in result.report.near_misses] == [kind], str(result.report)
    assert reason in result.report.near_misses[0].reason


def _tiny_llama_under_rla(dtype: torch.dtype):
    """A tiny Llama in `dtype`, 8 tokens, its logits under rla (aot_eager) and the one report."""
    model = tiny_causal_lm("llama", dtype=dtype)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    backend = rla_compile.Backend(compiler="aot_eager")
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(ids, use_cache=False).logits
    torch._dynamo.reset()
    (report,) = backend.reports
    return model, ids, got, report


def test_fp32_model_has_nothing_to_align():
    pytest.importorskip("transformers")
    model, ids, got, report = _tiny_llama_under_rla(torch.float32)
    with torch.no_grad():
        plain = torch.compile(model, backend="aot_eager")(ids, use_cache=False).logits
    assert report.note == "nothing to align: activations are float32"
    assert report.counts() == expected_sites(model.config)
    assert {s.status for s in report.sites} == {"already_aligned"}
    assert "nothing to align" in str(report)
    assert torch.equal(got, plain)  # nothing changed: bit for bit the plain aot_eager compile


def norm_of_rounded(x, w):  # found by the fuzzer: the rounding before the norm's upcast was removed
    t = (x.float() * 3).to(x.dtype)
    return norm_llama(t, w)


def test_rounding_before_a_site_is_not_the_sites():
    """A site reads its input as rounded by the code before it: `t.to(bf16).float()` is the
    rounded t. Only the site's own casts are removed (eager kernels: bit for bit)."""
    w = (1 + 0.2 * torch.randn(64)).bfloat16()
    backend = rla_compile.Backend(compiler="aot_eager")
    got = torch.compile(norm_of_rounded, backend=backend, fullgraph=True)(X, w)
    assert backend.reports[0].count("rmsnorm", "rewritten") == 1
    assert torch.equal(got, ref.rmsnorm((X.float() * 3).to(X.dtype), w))


# -- bad input: each gets the documented behaviour (docs/reliability.md) --------------------
def _aot_eager(fn, *args, **options):
    backend = rla_compile.Backend(compiler="aot_eager", **options)
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    (report,) = backend.reports
    return out, report


def test_integer_graph_has_nothing_to_align():
    a, b = torch.arange(12).view(3, 4), torch.arange(4)
    got, report = _aot_eager(lambda a, b: (a * b + 3) // 2, a, b)
    assert torch.equal(got, (a * b + 3) // 2)
    assert report.sites == [] and report.note == "nothing to align: no floating-point values"


def _swiglu(g, u):
    return F.silu(g) * u


def test_mixed_bf16_fp16_site_is_aligned_with_a_note():
    """bf16 * fp16 promotes to fp32 in eager: the site upcasts both inputs, computes in fp32
    and keeps the fp32 output dtype (nothing to round to)."""
    g, u = X, Y.half()
    got, report = _aot_eager(_swiglu, g, u)
    (site,) = report.sites
    assert (site.kind, site.status) == ("swiglu", "rewritten")
    assert "mixed bfloat16 and float16 inputs" in site.reason
    assert got.dtype == torch.float32
    assert torch.equal(got, ref.gated(g.float(), u.float()))
    assert not torch.equal(got, _swiglu(g, u))  # eager rounds silu(g) to bf16 first


def test_mixed_dtypes_under_inductor():
    """The same site through Inductor: compiles and keeps the fp32 output; Inductor's fp32
    sigmoid may differ from eager's in the last fp32 bit, hence the fp32-ulp tolerance."""
    g, u = X, Y.half()
    backend = rla_compile.Backend()
    got = torch.compile(_swiglu, backend=backend, fullgraph=True)(g, u)
    assert backend.reports[0].count("swiglu", "rewritten") == 1
    torch.testing.assert_close(got, ref.gated(g.float(), u.float()), rtol=2e-7, atol=1e-6)


def test_fp32_norm_weight_with_bf16_activations():
    """`_keep_in_fp32_modules`-style: the weight stays fp32, the activations are bf16. The
    site is rewritten; `w * y.to(bf16)` promotes, so its output is fp32, not rounded."""
    w = 1 + 0.2 * torch.randn(64)
    got, report = _aot_eager(norm_llama, X, w)
    (site,) = report.sites
    assert (site.kind, site.status, site.dtype) == ("rmsnorm", "rewritten", "bfloat16")
    assert got.dtype == torch.float32
    assert torch.equal(got, ref.rmsnorm(X, w, out_dtype=torch.float32))


def test_fp32_function_is_unchanged_bit_for_bit():
    x, w = X.float(), 1 + 0.2 * torch.randn(64)
    got, report = _aot_eager(norm_llama, x, w)
    assert report.note == "nothing to align: activations are float32"
    assert [(s.kind, s.status) for s in report.sites] == [("rmsnorm", "already_aligned")]
    torch._dynamo.reset()
    plain = torch.compile(norm_llama, backend="aot_eager", fullgraph=True)(x, w)
    assert torch.equal(got, plain)


def test_no_sites_selected_skips_every_site():
    got, report = _aot_eager(_swiglu, X, Y, sites=[])
    assert [(s.kind, s.status) for s in report.sites] == [("swiglu", "skipped")]
    assert "'swiglu' is not in options.sites" in report.sites[0].reason
    assert torch.equal(got, _swiglu(X, Y))


def test_fp16_model_is_aligned():
    pytest.importorskip("transformers")
    from hf_reference import contract_sites

    model, ids, got, report = _tiny_llama_under_rla(torch.float16)
    with torch.no_grad(), contract_sites(model):
        want = model(ids, use_cache=False).logits
    assert report.counts() == expected_sites(model.config)
    assert {(s.status, s.dtype) for s in report.sites} == {("rewritten", "float16")}
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "options,message",
    [
        ({"sites": [1, "rope"]}, "option 'sites' takes site names (strings), got 1"),
        ({"sites": [["rope"]]}, "option 'sites' takes site names (strings), got ['rope']"),
        ({"inductor": {"max_autotun": True}}, "unknown Inductor setting(s) 'max_autotun' in option 'inductor'"),
        ("rope", "rla options must be a dict of option names to values, got 'rope'"),
    ],
    ids=["site-not-a-string", "site-unhashable", "unknown-inductor-setting", "options-not-a-dict"],
)
def test_invalid_options_fail_before_compiling(options, message):
    """Through torch.compile the error surfaces at the first call, before any tracing by
    Inductor, naming the option; Options.from_dict raises the same OptionError directly."""
    with pytest.raises(rla_compile.OptionError) as direct:
        rla_compile.Options.from_dict(options)
    assert message in str(direct.value)
    with pytest.raises(Exception) as through_compile:
        torch.compile(lambda x: x + 1, backend="rla", options=options)(torch.ones(2))
    assert f"OptionError: {message}" in str(through_compile.value)


def test_unknown_mode_names_the_valid_ones():
    with pytest.raises(Exception) as error:
        torch.compile(lambda x: x + 1, backend="rla", mode="fastest")(torch.ones(2))
    assert "Unrecognized mode=fastest" in str(error.value) and "max-autotune" in str(error.value)


def rotation_by_flip(x, inv_freq, positions):  # x*cos + flip(x)*sin: no RoPE spelling covers it
    angles = positions[:, None].float() * inv_freq[None, :]
    return x * angles.cos().to(x.dtype) + x.flip(-1) * angles.sin().to(x.dtype)


def test_unrecognised_rotation_by_position_tables_is_a_near_miss():
    """A bf16 activation times tables computed from positions, with no RoPE matched: said, per
    product, not silently left unaligned."""
    result = rla_compile.align_function(rotation_by_flip, X, torch.rand(64), torch.arange(16))
    assert result.report.sites == [], str(result.report)
    misses = result.report.near_misses
    assert misses and {m.kind for m in misses} == {"rope"}, str(result.report)
    assert all("no RoPE spelling matched" in m.reason for m in misses)


def test_matched_rope_leaves_no_position_table_near_miss():
    model, _, _, report = _tiny_llama_under_rla(torch.bfloat16)
    assert report.count("rope", "rewritten") == 4 and not report.near_misses, str(report)


def test_rope_tables_from_rounded_frequencies_are_noted():
    """`model.to(torch.bfloat16)` rounds HF's fp32 inv_freq; loading with dtype= does not. The
    rope sites say where their tables came from, and how to load the model instead."""
    loaded = tiny_causal_lm("llama")  # from_config(dtype=bf16): inv_freq stays fp32
    cast = tiny_causal_lm("llama").to(torch.bfloat16)
    assert loaded.model.rotary_emb.inv_freq.dtype == torch.float32
    assert cast.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    notes = []
    for model in (loaded, cast):
        backend = rla_compile.Backend(compiler="aot_eager")
        with torch.no_grad():
            torch.compile(model, backend=backend)(ids, use_cache=False)
        torch._dynamo.reset()
        notes.append([s.reason for s in backend.reports[0].sites if s.kind == "rope"])
    assert len(notes[0]) == 4 and not any("inv_freq" in r for r in notes[0]), notes[0]
    assert len(notes[1]) == 4 and all("model.to(torch.bfloat16) rounded the fp32 inv_freq" in r for r in notes[1]), notes[1]


# -- attention (opt-in) --------------------------------------------------------------------------
Q, K, V = (torch.randn(2, 4, 16, 32).bfloat16() for _ in range(3))
H = torch.randn(2, 16, 64).bfloat16()
VOCAB = torch.randn(96, 64).bfloat16()
ATTENTION = [*rla_compile.DEFAULT_SITES, "attention"]


def sampling_probabilities(h, w):  # softmax over logits: a matmul before it, none after
    return torch.softmax(F.linear(h, w).float() / 0.7, dim=-1)


def softmax_weighting_inputs(x, v):  # softmax(x) @ v with no q·kᵀ behind x
    return torch.softmax(x.float(), dim=-1).to(x.dtype) @ v


def matmuls_without_softmax(q, k, v):
    return (q @ k.transpose(-2, -1)) @ v


@pytest.mark.parametrize("fn,args", [(sampling_probabilities, (H, VOCAB)), (softmax_weighting_inputs, (Q[..., :16], V)),
                                     (matmuls_without_softmax, (Q, K, V))], ids=lambda f: getattr(f, "__name__", ""))
def test_attention_lookalike_is_left_alone(fn, args):
    result = rla_compile.align_function(fn, *args, sites=ATTENTION)
    assert result.report.count("attention") == 0, str(result.report)
    assert not [m for m in result.report.near_misses if m.kind == "attention"], str(result.report)


def sdpa_with_dropout(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)


def eager_with_dropout(q, k, v):
    p = torch.softmax((q @ k.transpose(-2, -1)) * 0.125, dim=-1)
    return F.dropout(p, p=0.1, training=True) @ v


def weights_returned(q, k, v):  # HF's output_attentions: the probabilities leave the site
    p = torch.softmax((q @ k.transpose(-2, -1)) * 0.125, dim=-1)
    return p @ v, p


ATTENTION_NEAR_MISSES = [
    (sdpa_with_dropout, "dropout_p=0.1"),
    (eager_with_dropout, "dropout(p=0.1)"),
    (weights_returned, "read outside the site"),
]


@pytest.mark.parametrize("fn,reason", ATTENTION_NEAR_MISSES, ids=[f.__name__ for f, _ in ATTENTION_NEAR_MISSES])
def test_attention_near_miss_is_reported_not_rewritten(fn, reason):
    torch.manual_seed(0)
    result = rla_compile.align_function(fn, Q, K, V, sites=ATTENTION)
    assert result.report.count("attention") == 0, str(result.report)
    misses = [m for m in result.report.near_misses if m.kind == "attention"]
    assert len(misses) == 1 and reason in misses[0].reason, str(result.report)
    assert result.after == result.before


def test_attention_near_misses_only_when_asked_for():
    result = rla_compile.align_function(sdpa_with_dropout, Q, K, V)
    assert result.report.near_misses == []


def test_flex_attention_is_a_near_miss_with_the_reason():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def soft_capped(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / 50.0) * 50.0

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def flex(q, k, v, block_mask):
        return flex_attention(q, k, v, score_mod=soft_capped, block_mask=block_mask)

    # the block mask made outside: built inside the graph, its vmap does not re-trace (pre-dispatch)
    block_mask = create_block_mask(causal, None, None, 16, 16, device="cpu")
    result = rla_compile.align_function(flex, Q, K, V, block_mask, sites=ATTENTION)
    (miss,) = [m for m in result.report.near_misses if m.kind == "attention"]
    assert "flex_attention is not rewritten" in miss.reason and "score_mod" in miss.reason
    assert result.report.count("attention") == 0


class _DroppedAttention(torch.nn.Module):
    """Eager attention with dropout on the probabilities: aligned in eval, a near miss in training."""

    def forward(self, q, k, v):
        p = torch.softmax((q @ k.transpose(-1, -2)) * 0.25, -1, dtype=torch.float32).to(q.dtype)
        return F.dropout(p, 0.1, self.training) @ v


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _DroppedAttention()  # sites and near misses name their module: "attn"

    def forward(self, q, k, v):
        return self.attn(q, k, v)


def test_a_site_lost_in_a_recompile_is_a_warning_once(caplog):
    """A site the first graph aligned and a recompiled graph of the same module misses: the user
    hears of it at warning level, with the reason, once (not once per graph or step)."""
    module = _Block().eval()
    backend = rla_compile.Backend(compiler="aot_eager", sites=ATTENTION)
    compiled = torch.compile(module, backend=backend)
    torch._dynamo.reset()
    with caplog.at_level("WARNING", logger="rla_compile"):
        compiled(Q, K, V)
        assert not caplog.records  # aligned: nothing to say
        module.train()
        for _ in range(2):
            compiled(Q, K, V)
        module.eval()
        compiled(Q, K, V)
    torch._dynamo.reset()
    assert [r.count("attention", "rewritten") for r in backend.reports][:2] == [1, 0]
    lost = [r.getMessage() for r in caplog.records if "aligned in an earlier graph" in r.getMessage()]
    assert len(lost) == 1, lost
    assert "the attention site in" in lost[0] and "dropout(p=0.1) on the probabilities in training" in lost[0]
