"""rla's vLLM pass on the graphs vLLM's GPU path hands a post-grad pass (no GPU, no vLLM needed).

`tests/data/vllm_graphs/*.py` are real captures (see `capture.py` there): a Qwen3 decoder layer
from vLLM's own layers, split at attention by vLLM's `split_graph`, each piece as vLLM's
`PostGradPassManager` gives it to an added pass, with RMSNorm's IR torch wrapping on (vLLM's
GPU default) and off (`compilation_config`). The pass is called the way the manager calls
it: `pass_(graph)`. With vLLM installed, `test_vllm_gpu_path_live` recaptures the pieces and
runs the pass inside the real manager (version-gated).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from rla_compile import Options
from rla_compile.integrations.vllm import make_pass

GRAPHS = Path(__file__).parent / "data" / "vllm_graphs"
TOKENS = 7  # num_tokens, symbolic in the capture

# piece -> (sites per kind, all rewritten; near misses per kind)
EXPECTED = {
    "wrap_off_piece0": ({"residual_rmsnorm": 1, "rmsnorm": 2, "rope": 2}, {}),  # add+norm, q/k norm, rope
    "wrap_off_piece1": ({"residual_rmsnorm": 1, "swiglu": 1}, {}),  # after attention: add+norm, MLP
    "wrap_on_piece0": ({"rope": 2}, {"residual_rmsnorm": 1, "rmsnorm": 2}),  # norms are vllm_ir ops
    "wrap_on_piece1": ({"swiglu": 1}, {"residual_rmsnorm": 1}),
}


def _vllm_ir_ops() -> None:
    """vLLM's IR op schemas (the real ones when vLLM is installed), so the captures load."""
    try:
        import vllm.ir.ops  # noqa: F401
        return
    except ImportError:
        pass
    if hasattr(torch.ops.vllm_ir, "rms_norm"):
        return
    lib = torch.library.Library("vllm_ir", "FRAGMENT")
    lib.define("rms_norm(Tensor x, Tensor? weight, float epsilon, SymInt? variance_size=None) -> Tensor")
    lib.define("fused_add_rms_norm(Tensor x, Tensor x_residual, Tensor? weight, float epsilon, "
               "SymInt? variance_size=None) -> (Tensor, Tensor)")
    torch.library.register_fake("vllm_ir::rms_norm", lambda x, w, eps, size=None: torch.empty_like(x), lib=lib)
    torch.library.register_fake("vllm_ir::fused_add_rms_norm",
                                lambda x, r, w, eps, size=None: (torch.empty_like(x), torch.empty_like(x)), lib=lib)
    _vllm_ir_ops.lib = lib  # keep the registrations alive


def load(name: str) -> torch.fx.GraphModule:
    """A captured piece as a GraphModule with fake values on every node (num_tokens = TOKENS)."""
    _vllm_ir_ops()
    scope = {"torch": torch, "device": torch.device, "inf": math.inf}
    exec(compile((GRAPHS / f"{name}.py").read_text(), str(GRAPHS / f"{name}.py"), "exec"), scope)
    gm = torch.fx.symbolic_trace(type(name, (torch.nn.Module,), {"forward": scope["forward"]})())
    mode = torch._subclasses.FakeTensorMode()
    size = lambda d: d if isinstance(d, int) else TOKENS  # noqa: E731
    args = [TOKENS if dtype == "int" else mode.from_tensor(torch.empty([size(d) for d in shape], dtype=getattr(torch, dtype)))
            for dtype, shape in scope["INPUTS"]]
    FakeTensorProp(gm, mode).propagate(*args)
    return gm


def counts(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item.kind] = out.get(item.kind, 0) + 1
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_rla_pass_on_vllm_pieces(name):
    gm = load(name)
    rla = make_pass(Options.from_dict({}))
    rla(gm.graph)  # as vLLM's PostGradPassManager calls every pass
    (report,) = rla.reports
    sites, misses = EXPECTED[name]
    assert report.counts() == sites
    assert {s.status for s in report.sites} == {"rewritten"}
    assert counts(report.near_misses) == misses
    for miss in report.near_misses:  # the hidden norms are reported with what to do about them
        assert "opaque vllm_ir." in miss.reason and "ir_enable_torch_wrap=False" in miss.reason
    gm.graph.lint()


def test_vllm_pieces_fp32_inside_sites():
    """After the pass, nothing inside a site rounds: the only bf16 casts left in the MLP piece are
    the sites' own output roundings (tagged) and the graph's casts outside sites."""
    from rla_compile.ops import is_site_rounding

    gm = load("wrap_off_piece1")
    before = [n for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default
              and n.args[1] == torch.bfloat16]
    assert len(before) == 3  # stock: the norm's rounding before the weight, silu's, the residual's
    make_pass(Options.from_dict({}))(gm.graph)
    after = [n for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default
             and n.args[1] == torch.bfloat16]
    assert all(is_site_rounding(n) for n in after)
    # residual stream and norm output (residual_rmsnorm), gate*up (swiglu): once each
    assert sorted(n.meta["custom"]["rla_round"] for n in after) == ["residual_rmsnorm", "residual_rmsnorm", "swiglu"]


def test_rla_pass_uuid_follows_options():
    base = make_pass(Options.from_dict({})).uuid()
    assert make_pass(Options.from_dict({})).uuid() == base
    assert make_pass(Options.from_dict({"sites": ["rope"]})).uuid() != base
    assert make_pass(Options.from_dict({"pin_rounding": True})).uuid() != base
