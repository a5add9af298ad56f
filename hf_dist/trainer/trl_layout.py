"""What TRL's trainers with a frozen reference model (DPO, GRPO) run on under hf_dist, decided in one place.

``DistDPOTrainer`` and ``DistGRPOTrainer`` share the same shape: TRL's config plus ``DistTrainingArguments``' fields
(``trl_default`` keeps the TRL config's own defaults), a refusal before any process group of every layout no parity
test covers (``check_trl_layout``, asking the pure rules of ``hf_dist.trl_support``, which ``hf-dist plan`` asks
too: the model-parallel axes each trainer runs, TP for both and CP and PP for DPO, every rank in that one group), and
a frozen reference laid out like the policy (``lay_out_reference``).

Not here: the trainers themselves (``hf_dist.trainer.dpo``, ``hf_dist.trainer.grpo``) and the layouts
(``DistTrainer``).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import field

import torch
from torch import nn

from hf_dist.parallelism import parallelize
from hf_dist.strategy import Layout
from hf_dist.trainer import launch_env
from hf_dist.trainer.layout import resolve_layout



def trl_default(config_cls, name: str):
    """``config_cls``'s own default for a Trainer field it changes (``DistTrainingArguments`` would restore the
    Trainer's: dataclass fields of the later base in the MRO win)."""
    trl_field = {f.name: f for f in dataclasses.fields(config_cls)}[name]
    return field(default=trl_field.default, metadata=trl_field.metadata)


def default_trl_learning_rate(args, config_cls) -> None:
    """Give ``args`` ``config_cls``'s own learning rate when neither ``learning_rate`` nor ``base_learning_rate`` was
    set (``DistTrainingArguments`` keeps ``learning_rate=None`` to tell "not given" from an explicit value; the
    Trainer's 5e-5 would otherwise follow)."""
    if args.learning_rate is None and args.base_learning_rate is None:
        args.learning_rate = {f.name: f for f in dataclasses.fields(config_cls)}["learning_rate"].default


def check_trl_layout(args, refusal) -> Layout:
    """Refuse, before any process group, a layout ``refusal(layout, args)`` names a reason for; else return it.

    The layout is resolved from every source (fields, accelerate launch config, DeepSpeed, WORLD_SIZE) on a copy of
    ``args``, by the same functions ``DistTrainingArguments.__post_init__`` then runs on ``args`` itself, because the
    Trainer's own ``__post_init__`` starts the process group."""
    probe = copy.copy(args)
    launch_env.prepare_environment(probe)  # fills the fsdp2 fields from an accelerate launch (on the copy)
    layout = resolve_layout(probe)
    if (why := refusal(layout, probe)) is not None:
        raise ValueError(why)
    return layout


def as_config(args, config_cls, *, drop: tuple[str, ...] = ()):
    """``args`` as ``config_cls`` (a TRL config or ``TrainingArguments`` is converted field by field; the fields in
    ``drop`` are left to be derived again)."""
    if args is None or isinstance(args, config_cls):
        return args
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init and f.name not in drop}
    return config_cls(**values)


def lay_out_reference(reference: nn.Module, args, dims, owns_layout: bool) -> nn.Module:
    """The frozen reference laid out like the policy: FSDP2-sharded when hf_dist shards the policy, tensor-parallel
    with the policy's plan under TP (``parallelize``: the same mesh, default plan, whole lm_head), a whole replica per
    rank otherwise (DDP: accelerate placed it without a DDP wrap, it never needs gradients)."""
    reference.requires_grad_(False)
    if not owns_layout:
        return reference
    param_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    # no activation checkpointing, no compile and no gradient replication: it only runs forwards without autograd
    return parallelize(reference, dims, fsdp=args.hf_dist_fsdp, param_dtype=param_dtype, replicate_gradients=False)
