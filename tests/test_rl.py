"""rla in RL training: the environment switch for vLLM, the trainer-side callback, the shipped
model's tokenizer (default run, no vLLM or TRL needed), and a real TRL GRPO run with rla on both
sides (`rl` marker: `tox -e vllm` or `tox -e rl`, TRL 1.16.0 with vllm-cpu 0.32.0)."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rla_compile import OptionError, Options, bundled
from rla_compile.integrations import vllm as rla_vllm

PROBE = Path(__file__).parent / "probes" / "rl_probe.py"
# the shipped 4-layer Qwen3 compiled as one graph (docs/demo.md: 29 sites)
WHOLE_MODEL = {"rmsnorm": 9, "residual_rmsnorm": 8, "rope": 8, "swiglu": 4}


# --- RLA_VLLM / RLA_VLLM_OPTIONS ---------------------------------------------------------


def test_env_off_by_default():
    assert rla_vllm.options_from_env({}) is None
    for off in ("0", "false", "off", ""):
        assert rla_vllm.options_from_env({"RLA_VLLM": off, "RLA_VLLM_OPTIONS": '{"sites": ["rope"]}'}) is None


def test_env_on():
    assert rla_vllm.options_from_env({"RLA_VLLM": "1"}) == Options()
    assert rla_vllm.options_from_env({"RLA_VLLM": "true", "RLA_VLLM_OPTIONS": " "}) == Options()
    opts = rla_vllm.options_from_env({"RLA_VLLM": "1", "RLA_VLLM_OPTIONS": '{"sites": ["rope", "swiglu"], "pin_rounding": true}'})
    assert opts == Options(sites=frozenset({"rope", "swiglu"}), pin_rounding=True)
    # options alone switch it on too
    assert rla_vllm.options_from_env({"RLA_VLLM_OPTIONS": '{"sites": "rope"}'}).sites == {"rope"}


@pytest.mark.parametrize("raw, message", [
    ('{"sites": [rope]}', r"RLA_VLLM_OPTIONS is not valid JSON \(Expecting value: line 1 column 12"),
    ("sites=rope", "RLA_VLLM_OPTIONS is not valid JSON"),
    ('["rope"]', "RLA_VLLM_OPTIONS must be a JSON object of rla options, got '\\[\"rope\"\\]'"),
    ('{"site": ["rope"]}', "RLA_VLLM_OPTIONS: unknown rla option\\(s\\) 'site'"),
    ('{"sites": ["ropes"]}', "RLA_VLLM_OPTIONS: unknown site\\(s\\) 'ropes'"),
])
def test_bad_env_options_name_the_variable(raw, message):
    with pytest.raises(OptionError, match=message) as info:
        rla_vllm.options_from_env({"RLA_VLLM": "1", "RLA_VLLM_OPTIONS": raw})
    assert "RLA_VLLM_OPTIONS" in str(info.value)


def test_bad_env_switch_names_the_variable():
    with pytest.raises(OptionError, match=r"RLA_VLLM='yes please': expected 1 \(on\) or 0 \(off\)"):
        rla_vllm.options_from_env({"RLA_VLLM": "yes please"})


@dataclass
class FakeCompilationConfig:  # the two fields of vLLM's CompilationConfig the merge touches
    inductor_compile_config: dict = field(default_factory=dict)
    ir_enable_torch_wrap: bool | None = None


def test_env_settings_merge_into_the_engines_config():
    """One code path with compilation_config(): the same settings, merged into the engine's own
    config (a copy); the user's Inductor settings and explicit choices win."""
    users = FakeCompilationConfig({"max_autotune": False, "emulate_precision_casts": False})
    merged = rla_vllm._with_rla(users, Options(sites=frozenset({"swiglu"}), pin_rounding=True))
    assert users == FakeCompilationConfig({"max_autotune": False, "emulate_precision_casts": False})  # untouched
    rla_pass = merged.inductor_compile_config["post_grad_custom_post_pass"]
    assert rla_vllm.is_rla_pass(rla_pass) and rla_pass.options.sites == {"swiglu"}
    assert rla_pass is rla_vllm.injected[-1]
    assert merged.inductor_compile_config["emulate_precision_casts"] is False  # the user's, not pin_rounding's
    assert merged.ir_enable_torch_wrap is False
    explicit = rla_vllm._with_rla(FakeCompilationConfig(ir_enable_torch_wrap=True), Options(sites=frozenset({"swiglu"})))
    assert explicit.ir_enable_torch_wrap is True


