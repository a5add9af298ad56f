"""The one ``Layout`` of a DistTrainer run, resolved from every source, and telling the Trainer that hf_dist owns
the model's placement.

``resolve_layout(args)`` reads the training arguments (``tp_size``, ``pp_size``, ``ep_size``, ``cp_size``, the TP
options, the ``fsdp2*`` fields that ``launch_env`` fills from an accelerate FSDP launch config or
``TrainingArguments.fsdp``), the
DeepSpeed config (``deepspeed=`` or the accelerate launcher's) and the launcher's world (``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``), and returns the ``hf_dist.strategy.Layout`` whose rules decide what runs; it is called once,
in ``DistTrainingArguments.__post_init__``, before any process group. Nothing is changed: the environment is read.

Applying the layout is ``hf_dist.parallelize`` (``hf_dist.parallelism``); DDP (without TP/PP) and DeepSpeed are
left to accelerate. Not here: checkpointing (``checkpoint_glue``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from hf_dist.apply import ApplyPlan, apply_layout
from hf_dist.parallel_dims import ParallelDims
from hf_dist.strategy import Layout


def _world() -> tuple[int, int]:
    """(processes per node, nodes) from the launcher; one node when it does not say."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if local < 1 or world % local:
        return world, 1
    return local, world // local


def _deepspeed_config(args) -> dict | None:
    """The DeepSpeed config this run asks for (``deepspeed=`` path or dict, or the accelerate launcher's file);
    ``{}`` when only the launcher's flags are known; None without DeepSpeed."""
    value = getattr(args, "deepspeed", None)
    if isinstance(value, dict):
        return value
    path = value or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path:
        try:
            return json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ValueError(f"the DeepSpeed config {path!r} could not be read from {os.getcwd()} ({error}); pass an "
                             f"existing DeepSpeed JSON (an absolute path, or one relative to the working "
                             f"directory)") from None
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true", "yes"):
        return {}
    return None


def _deepspeed_fields(config: dict) -> dict:
    """``strategy`` and ``offload`` of a ZeRO config (accelerate's flags fill what the file leaves out)."""
    zero = config.get("zero_optimization", {}) or {}
    # the file's stage; else the launcher's; else accelerate's default (2) for a flags-only request, DeepSpeed's (0)
    stage = zero.get("stage", os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2 if not config else 0))
    try:
        stage = int(stage)
    except (TypeError, ValueError):
        stage = -1
    if stage not in (1, 2, 3):
        raise ValueError(f"DeepSpeed zero_optimization.stage={stage!r}: hf_dist runs ZeRO stages 1, 2 and 3; set the "
                         f"stage in the DeepSpeed config, or launch without DeepSpeed (accelerate_configs/ddp.yaml) "
                         f"for no sharding")

    def device(key: str, env: str) -> str:
        found = (zero.get(key) or {}).get("device") or os.environ.get(env) or "none"
        return str(found).lower()

    optimizer = device("offload_optimizer", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE")
    params = device("offload_param", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE")
    if "nvme" in (optimizer, params):
        offload = "nvme"
    elif stage == 3 and params == "cpu":
        offload = "cpu"
    elif optimizer == "cpu":
        offload = "cpu_optimizer" if stage == 3 else "cpu"
    else:
        offload = "none"
    return {"strategy": f"zero{stage}", "offload": offload}


def resolve_layout(args) -> Layout:
    """The ``Layout`` ``args`` and the launcher ask for; a combination hf_dist does not run raises ``ValueError``."""
    num_gpus, num_nodes = _world()
    fields: dict = {"tp": args.tp_size, "pp": args.pp_size, "ep": getattr(args, "ep_size", 1), "cp": getattr(args, "cp_size", 1),
                    "sequence_parallel": args.tp_sequence_parallel, "vocab_parallel": args.tp_vocab_parallel,
                    "num_gpus": num_gpus, "num_nodes": num_nodes}
    deepspeed = _deepspeed_config(args)
    fsdp = args.hf_dist_fsdp
    Layout.check_one_engine(deepspeed=deepspeed is not None, fsdp=fsdp is not None)
    if deepspeed is not None:
        fields |= _deepspeed_fields(deepspeed)
    elif fsdp is not None:
        fields["strategy"] = Layout.fsdp_strategy(dp_replicate=fsdp.dp_replicate,
                                                  reshard_after_forward=fsdp.reshard_after_forward)
        fields["offload"] = "cpu" if fsdp.cpu_offload else "none"
        fields["dp_replicate"] = fsdp.dp_replicate if fsdp.dp_replicate > 1 else None
        fields["dp_shard"] = fsdp.dp_shard
    else:
        fields["strategy"] = "ddp"
    return Layout(**fields)


def apply_plan(args) -> ApplyPlan:
    """What applying the layout needs from ``args`` (``hf_dist.apply.ApplyPlan``), read once here."""
    from hf_dist.pipeline_parallel.apply import chunked_loss_wanted
    from hf_dist.trainer.compile_glue import compile_request

    fsdp = args.hf_dist_fsdp
    return ApplyPlan(
        device=args.device,
        param_dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None,
        activation_checkpointing=bool(args.activation_checkpointing or (fsdp is not None and fsdp.activation_checkpointing)),
        fsdp=fsdp,
        sequence_parallel=args.layout.sequence_parallel,
        vocab_parallel=args.layout.vocab_parallel,
        compile_request=compile_request(args),
        pp_schedule=args.pp_schedule,
        pp_microbatches=args.pp_microbatches,
        layout_canary=bool(getattr(args, "layout_canary", True)),
        chunked_loss=chunked_loss_wanted(args.chunked_loss, args.layout),
    )


def apply_owned_layout(model: nn.Module, args, dims: ParallelDims) -> nn.Module:
    """Lay ``model`` out for ``dims`` as ``args`` ask (FSDP2 / TP / PP / EP / CP, the layouts hf_dist owns):
    ``hf_dist.apply_layout`` with the plan read from ``args``; DistTrainer and ``hf_dist.from_pretrained`` use it."""
    return apply_layout(model, dims, apply_plan(args))

