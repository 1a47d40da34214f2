"""Custom autograd Functions, checkpoints and custom ops keep their own forward and backward.

The re-trace to pre-dispatch ATen once inlined a custom `torch.autograd.Function`'s forward
under `_set_grad_enabled(False)` and dropped its backward: the output stopped requiring grad
and the parameters behind it silently got no gradient. Each test compares against the same
model under plain compilation (or eagerly, with the sites replaced by the contract
reference): which parameters get a gradient, and the gradients' bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import contract_reference as ref
import rla_compile

BF16 = torch.bfloat16


class Linear(torch.autograd.Function):
    """x @ w.T with a hand-written backward (what training frameworks' fused layers do)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.flatten(0, -2).t() @ x.flatten(0, -2)


class SwiGLU(torch.autograd.Function):
    """A fused-kernel stand-in: silu(g) * u rounding silu(g) first (HF eager's rounding), with
    its own fp32 backward. A site inside a Function: not rewritten, reported."""

    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return F.silu(g.float()).to(g.dtype) * u

    @staticmethod
    def backward(ctx, grad):
        g, u = ctx.saved_tensors
        gf, uf, grad_f = g.float(), u.float(), grad.float()
        s = torch.sigmoid(gf)
        return (grad_f * uf * s * (1 + gf * (1 - s))).to(g.dtype), (grad_f * gf * s).to(u.dtype)


def _hf_rmsnorm(x, w, eps=1e-6):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Block(nn.Module):
    """RMSNorm then a gated MLP, with a custom Function `before`, `inside` or `after` the sites
    (or none); `checkpointed` runs the whole block under torch.utils.checkpoint."""

    def __init__(self, where: str, dtype=BF16, checkpointed=False, d=16):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.where, self.checkpointed = where, checkpointed
        self.norm = nn.Parameter((1 + 0.1 * torch.randn(d, generator=gen)).to(dtype))
        self.proj = nn.Parameter((torch.randn(d, d, generator=gen) / d**0.5).to(dtype))
        self.gate_up = nn.Parameter((torch.randn(4 * d, d, generator=gen) / d**0.5).to(dtype))
        self.down = nn.Parameter((torch.randn(d, 2 * d, generator=gen) / d**0.5).to(dtype))
        self.contract = False  # eager reference: sites outside Functions computed by the contract

    def _norm(self, x):
        return ref.rmsnorm(x, self.norm) if self.contract else _hf_rmsnorm(x, self.norm)

    def _body(self, x):
        if self.where == "before":
            x = Linear.apply(x, self.proj)
        h = self._norm(x)
        g, u = F.linear(h, self.gate_up).chunk(2, dim=-1)
        if self.where == "inside":
            y = SwiGLU.apply(g, u)
        elif self.contract:
            y = ref.gated(g, u)
        else:
            y = F.silu(g.float()).to(g.dtype) * u
        y = F.linear(y, self.down)
        if self.where == "after":
            y = Linear.apply(y, self.proj)
        return y

    def forward(self, x):
        if self.checkpointed:
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


def _step(model, x, backend=None):
    """Output and every parameter's gradient (None where it got none), by name."""
    model.zero_grad(set_to_none=True)
    forward = torch.compile(model, backend=backend) if backend is not None else model
    out = forward(x)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(cotangent)
    grads = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    torch._dynamo.reset()
    return out.detach(), grads


def _x(dtype=BF16):
    return torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2)).to(dtype).requires_grad_()


def assert_same(got, expected):
    (out_a, grads_a), (out_b, grads_b) = got, expected
    assert {n for n, g in grads_a.items() if g is not None} == {n for n, g in grads_b.items() if g is not None}
    assert torch.equal(out_a, out_b)
    for name, g in grads_a.items():
        assert g is None or torch.equal(g, grads_b[name]), name


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_a_custom_function_keeps_its_gradient(inner, dtype):
    """The issue's reproduction: `Linear.apply(x, w) * s` under rla gets the gradient that plain
    compilation gives (no site: bit for bit)."""
    gen = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(8, 4, generator=gen).to(dtype))
    s = nn.Parameter(torch.ones(8, dtype=dtype))
    x = torch.randn(3, 4, generator=gen).to(dtype)

    def run(backend):
        w.grad = s.grad = None
        out = torch.compile(lambda x: Linear.apply(x, w) * s, backend=backend)(x)
        assert out.requires_grad
        out.sum().backward()
        torch._dynamo.reset()
        return out.detach(), w.grad, s.grad

    plain, aligned = run(inner), run(rla_compile.Backend(compiler=inner))
    for a, b in zip(aligned, plain, strict=True):
        assert b is not None and torch.equal(a, b)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("where", ["before", "inside", "after"])
def test_function_around_sites_equals_the_contract_reference(where, checkpointed):
    """bf16, eager kernels: the sites outside the Function follow the contract, the Function
    runs its own forward and backward; output and every gradient bit for bit."""
    model = Block(where, checkpointed=checkpointed)
    backend = rla_compile.Backend(compiler="aot_eager")
    got = _step(model, _x(), backend)
    model.contract = True
    assert_same(got, _step(model, _x()))

    sites = [s for r in backend.reports for s in r.sites]
    inside = [s for s in sites if "custom autograd.Function" in s.reason]
    assert {(s.kind, s.status) for s in sites if s not in inside} == {("rmsnorm", "rewritten")} | (
        set() if where == "inside" else {("swiglu", "rewritten")})
    if where == "inside":  # the site in the Function's body: found, not rewritten, and why
        assert [(s.kind, s.status) for s in inside] == [("swiglu", "skipped")]
        assert "test_functions.py" in inside[0].reason
    else:
        assert inside == []


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_function_in_an_fp32_model_equals_plain_compilation(checkpointed):
    """No site has a rounding to move in fp32: rla's graph is plain compilation's, bit for bit."""
    model = Block("after", dtype=torch.float32, checkpointed=checkpointed)
    got = _step(model, _x(torch.float32), rla_compile.Backend(compiler="aot_eager"))
    assert_same(got, _step(model, _x(torch.float32), "aot_eager"))


@torch.library.custom_op("rla_test::scaled", mutates_args=())
def scaled(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return x * s


@scaled.register_fake
def _(x, s):
    return torch.empty_like(x)


def _scaled_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _scaled_backward(ctx, grad):
    x, s = ctx.saved_tensors
    return grad * s, (grad * x).sum(dim=tuple(range(grad.dim() - 1)))


scaled.register_autograd(_scaled_backward, setup_context=_scaled_setup)


class CustomOpBlock(Block):
    """A `torch.library` custom op with a registered autograd formula after the sites."""

    def __init__(self):
        super().__init__("none")
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16).to(BF16))

    def forward(self, x):
        return scaled(super().forward(x), self.scale)


def test_custom_op_with_autograd_formula_keeps_its_gradient():
    model = CustomOpBlock()
    got = _step(model, _x(), rla_compile.Backend(compiler="aot_eager"))
    model.contract = True
    assert_same(got, _step(model, _x()))
    assert got[1]["scale"] is not None
