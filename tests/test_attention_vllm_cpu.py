"""The attention site's engine-paired form `rounding={"attention": "vllm_cpu_vec"}`
(rla_compile/sites/attention/vllm_cpu.py): vLLM-CPU's `vec` kernel order in the trainer.

Against the kernel itself, bit for bit: tests/test_vllm.py (needs vLLM). Here, without vLLM:
its exact-arithmetic pieces against independent references (exact rationals; this machine's
libm), the C form against the Python form it runs for, padding, the site's report and graph,
and gradients equal to the contract site's.
"""

import ctypes
import ctypes.util
import math
import random
from fractions import Fraction

import pytest
import torch

import contract_reference as ref
import rla_compile
from rla_compile.config import OptionError
from rla_compile.sites.attention import vllm_cpu as vec


def _round_to_fp32(exact: Fraction) -> float:
    """The fp32 nearest to `exact` (ties to even), from exact rationals."""
    guess = torch.tensor(float(exact), dtype=torch.float32)
    around = [torch.nextafter(guess, torch.tensor(-math.inf)), guess, torch.nextafter(guess, torch.tensor(math.inf))]
    best = min(around, key=lambda c: (abs(Fraction(c.item()) - exact), c.view(torch.int32).item() & 1))
    return best.item()


def test_fma32_rounds_once():
    rng = random.Random(0)
    a, b, c = ([rng.uniform(-2, 2) * 2.0 ** rng.randint(-20, 20) for _ in range(400)] for _ in range(3))
    a, b, c = (torch.tensor(x, dtype=torch.float32) for x in (a, b, c))
    c[:100] = -(a[:100].double() * b[:100].double()).float()  # cancellation: the product's tail is the result
    got = vec._fma32(a, b, c)
    want = [_round_to_fp32(Fraction(x.item()) * Fraction(y.item()) + Fraction(z.item())) for x, y, z in zip(a, b, c)]
    assert got.tolist() == want
    assert not torch.equal(got, a * b + c)  # two roundings differ somewhere: the check can fail


def test_glibc_expf_equals_this_machines_libm():
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(20000, generator=g) * 200 - 110, torch.randn(20000, generator=g) * 4,
                   torch.tensor([0.0, -0.0, -math.inf, math.inf, 88.7, -87.4, -103.9, -104.0])])
    want = torch.tensor([libm.expf(v) for v in x.tolist()], dtype=torch.float32)
    got = vec._glibc_expf(x)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert not torch.equal(torch.exp(x).view(torch.int32), want.view(torch.int32))  # torch's own exp is not libm's


def test_fast_expf_is_an_exp():
    """The AVX-512 build's polynomial (not runnable against its kernel here): an exp within a few ulp."""
    x = torch.linspace(-80, 80, 10001)
    got, exact = vec._fast_expf(x).double(), torch.exp(x.double())
    assert ((got - exact).abs() / exact).max() < 4 * 2.0 ** -23


@pytest.mark.parametrize("fused", [False, True], ids=["avx2", "avx512"])
def test_c_exps_are_the_python_forms_on_every_kind_of_value(fused):
    """The C form's block of exps (AVX-512: its own vector code) against the reference's exps,
    on 16-lane blocks and their tails: randn and wide arguments, both sides of the clamps and of
    the underflow to 0, ±0, -inf (a masked key) and a large finite running max subtracted."""
    assert vec.implementation() == "c"
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g) * 4, torch.rand(4000, generator=g) * 220 - 200,
                   torch.tensor([0.0, -0.0, -math.inf, 88.72, 88.73, -87.33, -87.34, -103.9, -104.0, 1e-30, -1e-30])])
    from rla_compile import native

    library = native.load("vllm_cpu_vec")
    for m in (0.0, 3.5, -1e30):
        for n in (x.numel(), 13, 1):  # a whole run of blocks, one tail alone, one lane
            s = x[:n].contiguous()
            got = torch.empty(n)
            library.rla_vllm_cpu_vec_exp(ctypes.c_void_p(s.data_ptr()), ctypes.c_int64(n), ctypes.c_float(m),
                                         ctypes.c_int(int(fused)), ctypes.c_void_p(got.data_ptr()))
            want = (vec._fast_expf if fused else vec._glibc_expf)(s - m)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (m, n)


def _inputs(batch=2, heads=4, tokens=40, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, tokens, dim, generator=g) for _ in range(3)]


@pytest.mark.parametrize("fused", [False, True], ids=["avx2", "avx512"])
@pytest.mark.parametrize("tokens, dim, spread", [(16, 32, 1.0), (40, 24, 4.0), (96, 32, 12.0), (300, 64, 1.0),
                                                 (600, 32, 8.0)])
