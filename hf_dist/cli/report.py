"""``hf-dist report RUN_DIR``: draw a run's loss, throughput, memory and step-time curves to a PNG."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "report",
        help="draw loss, throughput and memory curves of a run to PNG",
        description="Read RUN_DIR/log_history.jsonl (written by DistTrainer with --dist_logging true; else the "
        "newest trainer_state.json) and RUN_DIR/summary.json if present, and draw loss, tokens/s (+MFU), per-rank "
        "peak memory and per-rank busy time to one PNG.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the training output_dir")
    parser.add_argument("--out", default=None, metavar="PNG", help="image path (default RUN_DIR/report.png)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hf_dist.report import draw_report

    try:
        out, panels = draw_report(args.run_dir, args.out)
    except ValueError as err:
        print(f"hf-dist report: {err}")
        return 2
    print(f"wrote {out} ({', '.join(panels)})")
    return 0
