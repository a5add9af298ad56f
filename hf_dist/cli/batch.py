"""``hf-dist batch``: resolve the global-batch contract and LR scaling, print the table or the error."""

from __future__ import annotations

import argparse
import sys

from hf_dist.batch import LR_SCALINGS, BatchContract


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "batch",
        help="resolve micro batch x data parallel x accumulation and the scaled learning rate",
        description="Resolve the global-batch contract: accumulation = global / (micro x dp), where dp excludes "
        "tensor- and pipeline-parallel ranks. Prints the table, or the error and exits 2.",
    )
    parser.add_argument("--world-size", type=int, required=True, help="number of processes (GPUs)")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--micro-batch", type=int, required=True, help="sequences per forward on one dp rank")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (default 1)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence, for tokens/step")
    parser.add_argument("--base-lr", type=float, default=None, help="reference learning rate")
    parser.add_argument("--base-batch", type=int, default=None, help="global batch the reference LR was tuned at")
    parser.add_argument("--lr-scaling", choices=LR_SCALINGS, default=None, help="none, linear or sqrt")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    scaling = args.lr_scaling or ("linear" if args.base_lr is not None and args.base_batch is not None else "none")
    try:
        contract = BatchContract(
            world_size=args.world_size,
            global_batch_size=args.global_batch,
            micro_batch_size=args.micro_batch,
            tp=args.tp,
            pp=args.pp,
            seq_len=args.seq_len,
            base_learning_rate=args.base_lr,
            base_batch_size=args.base_batch,
            lr_scaling=scaling,
        )
    except ValueError as err:
        print(f"hf-dist batch: error: {err}", file=sys.stderr)
        return 2
    print(contract.table())
    return 0
