"""backend="rla" in real training setups (docs/training.md): FSDP2 and tensor parallel on 2
gloo processes, FSDP2 x tensor parallel on 4, activation checkpointing, dynamic shapes, the HF Trainer, PEFT LoRA.

References are independent of rla_compile: the model run eagerly with its sites replaced by
the contract reference (tests/support/hf_reference.py, handwritten.forward_contract). Where a setup
cuts the model into several graphs (an FSDP unit, a checkpointed layer), the values crossing
the cut are bf16 tensors and the reference rounds them there too (`unit_boundaries`).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import contract_reference as ref
import distributed_probe as probe
import tp_reference as tpr
import handwritten
import rla_compile
from gradients import assert_same_parameters, mismatches, step
from hf_reference import contract_sites
from models import expected_sites, tiny_causal_lm
from once import once_per_run
from zoo import tokens

pytest.importorskip("transformers")

LAYER = {"rmsnorm": 1, "residual_rmsnorm": 1, "rope": 2, "swiglu": 1}  # one Llama layer cut out


def _train(model, ids, backend=None, hf=True):
    return step(model, ids, backend, hf=hf)


@contextlib.contextmanager
def unit_boundaries(model):
    """Each decoder layer its own graph: the residual stream enters layers 1.. and the final
    norm as a bf16 tensor (a fresh alias, so the reference norm does not find its fp32 sum),
    and RoPE's cos/sin enter the layers rounded to bf16 (no bypass across graphs)."""

    def fresh(module, args, kwargs):
        if args:
            return (args[0].view_as(args[0]), *args[1:]), kwargs
        return args, kwargs | {"hidden_states": kwargs["hidden_states"].view_as(kwargs["hidden_states"])}

    inner = model.model
    hooks = [m.register_forward_pre_hook(fresh, with_kwargs=True) for m in (*inner.layers[1:], inner.norm)]
    hooks.append(inner.rotary_emb.register_forward_hook(lambda m, a, out: tuple(t.to(torch.bfloat16) for t in out)))
    try:
        yield model
    finally:
        for hook in hooks:
            hook.remove()


# -- FSDP2 and tensor parallel: 2 processes ---------------------------------------------------
@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    def run(out):
        subprocess.run([sys.executable, str(Path(probe.__file__)), str(out)], check=True, capture_output=True, timeout=600)

    return torch.load(once_per_run(tmp_path_factory, "distributed_results.pt", run))


def _reference_training(boundaries: bool, model_type: str = "llama", kinds=("rmsnorm", "swiglu", "rope")):
    """The probe's training run, single process, eager, sites by the contract reference."""
    model = tiny_causal_lm(model_type)
    opt, ids, losses = probe.optimizer(model.parameters()), probe.batch(), []
    with contract_sites(model, kinds=kinds), (unit_boundaries(model) if boundaries else contextlib.nullcontext()):
        for _ in range(probe.STEPS):
            loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, {name: p.detach() for name, p in model.state_dict().items()}


def _site_counts(reports):
    return [{k: sum(1 for s in r["sites"] if s["kind"] == k) for k in LAYER} for r in reports if r["sites"]]


@pytest.mark.multiprocess
@pytest.mark.parametrize("setup, boundaries", [("fsdp_per_layer", True), ("fsdp_root", False)])
def test_fsdp2_training_equals_single_process_contract_reference(distributed, setup, boundaries):
    """3 AdamW steps on 2 ranks: losses and the gathered parameters, bit for bit."""
    got = distributed[setup]
    losses, params = _reference_training(boundaries)
    assert got["losses"] == losses
    assert set(got["params"]) == set(params)
    assert sum(int((got["params"][n] != p).sum()) for n, p in params.items()) == 0
    reports = got["reports"][0]  # rank 0's; both ranks compile the same graphs
    assert all(_site_counts(r) == _site_counts(reports) for r in got["reports"])
    assert all(s["status"] == "rewritten" for r in reports for s in r["sites"])
    if setup == "fsdp_root":  # one FSDP unit: one graph with every site, as without FSDP
        assert _site_counts(reports) == [expected_sites(tiny_causal_lm("llama").config)]
    else:  # FSDP2's hooks are Dynamo-disabled: a graph per layer (both layers share it), then the final norm
        assert _site_counts(reports) == [LAYER, {"rmsnorm": 1, "residual_rmsnorm": 0, "rope": 0, "swiglu": 0}]


