"""The attention site's chunked form (sites/attention/chunked.py): the contract one block of
query rows at a time, for long sequences.

Compared with the contract's eager fp32 reference (`contract_reference.attention`, written
independently): the output and q's gradient bit for bit at any block size; k's and v's
gradients (and a query-broadcast bias's), summed over the blocks in an fp32 order of their own,
bit for bit at one block and within 1 ulp on at most 1% of elements at many; a soft-cap's tanh
too (its vectorised kernel's scalar tail moves with the block's size). The site emits
the form above its budget and under dynamic shapes; the tests force it at small sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import contract_reference as ref
import rla_compile
from rla_compile.mismatch.metrics import ulp_distance
from rla_compile.sites.attention import chunked as attention_chunked
from site_cases import CASES

ATTENTION_CASES = [c for c in CASES if c.kind == "attention" and c.status == "rewritten"]


def _within_one_ulp(got, want):
    differ = got != want
    assert int(differ.sum()) <= max(1, got.numel() // 100)
    if differ.any():
        assert float(ulp_distance(got[differ], want[differ]).max()) <= 1


def _check(got, want, many_blocks: bool, exact: tuple[int, ...]):
    """Tensors at the `exact` indices bit for bit; the rest too at one block, else within 1 ulp."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if i in exact or not many_blocks:
            assert torch.equal(a, b), f"tensor {i}: {int((a != b).sum())} of {a.numel()} elements differ"
        else:
            _within_one_ulp(a, b)


@dataclass(frozen=True)
class Blocks:
    many: bool  # more than one block
    mib: float  # option attention_chunk_mib

    @property
    def budget(self) -> int:
        return int(self.mib * (1 << 20))


@pytest.fixture
def blocks(monkeypatch, request):
    """The chunked form forced at the small sizes of the tests: 1 block, or blocks of 8 rows
    (`MIN_ROWS` lowered to 8: the GEMM keeps its kernel from 4 rows on; measured)."""
    monkeypatch.setattr(attention_chunked, "CHUNK_ABOVE_BYTES", 0)
    monkeypatch.setattr(attention_chunked, "MIN_ROWS", 8)
    return Blocks(request.param == "many", 1024 if request.param == "one" else 0.0001)


