"""The command line.

    rla-compile demo                      the shipped model: its sites, and the mismatch baseline vs aligned
    rla-compile mismatch [MODEL_DIR]      trainer vs inference mismatch: rla off / one side / both, per site
    rla-compile inspect [MODEL_DIR]       align a model, write the debug dump, print the site table

Progress and diagnostics go to stderr, results (reports, tables) to stdout. Arguments are
checked before any slow step; torch is imported only once they are (`--help` is instant).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import __version__, bundled
from .progress import say_progress, timed
from .site_names import OPT_IN, check_site_names, default_sites

__all__ = ["main"]

SEEDS = 2**64  # torch.manual_seed's range


def whole_number(low: int, high: int | None = None):
    """An argparse `type`: an int from `low` (to `high`), or an error that names the range
    (argparse prefixes the argument's name)."""
    valid = f"a whole number >= {low}" if high is None else f"a whole number from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: use {valid}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range: use {valid}")
        return value

    return parse


def _load(model_dir: str | None, model_type: str):
    """The model in `model_dir` (bf16, as `bundled.load` loads any; stderr says so when its
    weights were saved in another dtype), or the embedded tiny one."""
    if model_dir is None:
        from .tiny import tiny_causal_lm

        return tiny_causal_lm(model_type)
    cast = bundled.cast_note(model_dir)
    if cast:
        say_progress(cast)
    return bundled.load("bfloat16", model_dir)


def inspect_model(model_dir: str | None, model_type: str, out: str, tokens: int, train: bool, sites: str | None) -> int:
    # before any slow import: the directory and the site names
    if model_dir is not None:
        bundled.check_model_dir(model_dir, default=f"the embedded tiny {model_type} (--model picks the family)")
    if sites:
        check_site_names(sites, "--sites")
    model = _load(model_dir, model_type)
    import torch

    from .backend import Backend

    options = {"debug": out} | ({"sites": sites} if sites else {})
    be = Backend(compiler="aot_eager", **options)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend=be)
    if train:
        compiled(ids, labels=ids, use_cache=False).loss.backward()
    else:
        with torch.no_grad():
            compiled(ids, use_cache=False)
    for report in be.reports:
        print(report)
        print()
    print(f"debug dump: {Path(out).resolve()} (index.txt lists every graph)")
    return 0


def check_outputs(args) -> None:
    """Fail before minutes of work, not after: what --plot and --json need."""
    if getattr(args, "plot", None):
        try:
            import matplotlib  # noqa: F401
        except ImportError as error:
            raise ImportError("--plot needs matplotlib: pip install 'rla_compile[bench]'") from error
    for flag in ("json", "plot"):
        path = getattr(args, flag, None)
        if path and not Path(path).resolve().parent.is_dir():
            raise FileNotFoundError(f"--{flag} {path}: the directory {Path(path).resolve().parent} does not exist")


def read_stack(text: str | None, flag: str):
    """A stack label from the command line as a `Stack` (None stays None, as do the inference
    shortcuts 'vllm' and 'hf'), checked before torch is imported, vLLM's presence included."""
    from .mismatch.stacks import Stack, require_vllm

    if text is None or text == "hf":
        return text
    stack = Stack("vllm", "inductor") if text == "vllm" else Stack.parse(text)
    if stack.engine == "vllm":
        require_vllm(f"{flag} {text}")
    return text if text == "vllm" else stack