@pytest.mark.multiprocess
def test_fsdp2_trains_an_moe_model_as_the_contract_reference(distributed):
    """FSDP2 per layer on 2 ranks, a tiny Qwen3-MoE with the router and expert-combine sites
    too: 3 AdamW steps' losses and the gathered parameters (the routers' and the experts' too)
    bit for bit against the single-process eager run with the contract reference's sites."""
    got = distributed["fsdp_moe"]
    losses, params = _reference_training(True, "qwen3_moe", ("rmsnorm", "swiglu", "rope", "router"))
    assert got["losses"] == losses
    assert set(got["params"]) == set(params) and any("experts" in n for n in params) and any(".gate." in n for n in params)
    assert sum(int((got["params"][n] != p).sum()) for n, p in params.items()) == 0
    reports = got["reports"][0]
    kinds = {s["kind"] for r in reports for s in r["sites"]}
    assert {"router", "expert_combine"} <= kinds, kinds
    assert all(s["status"] == "rewritten" for r in reports for s in r["sites"])
    # the MoE blocks as written (the default sites' reference only) train elsewhere
    without, without_params = _reference_training(True, "qwen3_moe")
    assert without != losses and sum(int((got["params"][n] != p).sum()) for n, p in without_params.items()) > 0


@pytest.mark.multiprocess
def test_fsdp2_per_layer_units_cut_the_residual_norms(distributed):
    """The per-layer cut is visible: the whole-model contract reference trains differently."""
    assert distributed["fsdp_per_layer"]["losses"] != _reference_training(boundaries=False)[0]


# -- tensor parallel (DTensor): 2 processes; FSDP2 x TP: 4 processes -----------------------------
@pytest.fixture(scope="module")
def distributed_2d(tmp_path_factory):
    def run(out):
        subprocess.run([sys.executable, str(Path(probe.__file__)), str(out), "2d"], check=True, capture_output=True,
                       timeout=600)

    return torch.load(once_per_run(tmp_path_factory, "distributed_2d_results.pt", run))


def _tp_step(sequence_parallel: bool, sites: str, cut: bool = False):
    """The probe's forward and backward on one process with tensor parallelism's arithmetic
    (tests/support/tp_reference.py): logits and every parameter gradient. sites: "contract" (the
    independent reference), "model" (as written, eager) or "rla" (compiled on this process).
    cut: each decoder layer its own graph and the final norm outside them (torchtitan's
    per-layer compile), as `unit_boundaries` models it."""
    model = tpr.shard_like_tp(tiny_causal_lm("llama"), sequence_parallel)
    forward = model
    if sites == "rla":
        torch._dynamo.reset()
        forward = torch.compile(model, backend=rla_compile.Backend(compiler="aot_eager"))
    with contextlib.ExitStack() as stack:
        if sites == "contract":
            stack.enter_context(contract_sites(model, skip=(model.model.norm,) if cut else ()))
        if cut:
            stack.enter_context(unit_boundaries(model))
        logits = forward(probe.batch(), use_cache=False).logits
        logits.backward(probe.cotangent(logits.shape))
    torch._dynamo.reset()
    return logits.detach(), tpr.grads(model)


def _tp_mismatches(got, logits, grads) -> tuple[int, int]:
    assert_same_parameters(got["grads"], grads)  # the guard against lost gradients, under TP
    return int((logits != got["logits"]).sum()), sum(int((g != got["grads"][n]).sum()) for n, g in grads.items())


