"""Each benchmark script runs at its smallest size, so the scripts cannot rot. (The numbers
are in docs/performance.md; timing is not asserted here.)

The runs, each a benchmark in a fresh process with cold caches (8 minutes of 2 cores), are
marked `bench`: CI runs them (`tox -e extended`, beside the default run), the default run does
not, so that it stays under 15 minutes (docs/testing.md)."""

from __future__ import annotations

import ast
import json
import statistics
import subprocess
from pathlib import Path

import pytest

import rla_compile.sites

from benchmarks.common import RESULTS, module_command, module_env


def _run(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(module_command(f"benchmarks.{name}", *args), capture_output=True, text=True, cwd=cwd,
                          env=module_env(), timeout=900)


def test_every_committed_result_names_the_script_that_writes_it():
    """Each file in benchmarks/results is named in the docstring of one benchmark (the command
    that writes it): a result whose script is gone, or that no script writes, fails here."""
    docs = {p.stem: ast.get_docstring(ast.parse(p.read_text())) or "" for p in RESULTS.parent.glob("*.py")}
    writers = {r.name: [s for s, doc in docs.items() if f"benchmarks/results/{r.name}" in doc] for r in RESULTS.iterdir()}
    assert {name: found for name, found in writers.items() if len(found) != 1} == {}


@pytest.mark.bench
def test_runtime_smoke(tmp_path):
    """Two runs, each in a fresh process, and their spread."""
    done = _run("runtime", "--sizes", "small", "--modes", "inference", "--reps", "1", "--runs", "2", "--json", "r.json",
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (result,) = json.loads((tmp_path / "r.json").read_text())["results"]
    assert set(result["ratio_vs_inductor"]) == {"inductor", "rla", "rla pinned"}
    assert len(result["runs"]) == 2
    ratios = sorted(run["ratio_vs_inductor"]["rla"] for run in result["runs"])
    spread = result["ratio_across_runs"]["rla"]  # over the two runs: their ratios, and the midpoint
    assert [spread["min"], spread["max"]] == ratios and spread["median"] == statistics.median(ratios)
    assert result["ratio_vs_inductor"]["rla"] == spread["median"]


@pytest.mark.bench
def test_moe_cost_smoke(tmp_path):
    """The paired experts' variant and the MoE sites' at the smallest MoE shape; ratios to both
    plain Inductor runs."""
    done = _run("moe_cost", "--layers", "1", "--tokens", "8", "--experts", "8", "--reps", "2", "--modes", "inference",
                "--paired", "--json", "m.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads((tmp_path / "m.json").read_text())["results"]
    names = ["inductor", "rla, MoE sites", "rla, every site, experts paired", "inductor again"]
    assert list(result["median_s"]) == names and result["shape"]["num_experts"] == 8
    again = result["median_s"]["inductor again"]
    assert all(result["ratio_vs_inductor_again"][n] == result["median_s"][n] / again for n in names)
    assert "rla, every site, experts paired" in done.stdout.splitlines()[1]


@pytest.mark.bench
def test_upcasts_before_after_smoke(tmp_path):
    """The tiny Qwen3 (its q/k norms feed RoPE in one kernel): rla's rounding kept inside the
    kernel makes as many kernels as plain Inductor and no upcast call; the ATen upcasts it
    replaced are 2 calls a layer, each splitting a kernel."""
    done = _run("upcasts_before_after", "--sizes", "qwen3-host", "--modes", "inference", "--reps", "1", "--json",
                "u.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (result,) = json.loads((tmp_path / "u.json").read_text())["results"]
    assert set(result["ratio_vs_inductor"]) == {"inductor", "rla (rounding in kernel)", "rla (ATen upcasts)",
                                                "rla (bf16 copy)", "rla (fp64 upcasts)", "rla (prims fallback)",
                                                "inductor again"}
    times, calls = result["times_s"], result["calls"]
    assert max(times["inductor"]) < 50 * min(times["rla (fp64 upcasts)"])  # no compile inside the timed steps
    assert calls["rla (rounding in kernel)"]["generated_kernels"] == calls["inductor"]["generated_kernels"]
    assert "rla::upcast" not in calls["rla (rounding in kernel)"]["op_calls_by_name"]
    assert calls["rla (ATen upcasts)"]["op_calls_by_name"]["rla::upcast"] == 8  # 4 layers: q and k
    assert calls["rla (ATen upcasts)"]["generated_kernels"] > calls["inductor"]["generated_kernels"]


@pytest.mark.bench
def test_residual_save_smoke(tmp_path):
    done = _run("residual_save", "--sizes", "small", "--reps", "1", "--json", "s.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (result,) = json.loads((tmp_path / "s.json").read_text())["results"]
    saved = result["saved_bytes"]
    # the two rla variants compile different graphs: saving the stream keeps more bytes
    assert saved["rla (stream saved)"] > saved["rla (stream recomputed)"] > 0


@pytest.mark.bench
def test_kernel_profile_smoke(tmp_path):
    done = _run("kernel_profile", "--size", "small", "--mode", "inference", "--steps", "1", "--json", "k.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "k.json").read_text())["results"]
    for name in ("inductor", "rla"):  # Inductor's generated kernels show up as events of their own
        assert any(k.startswith("cpp_fused") for k in result["us_per_step"][name])


@pytest.mark.bench
def test_memory_smoke(tmp_path):
    done = _run("memory", "--sizes", "small", "--json", "m.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (result,) = json.loads((tmp_path / "m.json").read_text())["results"]
    assert result["saved_bytes"]["rla"] > 0


@pytest.mark.bench
def test_compile_time_smoke(tmp_path):
    done = _run("compile_time", "--layers", "1", "--json", "c.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (result,) = json.loads((tmp_path / "c.json").read_text())["results"]
    assert result["sites"] == 6 and 0 < result["rla_fraction"] < 1


def test_gpu_script_says_what_it_needs_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the real thing")
    done = _run("gpu", cwd=tmp_path)
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr


@pytest.mark.bench
def test_gpu_attention_smoke_on_cpu(tmp_path):
    """The exact section at its smoke shapes on CPU: the site matched, and under aot_eager its
    output and gradients equal the contract reference's bit for bit (as the GPU run found);
    the script's cost section and its CUDA default refuse to run without CUDA, saying why."""
    import torch

    done = _run("gpu_attention", "--device", "cpu", "--sections", "exact", "--shapes", "smoke", "smoke-padded",
                "--json", "g.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "g.json").read_text())["results"]
    assert results["errors"] == [] and [r["shape"] for r in results["exact"]] == ["smoke", "smoke-padded"]
    for r in results["exact"]:
        exact = r["forms"]["rla attention (aot_eager)"]
        assert exact["rewritten"] == 1 and r["forms"]["rla attention (inductor)"]["rewritten"] == 1
        assert {k: v["equal"] for k, v in exact.items() if k != "rewritten"} == dict.fromkeys(
            ("out", "grad_q", "grad_k", "grad_v"), 1.0)
    if not torch.cuda.is_available():
        done = _run("gpu_attention", cwd=tmp_path)
        assert done.returncode == 2 and "needs a CUDA device" in done.stderr


def test_plot_of_committed_results(tmp_path):
    pytest.importorskip("matplotlib")
    for name in ("runtime_cpu.json", "memory_cpu.json", "compile_time_cpu.json"):
        (tmp_path / name).write_text((RESULTS / name).read_text())
    done = subprocess.run(module_command("benchmarks.plot", str(tmp_path)), capture_output=True, text=True,
                          env=module_env())
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "performance_cpu.png").stat().st_size > 10_000


def _real_shape(tmp_path, *args):
    done = _run("real_shape", "--layers", "1", "--hidden", "64", "--vocab", "512", "--tokens", "16", "--reps", "1",
                "--no-warm-up", "--json", "s.json", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return json.loads((tmp_path / "s.json").read_text())["results"]


@pytest.mark.bench
def test_real_shape_smoke(tmp_path):
    """The real-shape comparison at a toy size (the real one runs by hand: docs/performance.md),
    one run of the default sites (the spread over fresh processes: test_runtime_smoke)."""
    run = _real_shape(tmp_path, "--variants", "rla")  # one run, in this process
    assert set(run["variants"]) == {"inductor", "rla"}
    assert run["variants"]["rla"]["train_rla_s"]["retrace"] > 0
    assert run["variants"]["rla"]["saved_bytes"] > 0 and run["ratio_vs_inductor"]["rla"]["saved_bytes"] > 0


@pytest.mark.slow
def test_real_shape_smoke_every_variant(tmp_path):
    """Every variant by default: the default sites and each opt-in site on top (from the registry)."""
    run = _real_shape(tmp_path)  # one run (`--runs 1`, the default) is its result itself, no "runs" list
    assert set(run["variants"]) == {"inductor", "rla", *(f"rla + {kind}" for kind in rla_compile.sites.OPT_IN_SITES)}


@pytest.mark.bench
def test_attention_forms_smoke(tmp_path):
    done = _run("attention_forms", "--shapes", "shipped", "--reps", "1", "--json", "a.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (result,) = json.loads((tmp_path / "a.json").read_text())["results"]
    assert set(result["ratio_vs_contract"]) == {"sdpa (no rla)", "fp32 sdpa (no rla)", "contract", "chunked",
                                                "vllm_cpu_vec", "vllm_cpu_vec (Python reference)"}
    assert result["ratio_vs_contract"]["contract"] == 1.0
    equal = result["equal_to_reference_out_dq_dk_dv"]
    assert equal["contract"] == [1.0] * 4  # eager kernels: the contract's form is the reference
    assert equal["chunked"][:2] == [1.0] * 2  # output and dq bit for bit in blocks too
    assert all(result["saved_bytes"][name] > 0 for name in result["ratio_vs_contract"])
