"""Every site spelling, compiled with the rla backend, follows the contract bit for bit:
outputs and the gradients of every input, bf16 and fp16, both compilers, rounding pinned
or not. Without rla (Inductor rounding like eager) the same functions differ.

What "bit for bit" compares against:
- compiler="aot_eager" runs eager kernels: equal to the eager fp32 reference.
- compiler="inductor": equal to the same reference compiled by Inductor with the same settings.
  Against the *eager* reference, Inductor's own fp32 kernels (its reduction order in the
  backward's sums, its vectorised tanh/exp) can move a value across a rounding boundary: at
  most 1 ulp of the output dtype, in at most 1% of elements. That is the compiler's fp32
  arithmetic, not a rounding location, and the test bounds it.
- compiler="inductor" with rounding pinned: the outputs equal the *eager* reference, since the
  reductions and transcendentals a site rounding reads run on ATen's kernels
  (`KeepSiteRounding`); each gradient equals one of the two references (values saved from the
  forward are eager's, the backward's own sums Inductor's).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._inductor import config as inductor_config

import rla_compile
from rla_compile.mismatch.metrics import ulp_distance
from rla_compile.tiny import tiny_causal_lm
from site_cases import CASES, POST_NORM, ROUNDED_INPUTS, Case

DTYPES = [torch.bfloat16, torch.float16]
# Pinned, attention's gradients are neither reference's: the backward reads the probabilities
# P computed by ATen's softmax (pinned like the forward's rounding) and computes the softmax's
# backward sum(dP * P) with Inductor's reduction order. Bounded below like unpinned Inductor's:
# at most 1 ulp on at most 1% of elements (measured: 2 of 4096 elements, fp16 only).
_MIXED_PINNED_GRADIENTS = {"attention"}
# A router's input gradient is a sum over the experts of terms that cancel (a softmax's gradient
# sums to zero across them), so Inductor's fp32 order in the backward moves its small results by
# many ulps (measured: 38 of 1024 elements of h's gradient, up to 36 bf16 ulps); equal to the
# reference compiled by Inductor, checked exactly above, not within 1 ulp of eager kernels'.
_CANCELLING_GRADIENTS = {"router"}


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def _run(fn, case: Case, dtype, backend=None, emulate=False):
    args = case.inputs(dtype)
    with inductor_config.patch(emulate_precision_casts=emulate):
        compiled = torch.compile(fn, backend=backend, fullgraph=True) if backend is not None else fn
        outs = _outputs(compiled(*args))
    grads = ()
    if case.grads:
        torch.manual_seed(1)
        floating = [o for o in outs if o.is_floating_point()]  # a router's expert ids have no gradient
        cotangents = [torch.randn_like(o) for o in floating]
        grads = torch.autograd.grad(floating, [args[i] for i in case.grads], cotangents)
    return [o.detach() for o in outs] + list(grads)


def _mismatches(a, b):
    return [int((x != y).sum()) for x, y in zip(a, b, strict=True)]


# The grid is case × dtype × pinned × compiler. Every cell runs in CI; the default run takes
# every case in bf16 under both compilers and in fp16 under aot_eager, and fp16 under Inductor
# for one case per site kind: the rewrite does not depend on the dtype, Inductor's fp16
# conversions do not depend on the case. The other fp16 × Inductor cells are marked `grid`
# (`tox -e extended`, which CI runs): 4 minutes of 2 cores the default run need not spend.
REPRESENTATIVES = {next(c.name for c in CASES if c.kind == kind) for kind in {c.kind for c in CASES}}


def _grid(case: Case, dtype, inner: str) -> bool:
    return dtype == torch.float16 and inner == "inductor" and case.name not in REPRESENTATIVES


def _cells(cases, pins=(False, True), inners=("inductor", "aot_eager")):
    """Pinned under aot_eager would repeat its unpinned twin: `pin_rounding` is an Inductor
    setting (emulate_precision_casts, and rla's lowering of the roundings), and neither the
    rewrite nor aot_eager reads it."""
    return [pytest.param(case, dtype, pin, inner, marks=[pytest.mark.grid] if _grid(case, dtype, inner) else [],
                         id=f"{case.name}-{'bf16' if dtype == torch.bfloat16 else 'fp16'}-"
                            f"{'pinned' if pin else 'unpinned'}-{inner}")
            for case in cases for dtype in DTYPES for pin in pins for inner in inners
            if not (pin and inner == "aot_eager")]


@pytest.mark.parametrize("case, dtype, pin, inner", _cells(CASES))
def test_site_follows_contract(case: Case, dtype, pin, inner):
    backend = rla_compile.Backend(compiler=inner, pin_rounding=pin, sites=list(rla_compile.SITE_KINDS))
    got = _run(case.fn, case, dtype, backend, emulate=pin)
    eager_ref = _run(case.reference, case, dtype)

    (report,) = backend.reports
    assert report.count(case.kind) == case.count, str(report)
    assert report.count(case.kind, case.status) == case.count, str(report)
    assert len(report.sites) == case.count, str(report)
    assert [t.dtype for t in got] == [t.dtype for t in eager_ref]

    if inner == "aot_eager":
        assert _mismatches(got, eager_ref) == [0] * len(got)
        return
    compiled_ref = _run(case.reference, case, dtype, "inductor", emulate=pin)
    if pin:
        # rounded outputs equal eager's; fp32 ones (the logits, which leave unrounded) carry
        # Inductor's own fp32 math like the gradients do
        outputs = len([t for t in got[: len(got) - len(case.grads)] if t.dtype == dtype])
        assert _mismatches(got[:outputs], eager_ref[:outputs]) == [0] * outputs
        checked = len(got) if case.kind not in _MIXED_PINNED_GRADIENTS else outputs
        assert [min(pair) for pair in zip(_mismatches(got, compiled_ref), _mismatches(got, eager_ref))][:checked] == [0] * checked
    else:
        assert _mismatches(got, compiled_ref) == [0] * len(got)
    compared = len(got) - len(case.grads) if case.kind in _CANCELLING_GRADIENTS else len(got)
    for a, b in zip(got[:compared], eager_ref[:compared]):
        if not a.is_floating_point():  # a router's choice of experts: the same, whatever the kernels
            assert torch.equal(a, b)
            continue
        if a.dtype == torch.float32:  # compared bit for bit with the compiled reference above
            continue
        differ = a != b
        assert int(differ.sum()) <= max(1, a.numel() // 100)
        if differ.any():
            assert float(ulp_distance(a[differ], b[differ]).max()) <= 1


def test_upcast_keeps_the_order_of_the_values_other_users():
    """OLMo2's post-norm block: the residual stream h feeds two projections, then the residual
    add. h's gradient sums three bf16 contributions in the order autograd meets h's users; the
    site's fp32 upcast of h must not become h's first user, or the sum's rounding changes."""
    backend = rla_compile.Backend(compiler="aot_eager")
    got = _run(POST_NORM.fn, POST_NORM, torch.bfloat16, backend)
    assert backend.reports[0].count("residual_rmsnorm", "rewritten") == 1
    assert _mismatches(got, _run(POST_NORM.reference, POST_NORM, torch.bfloat16)) == [0] * len(got)


@pytest.mark.parametrize("case, dtype", [pytest.param(c, d, id=f"{c.name}-{'bf16' if d == torch.bfloat16 else 'fp16'}")
                                         for c in CASES if c.status == "rewritten" for d in DTYPES])
def test_without_rla_the_difference_shows(case: Case, dtype):
    """As written, each case rounds where the contract does not, so the comparisons above could
    fail: on eager kernels, and for one case of each site kind under Inductor rounding like
    eager (emulate_precision_casts keeps the mid-site roundings the pass removes; it rounds
    where eager kernels do, so the other cases' eager difference is theirs under it too)."""
    inductor = case.name in REPRESENTATIVES and dtype == torch.bfloat16
    got = _run(case.fn, case, dtype, "inductor" if inductor else None, emulate=inductor)
    ref = _run(case.reference, case, dtype, "inductor" if inductor else None, emulate=inductor)
    assert sum(_mismatches(got, ref)) > 0


def test_site_rounding_survives_fusion_into_a_consumer_unpinned():
    """A site's output feeding a pointwise op that Inductor fuses into the same kernel: without
    the per-node barrier (KeepSiteRounding) unpinned Inductor would skip the site's rounding and
    add in fp32. With it, unpinned Inductor equals eager kernels on the same rewritten graph."""
    import torch.nn.functional as F

    def block(x, w, g, u, y):
        xf = x.float()
        norm = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return norm + y, F.silu(g) * u + y

    gen = torch.Generator().manual_seed(0)
    x, g, u, y = (torch.randn(4, 8, 64, generator=gen).bfloat16() for _ in range(4))
    w = (1 + 0.1 * torch.randn(64, generator=gen)).bfloat16()
    outs = {}
    for inner in ("inductor", "aot_eager"):
        torch._dynamo.reset()
        with inductor_config.patch(emulate_precision_casts=False, fx_graph_cache=False):
            outs[inner] = torch.compile(block, backend=rla_compile.Backend(compiler=inner, pin_rounding=False))(x, w, g, u, y)
    torch._dynamo.reset()
    assert _mismatches(outs["inductor"], outs["aot_eager"]) == [0, 0]
    # the contract, written out: each site rounds once, then the add rounds
    norm_ref = (w.float() * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6))).bfloat16()
    assert torch.equal(outs["aot_eager"][0], norm_ref + y)
    assert torch.equal(outs["aot_eager"][1], (F.silu(g.float()) * u.float()).bfloat16() + y)


