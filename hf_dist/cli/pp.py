"""``hf-dist pp``: show how a model splits into pipeline stages, and the bubble of a schedule.

Builds the model on the ``meta`` device (no memory, nothing downloaded) from a catalogue name, a local
directory with ``config.json`` or a ``model_type``, and prints ``plan_stages``'s stages: owner rank, parameter
count and share, first and last module. With ``--microbatches`` it adds the fill-drain bubble.
"""

from __future__ import annotations

import argparse

from hf_dist.pipeline_parallel.schedules import SCHEDULES, PipelineConfig, theoretical_utilisation


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "pp",
        help="split a model into pipeline stages (balanced by parameters) and print the plan",
        description="Split a decoder-only causal LM into pp x virtual stages: the first owns the embeddings, the "
        "last the final norm and lm_head; balanced by parameter count unless --split-points is given.",
    )
    parser.add_argument("--model", required=True, help="catalogue name (llama-2-13b), local dir, or model_type")
    parser.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    parser.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b", help="pipeline schedule")
    parser.add_argument("--virtual-stages", type=int, default=None, help="stages per rank (interleaved schedules)")
    parser.add_argument("--split-points", nargs="+", default=None, help="layer names where stages 1.. start")
    parser.add_argument("--microbatches", type=int, default=None, help="micro-batches per step, for the bubble")
    parser.set_defaults(func=run)


def plan_for(args: argparse.Namespace):
    import torch
    from transformers import AutoModelForCausalLM

    from hf_dist.configs.model_info import load_config
    from hf_dist.pipeline_parallel import plan_stages, stage_units
    from hf_dist.pipeline_parallel.stage_module import stage_fqns
    from hf_dist.pipeline_parallel.support import check_pipeline_support

    config = PipelineConfig(
        schedule=args.schedule, microbatches=args.microbatches or 1, virtual_stages=args.virtual_stages,
        split_points=tuple(args.split_points) if args.split_points else None,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(args.model))
    check_pipeline_support(model.config)  # training's own PP rule: never plan what training refuses
    layers, embed, head = stage_units(model)
    embed_fqns, head_fqns = stage_fqns(model)
    return plan_stages(
        layers, pp_size=args.pp, virtual_stages=config.virtual_stages, embed_size=embed, head_size=head,
        split_points=config.split_points, placement=config.spec.placement, embed_fqns=embed_fqns, head_fqns=head_fqns,
    )


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_for(args)
    except ValueError as error:
        print(f"error: {error}")
        return 2
    total = sum(plan.stage_sizes)
    print(f"{args.model}: {total:,} parameters in {plan.num_stages} stages on {plan.pp_size} ranks ({args.schedule})")
    print(f"{'stage':>5} {'rank':>4} {'params':>16} {'share':>6}  modules")
    for i, names in enumerate(plan.stages):
        size = plan.stage_sizes[i]
        print(f"{i:>5} {plan.rank_of(i):>4} {size:>16,} {size / total:>6.1%}  {names[0]} .. {names[-1]}")
    if args.microbatches:
        busy = theoretical_utilisation(args.microbatches, plan.pp_size)
        m = args.microbatches
        print(f"micro-batches {m}: fill-drain utilisation m/(m+p-1) = {busy:.2f} (bubble {1 - busy:.0%})")
        if args.microbatches < 2 * plan.num_stages:
            print(f"warning: fewer than 2 x {plan.num_stages} stages micro-batches; the bubble dominates")
    return 0