def _qkv(dtype, batch=2, heads=4, kv_heads=2, tokens=36, size=16):
    torch.manual_seed(0)
    return [(torch.randn(batch, h, tokens, size) * 2).to(dtype) for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("blocks", ["one", "many"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mask", ["causal", "bias", "bias_per_batch", "keep", "softcap_bias"])
def test_op_equals_the_contract_reference(mask, dtype, blocks):
    q, k, v = _qkv(dtype)
    tokens, groups = q.shape[-2], q.shape[1] // k.shape[1]
    bias = keep = None
    if mask in ("bias", "softcap_bias"):
        bias = torch.randn(1, 1, tokens, tokens).to(dtype)
    elif mask == "bias_per_batch":  # broadcast over heads and queries: its gradient sums over the blocks
        bias = torch.randn(q.shape[0], 1, 1, tokens).to(dtype)
    elif mask == "keep":
        keep = torch.rand(q.shape[0], 1, tokens, tokens) > 0.3
        keep[..., 0] = True
    softcap = 5.0 if mask == "softcap_bias" else None
    inputs = [t.requires_grad_() for t in (q, k, v, *([bias] if bias is not None else []))]
    cotangent = torch.randn_like(q)

    def grads(out):
        return [out.detach(), *torch.autograd.grad(out, inputs, cotangent)]

    want = grads(ref.attention(q, k, v, mask=bias if keep is None else keep, causal=mask == "causal",
                               softcap=softcap, groups=groups))
    qf = q.float() / math.sqrt(q.shape[-1])
    kf, vf = (t.float().repeat_interleave(groups, 1) for t in (k, v))
    out = attention_chunked.attention(qf, kf, vf, None if bias is None else bias.float(),
                                      None if keep is None else ~keep, -math.inf, mask == "causal", softcap,
                                      blocks.budget)
    got = grads(out.to(dtype))
    # the output and q's gradient; soft-capped, not those either: ATen's tanh runs vectorised
    # over the whole tensor with a scalar tail, so the tail's elements depend on the block's size
    _check(got, want, blocks.many, exact=() if softcap else (0, 1))


def test_the_backward_keeps_no_scores():
    """What the op saves for its backward is q, k and v ([B, H, L, E]), never a [B, H, L, S]
    tensor (the contract's form keeps the fp32 probabilities)."""
    q, k, v = (t.float().requires_grad_() for t in _qkv(torch.bfloat16, heads=2, kv_heads=2, tokens=64, size=8))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        attention_chunked.attention(q, k, v, None, None, -math.inf, True, None)
    assert saved and max(math.prod(s) for s in saved) == q.numel(), saved


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("blocks", ["one", "many"], indirect=True)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: c.name)
def test_every_spelling_in_blocks_follows_the_contract(case, blocks, compiler):
    """Each attention spelling of test_sites.py, the site forced to its chunked form: the
    output equals the eager reference bit for bit under both compilers (the form is one extern
    op, eager kernels inside); the gradients bit for bit at one block, within 1 ulp at many."""
    backend = rla_compile.Backend(compiler=compiler, sites=["attention"], attention_chunk_mib=blocks.mib)
    torch._dynamo.reset()
    try:
        got = _run(torch.compile(case.fn, backend=backend, fullgraph=True), case)
    finally:
        torch._dynamo.reset()
    want = _run(case.reference, case)
    (report,) = backend.reports
    (site,) = [s for s in report.sites if s.kind == "attention"]
    assert site.status == "rewritten" and "blocks of query rows" in site.reason, str(report)
    _check(got, want, blocks.many, exact=(0,))


def _run(fn, case):
    args = case.inputs(torch.bfloat16)
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.manual_seed(1)
    cotangents = [torch.randn_like(o) for o in outs]
    return [o.detach() for o in outs] + list(torch.autograd.grad(outs, [args[i] for i in case.grads], cotangents))


def _site_reasons(fn, *args, dynamic=False):
    backend = rla_compile.Backend(compiler="aot_eager", sites=["attention"])
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    finally:
        torch._dynamo.reset()
    return [s.reason for r in backend.reports for s in r.sites if s.kind == "attention"]


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_small_static_shapes_keep_the_contracts_form():
    reasons = _site_reasons(_sdpa, *_qkv(torch.bfloat16, kv_heads=4))
    assert reasons and not any("blocks" in r for r in reasons), reasons


def test_scores_above_the_budget_take_the_chunked_form(monkeypatch):
    q, k, v = _qkv(torch.bfloat16, batch=1, heads=2, kv_heads=2, tokens=32)
    monkeypatch.setattr(attention_chunked, "CHUNK_ABOVE_BYTES", 2 * 32 * 32 * 4 - 1)  # one byte less than the scores
    assert all("blocks of query rows" in r for r in _site_reasons(_sdpa, q, k, v))


def test_dynamic_shapes_take_the_chunked_form():
    """Sizes known at run time only: the op decides its blocks when it runs."""
    def eager(q, k, v):
        return torch.softmax((q @ k.transpose(-1, -2)) * 0.25, -1, dtype=torch.float32).to(q.dtype) @ v
    q, k, v = _qkv(torch.bfloat16, kv_heads=4)
    reasons = _site_reasons(eager, q, k, v, dynamic=True)
    assert reasons and all("blocks of query rows" in r for r in reasons), reasons


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_causal_sdpa_at_varying_lengths_stays_aligned(compiler):
    """HF's default attention (SDPA with is_causal) in a loop of varying lengths: the first length
    compiles a static graph, the second a dynamic one, where the site takes the chunked form and
    the causal flag at run time. Every graph aligns it, and every length equals the reference.
    (It was a near miss from the second length on: the rest of a run on stock SDPA.)"""
    def causal(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    backend = rla_compile.Backend(compiler=compiler, sites=["attention"])
    torch._dynamo.reset()
    compiled = torch.compile(causal, backend=backend)
    for tokens in (17, 40, 23):
        q, k, v = _qkv(torch.bfloat16, batch=2, heads=4, kv_heads=4, tokens=tokens)
        got = compiled(q, k, v)
        assert torch.equal(got, ref.attention(q, k, v, causal=True)), tokens
    torch._dynamo.reset()
    assert len(backend.reports) == 2  # a static graph, then a dynamic one that serves every later length
    assert [r.count("attention", "rewritten") for r in backend.reports] == [1, 1]
    assert "blocks of query rows" in backend.reports[1].sites[0].reason


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("form", ["whole", "chunked", "vllm_cpu_vec"])
def test_left_padded_rows_attend_to_nothing_as_sdpa(form, compiler):
    """Left padding under SDPA's bool mask (HF's default attention on a padded batch, as TRL
    scores completions): a query row whose every key is masked is 0, as SDPA computes it, with a
    gradient of 0. It was softmax's 0/0: NaN in the padded rows, which the backward spread to
    every weight (TRL GRPO with every site: after one step the policy emitted only EOS)."""
    q, k, v = (t.requires_grad_() for t in _qkv(torch.bfloat16, heads=4, kv_heads=4, tokens=24))
    pad = 5  # the second sequence is left-padded by 5 tokens
    keys = torch.ones(2, 24, dtype=torch.bool)
    keys[1, :pad] = False
    mask = torch.ones(24, 24, dtype=torch.bool).tril() & keys[:, None, None, :]  # [2, 1, 24, 24]

    def padded(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    rounding = {"attention": "vllm_cpu_vec"} if form == "vllm_cpu_vec" else {}
    backend = rla_compile.Backend(compiler=compiler, sites=["attention"], rounding=rounding)
    weights = torch.randn(2, 4, 24, 16)

    def run(q, k, v, mask, weights):
        torch._dynamo.reset()
        out = torch.compile(padded, backend=backend, dynamic=form == "chunked")(q, k, v, mask)
        torch._dynamo.reset()
        return out, torch.autograd.grad((out.float() * weights).sum(), (q, k, v))

    got, grads = run(q, k, v, mask, weights)
    report = backend.reports[0]
    assert report.count("attention", "rewritten") == 1, report
    assert ("blocks of query rows" in report.sites[0].reason) == (form == "chunked")
    stock = padded(q, k, v, mask)
    assert torch.equal(stock[1, :, :pad], torch.zeros_like(stock[1, :, :pad]))  # what SDPA computes there
    assert torch.equal(got[1, :, :pad], stock[1, :, :pad])
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][1, :, :pad], torch.zeros_like(grads[0][1, :, :pad]))  # nothing flows from them
    assert not grads[1][1, :, :pad].any() and not grads[2][1, :, :pad].any()  # nor to the padding's keys
    # the padded sequence's own rows: as the sequence alone, unpadded
    alone = [t[1:, :, pad:].detach().requires_grad_() for t in (q, k, v)]
    got_alone, grads_alone = run(*alone, mask[1:, :, pad:, pad:], weights[1:, :, pad:])
    exact = not (compiler == "inductor" and form == "whole")  # Inductor's own softmax: its sums follow the row's length
    check = torch.equal if exact else (lambda a, b: torch.allclose(a.float(), b.float(), rtol=0.02, atol=0.02))
    assert check(got[1:, :, pad:], got_alone)
    assert all(check(g[1:, :, pad:], a) for g, a in zip(grads, grads_alone))
    if form != "vllm_cpu_vec" and compiler == "aot_eager":  # the contract, bit for bit
        want = ref.attention(q, k, v, mask=mask)
        assert torch.equal(got, want)
        want_grads = torch.autograd.grad((want.float() * weights).sum(), (q, k, v))
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))


