"""``hf-dist config``: write the configs for a layout you name (no choosing: that is ``hf-dist plan``).

Also ``--ship`` (regenerate ``ds_configs/`` and ``accelerate_configs/``) and ``--check FILE...`` (read files back
strictly and report the first problem of each).
"""

from __future__ import annotations

import argparse
import sys

from hf_dist.batch import BatchContract
from hf_dist.configs.launch import LaunchSpec, describe, layout_files, write_files
from hf_dist.strategy import OFFLOADS, STRATEGIES, Layout


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "config",
        help="write accelerate/DeepSpeed/hf_dist configs and the launch command for a named layout",
        description="Write accelerate.yaml, deepspeed.json (ZeRO), hf_dist.yaml (TP/PP and batch) and launch.sh for "
        "the layout you name. Accumulation is derived: global / (micro x dp), dp = GPUs x nodes / (tp x pp).",
    )
    parser.add_argument("--strategy", choices=STRATEGIES, help="data-parallel flavour")
    parser.add_argument("--gpus", type=int, help="GPUs (processes) per node")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument("--micro-batch", type=int, help="sequences per forward on one data-parallel rank")
    parser.add_argument("--global-batch", type=int, help="sequences per optimizer step across all ranks")
    parser.add_argument("--tp", type=int, default=1, help="hf_dist tensor-parallel degree (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="hf_dist pipeline-parallel degree (default 1)")
    parser.add_argument("--ep", type=int, default=1, help="hf_dist expert-parallel degree for MoE models (default 1)")
    parser.add_argument("--cp", type=int, default=1, help="hf_dist context-parallel degree (default 1)")
    parser.add_argument("--model", help="local model directory or model_type (e.g. llama): FSDP wrap classes, and "
                        "the layout checked against the model as the run checks it")
    parser.add_argument("--wrap", help="comma-separated layer classes FSDP wraps (instead of --model)")
    parser.add_argument("--precision", choices=("bf16", "fp16", "no"), default="bf16", help="default bf16")
    parser.add_argument("--offload", choices=OFFLOADS, default="none",
                        help="cpu (ZeRO: optimizer, ZeRO-3 also parameters; FSDP: parameters, gradients, optimizer), "
                        "cpu_optimizer (ZeRO-3 optimizer only), nvme (ZeRO-3); default none")
    parser.add_argument("--tp-sequence-parallel", action="store_true", help="with --tp: sequence parallelism")
    parser.add_argument("--tp-vocab-parallel", action="store_true", help="with --tp: vocabulary-parallel head")
    parser.add_argument("--fsdp-version", type=int, choices=(1, 2), default=2, help="default 2 (fully_shard)")
    parser.add_argument("--no-activation-checkpointing", action="store_true", help="keep all activations")
    parser.add_argument("--main-process-ip", help="node-0 address (multi-node; default: given at launch)")
    parser.add_argument("--main-process-port", type=int, help="node-0 port (multi-node; default: given at launch)")
    parser.add_argument("--out", help="folder to write into (files already there are refused; see --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of an earlier --out")
    parser.add_argument("--ship", nargs="?", const=".", metavar="ROOT",
                        help="regenerate the shipped ds_configs/ and accelerate_configs/ under ROOT (default .)")
    parser.add_argument("--check", nargs="+", metavar="PATH",
                        help="read config files (or layout folders) back strictly and report problems")
    parser.set_defaults(func=run)


def _wrap_classes(args: argparse.Namespace) -> tuple[str, ...] | None:
    if args.wrap:
        return tuple(c.strip() for c in args.wrap.split(",") if c.strip())
    if args.model and args.strategy.startswith("fsdp_"):
        from hf_dist.configs.model_info import no_split_modules

        return no_split_modules(args.model)
    return None


def _layout(args: argparse.Namespace) -> LaunchSpec:
    missing = [flag for flag, value in (("--strategy", args.strategy), ("--gpus", args.gpus),
                                        ("--micro-batch", args.micro_batch), ("--global-batch", args.global_batch),
                                        ("--out", args.out)) if value is None]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}; a layout needs --strategy, --gpus, --micro-batch, "
                         f"--global-batch and --out")
    layout = Layout(strategy=args.strategy, num_gpus=args.gpus, num_nodes=args.nodes, tp=args.tp, pp=args.pp,
                    ep=args.ep, cp=args.cp, offload=args.offload, sequence_parallel=args.tp_sequence_parallel,
                    vocab_parallel=args.tp_vocab_parallel)
    if args.model:  # the run's own answer for this model (hf_dist.support), before a file is written
        from hf_dist.configs.model_info import load_config
        from hf_dist.support import check_model_layout

        check_model_layout(load_config(args.model), layout)
    contract = BatchContract(world_size=layout.world_size, global_batch_size=args.global_batch,
                             micro_batch_size=args.micro_batch, tp=args.tp, pp=args.pp, cp=args.cp)
    return LaunchSpec(
        layout=layout, micro_batch_size=args.micro_batch,
        gradient_accumulation_steps=contract.gradient_accumulation_steps, mixed_precision=args.precision,
        no_split_modules=_wrap_classes(args), gradient_checkpointing=not args.no_activation_checkpointing,
        fsdp_version=args.fsdp_version, main_process_ip=args.main_process_ip,
        main_process_port=args.main_process_port,
    )


def _check(paths: list[str]) -> int:
    from pathlib import Path

    from hf_dist.configs.strict import read_config_file, read_layout_dir

    failed = 0
    for name in paths:
        try:
            read_layout_dir(name) if Path(name).is_dir() else read_config_file(name)
            print(f"ok: {name}")
        except (ValueError, OSError) as err:
            failed += 1
            print(f"error: {err}" if name in str(err) else f"error: {name}: {err}", file=sys.stderr)
    return 2 if failed else 0


def run(args: argparse.Namespace) -> int:
    if args.check:
        return _check(args.check)
    if args.ship is not None:
        from hf_dist.configs.ship import regenerate

        for path in regenerate(args.ship):
            print(path)
        return 0
    try:
        layout = _layout(args)
        written = write_files(args.out, layout_files(layout, args.out), overwrite=args.overwrite)
    except ValueError as err:
        print(f"hf-dist config: error: {err}", file=sys.stderr)
        return 2
    print(describe(layout))
    for path in written:
        print(f"wrote {path}")
    print(f"launch: bash {args.out.rstrip('/')}/launch.sh TRAIN_SCRIPT [training arguments]")
    return 0
