"""The ``hf-dist`` command line: one module per subcommand, each with ``register(subparsers)``.

A subcommand module adds its parser and sets ``func`` (``args -> exit code``) as the default.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Each name is a module hf_dist.cli.<name> with register(subparsers).
SUBCOMMANDS: tuple[str, ...] = ("batch", "checkpoint", "plan", "config", "doctor", "report", "pp", "demo_model")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-dist",
        description="hf_dist: take Hugging Face causal LMs from one GPU to many.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"hf_dist.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
