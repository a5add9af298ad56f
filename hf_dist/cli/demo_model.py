"""``hf-dist demo-model``: build (once) and print the directory of the offline SmolLM2-135M-Instruct model.

The last line of output is the directory, so a script can do ``MODEL=$(hf-dist demo-model)``.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo-model",
        help="turn the pip-installed SmolLM2-135M-Instruct GGUF into a cached HF model directory; print its path",
    )
    parser.add_argument(
        "--dir", default=None,
        help="model directory (default: $HF_DIST_DEMO_MODEL_DIR or ~/.cache/hf_dist/SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--rebuild", action="store_true", help="convert again even when the directory is complete")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hf_dist.models.demo_model import demo_model_dir

    try:
        path = demo_model_dir(args.dir, rebuild=args.rebuild)
    except ValueError as err:
        print(f"hf-dist demo-model: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0