def _sites_per_rank(got):
    """Per rank: the site counts of each graph, and whether every site was rewritten."""
    assert [{r["rank"] for r in reports} for reports in got["reports"]] == [{i} for i in range(len(got["reports"]))]
    return [([{k: sum(1 for s in r["sites"] if s["kind"] == k) for k in LAYER} for r in reports],
             all(s["status"] == "rewritten" for r in reports for s in r["sites"]) and all(not r["note"] for r in reports))
            for reports in got["reports"]]


@pytest.mark.multiprocess
@pytest.mark.parametrize("setup", ["tp", "tp_sp"])
def test_tensor_parallel_equals_single_process_contract_reference(distributed, setup):
    """Colwise/Rowwise projections (tp) and torchtitan's plan with sequence-parallel norms
    (tp_sp) on 2 ranks: every site of the one graph rewritten on every rank; logits and every
    parameter gradient (gathered) equal the contract reference with TP's arithmetic, bit for bit."""
    got = distributed[setup]
    whole = expected_sites(tiny_causal_lm("llama").config)
    assert _sites_per_rank(got) == [([whole], True)] * 2
    assert _tp_mismatches(got, *_tp_step(setup == "tp_sp", "contract")) == (0, 0)


@pytest.mark.multiprocess
def test_fsdp2_x_tensor_parallel_equals_single_process_contract_reference(distributed_2d):
    """torchtitan's 2D on 4 ranks (dp=2 x tp=2, FSDP2 per layer, each layer compiled): per rank
    one graph per layer with every layer site rewritten; logits and gradients bit for bit."""
    got = distributed_2d["fsdp_tp"]
    assert _sites_per_rank(got) == [([LAYER, LAYER], True)] * 4
    assert _tp_mismatches(got, *_tp_step(True, "contract", cut=True)) == (0, 0)


@pytest.mark.multiprocess
def test_tensor_parallel_equals_rla_on_one_process(distributed):
    """The plain plan: rla on one process, on a model with TP's arithmetic, gives TP's bits."""
    assert _tp_mismatches(distributed["tp"], *_tp_step(False, "rla")) == (0, 0)


@pytest.mark.multiprocess
def test_tp_reference_models_tensor_parallel_arithmetic(distributed):
    """Without rla on either side, torchtitan's plan compiled as written (aot_eager) equals the
    one-process model of TP's arithmetic with the model's own roundings, bit for bit: the
    reference's TP part is right independently of the sites."""
    got = distributed["tp_sp_as_written"]
    assert got["reports"] == [[], []]
    assert _tp_mismatches(got, *_tp_step(True, "model")) == (0, 0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("setup", ["tp", "tp_sp"])
def test_tensor_parallel_comparison_sees_the_sites(distributed, setup):
    """Without rla's rewrite (the model's own roundings), logits and gradients differ."""
    logits, grads = _tp_mismatches(distributed[setup], *_tp_step(setup == "tp_sp", "model"))
    assert logits > 0 and grads > 0


def test_subclass_graph_that_cannot_be_retraced_says_why(monkeypatch, caplog):
    """A graph with tensor-subclass inputs whose re-trace fails is compiled as written, and its
    report names the subclass and the error."""
    from torch.testing._internal.two_tensor import TwoTensor

    import rla_compile.backend as backend_module

    def fail(gm, example_inputs):
        raise RuntimeError("Unable to cast NotImplemented to Tensor")

    monkeypatch.setattr(backend_module, "pre_dispatch", fail)
    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16)
    backend = rla_compile.Backend(compiler="aot_eager")
    out = torch.compile(lambda x, w: x * w, backend=backend)(x, TwoTensor(w, w))
    torch._dynamo.reset()
    assert torch.equal(out.a, x * w)
    (report,) = backend.reports
    assert not report.sites and report.note == (
        "not aligned: graph inputs are tensor subclasses (TwoTensor) and rla's pre-dispatch re-trace "
        "failed (RuntimeError: Unable to cast NotImplemented to Tensor); compiled as written")


