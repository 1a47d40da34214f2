"""Debug mode: the dump's layout and contents, near misses, torch's log and trace channels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import expecttest
import torch

import rla_compile
from rla_compile.tiny import tiny_causal_lm
from site_cases import CASES
from test_negative import layernorm_by_hand, rsqrt_not_a_norm

ROOT = Path(__file__).resolve().parent.parent
BY_NAME = {c.name: c for c in CASES}


def _compile_with_debug(fn, args, directory):
    backend = rla_compile.Backend(compiler="aot_eager", debug=str(directory))
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return backend


class DumpContents(expecttest.TestCase):
    def test_tiny_llama_dump_layout_and_table(self):
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp) / "dump"
            model = tiny_causal_lm("llama")
            backend = rla_compile.Backend(compiler="aot_eager", debug=str(directory))
            with torch.no_grad():
                torch.compile(model, backend=backend)(torch.randint(0, 128, (1, 8)), use_cache=False)
            index = (directory / "index.txt").read_text().splitlines()
            self.assertEqual(index, ["graph_0_0\t0/0: rewritten residual_rmsnorm=4, rmsnorm=1, rope=4, swiglu=2"])
            folder = directory / "graph_0_0"
            self.assertEqual(
                sorted(p.name for p in folder.iterdir()),
                ["after.py", "after.txt", "before.py", "before.txt", "diff.txt", "report.json", "report.txt"],
            )
            self.assertIn('"bf16[1, 8, 64]"', (folder / "before.py").read_text())  # dtypes on every node
            self.assertIn("# rla: round residual_rmsnorm", (folder / "after.txt").read_text())
            report = json.loads((folder / "report.json").read_text())
            self.assertEqual(len(report["sites"]), 11)
            self.assertExpectedInline((folder / "report.txt").read_text(), """\
rla report for graph 0/0: 11 site(s)
kind              status     variant  dtype  module                                   source                                         reason
----------------  ---------  -------  -----  ---------------------------------------  ---------------------------------------------  ------
rmsnorm           rewritten  llama    bf16   model.layers.0.input_layernorm           modeling_llama.py:66 in forward
rope              rewritten  neox     bf16   model.layers.0.self_attn                 modeling_llama.py:147 in apply_rotary_pos_emb
rope              rewritten  neox     bf16   model.layers.0.self_attn                 modeling_llama.py:148 in apply_rotary_pos_emb
residual_rmsnorm  rewritten  llama    bf16   model.layers.0.post_attention_layernorm  modeling_llama.py:66 in forward
swiglu            rewritten  swiglu   bf16   model.layers.0.mlp                       modeling_llama.py:164 in forward
residual_rmsnorm  rewritten  llama    bf16   model.layers.1.input_layernorm           modeling_llama.py:66 in forward
rope              rewritten  neox     bf16   model.layers.1.self_attn                 modeling_llama.py:147 in apply_rotary_pos_emb
rope              rewritten  neox     bf16   model.layers.1.self_attn                 modeling_llama.py:148 in apply_rotary_pos_emb
residual_rmsnorm  rewritten  llama    bf16   model.layers.1.post_attention_layernorm  modeling_llama.py:66 in forward
swiglu            rewritten  swiglu   bf16   model.layers.1.mlp                       modeling_llama.py:164 in forward
residual_rmsnorm  rewritten  llama    bf16   model.norm                               modeling_llama.py:66 in forward
""")

    def test_diff_of_one_site(self):
        import tempfile

        case = BY_NAME["glu_silu"]
        with tempfile.TemporaryDirectory() as tmp:
            _compile_with_debug(case.fn, case.inputs(torch.bfloat16), tmp)
            diff = (Path(tmp) / "graph_0_0" / "diff.txt").read_text()
        self.assertExpectedInline(diff, """\
--- before.txt
+++ after.txt
@@ -1,5 +1,8 @@
 %arg0_1: bf16[2, 16, 128] = input
 %arg1_1: bf16[2, 16, 128] = input