def test_c_form_is_the_python_form_bit_for_bit(tokens, dim, spread, fused):
    """csrc/vllm_cpu_vec.c against `_one_request` (the Python form, checked against vLLM's kernel
    in tests/test_vllm.py): causal and with an additive mask holding masked keys, 1 and 2
    threads' blocks, randn and wide scores (spread > 1: the running max grows by more than 8),
    head sizes in whole 16-lane tiles and not (24: a tile and a tail)."""
    assert vec.implementation() == "c"  # this machine has a C compiler: the C form must build
    g = torch.Generator().manual_seed(tokens)
    q, k, v = (torch.randn(2, tokens, dim, generator=g) for _ in range(3))
    q = q * spread / math.sqrt(dim)
    bias = torch.zeros(1, tokens, tokens)
    bias[..., torch.rand(tokens, generator=g) < 0.1] = torch.finfo(torch.float32).min
    bias[..., 0] = -1.5  # every row keeps a key, and the mask is not only 0 and -inf
    for mask in (None, bias):
        for threads in (1, 2):
            want = vec._one_request(q, k, v, mask, fused, threads, 512 << 10)
            got = vec._one_request_c(q, k, v, mask, fused, threads, 512 << 10)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (mask is None, threads)


def test_without_a_compiler_the_python_form_runs_and_says_why(monkeypatch, tmp_path, caplog):
    from rla_compile import native

    q, k, v = (t[0] for t in _inputs(batch=1, tokens=24))
    assert vec.implementation() == "c"
    with_c = vec.attention(q[None] * 0.2, k[None], v[None], None, True)  # before the compiler is taken away
    monkeypatch.setenv("RLA_CACHE_DIR", str(tmp_path))  # nothing cached: a build is needed
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    for cached in (native.load, vec._kernel, vec._warn_once):
        cached.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="rla_compile"):
            assert vec.implementation() == "python"
            got = vec.attention(q[None] * 0.2, k[None], v[None], None, True)
        assert "runs its Python reference" in caplog.text and "failed" in caplog.text
        assert torch.equal(got, with_c)  # the Python form, where C cannot be built, gives the C form's bits
    finally:
        for cached in (native.load, vec._kernel, vec._warn_once):
            cached.cache_clear()


def test_the_c_forms_are_built_for_this_cpu_and_without_it_where_the_compiler_refuses(monkeypatch, tmp_path):
    """`native.load` builds with `-march=native` (vector units: same IEEE operations, same order)
    and OpenMP (heads over torch's threads), and falls back to the plain flags where the compiler
    rejects them (heads then over a thread pool); both builds give the same bits."""
    import shutil

    from rla_compile import native

    q, k, v = (t[0] for t in _inputs(batch=1, tokens=140))  # 4 x 140² scores: over 2 threads
    assert 4 * 140 * 140 >= vec._THREADED_FROM
    picky = tmp_path / "cc"  # a compiler that knows neither -march=native nor -fopenmp
    picky.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in -march=native|-fopenmp) exit 1;; esac; done\n'
                     f'exec {shutil.which("gcc") or shutil.which("cc")} "$@"\n')
    picky.chmod(0o755)
    results = {}
    try:
        for cc in (None, picky):
            monkeypatch.setenv("RLA_CACHE_DIR", str(tmp_path / f"cache-{cc is None}"))
            if cc is not None:
                monkeypatch.setenv("CC", str(cc))
            for cached in (native.load, vec._kernel, vec._warn_once):
                cached.cache_clear()
            assert vec.implementation() == "c" and vec._openmp() == (cc is None)
            threads = torch.get_num_threads()
            torch.set_num_threads(2)
            try:
                results[cc is None] = vec.attention(q[None] * 0.2, k[None], v[None], None, True)
            finally:
                torch.set_num_threads(threads)
            (built,) = (tmp_path / f"cache-{cc is None}").glob("vllm_cpu_vec-*.so")
        assert torch.equal(results[True].view(torch.int16), results[False].view(torch.int16))
    finally:
        for cached in (native.load, vec._kernel, vec._warn_once):
            cached.cache_clear()


def test_heads_and_sequences_share_the_threads_and_change_no_bit():
    """The C form shares its heads out over torch's own OpenMP threads (built with OpenMP, the
    runtime torch loaded, not a second one); a causal batch runs as one request per sequence, its
    heads side by side. Neither the thread count nor the batch changes a bit."""
    import os

    assert vec._openmp()  # gcc here has OpenMP
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as maps:
            runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libomp" in line}
        assert len(runtimes) == 1, runtimes
    q, k, v = _inputs(batch=3, heads=8, tokens=130)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [vec.attention(q[b:b + 1] * 0.2, k[b:b + 1], v[b:b + 1], None, True) for b in range(3)]
        torch.set_num_threads(2)
        together = vec.attention(q * 0.2, k, v, None, True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.cat(alone).view(torch.int32), together.view(torch.int32))


