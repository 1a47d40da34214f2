"""The command line.

    rla-compile demo                      sites of an embedded tiny model, and the mismatch rla removes
    rla-compile inspect [MODEL_DIR]       align a model, write the debug dump, print the site table
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main"]


def _load(model_dir: str | None, model_type: str):
    import torch

    if model_dir is None:
        from .tiny import tiny_causal_lm

        return tiny_causal_lm(model_type)
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise SystemExit(f"rla-compile inspect: {model_dir} is not a model directory (no config.json); "
                         "pass a directory written by save_pretrained, or no path for the embedded tiny model")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="eager", local_files_only=True
    )


def inspect_model(model_dir: str | None, model_type: str, out: str, tokens: int, train: bool, sites: str | None) -> int:
    import torch

    from .backend import backend

    model = _load(model_dir, model_type)
    options = {"debug": out} | ({"sites": sites} if sites else {})
    be = backend(inner="aot_eager", **options)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rla-compile", description="Rounding-location alignment for torch.compile.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="find and align the sites of an embedded tiny model; show the mismatch it removes")
    demo.add_argument("--model", default="llama", help="HF model type of the tiny model (default: llama)")
    demo.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2)")
    demo.add_argument("--tokens", type=int, default=32, help="tokens per sequence (default: 32)")

    inspect = commands.add_parser("inspect", help="align a model and write the debug dump (graphs, diffs, reports)")
    inspect.add_argument("model_dir", nargs="?", help="a local HF model directory (default: the embedded tiny model)")
    inspect.add_argument("--model", default="llama", help="model type of the embedded tiny model (default: llama)")
    inspect.add_argument("--out", default="rla_debug", help="dump directory (default: ./rla_debug)")
    inspect.add_argument("--tokens", type=int, default=16, help="tokens to trace with (default: 16)")
    inspect.add_argument("--train", action="store_true", help="trace a training step (forward + backward)")
    inspect.add_argument("--sites", help="comma-separated sites to align (default: all)")

    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from .demo import run_demo

            run_demo(args.model, args.layers, args.tokens)
            return 0
        return inspect_model(args.model_dir, args.model, args.out, args.tokens, args.train, args.sites)
    except ImportError as error:
        print(f"rla-compile {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
