"""``hf-dist plan``: rank the layouts for a model on some GPUs, say what fits and why, write the chosen configs.

Exit code 0 when a layout fits, 1 when none does, 2 on bad input, 3 when a ``--calibrate`` run fails.
"""

from __future__ import annotations

import argparse
import json
import sys

from hf_dist.planner.host import LOADINGS
from hf_dist.planner.workload import ATTENTIONS
from hf_dist.precision import MIXED_PRECISIONS


DEFAULT_SEQ_LEN = 4096
"""The sequence length planned when ``--seq-len`` is not given."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="estimate per-GPU memory and step time of every layout, choose the fastest that fits",
        description="Estimate the per-GPU peak memory (every term named) and the step time (compute, and "
        "communication from the ledger minimum's bytes over the links) of DDP, ZeRO-1/2/3, FSDP, TP, PP, EP, CP and "
        "offload layouts for a model, and choose the fastest that fits (within 5%%, the first in the order of least "
        "communication). --out writes the chosen layout's configs (hf_dist.configs).",
    )
    parser.add_argument("--model", required=True, help="catalogue name (e.g. llama-2-13b) or a local HF config dir")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs per node")
    parser.add_argument("--gpu", default=None,
                        help="GPU kind, e.g. a100-80gb, h100, l4 (default: this machine's GPU, said on stderr)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}, said on stderr)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per optimizer step (default: micro batch x every GPU, said on stderr)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per forward per dp rank (default 1)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument("--trainer", choices=("sft", "dpo", "grpo"), default="sft",
                        help="sft (default: a plain or SFT step); dpo: pairs (chosen + rejected in one forward) "
                        "beside a frozen reference model laid out like the policy; grpo: completions generated in "
                        "the step (their KV cache), a reference when --beta > 0. dpo and grpo are offered only the "
                        "layouts DistDPOTrainer / DistGRPOTrainer run")
    parser.add_argument("--num-generations", type=int, default=None,
                        help="grpo: completions per prompt (default TRL's 8); --global-batch counts completions")
    parser.add_argument("--beta", type=float, default=None,
                        help="grpo: the KL coefficient; > 0 loads a frozen reference model (default TRL's 0.0)")
    parser.add_argument("--lora", action="store_true", help="also consider LoRA on a frozen base, and prefer it")
    parser.add_argument("--lora-rank", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--precision", choices=MIXED_PRECISIONS, default="bf16",
                        help="bf16 (default, --bf16): each layout is forecast in the precision it runs: FSDP2 and "
                        "DeepSpeed bf16 parameters with an fp32 master, DDP fp32 parameters under autocast, pipeline "
                        "stages a bf16 model; fp32; pure_bf16: a bf16 model, gradients and Adam (8 B/param)")
    parser.add_argument("--host-ram-gb", type=float, default=None,
                        help="host RAM per node in GB (1e9 bytes); default: a typical node of the GPU kind")
    parser.add_argument("--loading", choices=LOADINGS, default="auto",
                        help="the host-RAM peak while loading: auto (default: as hf_dist.from_pretrained loads each "
                        "layout: streaming for FSDP2/TP/PP, transformers for DDP/DeepSpeed), every_rank "
                        "(from_pretrained on each rank) or streaming (meta init, each rank reads its slices)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the efficiency on this machine: a few training steps of the model scaled down "
                        "to --calibrate-layers layers, in the chosen layout's precision, run with the layout's "
                        "parallelism (DDP/FSDP2/TP, real collectives) on --calibrate-ranks processes, or on one "
                        "device when only one is available; the forecast then uses it instead of the assumed compute "
                        "efficiency and says which ran")
    parser.add_argument("--calibrate-layers", type=int, default=2, help="layers of the scaled-down model (2)")
    parser.add_argument("--calibrate-steps", type=int, default=3, help="measured steps after one warm-up (3)")
    parser.add_argument("--calibrate-ranks", type=int, default=None,
                        help="processes for --calibrate (default: this node's GPUs, or 2 gloo ranks on a CPU with "
                        "2+ cores; at most the layout's GPUs per node); 1: the one-device path")
    parser.add_argument("--intra-node-gbs", type=float, default=None, metavar="GB/S",
                        help="bandwidth per GPU per direction inside a node, GB/s (e.g. hf-dist doctor's busbw); "
                        "default: the GPU kind's NVLink or PCIe peak")
    parser.add_argument("--inter-node-gbs", type=float, default=None, metavar="GB/S",
                        help="network bandwidth per GPU per direction between nodes, GB/s; default: the GPU kind's "
                        "typical node")
    parser.add_argument("--lengths", default=None, metavar="FILE",
                        help="the dataset's sequence lengths (JSON list or one per line): useful tokens/s "
                        "discounts the padding")
    parser.add_argument("--expandable-segments", action="store_true",
                        help="forecast reserved memory with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    parser.add_argument("--attention", choices=ATTENTIONS, default="sdpa", help="attention kernel (default sdpa)")
    parser.add_argument("--no-activation-checkpointing", action="store_true", help="keep every layer's activations")
    parser.add_argument("--safety-margin", type=float, default=0.10, help="fraction of GPU memory kept free")
    parser.add_argument("--train-tokens", type=float, default=None, help="tokens to train on, for wall-clock time")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write a stacked bar chart of the breakdowns")
    parser.add_argument("--out", default=None, metavar="DIR", help="write the chosen layout's configs to DIR")
    parser.add_argument("--overwrite", action="store_true", help="replace configs an earlier --out wrote to DIR")
    parser.set_defaults(func=run)


def local_gpu_kind() -> str:
    """The catalogue kind of this machine's first GPU, for a ``plan`` without ``--gpu``; ``ValueError`` naming the
    kinds when there is no GPU here or its kind is not in the catalogue."""
    import torch

    from hf_dist.planner.catalogue import GPU_CATALOGUE, gpu_from_device_name

    kinds = ", ".join(GPU_CATALOGUE)
    if not torch.cuda.is_available():
        raise ValueError(f"--gpu is not given and this machine has no CUDA GPU to plan for; name the GPU kind the run "
                         f"will use, e.g. --gpu h100 (one of {kinds})")
    name = torch.cuda.get_device_name(0)
    spec = gpu_from_device_name(name)
    if spec is None:
        raise ValueError(f"--gpu is not given and this machine's GPU ({name}) is not in the GPU catalogue; name the "
                         f"nearest kind with --gpu (one of {kinds})")
    return spec.name


def _fill_defaults(args: argparse.Namespace) -> None:
    """The GPU kind, sequence length and global batch when the command does not give them, said once on stderr."""
    assumed = []
    if args.gpu is None:
        args.gpu = local_gpu_kind()
        assumed.append(f"--gpu {args.gpu} (this machine's GPU)")
    if args.seq_len is None:
        args.seq_len = DEFAULT_SEQ_LEN
        assumed.append(f"--seq-len {args.seq_len}")
    if args.global_batch is None:
        args.global_batch = args.micro_batch * args.gpus * args.nodes
        assumed.append(f"--global-batch {args.global_batch} (micro batch x every GPU)")
    if assumed:
        print(f"hf-dist plan: assumed {', '.join(assumed)}; pass them to plan your own workload", file=sys.stderr)


def _request(args: argparse.Namespace):
    from hf_dist.planner import MemoryAssumptions, PlanRequest, gpu_spec, model_spec

    if args.trainer != "grpo":
        for flag, value in (("--num-generations", args.num_generations), ("--beta", args.beta)):
            if value is not None:
                raise ValueError(f"{flag} applies to --trainer grpo only (this plan is --trainer {args.trainer}); "
                                 f"drop it or pass --trainer grpo")
    for flag, value in (("--host-ram-gb", args.host_ram_gb), ("--intra-node-gbs", args.intra_node_gbs),
                        ("--inter-node-gbs", args.inter_node_gbs)):
        if value is not None and value <= 0:
            raise ValueError(f"{flag}={value} must be positive")
    useful = 1.0
    if args.lengths:
        from hf_dist.planner.calibrate import read_lengths, useful_fraction

        useful = useful_fraction(read_lengths(args.lengths), args.seq_len)
    return PlanRequest(
        useful_fraction=useful, trainer=args.trainer, beta=args.beta,
        **({"num_generations": args.num_generations} if args.num_generations is not None else {}),
        intra_node_bandwidth=args.intra_node_gbs * 1e9 if args.intra_node_gbs else None,
        inter_node_bandwidth=args.inter_node_gbs * 1e9 if args.inter_node_gbs else None,
        host_ram_bytes=int(args.host_ram_gb * 1e9) if args.host_ram_gb else None, loading=args.loading,
        assumptions=MemoryAssumptions(expandable_segments=args.expandable_segments),
        model=model_spec(args.model), gpu=gpu_spec(args.gpu), num_gpus=args.gpus, num_nodes=args.nodes,
        seq_len=args.seq_len, global_batch=args.global_batch, micro_batch=args.micro_batch,
        precision=args.precision, attention=args.attention,
        activation_checkpointing=not args.no_activation_checkpointing, lora=args.lora, lora_rank=args.lora_rank,
        safety_margin=args.safety_margin, train_tokens=args.train_tokens,
    )


def _check_outputs(args: argparse.Namespace) -> None:
    """Where the plot and configs go, checked before planning (a bad path is an error, not a traceback)."""
    from pathlib import Path

    if args.plot:
        parent = Path(args.plot).resolve().parent
        if not parent.is_dir():
            raise ValueError(f"--plot {args.plot}: folder {parent} does not exist; create it or pick another path")
        if Path(args.plot).is_dir():
            raise ValueError(f"--plot {args.plot} is a folder; pass a file name such as {Path(args.plot) / 'plan.png'}")
    if args.out and Path(args.out).exists() and any(Path(args.out).iterdir()) and not args.overwrite:
        raise ValueError(f"--out {args.out} is not empty; choose a new folder, or pass --overwrite to replace the "
                         f"configs in it")


def write_chosen_configs(plan, out_dir: str, overwrite: bool = True) -> list:
    """Write the chosen layout's DeepSpeed/accelerate/hf_dist files through ``hf_dist.configs``."""
    import dataclasses

    from hf_dist.configs import write_layout_configs  # owned by the configs generators

    chosen, req = plan.chosen, plan.request
    return write_layout_configs(
        out_dir, layout=dataclasses.replace(chosen.layout, lora_rank=0),  # LoRA is the training script's (PEFT)
        micro_batch_size=chosen.batch.micro_batch_size,
        gradient_accumulation_steps=chosen.batch.gradient_accumulation_steps,
        mixed_precision="no" if req.precision == "fp32" else "bf16",
        no_split_modules=list(req.model.decoder_layer_classes),
        gradient_checkpointing=req.activation_checkpointing, overwrite=overwrite,
    )