def test_logits_site_sets_vllms_head_dtype_unless_the_user_did():
    logits = Options(sites=frozenset({"rope", "logits"}))
    assert rla_vllm._engine_overrides(Options(), None) is None  # not selected: nothing to change
    assert rla_vllm._engine_overrides(logits, None) == {"head_dtype": "float32"}
    assert rla_vllm._engine_overrides(logits, {"rope_theta": 1e4}) == {"rope_theta": 1e4, "head_dtype": "float32"}
    assert rla_vllm._engine_overrides(logits, {"head_dtype": "model"}) is None  # the user's choice wins


@pytest.mark.rl
def test_trl_logprob_head_projects_from_fp32():
    """TRL's chunked logprob function, patched, equals log-softmax of the contract's fp32 logits
    (tests/support/contract_reference.py), where stock TRL rounds its bf16 tiles."""
    pytest.importorskip("trl")
    import torch

    import contract_reference as ref
    import trl.trainer.utils as trl_utils
    from rla_compile.integrations import trl as rla_trl

    gen = torch.Generator().manual_seed(0)
    hidden = (2 * torch.randn(40, 64, generator=gen)).bfloat16().requires_grad_()
    weight = (0.3 * torch.randn(256, 64, generator=gen)).bfloat16().requires_grad_()
    targets = torch.randint(0, 256, (40,), generator=gen)
    expected = ref.logits(hidden, weight).log_softmax(-1).gather(-1, targets[:, None])[:, 0]

    def logprobs():
        out = trl_utils._ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 64, None, 1.0, ())
        return out[0]

    stock = logprobs()
    assert rla_trl.align_logprob_head()
    try:
        aligned = logprobs()
    finally:
        rla_trl.disable()
    assert not torch.equal(stock.detach(), expected.detach())  # bf16 tiles: the rounding shows
    torch.testing.assert_close(aligned, expected, rtol=0, atol=2e-6)  # fp32 tiles; only the summation order differs
    aligned.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16


def test_explicit_pass_wins():
    theirs = rla_vllm.make_pass(Options(sites=frozenset({"rmsnorm"})))
    config = FakeCompilationConfig({"post_grad_custom_post_pass": theirs})
    assert rla_vllm._with_rla(config, Options()) is config  # rla's own pass, other options: kept
    own = object()
    config = FakeCompilationConfig({"post_grad_custom_post_pass": own})
    assert rla_vllm._with_rla(config, Options()) is config  # someone else's pass: kept, rla not added


def test_pass_pickles_with_its_options():
    import pickle

    rla_pass = rla_vllm.make_pass(Options(sites=frozenset({"rope"}), pin_rounding=True))
    copied = pickle.loads(pickle.dumps(rla_pass))
    assert copied.options == rla_pass.options and copied.uuid() == rla_pass.uuid()
    assert copy.deepcopy(rla_pass) is rla_pass  # vLLM's config copies share one pass


# --- the trainer side ----------------------------------------------------------------------


def _train(callbacks, steps=2):
    import tempfile

    import torch
    from transformers import Trainer, TrainingArguments

    from rla_compile.tiny import tiny_causal_lm

    model = tiny_causal_lm("qwen3")
    ids = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=steps, use_cpu=True,
                                 report_to=[], save_strategy="no", logging_steps=1)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        result = trainer.train()
    return trainer, result


def test_callback_compiles_the_trained_model():
    from rla_compile.integrations.trl import RlaCallback

    callback = RlaCallback(compiler="aot_eager")
    trainer, result = _train([callback])
    assert math.isfinite(result.training_loss)
    (report,) = callback.backend.reports
    assert report.counts() == {"rmsnorm": 5, "residual_rmsnorm": 4, "rope": 4, "swiglu": 2}
    assert {s.status for s in report.sites} == {"rewritten"}