-%silu: bf16[2, 16, 128] = aten.silu.default(%arg0_1)
-%mul: bf16[2, 16, 128] = aten.mul.Tensor(%silu, %arg1_1)
-return [%mul]
+%arg0_1_fp32: fp32[2, 16, 128] = aten._to_copy.default(%arg0_1, dtype=fp32)
+%silu: fp32[2, 16, 128] = aten.silu.default(%arg0_1_fp32)
+%arg1_1_fp32: fp32[2, 16, 128] = aten._to_copy.default(%arg1_1, dtype=fp32)
+%mul: fp32[2, 16, 128] = aten.mul.Tensor(%silu, %arg1_1_fp32)
+%mul_rounded: bf16[2, 16, 128] = aten._to_copy.default(%mul, dtype=bf16)  # rla: round swiglu
+return [%mul_rounded]
""")


def test_planted_near_misses_are_in_the_dump(tmp_path):
    x = torch.randn(2, 8, 64).bfloat16()

    def planted(x):
        return rsqrt_not_a_norm(x), layernorm_by_hand(x)

    _compile_with_debug(planted, (x,), tmp_path)
    text = (tmp_path / "graph_0_0" / "report.txt").read_text()
    assert "0 site(s)" in text and "near misses (2):" in text
    assert "rmsnorm: rsqrt at top level: abs_1: not a mean or sum/D" in text
    assert "mean-centred input (LayerNorm, not RMSNorm)" in text


def test_recompiles_never_overwrite_a_dump(tmp_path):
    case = BY_NAME["norm_llama"]
    for _ in range(2):
        torch._dynamo.reset()  # compile ids restart at 0/0
        _compile_with_debug(case.fn, case.inputs(torch.bfloat16), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph_0_0", "graph_0_0-1", "index.txt"]
    assert len((tmp_path / "index.txt").read_text().splitlines()) == 2


def _run_example_with_env(env_extra: dict, cwd: Path) -> subprocess.CompletedProcess:
    code = (
        "import torch, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'tests' / 'support')!r})\n"
        "from site_cases import glu_silu\n"
        "g, u = torch.randn(2, 8, 64).bfloat16(), torch.randn(2, 8, 64).bfloat16()\n"
        "torch.compile(glu_silu, backend='rla', options={'compiler': 'aot_eager'})(g, u)\n"
    )
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, check=True)


def test_torch_logs_shows_the_summary(tmp_path):
    done = _run_example_with_env({"TORCH_LOGS": "+rla_compile"}, tmp_path)
    assert "0/0: rewritten swiglu=1" in done.stderr


def test_torch_trace_gets_the_report(tmp_path):
    _run_example_with_env({"TORCH_TRACE": str(tmp_path / "trace")}, tmp_path)
    logs = "".join(p.read_text() for p in (tmp_path / "trace").iterdir())
    assert '"name": "rla_report"' in logs and '"name": "rla_graph_after"' in logs


def test_rla_debug_environment_variable_maps_onto_the_option(tmp_path):
    _run_example_with_env({"RLA_DEBUG": str(tmp_path / "dump")}, tmp_path)
    assert (tmp_path / "dump" / "index.txt").read_text().startswith("graph_0_0\t0/0: rewritten swiglu=1")


def test_graph_report_round_trips_through_its_dict(tmp_path):
    """`to_dict` / `from_dict` (how reports cross processes: vLLM workers, tensor-parallel ranks)
    keep every field, the rank included."""
    from rla_compile.report import GraphReport, NearMiss, SiteReport

    site = SiteReport("rope", "rewritten", "neox", "bfloat16", "model.layers.0.self_attn", "m.py:1 in f", "mul",
                      nodes=("mul", "add"))
    report = GraphReport("0/1", [site], [NearMiss("rmsnorm", "rsqrt", "norm", "no weight")], note="n",
                         seconds={"retrace": 0.5}, rank=3)
    assert GraphReport.from_dict(report.to_dict()) == report
    assert GraphReport.from_dict(json.loads(report.to_json())) == report
    assert "(rank 3)" in GraphReport.from_dict(report.to_dict()).summary()


def test_inspect_cli_writes_the_dump(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "rla_compile.cli", "inspect", "--out", str(tmp_path / "d")],
        capture_output=True, text=True, check=True,
    )
    assert "residual_rmsnorm" in done.stdout and "index.txt lists every graph" in done.stdout
    assert (tmp_path / "d" / "graph_0_0" / "after.py").is_file()


def test_inspect_cli_reads_a_saved_model(tmp_path):
    tiny_causal_lm("qwen3").save_pretrained(tmp_path / "qwen3")
    done = subprocess.run(
        [sys.executable, "-m", "rla_compile.cli", "inspect", str(tmp_path / "qwen3"), "--out", str(tmp_path / "d")],
        capture_output=True, text=True, check=True,
    )
    assert "model.layers.1.self_attn.k_norm" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "rla_compile.cli", "inspect", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode != 0 and "not a model directory" in bad.stderr