def test_site_to_site_rounding_survives_the_cpu_kernel_cache_unpinned():
    """Qwen3's q_norm feeding RoPE: the norm's rounded output is stored and read back, upcast,
    in the same fused CPU kernel. Inductor's C++ code generator would hand the load the fp32
    value the store came from (its cse cache trick, unpinned only), skipping the rounding the
    contract puts there: 1736 of 6144 outputs differed from eager kernels before rla ran those
    upcasts as ATen calls."""

    def rotate_half(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    def q_norm_then_rope(q, w, cos, sin):
        qf = q.float()
        n = (w * (qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(q.dtype)).transpose(1, 2)
        return n * cos + rotate_half(n) * sin

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 24, 4, 32, generator=gen).bfloat16()
    w = (1 + 0.1 * torch.randn(32, generator=gen)).bfloat16()
    angles = torch.outer(torch.arange(24.0), 1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32)).repeat(1, 2)
    cos, sin = angles.cos().bfloat16()[None, None], angles.sin().bfloat16()[None, None]
    outs = {}
    for inner in ("inductor", "aot_eager"):
        torch._dynamo.reset()
        backend = rla_compile.Backend(compiler=inner, pin_rounding=False)
        with inductor_config.patch(fx_graph_cache=False):
            outs[inner] = torch.compile(q_norm_then_rope, backend=backend)(q, w, cos, sin)
        assert backend.reports[0].counts() == {"rmsnorm": 1, "rope": 1}
    torch._dynamo.reset()
    assert int((outs["inductor"] != outs["aot_eager"]).sum()) == 0