def test_callback_pairs_the_trainer_with_the_engines_kernel_when_it_samples_with_vllm(monkeypatch):
    """A trainer that samples with vLLM (`use_vllm`) rounds the attention site as vLLM's own
    kernel does here (the probe, stood in for: the default run has no vLLM); without vLLM, or
    with the user's own mode, the options stay as given."""
    from types import SimpleNamespace

    from rla_compile.integrations import trl as rla_trl
    from rla_compile.integrations import vllm_kernels

    monkeypatch.setitem(vllm_kernels.ROUNDING_PROBES, "cpu_attention", lambda: "toward_zero")
    sites = ["rope", "attention"]
    paired = rla_trl.paired_with_engine(Options.from_dict({"sites": sites}), SimpleNamespace(use_vllm=True))
    assert paired.rounding == {"attention": "toward_zero"} and paired.sites == frozenset(sites)
    for args, given in [(SimpleNamespace(use_vllm=False), {}), (SimpleNamespace(), {}),
                        (SimpleNamespace(use_vllm=True), {"attention": "nearest"})]:
        options = Options.from_dict({"sites": sites, "rounding": given})
        assert rla_trl.paired_with_engine(options, args) is options
    # a kernel that follows no mode (AMX: P in bf16) leaves the trainer at the contract's default
    monkeypatch.setitem(vllm_kernels.ROUNDING_PROBES, "cpu_attention", lambda: None)
    assert rla_trl.paired_with_engine(Options.from_dict({"sites": sites}), SimpleNamespace(use_vllm=True)).rounding == {}
    # a vLLM server runs elsewhere: its kernel is not measured here (a warning says what to do)
    server = SimpleNamespace(use_vllm=True, vllm_mode="server")
    options = Options.from_dict({"sites": sites})
    assert rla_trl.paired_with_engine(options, server) is options
    # a colocated engine on CUDA: the attention form its backend pairs with, else a warning
    def engine(backend, device="cuda"):
        return SimpleNamespace(vllm_config=SimpleNamespace(device_config=SimpleNamespace(device_type=device),
                                                           attention_config=SimpleNamespace(backend=backend)))

    colocated = SimpleNamespace(use_vllm=True, vllm_mode="colocate")
    options = Options.from_dict({"sites": sites})
    assert rla_trl.paired_with_engine(options, colocated, engine("TRITON_ATTN")).rounding == {"attention": "vllm_triton"}
    assert rla_trl.paired_with_engine(options, colocated, engine("FLASH_ATTN")) is options
    given = Options.from_dict({"sites": sites, "rounding": {"attention": "nearest"}})
    assert rla_trl.paired_with_engine(given, colocated, engine("TRITON_ATTN")) is given
    trainer = SimpleNamespace(vllm_generation=SimpleNamespace(llm=SimpleNamespace(llm_engine=engine("TRITON_ATTN"))))
    assert rla_trl._colocated_engine(trainer).vllm_config.attention_config.backend == "TRITON_ATTN"
    assert rla_trl._colocated_engine(SimpleNamespace()) is None
    # sites without an engine kernel never run a probe
    monkeypatch.setitem(vllm_kernels.ROUNDING_PROBES, "cpu_attention", lambda: pytest.fail("probed"))
    options = Options.from_dict({"sites": ["rope"]})
    assert rla_trl.paired_with_engine(options, SimpleNamespace(use_vllm=True)) is options

    # the callback compiles with the paired options
    callback = rla_trl.RlaCallback(sites=["rmsnorm", "attention"], compiler="aot_eager")
    monkeypatch.setitem(vllm_kernels.ROUNDING_PROBES, "cpu_attention", lambda: "toward_zero")
    callback.on_train_begin(SimpleNamespace(use_vllm=True), None, None, model=bundled.load())
    callback.on_train_end(None, None, None)
    assert callback.backend.options.rounding == {"attention": "toward_zero"}
    assert callback.options.rounding == {}  # the user's options, as given


