"""The command line: `rla-compile demo`."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rla-compile", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="find and align the sites of an embedded tiny model; show the logprob mismatch it removes"
    )
    demo.add_argument("--model", default="llama", help="HF model type of the tiny model (default: llama)")
    demo.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2)")
    demo.add_argument("--tokens", type=int, default=32, help="tokens per sequence (default: 32)")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from .demo import run_demo

        try:
            run_demo(args.model, args.layers, args.tokens)
        except ImportError as error:
            print(f"rla-compile demo: {error}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