def test_tensor_subclass_inputs_are_aligned():
    """A subclass input without DTensor's conversions re-traces like a tensor."""
    from torch.testing._internal.two_tensor import TwoTensor

    def norm(x, w):
        h = x.to(torch.float32)
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)

    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16)
    backend = rla_compile.Backend(compiler="aot_eager")
    out = torch.compile(norm, backend=backend)(x, TwoTensor(w, w))
    torch._dynamo.reset()
    (report,) = backend.reports
    assert report.counts() == {"rmsnorm": 1} and report.count(status="rewritten") == 1
    assert torch.equal(out.a, ref.rmsnorm(x, w)) and torch.equal(out.b, ref.rmsnorm(x, w))


# -- activation checkpointing -----------------------------------------------------------------
class CheckpointedNano(handwritten.NanoSwiGLU):
    """nanoGPT-SwiGLU with every block under torch.utils.checkpoint."""

    def _block(self, block, x):
        h = x + self._attention(block, block.norm1(x), self.rope)
        normed = block.norm2(h)
        return h + block.w2(F.silu(block.w1(normed)) * block.w3(normed))

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = checkpoint(self._block, block, x, use_reentrant=False)
        return self.head(self.final_norm(x))

    def forward_contract_per_block(self, idx):
        """The contract inside each block; the stream leaves a block as a bf16 sum."""
        eps, x = self.c.eps, self.embed(idx)
        for block in self.blocks:
            attn = self._attention(block, ref.rmsnorm(x, block.norm1.weight, eps), self.rope_contract)
            h, normed = ref.residual_rmsnorm(x, attn, block.norm2.weight, eps)
            x = h + block.w2(ref.gated(block.w1(normed), block.w3(normed)))
        return self.head(ref.rmsnorm(x, self.final_norm.weight, eps))


def test_checkpointed_handwritten_blocks_equal_contract_reference():
    torch.manual_seed(0)
    model, ids = CheckpointedNano().to(torch.bfloat16), tokens()
    backend = rla_compile.Backend(compiler="aot_eager")
    got = _train(model, ids, backend, hf=False)
    (report,) = backend.reports
    assert report.counts() == {"rmsnorm": 3, "residual_rmsnorm": 2, "swiglu": 2, "rope": 4}
    assert report.count(status="rewritten") == len(report.sites)
    model.forward = model.forward_contract_per_block
    assert mismatches(got, _train(model, ids, hf=False)) == 0


def test_hf_gradient_checkpointing_equals_contract_reference():
    model, ids = tiny_causal_lm("llama"), tokens()
    model.gradient_checkpointing_enable()
    model.train()
    backend = rla_compile.Backend(compiler="aot_eager")
    got = _train(model, ids, backend)
    (report,) = backend.reports
    assert report.counts() == {"rmsnorm": 3, "residual_rmsnorm": 2, "swiglu": 2, "rope": 4}
    assert report.count(status="rewritten") == len(report.sites)
    torch._dynamo.reset()
    # Recomputation re-runs a layer on saved inputs, which the reference's by-identity
    # bookkeeping of residual sums cannot follow; checkpointing does not change values.
    model.gradient_checkpointing_disable()
    with contract_sites(model), unit_boundaries(model):
        assert mismatches(got, _train(model, ids)) == 0


def test_the_backward_reads_the_residual_stream_saved(monkeypatch):
    """The residual stream's roundings are saved for the backward (`rewriter.mark_save`), so no
    backward kernel both rounds and upcasts it: without the tag the partitioner recomputed
    the stream from the block outputs, a fused chain of roundings and upcasts whose upcasts
    had to run on ATen (one per residual site; 1.08x plain Inductor's small training step).
    Pinned, the step still equals the contract reference (test_coverage's standard)."""
    import rla_compile.lowering as lowering

    fallbacks, keep = [], lowering.keep_site_roundings

    def counting(graph):
        keep(graph)
        tables = set(lowering.position_tables(graph))  # RoPE's cos/sin run on ATen by design
        fallbacks.append(sum((bool(n.meta.get("should_fallback")) and n not in tables)
                             or n.target is torch.ops.rla.upcast.default for n in graph.nodes))

    monkeypatch.setattr(lowering, "keep_site_roundings", counting)
    model, ids = tiny_causal_lm("llama"), tokens()
    with torch._inductor.config.patch(fx_graph_cache=False):
        _train(model, ids, rla_compile.Backend(pin_rounding=False))
        assert fallbacks == [0, 0]  # the forward graph and the backward graph: no upcast on ATen
        torch._dynamo.reset()
        got = _train(model, ids, rla_compile.Backend(pin_rounding=True))
    torch._dynamo.reset()
    with contract_sites(model):
        reference = _train(model, ids)
    assert_same_parameters(got, reference)
    assert torch.equal(got["logits"], reference["logits"])  # logits bit for bit
    ref.within_one_ulp([got[k] for k in reference], list(reference.values()))