def test_roundings_read_in_their_kernel_are_rounded_there_and_calls_have_no_python(monkeypatch):
    """Qwen3's q/k norm roundings, which RoPE upcasts in the same kernel (as above), become
    `rla::rounding`: Inductor lowers them into the generated kernel (`lowering.round_in_kernel`),
    so no upcast runs on ATen (an extra call and kernel per upcast, the host time a GPU waits
    on: docs/performance.md#host-time). What still runs as a call of rla's is a call of an op
    defined on a Library: not a per-node fallback of the post-grad `prims.convert_element_type`,
    whose Python reference took 0.1-0.6 ms of host time per call and left an H200 waiting on
    every layer (3.1x the wall time of an inference at Qwen3-0.6B's width), and not a
    `torch.library.custom_op` (a Python autograd wrapper, 0.2 ms). The same holds for the
    pinned mode's eager kernels."""
    import rla_compile.lowering as lowering
    from torch._library.custom_ops import OPDEFS

    graphs, keep = [], lowering.keep_site_roundings

    def recording(graph):
        keep(graph)
        graphs.append([(n.target, bool(n.meta.get("should_fallback"))) for n in graph.nodes if n.op == "call_function"])

    monkeypatch.setattr(lowering, "keep_site_roundings", recording)
    model, ids = tiny_causal_lm("qwen3", num_hidden_layers=1), torch.randint(0, 128, (1, 8))
    torch._dynamo.reset()
    try:
        with inductor_config.patch(fx_graph_cache=False), torch.no_grad():
            torch.compile(model, backend=rla_compile.Backend(pin_rounding=False))(ids, use_cache=False)
    finally:
        torch._dynamo.reset()
    (nodes,) = graphs
    assert sum(target is torch.ops.rla.rounding.default for target, _ in nodes) == 2  # q and k norms into RoPE
    assert sum(target is torch.ops.rla.upcast.default for target, _ in nodes) == 0
    assert [t for t, fallback in nodes if fallback and t.namespace == "prims"] == []
    assert [name for name in ("upcast", "rounding", "eager_native_layer_norm", "eager_softmax", "eager_gelu")
            if f"rla::{name}" in OPDEFS] == []