def test_rows_per_block_follows_the_budget():
    mib = 1 << 20
    assert attention_chunked.rows_per_block(1, 16, 1024, 1024, mib) == mib // (16 * 1024 * 4)  # 16 rows
    assert attention_chunked.rows_per_block(1, 1, 8, 8, mib) == 8  # all rows: one block
    assert attention_chunked.rows_per_block(64, 64, 1000, 1 << 20, mib) == attention_chunked.MIN_ROWS
    assert attention_chunked.rows_per_block(64, 64, 10, 1 << 20, mib) == 10  # fewer rows than MIN_ROWS: one block
    assert attention_chunked.blocks(40, 16) == [(0, 16), (16, 40)]  # 8 left over: joins the last block
    assert attention_chunked.blocks(48, 16) == [(0, 16), (16, 32), (32, 48)]
    assert attention_chunked.blocks(5, 16) == [(0, 5)]
    assert attention_chunked.DEFAULT_BUDGET == 16 * mib == int(rla_compile.Options().attention_chunk_mib * mib)


@pytest.mark.parametrize("value", ["abc", 0, -3, True])
def test_a_bad_budget_is_a_clear_error(value):
    with pytest.raises(rla_compile.OptionError, match="attention_chunk_mib.*positive number of MiB"):
        rla_compile.Options(sites=frozenset({"attention"}), attention_chunk_mib=value)


def test_the_budget_is_in_the_graph_and_the_cache_key():
    """Option `attention_chunk_mib` is the op's argument in the compiled graph (it changes the
    fp32 order of k's and v's gradients), and part of the cache key."""
    q, k, v = (t.requires_grad_() for t in _qkv(torch.bfloat16, batch=1, heads=2, kv_heads=2, tokens=48))

    def grads(mib):
        backend = rla_compile.Backend(compiler="aot_eager", sites=["attention"], attention_chunk_mib=mib)
        torch._dynamo.reset()
        out = torch.compile(_sdpa, backend=backend, dynamic=True)(q, k, v)
        torch._dynamo.reset()
        assert "blocks of query rows" in backend.reports[0].sites[0].reason
        return out, torch.autograd.grad(out.float().sum(), (q, k, v))

    one_out, one = grads(16)
    many_out, many = grads(0.001)  # 1048 bytes: blocks of MIN_ROWS rows
    assert torch.equal(one_out, many_out) and torch.equal(one[0], many[0])  # the output and q's gradient: the same
    assert rla_compile.Options(attention_chunk_mib=1).uuid() != rla_compile.Options().uuid()


def test_the_ops_pass_torch_library_opcheck():
    """Schema, fake kernels (strides included), autograd registration and AOT dispatch with
    dynamic shapes, by torch's own checker."""
    q, k, v = (t.float() for t in _qkv(torch.bfloat16, kv_heads=4, tokens=20))
    bias = torch.randn(2, 1, 20, 20)
    for args in [(q, k, v, None, None, -math.inf, True, None), (q, k, v, bias, bias > 1, -1e4, False, 3.0)]:
        torch.library.opcheck(attention_chunked.attention, [a.requires_grad_() if isinstance(a, torch.Tensor)
                                                            and a.is_floating_point() else a for a in args])