# -- dynamic shapes ---------------------------------------------------------------------------
def _shapes_against_reference(shapes, mark):
    model = tiny_causal_lm("llama")
    backend = rla_compile.Backend(compiler="aot_eager")
    compiled = torch.compile(model, backend=backend)
    for batch, seq in shapes:
        ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seq))
        if mark:
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(ids, 1)
        with torch.no_grad():
            got = compiled(ids, use_cache=False).logits
            with contract_sites(model):
                reference = model(ids, use_cache=False).logits
        assert torch.equal(got, reference), (batch, seq)
    for report in backend.reports:
        assert report.counts() == expected_sites(model.config)
        assert report.count(status="rewritten") == len(report.sites)
    return backend.reports


def test_automatic_dynamic_shapes_recompile_once_and_keep_the_contract():
    """Static first graph; the second sequence length recompiles with a symbolic length,
    which the third reuses."""
    assert len(_shapes_against_reference([(2, 8), (2, 12), (2, 16)], mark=False)) == 2


def test_mark_dynamic_batch_and_length_compile_once():
    assert len(_shapes_against_reference([(2, 8), (3, 12), (4, 16)], mark=True)) == 1


# -- HF Trainer, PEFT -------------------------------------------------------------------------
def test_trainer_with_compiled_model_runs_rla(tmp_path, caplog):
    from transformers import Trainer, TrainingArguments

    model = tiny_causal_lm("llama")
    model.compile(backend="rla", options={"compiler": "aot_eager"})  # in place: Trainer reads forward's signature
    batches = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids, "labels": ids} for ids in batches]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, use_cpu=True,
                             report_to=[], save_strategy="no", logging_steps=1)
    with caplog.at_level(logging.INFO, logger="rla_compile"):
        result = Trainer(model=model, args=args, train_dataset=data).train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    summaries = [r.getMessage() for r in caplog.records if r.name == "rla_compile.graph_pass"]
    assert summaries and all("rewritten residual_rmsnorm=4, rmsnorm=1, rope=4, swiglu=2" in s for s in summaries)


def test_trainer_torch_compile_backend_rla_is_refused_by_accelerate(tmp_path):
    """accelerate's TorchDynamoPlugin accepts only its own enum of backend names. Compile the
    model yourself (above). If this starts passing, update docs/training.md."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), torch_compile=True, torch_compile_backend="rla",
                             use_cpu=True, report_to=[], max_steps=1)
    with pytest.raises(ValueError, match="'RLA' is not a valid DynamoBackend"):
        Trainer(model=tiny_causal_lm("llama"), args=args, train_dataset=[])


def test_peft_lora_model_equals_contract_reference():
    peft = pytest.importorskip("peft")
    base = tiny_causal_lm("llama")
    targets = ["q_proj", "v_proj", "gate_proj", "down_proj"]
    config = peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False)  # random B: adapters active
    model, ids = peft.get_peft_model(base, config), tokens()
    backend = rla_compile.Backend(compiler="aot_eager")
    got = _train(model, ids, backend)  # gradients of the LoRA weights only: the base is frozen
    (report,) = backend.reports
    assert report.counts() == expected_sites(base.config)
    assert report.count(status="rewritten") == len(report.sites)
    torch._dynamo.reset()
    with contract_sites(base):
        assert mismatches(got, _train(model, ids)) == 0