def _bit_patterns(dtype: torch.dtype) -> torch.Tensor:
    """fp32 bit patterns of every kind a rounding to `dtype` meets: random ones (every exponent,
    both signs; for fp16 also ones concentrated on its range, 2^-27 to 2^17), each with its
    dropped bits (16 for bf16, 13 for fp16) set to the cases of round-to-nearest-even (below,
    at and above a tie, zero, all ones), and the special values (zeros, subnormals, the largest
    finite numbers and those that round to inf, infinities, NaNs). 2^16 + 7 of each: both the
    vector loop and its scalar tail."""
    gen = torch.Generator().manual_seed(0)
    dropped = 16 if dtype == torch.bfloat16 else 13
    count = (1 << 16) + 7
    high = [torch.randint(0, 1 << (32 - dropped), (count,), generator=gen, dtype=torch.int64) << dropped]
    if dtype == torch.float16:  # sign, exponents 100-144, random kept mantissa bits
        sign = torch.randint(0, 2, (count,), generator=gen, dtype=torch.int64) << 31
        exponent = torch.randint(100, 145, (count,), generator=gen, dtype=torch.int64) << 23
        high.append(sign | exponent | (torch.randint(0, 1 << (23 - dropped), (count,), generator=gen) << dropped))
    half = 1 << (dropped - 1)
    low = [0, half - 1, half, half + 1, (1 << dropped) - 1]
    special = [0x00000000, 0x80000000, 0x00000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x00800000, 0x7F7F7FFF,
               0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF,
               0x3F808000, 0x3F818000, 0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0xC77FF000, 0x38800000,
               0x387FFFFF, 0x33800000, 0x33000000, 0x33000001, 0x33400000, 0xB3000001]
    bits = torch.cat([h | d for h in high for d in low] + [torch.tensor(special, dtype=torch.int64)])
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)  # as signed 32-bit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rounding_in_kernel_is_atens_conversion_on_every_kind_of_value(dtype):
    """`rla::rounding` as Inductor lowers it (`lowering._rounded_in_fp32`, the rounding written
    out in fp32) against ATen's fp32 -> bf16/fp16 conversion, bit for bit (NaN as NaN), both
    stored and upcast again by a reader fused into the same kernel (the reader Inductor's
    cache would otherwise hand the unrounded value): ties each way, subnormals, overflow to inf
    (fp16: above 65504), fp16's subnormal range."""
    x = _bit_patterns(dtype)
    want = x.to(dtype)
    torch._dynamo.reset()
    try:
        with inductor_config.patch(fx_graph_cache=False):
            stored = torch.compile(lambda v: torch.ops.rla.rounding(v, dtype), backend="inductor")(x)
            read = torch.compile(lambda v: torch.ops.rla.rounding(v, dtype).float() * 3, backend="inductor")(x)
    finally:
        torch._dynamo.reset()
    nan = want.isnan()
    assert stored.dtype == dtype and torch.equal(stored.isnan(), nan)
    assert torch.equal(stored[~nan].view(torch.int16), want[~nan].view(torch.int16))
    expected = want.float() * 3
    assert torch.equal(read.isnan(), expected.isnan())
    assert torch.equal(read[~nan].view(torch.int32), expected[~nan].view(torch.int32))