def run_mismatch(args) -> int:
    check_outputs(args)
    # before torch is imported: the model directory, the stacks, and room for the prompts in the held-out text
    model_dir = bundled.check_model_dir(args.model_dir or bundled.MODEL_DIR)
    if args.localise:
        a, b = (read_stack(s, "--localise") for s in args.localise)
    else:
        trainer, inference = read_stack(args.trainer, "--trainer"), read_stack(args.inference, "--inference")
    prompts = bundled.prompts(args.prompts, args.prompt_tokens)
    from . import mismatch

    if args.localise:
        a, b = a.paired(b), b.paired(a)  # an HF trainer against vLLM rounds as vLLM's own kernels do here
        cast = bundled.cast_note(model_dir, {"bfloat16", a.dtype, b.dtype})  # the sampler runs bf16
        if cast:
            say_progress(cast)
        with timed(say_progress, f"sampling {args.prompts} continuations of {args.new_tokens} tokens from "
                                 f"{model_dir.name} (HF, eager)"):
            sequences = mismatch.sample(model_dir, prompts, args.new_tokens, args.seed)
        with timed(say_progress, f"running {a.label} and {b.label}, recording every point, then each unrecorded"):
            result = mismatch.localise(a, b, sequences, model_dir, prompt_tokens=args.prompt_tokens)
        print(result.table())
        if args.json:
            Path(args.json).write_text(json.dumps(result.to_dict(), indent=2))
        return 0
    report = mismatch.measure(model_dir, trainer, inference, ablation=args.ablation, prompts=args.prompts,
                              prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, seed=args.seed,
                              say=say_progress)
    print(report.table())
    if args.json:
        Path(args.json).write_text(report.to_json())
    if args.plot:
        print(f"plot: {report.plot(args.plot)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rla-compile", description="Rounding-location alignment for torch.compile.")
    parser.add_argument("--version", action="version", version=f"rla-compile {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="the shipped model: the sites rla finds, then the mismatch baseline vs aligned")
    demo.add_argument("--inference", choices=("vllm", "hf"), help="inference stack (default: vllm when installed, else hf)")

    mismatch = commands.add_parser("mismatch", help="measure the trainer/inference mismatch; per-site ablation; localise")
    mismatch.add_argument("model_dir", nargs="?", help="a local HF model directory (default: the shipped model)")
    mismatch.add_argument("--trainer",
                          help="training stack (default: hf-inductor:train); form engine-compiler[:dtype][:train]")
    mismatch.add_argument("--inference", help="'vllm', 'hf' or a stack such as vllm-eager, hf-aot_eager, "
                                              "vllm-inductor:decode (the logprobs vLLM returns while generating) "
                                              "(default: vllm when installed, else hf = hf-aot_eager)")
    mismatch.add_argument("--ablation", action="store_true", help="align each site alone on both sides, then all")
    mismatch.add_argument("--prompts", type=whole_number(1), default=8, help="sequences (default: 8)")
    mismatch.add_argument("--prompt-tokens", type=whole_number(1), default=32, help="prompt length (default: 32)")
    mismatch.add_argument("--new-tokens", type=whole_number(1), default=64,
                          help="sampled tokens per sequence (default: 64)")
    mismatch.add_argument("--seed", type=whole_number(0, SEEDS - 1), default=0,
                          help="seed of the sampler that draws the continuations (default: 0)")
    mismatch.add_argument("--json", help="write the report as JSON here")
    mismatch.add_argument("--plot", help="write a PNG (δ histograms and per-configuration bars) here")
    mismatch.add_argument("--localise", nargs=2, metavar=("A", "B"),
                          help="instead: where two stacks part, per layer and point (e.g. hf-aot_eager hf-inductor, "
                               "or hf-inductor+rla:train vllm-inductor+rla)")

    inspect = commands.add_parser("inspect", help="align a model and write the debug dump (graphs, diffs, reports)")
    inspect.add_argument("model_dir", nargs="?", help="a local HF model directory (default: the embedded tiny model)")
    inspect.add_argument("--model", default="llama", help="model type of the embedded tiny model (default: llama)")
    inspect.add_argument("--out", default="rla_debug", help="dump directory (default: ./rla_debug)")
    inspect.add_argument("--tokens", type=whole_number(1), default=16, help="tokens to trace with (default: 16)")
    inspect.add_argument("--train", action="store_true", help="trace a training step (forward + backward)")
    inspect.add_argument("--sites", help=f"comma-separated sites to align (default: {','.join(default_sites())}; "
                                         f"opt-in: {','.join(OPT_IN)})")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "mismatch" and args.localise:
        ignored = [f"--{flag}" for flag in ("trainer", "inference", "ablation", "plot") if getattr(args, flag)]
        if ignored:
            parser.error(f"mismatch --localise compares its own two stacks: drop {', '.join(ignored)}")
    try:
        if args.command == "demo":
            if args.inference == "vllm":  # before minutes of compiling, not after
                from .mismatch.stacks import require_vllm

                require_vllm("demo --inference vllm")
            from .demo import run_demo

            run_demo(args.inference)
            return 0
        if args.command == "mismatch":
            return run_mismatch(args)
        return inspect_model(args.model_dir, args.model, args.out, args.tokens, args.train, args.sites)
    except (ImportError, ValueError, FileNotFoundError) as error:
        print(f"rla-compile {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