def test_a_left_padded_sequence_gets_the_engines_positions():
    """TRL scores left-padded prompts with input_ids and attention_mask only; transformers then
    starts a padded sequence's positions at its padding, vLLM at its first token.
    `positions_from_mask` (the callback adds it when the trainer samples with vLLM) numbers them
    from the first token: the positions RoPE reads are the sequence's own, as the engine's; the
    callback takes the hook off when training ends."""
    import torch

    from rla_compile.integrations import trl as rla_trl

    model = bundled.load()
    seen = []
    rotary = model.model.rotary_emb.register_forward_hook(lambda m, args, out: seen.append(args[1].clone()))
    ids = torch.tensor([[0, 0, 0, 65, 66, 67], [65, 66, 67, 68, 69, 70]])
    mask = (ids != 0).long()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        handle = rla_trl.positions_from_mask(model)
        model(input_ids=ids, attention_mask=mask)
        model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(6)[None].expand(2, 6))  # the caller's own
        handle.remove()
    rotary.remove()
    stock, own, given = seen
    assert stock.tolist() == [[0, 1, 2, 3, 4, 5]]  # transformers: the padding counted
    assert own.tolist() == [[0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5]]
    assert given.tolist() == [[0, 1, 2, 3, 4, 5]] * 2

    from types import SimpleNamespace

    callback = rla_trl.RlaCallback(sites=["rope"], compiler="aot_eager")
    model = bundled.load()
    callback.on_train_begin(SimpleNamespace(use_vllm=True), None, None, model=model)
    assert len(model._forward_pre_hooks) == 1
    callback.on_train_end(None, None, None)
    assert not model._forward_pre_hooks


def test_checkpointing_hooks_do_not_pile_up_and_the_policy_stays_compiled():
    """transformers adds an input-grad hook at every `gradient_checkpointing_enable()` and keeps
    the old ones; TRL toggles checkpointing every step, so a compiled policy recompiles every
    step and turns eager (no rla) after Dynamo's recompile limit. With `fix_checkpointing_hooks`
    one hook stays, and the policy compiles twice (grad on, grad off) however often it toggles."""
    import torch
    from transformers import PreTrainedModel

    import rla_compile
    from rla_compile.integrations import trl as rla_trl

    library_own = PreTrainedModel.enable_input_require_grads
    model = bundled.load()
    for _ in range(3):
        model.gradient_checkpointing_enable()
        model.gradient_checkpointing_disable()
    assert len(model.model.embed_tokens._forward_hooks) == 3  # transformers' own: one more per enable
    assert rla_trl.fix_checkpointing_hooks()
    try:
        model = bundled.load()
        model.train()
        backend = rla_compile.Backend(compiler="aot_eager")
        model.compile(backend=backend)
        ids = torch.tensor(bundled.prompts(2, 16))
        for _ in range(torch._dynamo.config.recompile_limit + 2):  # as TRL: off around scoring, on for the step
            model.gradient_checkpointing_disable()
            with torch.no_grad():
                model(ids, use_cache=False)
            model.gradient_checkpointing_enable()
            model(ids, labels=ids, use_cache=False).loss.backward()
        assert len(model.model.embed_tokens._forward_hooks) == 1
        assert len(backend.reports) == 2 and all(r.counts() for r in backend.reports)
        assert model.model.embed_tokens.weight.grad is not None
    finally:
        rla_trl.disable()
    assert PreTrainedModel.enable_input_require_grads is library_own


def test_callback_says_when_dynamo_gives_up_on_the_policy(caplog):
    """Dynamo's recompile limit turns a compiled function eager, without rla, with one line in
    Dynamo's log: while training, the callback says it on rla's logger and keeps it."""
    import logging

    import torch

    from rla_compile.integrations import trl as rla_trl

    callback = rla_trl.RlaCallback(compiler="aot_eager")
    callback.on_train_begin(None, None, None, model=bundled.load())

    def step(x):
        return x * 2

    compiled = torch.compile(step, backend=callback.backend, dynamic=False)
    with caplog.at_level(logging.WARNING), torch._dynamo.config.patch(recompile_limit=2):
        for n in range(1, 5):  # a new static shape each call: the third recompile is over the limit
            compiled(torch.ones(n))
    callback.on_train_end(None, None, None)
    (hit,) = callback.eager_fallbacks.hits
    assert "recompile_limit" in hit and "'step'" in hit
    (said,) = [r for r in caplog.records if r.name == rla_trl.__name__ and "WITHOUT rla's sites" in r.getMessage()]
    assert said.levelno == logging.WARNING and "function: 'step'" in said.getMessage()
    # detached at the end of training
    assert callback.eager_fallbacks not in logging.getLogger(rla_trl.EagerFallbacks.LOGGER).handlers