def test_left_padding_leaves_each_sequence_as_it_is_alone():
    """The kernel's blocks and lanes start at a sequence's first token: padding before it changes nothing."""
    q, k, v = _inputs(batch=1)
    alone = vec.attention(q * 0.2, k, v, None, True)
    pad = 5
    padded = [torch.cat([torch.randn(1, 4, pad, 32), t], 2) for t in (q * 0.2, k, v)]
    bias = torch.zeros(1, 1, 45, 45).masked_fill(torch.ones(45, 45, dtype=torch.bool).triu(1), -3.4e38)
    bias[..., :pad] = -3.4e38
    got = vec.attention(*padded, bias, False)
    assert torch.equal(got[:, :, pad:], alone)


def _attention(q, k, v, mask):  # HF's eager attention, one head group
    w = torch.matmul(q, k.transpose(2, 3)) * (1 / math.sqrt(q.shape[-1]))
    return torch.matmul(torch.softmax((w + mask).float(), -1).to(q.dtype), v)


def _run(rounding, q, k, v, mask, compiler="inductor"):
    torch._dynamo.reset()
    backend = rla_compile.Backend(compiler=compiler, sites=["attention"], rounding={"attention": rounding})
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = torch.compile(_attention, backend=backend)(*leaves, mask)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))  # a gradient that is not out's
    (out.float() * weights).sum().backward()
    torch._dynamo.reset()
    return out.detach(), [t.grad for t in leaves], backend.reports