def _documented_variants() -> set[tuple[str, str]]:
    """(kind, variant) of every site in docs/coverage.md: the HF zoo, hand-written models and
    the other frameworks' models, as their compiles reported them."""
    from coverage_table import DOC, split

    found = set()
    for line in "".join(split(DOC.read_text())).splitlines():  # not the attention sweep's table
        if not line.startswith("| ") or line.startswith("| model"):
            continue
        for item in line.rstrip(" |").rsplit(" | ", 1)[1].split("; "):
            kind, _, variant = item.partition(": ")
            found.add((kind, variant))
    return found


def test_every_variant_a_model_reports_has_a_case_checked_against_the_reference():
    """The guard against a report claiming an alignment its output does not show: every
    (kind, variant) that a model in docs/coverage.md reports is also reported by a case above,
    whose output and gradients test_site_follows_contract compares with the contract reference."""
    checked = set()
    for case in CASES:
        backend = rla_compile.Backend(compiler="aot_eager", sites=list(rla_compile.SITE_KINDS))
        torch._dynamo.reset()
        torch.compile(case.fn, backend=backend, fullgraph=True)(*case.inputs(torch.bfloat16))
        checked |= {(s.kind, s.variant) for r in backend.reports for s in r.sites}
    documented = _documented_variants()
    assert len(documented) > 10
    assert documented <= checked, f"variants without a site case: {sorted(documented - checked)}"


def test_an_already_aligned_sites_own_rounding_is_kept_like_a_rewritten_ones():
    """Left as written, its one rounding is still the site's: tagged, so Inductor keeps it and,
    pinned, computes what it rounds with eager's math (litgpt's Qwen3 q/k norms: Inductor's own
    mean flipped one element, 33 logits differed between compiler="inductor" pinned and aot_eager)."""
    case = next(c for c in CASES if c.name == "norm_olmo_core")
    result = rla_compile.align_function(case.fn, *case.inputs(torch.bfloat16))
    assert result.report.count("rmsnorm", "already_aligned") == 1
    assert "# rla: round rmsnorm" in result.after
    assert "# rla: round" not in result.before


def test_rotation_matrix_table_gradients_on_eager_kernels():
    """The rotation-matrix RoPE's cos/sin gradients (excluded from CASES: outside the site they
    add up where Inductor fuses) equal the reference on eager kernels."""
    case = next(c for c in CASES if c.name == "rope_matrix")
    case = dataclasses.replace(case, grads=(0, 1, 2))
    backend = rla_compile.Backend(compiler="aot_eager")
    got = _run(case.fn, case, torch.bfloat16, backend)
    assert backend.reports[0].count("rope", "rewritten") == 1
    assert _mismatches(got, _run(case.reference, case, torch.bfloat16)) == [0] * len(got)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_attention_reads_inputs_rounded_before_it(inner):
    """q and k rounded from fp32 just before attention (OLMo's, Cohere's RoPE): the site reads
    the rounded values. On eager kernels outputs and gradients equal the reference; pinned
    Inductor keeps that rounding (emulate_precision_casts) and the output equals it too.
    Unpinned, Inductor drops a rounding that is no site's where it fuses: not the contract's."""
    case = ROUNDED_INPUTS
    backend = rla_compile.Backend(compiler=inner, pin_rounding=True, sites=["attention"])
    got = _run(case.fn, case, torch.bfloat16, backend, emulate=True)
    assert backend.reports[0].count("attention", "rewritten") == 1
    want = _run(case.reference, case, torch.bfloat16)
    checked = len(got) if inner == "aot_eager" else 1
    assert _mismatches(got, want)[:checked] == [0] * checked
