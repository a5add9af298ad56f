"""``hf-dist doctor``: environment report; under a launcher (``WORLD_SIZE > 1``) also the all-reduce probe.

    hf-dist doctor                                   # this machine
    accelerate launch --multi_gpu --num_processes 8 -m hf_dist.cli doctor     # + bandwidth table, stragglers
    torchrun --nproc_per_node 8 -m hf_dist.cli doctor

Rank 0 prints; exit code 1 when the all-reduce result check fails, 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """``"4096"``, ``"64K"``, ``"16M"``, ``"1G"`` -> bytes (binary units)."""
    text = text.strip().upper().removesuffix("B")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    number = text[: len(text) - len(unit)]
    if not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a positive byte count such as 4096, 64K, 16M or 1G")
    return int(number) * _UNITS[unit]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="environment report; under a launcher also an all-reduce bandwidth probe and straggler check",
        description="Report torch/CUDA/NCCL/gloo, devices and memory and DeepSpeed ops. Started by a launcher "
        "(WORLD_SIZE > 1) it also times all-reduce per message size (algbw, busbw = algbw x 2(n-1)/n, as nccl-tests) "
        "and warns about straggler ranks (> 1.2 x the median).",
    )
    parser.add_argument("--sizes", type=lambda s: tuple(parse_size(x) for x in s.split(",")), default=None,
                        help="comma-separated message sizes, e.g. 1K,1M,64M (default: 1K..256M on GPU, 1K..4M on CPU)")
    parser.add_argument("--iters", type=int, default=None, help="timed all-reduces per size (default 20 GPU, 5 CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed all-reduces per size (default 5 GPU, 2 CPU)")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed op report")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=run)


def _init_group() -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    use_nccl = torch.cuda.is_available() and dist.is_nccl_available()
    if use_nccl:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_nccl else "gloo")


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from hf_dist.doctor import collect_env, format_env, format_probe, run_probe

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = int(os.environ.get("RANK", "0"))
    report = collect_env(with_deepspeed=not args.no_deepspeed) if rank == 0 else None
    result = None
    if launched:
        _init_group()
        try:
            result = run_probe(sizes=args.sizes, iters=args.iters, warmup=args.warmup)
        except ValueError as err:
            print(f"hf-dist doctor: error: {err}", file=sys.stderr)
            return 2
        finally:
            dist.barrier()
            dist.destroy_process_group()
    if rank != 0:
        return 0 if result is None or result.correct else 1
    if args.json:
        payload = {"env": dataclasses.asdict(report), "probe": dataclasses.asdict(result) if result else None}
        print(json.dumps(payload, indent=2, default=str))
    else:
        print(format_env(report))
        if result is None:
            print("all-reduce probe: not run (single process); start under a launcher, e.g. "
                  "accelerate launch --multi_gpu --num_processes N -m hf_dist.cli doctor")
        else:
            print(format_probe(result))
    return 0 if result is None or result.correct else 1