def _calibrated(plan, args: argparse.Namespace):
    """Measure the chosen layout's efficiency here (its parallelism on several ranks, or one device) and plan
    again with it."""
    import dataclasses

    from hf_dist.cli.calibrate_ranks import calibrate_for_plan
    from hf_dist.planner import Workload, choose_layout

    chosen, req = plan.chosen, plan.request
    workload = Workload(seq_len=req.seq_len, micro_batch_size=req.micro_batch, precision=chosen.workload_precision,
                        attention=req.attention, activation_checkpointing=req.activation_checkpointing)
    result = calibrate_for_plan(req.model, workload, chosen.layout, ranks=args.calibrate_ranks,
                                layers=args.calibrate_layers, steps=args.calibrate_steps)
    print(f"{result.source}: {result.step_time_s:.3f} s/step, efficiency {result.efficiency:.1%}", file=sys.stderr)
    return choose_layout(dataclasses.replace(req, base_efficiency=result.efficiency, efficiency_source=result.source))


def run(args: argparse.Namespace) -> int:
    from hf_dist.planner import choose_layout
    from hf_dist.planner.report import plan_json, plan_table, plot_plan

    try:
        _check_outputs(args)
        _fill_defaults(args)
        plan = choose_layout(_request(args))
        if args.calibrate and plan.chosen is not None:
            plan = _calibrated(plan, args)
    except ValueError as err:
        print(f"hf-dist plan: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # the calibration processes failed
        print(f"hf-dist plan: error: {err}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(plan_json(plan), indent=2))
    else:
        print(plan_table(plan))
    if args.plot:
        plot_plan(plan, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.out and plan.chosen is not None:
        for path in write_chosen_configs(plan, args.out, overwrite=args.overwrite):
            print(f"wrote {path}", file=sys.stderr)
        if plan.chosen.layout.lora_rank:
            print(f"note: LoRA rank {plan.chosen.layout.lora_rank} is not part of the launch configs; "
                  f"pass it to your PEFT setup", file=sys.stderr)
    return 0 if plan.chosen is not None else 1