def test_enable_reaches_every_trainer_and_disable_undoes_it():
    from rla_compile.integrations import trl as rla_trl

    with pytest.raises(OptionError, match="unknown site"):
        rla_trl.enable(sites=["ropes"], vllm=False)
    rla_trl.enable(vllm=False, compiler="aot_eager")
    try:
        trainer, _ = _train(None, steps=1)
        (callback,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, rla_trl.RlaCallback)]
        assert callback.backend.reports and callback.options.compiler == "aot_eager"
        assert "RLA_VLLM" not in os.environ  # vllm=False leaves engines alone
    finally:
        rla_trl.disable()
    trainer, _ = _train(None, steps=1)
    assert not [c for c in trainer.callback_handler.callbacks if isinstance(c, rla_trl.RlaCallback)]


def test_enable_sets_the_vllm_switch(monkeypatch):
    from rla_compile.integrations import trl as rla_trl

    monkeypatch.setitem(sys.modules, "vllm", None)  # as without vLLM: the variables only
    rla_trl.enable(trainer=False, sites=["rope", "swiglu"], compiler="aot_eager")
    try:
        assert os.environ["RLA_VLLM"] == "1"
        assert rla_vllm.options_from_env() == Options(sites=frozenset({"rope", "swiglu"}))
    finally:
        rla_trl.disable()
    assert rla_vllm.options_from_env() is None


def test_disable_leaves_the_environment_as_it_found_it(monkeypatch):
    """A variable the user had set before `enable()` is theirs again after `disable()`; one that
    was unset is unset again."""
    from rla_compile.integrations import trl as rla_trl

    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setenv("RLA_VLLM_OPTIONS", '{"sites": ["rope"]}')  # the user's own
    monkeypatch.delenv("RLA_VLLM", raising=False)
    before = dict(os.environ)
    rla_trl.enable(trainer=False, sites=["swiglu"])
    try:
        assert os.environ["RLA_VLLM"] == "1" and json.loads(os.environ["RLA_VLLM_OPTIONS"])["sites"] == ["swiglu"]
    finally:
        rla_trl.disable()
    assert dict(os.environ) == before


def test_enable_without_trl_says_what_is_on_and_off(monkeypatch, caplog):
    """Without TRL (and vLLM), `enable()` still switches rla on for transformers' Trainer and sets
    the vLLM variables, and says so: the parts it could not switch on, and why, in its return
    value and in a warning."""
    import logging

    from rla_compile.integrations import trl as rla_trl

    for name in ("trl", "trl.trainer.utils", "vllm"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with caplog.at_level(logging.INFO, logger=rla_trl.__name__):
        status = rla_trl.enable(sites=["rope", "logits"], compiler="aot_eager")
    try:
        assert status.on[0] == "RlaCallback on every transformers.Trainer built afterwards"
        assert any(part.startswith("RLA_VLLM=1") for part in status.on)
        assert status.off == {
            "TRL's trainers": "TRL is not installed: pip install 'rla_compile[rl]'",
            "TRL's logprob head in fp32 (the logits site)": "TRL is not installed",
            "rla in this process's vLLM engines": f"vLLM is not installed: {rla_vllm.INSTALL}",
        }
        (record,) = [r for r in caplog.records if r.name == rla_trl.__name__]
        assert record.levelno == logging.WARNING and record.getMessage() == str(status)
        assert "NOT switched on: TRL's trainers (TRL is not installed" in str(status)
    finally:
        rla_trl.disable()


def test_enable_parses_the_options_once(monkeypatch):
    """One `enable()` and the trainers built after it share one parsed `Options`; the vLLM
    variables are written from it, for other processes, not read back."""
    from rla_compile.integrations import trl as rla_trl

    monkeypatch.setitem(sys.modules, "vllm", None)
    parsed = []
    from_dict = Options.from_dict.__func__
    monkeypatch.setattr(Options, "from_dict", classmethod(lambda cls, o: parsed.append(o) or from_dict(cls, o)))
    rla_trl.enable(sites=["rope", "swiglu"], compiler="aot_eager")
    try:
        trainer, _ = _train(None, steps=1)
        (callback,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, rla_trl.RlaCallback)]
        assert parsed == [{"sites": ["rope", "swiglu"], "compiler": "aot_eager"}]
        assert callback.options == Options(sites=frozenset({"rope", "swiglu"}), compiler="aot_eager")
        assert json.loads(os.environ["RLA_VLLM_OPTIONS"]) == {"sites": ["rope", "swiglu"]}  # compiler is the trainer's
    finally:
        rla_trl.disable()