def test_site_runs_the_form_and_keeps_the_contracts_gradient():
    q, k, v = (t.bfloat16() for t in _inputs(tokens=96))
    causal = torch.ones(96, 96, dtype=torch.bool).triu(1)
    mask = torch.zeros(2, 1, 96, 96).masked_fill(causal, torch.finfo(torch.bfloat16).min).bfloat16()
    out, grads, reports = _run("vllm_cpu_vec", q, k, v, mask)
    (site,) = reports[0].sites
    assert site.status == "rewritten" and f"vLLM-CPU's {vec.variant()} vec kernel order" in site.reason
    rounding = vec.output_rounding()  # as the kernel's build rounds on this CPU
    _, want_grads, _ = _run(rounding, q, k, v, mask)
    # forward: the contract up to the kernel's fp32 order (a last-bit flip on a few elements)
    reference = ref.attention(q, k, v, mask=mask, scale=1 / math.sqrt(32), rounding=rounding)
    assert (out != reference).float().mean() < 1e-3
    assert ((out.float() - reference.float()).abs() <= reference.float().abs() * 2 ** -7).all()
    # backward: the contract's formulas over the contract's P, bit for bit the contract site's
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "left-padded"])
def test_long_sequences_backward_in_blocks_over_the_keys_a_block_keeps(padded):
    """Above the chunked form's threshold the backward runs one block of query rows at a time,
    each over the keys up to the last one its rows keep (`_backward_in_blocks`): its gradients
    are autograd's over the contract in float64 to fp32's precision (blocks of 16 rows here, the
    keys after each block's last row skipped, a left-padded sequence's mask too)."""
    q, k, v = (t.double().float() for t in _inputs(batch=2, heads=2, tokens=80, dim=16))
    bias, causal = None, True
    if padded:
        bias = torch.zeros(2, 1, 80, 80).masked_fill(torch.ones(80, 80, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
        bias[1, :, :, :11] = torch.finfo(torch.float32).min
        bias[1, :, :11, :] = 0.0  # HF unmasks the padding rows
        causal = False
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    got = vec._backward_in_blocks(grad, q, k, v, bias, causal, budget=16 * 2 * 2 * 80 * 4)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    scores = leaves[0] @ leaves[1].transpose(-1, -2)
    if causal:
        scores = scores.masked_fill(torch.ones(80, 80, dtype=torch.bool).triu(1), -math.inf)
    else:
        scores = scores + bias.double()
    (torch.softmax(scores, -1) @ leaves[2]).backward(grad.double())
    for mine, ref_leaf in zip(got, leaves):
        assert ((mine.double() - ref_leaf.grad).abs().max() / ref_leaf.grad.abs().max()) < 1e-5


def test_longer_sequences_backward_in_blocks_as_one_op():
    """From `_BLOCKED_FROM_QUERIES` queries the compiled backward calls the blocked backward as
    one op (traced, its per-block updates would copy whole gradients), whose gradients are
    autograd's over the contract in float64 to fp32's precision."""
    q, k, v = (t.bfloat16() for t in _inputs(batch=1, heads=8, tokens=192, dim=32))
    assert 192 >= vec._BLOCKED_FROM_QUERIES
    causal = torch.ones(192, 192, dtype=torch.bool).triu(1)
    mask = torch.zeros(1, 1, 192, 192).masked_fill(causal, torch.finfo(torch.bfloat16).min).bfloat16()
    calls = []
    real = vec._backward_in_blocks
    torch._dynamo.reset()
    backend = rla_compile.Backend(compiler="aot_eager", sites=["attention"], rounding={"attention": "vllm_cpu_vec"})
    compiled = torch.compile(_attention, backend=backend)
    weights = torch.randn(1, 8, 192, 32, generator=torch.Generator().manual_seed(1))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vec, "_backward_in_blocks", lambda *a: calls.append(1) or real(*a))
        for _ in range(2):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            (compiled(*leaves, mask).float() * weights).sum().backward()
    torch._dynamo.reset()
    assert len(calls) == 2  # run by each backward (traced, it would have run once, while compiling)
    grads = [t.grad for t in leaves]
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out = _attention(*leaves, mask.double().masked_fill(causal, -math.inf))
    (out * weights.double()).sum().backward()
    for mine, want in zip(grads, leaves):
        assert ((mine.double() - want.grad).abs().max() / want.grad.abs().max()) < 2 ** -7  # bf16 gradients


def test_soft_capped_attention_keeps_the_contracts_form_and_says_so():
    def capped(q, k, v):
        s = torch.matmul(q, k.transpose(2, 3)) * 0.25
        s = torch.tanh(s / 50.0) * 50.0
        return torch.matmul(torch.softmax(s.float(), -1).to(q.dtype), v)

    q, k, v = (t.bfloat16() for t in _inputs())
    torch._dynamo.reset()
    backend = rla_compile.Backend(compiler="aot_eager", sites=["attention"], rounding={"attention": "vllm_cpu_vec"})
    got = torch.compile(capped, backend=backend)(q, k, v)
    (site,) = backend.reports[0].sites
    assert site.status == "rewritten" and "soft-capping is not emulated" in site.reason
    assert torch.equal(got, ref.attention(q, k, v, scale=0.25, softcap=50.0, rounding=vec.output_rounding()))


@pytest.mark.parametrize("bf16_instruction, rounding", [(True, "nearest"), (False, "toward_zero")])
def test_the_form_rounds_as_the_kernels_build_for_this_cpu(monkeypatch, bf16_instruction, rounding):
    """vLLM-CPU's x86 builds convert the output with AVX512-BF16's instruction where the CPU has
    it (to nearest) and drop the low bits where it does not: the form's one rounding follows."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16_instruction)
    q, k, v = (t.bfloat16() for t in _inputs(tokens=40))
    mask = torch.zeros(2, 1, 40, 40).masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), -1e4).bfloat16()
    out, _, reports = _run("vllm_cpu_vec", q, k, v, mask, compiler="aot_eager")
    # the form's fp32 result, as the site calls it: q × scale, the mask as an additive fp32 bias
    exact = torch.ops.rla.vllm_cpu_vec_attention(q.float() * (1 / math.sqrt(32)), k.float(), v.float(),
                                                 mask.float(), False)
    nearest, toward_zero = exact.bfloat16(), ref.round_toward_zero(exact)
    assert not torch.equal(nearest, toward_zero)  # the inputs tell the two apart
    assert torch.equal(out, nearest if rounding == "nearest" else toward_zero)


def test_the_form_is_the_attention_sites_only():
    with pytest.raises(OptionError, match="unknown mode 'vllm_cpu_vec' for site 'rope'; valid: nearest, toward_zero"):
        rla_compile.Backend(sites=["rope"], rounding={"rope": "vllm_cpu_vec"})
    rla_compile.Backend(sites=["attention"], rounding={"attention": "vllm_cpu_vec"})


def test_whole_model_every_layer_in_the_form():
    from rla_compile.tiny import tiny_causal_lm

    model = tiny_causal_lm("qwen3").train()
    ids = torch.randint(1, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    backend = rla_compile.Backend(compiler="aot_eager", sites=[*rla_compile.sites.DEFAULT_SITES, "attention"],
                                  rounding={"attention": "vllm_cpu_vec"})
    torch._dynamo.reset()
    try:
        logits = torch.compile(model, backend=backend)(ids, use_cache=False).logits
        logits.float().logsumexp(-1).sum().backward()
    finally:
        torch._dynamo.reset()
    layers = [s for r in backend.reports for s in r.sites if s.kind == "attention"]
    assert len(layers) == model.config.num_hidden_layers
    assert all(s.status == "rewritten" and "vec kernel order" in s.reason for s in layers)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