# --- patches, and the way back -------------------------------------------------------------


def test_patching_restores_what_the_owner_had():
    from rla_compile.integrations import patching

    class Base:
        def inherited(self):
            return "base"

    class Library(Base):
        def own(self):
            return "own"

    own, inherited = Library.__dict__["own"], Base.__dict__["inherited"]
    assert patching.original(Library, "own") is own
    patching.patch(Library, "own", lambda self: "first")
    patching.patch(Library, "own", lambda self: "second")  # replaces rla's value: no stacking
    patching.patch(Library, "inherited", lambda self: "patched")
    assert (Library().own(), Library().inherited()) == ("second", "patched")
    assert patching.original(Library, "own") is own and patching.original(Library, "inherited") is inherited
    patching.undo_all()
    assert Library.__dict__["own"] is own
    assert "inherited" not in Library.__dict__ and Library.inherited is inherited  # inherited again, not copied down
    patching.undo_all()  # nothing left: a no-op
    assert Library.__dict__["own"] is own


def test_disable_gives_transformers_its_trainer_back(monkeypatch):
    from transformers import Trainer

    from rla_compile.integrations import trl as rla_trl

    monkeypatch.setitem(sys.modules, "vllm", None)
    own = Trainer.__init__
    rla_trl.enable(compiler="aot_eager")
    rla_trl.enable(compiler="aot_eager", sites=["rope"])  # twice: still one wrapper around transformers' own
    assert Trainer.__init__ is not own and Trainer.__init__.__wrapped__ is own
    rla_trl.disable()
    assert Trainer.__init__ is own and "RLA_VLLM" not in os.environ


@pytest.mark.rl
def test_disable_gives_trl_and_vllm_their_functions_back():
    """Every patch rla makes in TRL and vLLM, undone by `disable()` (runs where both are
    installed: `tox -e rl`)."""
    pytest.importorskip("trl")
    pytest.importorskip("vllm")
    import trl.trainer.utils as trl_utils
    from trl.generation.vllm_generation import VLLMGeneration
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from rla_compile.integrations import trl as rla_trl

    owners = [(EngineArgs, "create_engine_config"), (RotaryEmbedding, "__init__"),
              (VLLMGeneration, "sync_weights"), (trl_utils, "_ChunkedLogProbFunction")]
    rla_trl.disable()  # from what other tests in this process left
    own = [vars(owner)[name] for owner, name in owners]
    status = rla_trl.enable(sites=["rope", "logits"], compiler="aot_eager")
    rla_vllm.compilation_config(sites=["rope"])  # the fp32 RoPE tables
    rla_trl.fix_weight_sync()  # a no-op off vLLM-CPU
    assert "TRL's logprob head in fp32 (the logits site)" in status.on
    assert EngineArgs.create_engine_config is not own[0] and RotaryEmbedding.__init__ is not own[1]
    rla_trl.disable()
    assert all(vars(owner)[name] is fn for (owner, name), fn in zip(owners, own))


# --- the shipped model's tokenizer ---------------------------------------------------------


def test_shipped_tokenizer_is_bytes(tmp_path):
    from transformers import AutoTokenizer

    shipped = AutoTokenizer.from_pretrained(bundled.MODEL_DIR)
    text = "def f(x):\n\treturn x  # é ✓ \x00"
    ids = shipped(text, add_special_tokens=False)["input_ids"]
    assert ids == bundled.encode(text) and shipped.decode(ids) == text
    assert (shipped.bos_token_id, shipped.eos_token_id, shipped.pad_token_id, len(shipped)) == (2, 3, 3, 256)
    written = bundled.save_tokenizer(tmp_path)  # the shipped files are the builder's
    assert sorted(p.name for p in written) == ["tokenizer.json", "tokenizer_config.json"]
    for path in written:
        assert json.loads(path.read_text()) == json.loads((bundled.MODEL_DIR / path.name).read_text())


# --- TRL GRPO with a real vLLM-CPU engine ----------------------------------------------------


@pytest.mark.rl
def test_grpo_trl_with_rla_on_both_sides(tmp_path):
    """examples/grpo_trl.py at 2 steps: TRL logs the trainer/vLLM logprob difference, both
    sides report the shipped model's 29 sites rewritten, and the weight sync reaches vLLM-CPU."""
    pytest.importorskip("trl")
    pytest.importorskip("vllm")
    env = rla_vllm.engine_env(tmp_path / "vllm_cache")
    for name in ("RLA_VLLM", "RLA_VLLM_OPTIONS", "RLA_VLLM_FP32_ROPE"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(PROBE), "--steps", "2"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])

    steps = [log for log in result["logs"] if "sampling/sampling_logp_difference/mean" in log]
    assert [log["step"] for log in steps] == [1, 2]
    for log in steps:
        mean, top = log["sampling/sampling_logp_difference/mean"], log["sampling/sampling_logp_difference/max"]
        assert 0 < mean <= top < 1  # the stacks differ (GEMMs, attention), a little
        ratio = [log[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")]
        assert 0 < ratio[0] <= ratio[1] <= ratio[2] and all(map(math.isfinite, ratio))
        assert 0 <= log["reward"] <= 1 and math.isfinite(log["loss"])

    # vLLM-CPU compiles the whole model as one graph: every site, rewritten
    assert result["vllm_reports"] == [{"graph": "vllm_0", "counts": WHOLE_MODEL, "statuses": ["rewritten"]}]
    # the trainer: TRL's no-grad scoring forward (the logprobs it compares with vLLM's) is one
    # graph with every site; the training forward is cut per layer by TRL's default gradient
    # checkpointing (docs/rl.md); graphs after TRL's logprob function have no sites
    trainer = result["trainer_reports"]
    assert WHOLE_MODEL in [r["counts"] for r in trainer]
    assert {"rmsnorm": 13, "residual_rmsnorm": 4, "rope": 8, "swiglu": 4} in [r["counts"] for r in trainer]
    assert all(r["statuses"] == ["rewritten"] for r in trainer if r["counts"])
    # the weight sync (reload_weights on vLLM-CPU) put the trained weights into the engine
    assert result["embed_trained"] and result["embed_synced"]
    # the example's own printout
    assert "step 2: logp-diff mean" in done.stdout


@pytest.mark.rl
def test_rl_benchmark_smoke(tmp_path):
    """`python -m benchmarks.rl` at its smallest: the fullest configuration (every site on both
    sides, the trainer's attention paired with vLLM's kernel) on the MoE model (its experts
    paired with vLLM-CPU's fused MoE kernel, its weights synced into the engine and re-packed),
    one step, the progress line, the table and the JSON."""
    pytest.importorskip("trl")
    pytest.importorskip("vllm")
    from benchmarks.common import module_command, module_env

    done = subprocess.run(module_command("benchmarks.rl", "--steps", "1", "--configs", "all", "--model", "moe",
                                         "--json", str(tmp_path / "rl.json")),
                          capture_output=True, text=True, cwd=tmp_path, env=module_env(), timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    (result,) = json.loads((tmp_path / "rl.json").read_text())["results"]
    assert result["config"] == "all" and result["model"] == "moe" and result["compiled_graphs"] >= 1
    assert any(counts.get("rope") == 8 and counts.get("attention") == 4 and counts.get("router") == 4
               and counts.get("expert_combine") == 4 for counts in result["trainer_sites"])
    from rla_compile.integrations.vllm_kernels import cpu_attention_kernel

    mode = cpu_attention_kernel()[1]  # this machine's kernel, measured: the trainer rounds as it does
    assert result["trainer_rounding"] == ({} if mode in (None, "nearest") else {"attention": mode})
    (step,) = result["steps"]
    assert step["step"] == 1 and 0 <= step["logp_diff_mean"] <= step["logp_diff_max"] and step["step_time"] > 0
    assert step["k3"] >= 0 and 0 <= step["bitwise"] <= 1  # on the same tokens as TRL's metric
    # the experts paired and the synced weights packed: TRL's gap is fp32 noise (stock: about 1e-3)
    assert step["logp_diff_mean"] < 1e-5
    assert "all seed 0 step 1/1: logp-diff mean" in done.stderr  # the progress line
    assert done.stdout.splitlines()[1].startswith("all")
