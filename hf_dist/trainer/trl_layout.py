"""What TRL's trainers with a frozen reference model (DPO, GRPO) run on under hf_dist, decided in one place.

``DistDPOTrainer`` and ``DistGRPOTrainer`` share the same shape: TRL's config plus ``DistTrainingArguments``' fields
(``trl_default`` keeps the TRL config's own defaults), a refusal before any process group of every layout no parity
test covers (``trl_layout_refusal`` / ``check_trl_layout``), and a frozen reference laid out like the policy
(``lay_out_reference``). Each trainer passes only what differs: the model-parallel axes it refuses, each with why,
and which of its options hf_dist's FSDP2 does not take. The axes it runs (TP for both, CP for DPO) share one rule
(``_model_parallel_refusal``): every rank in one TP or CP group, and under TP the default plan, whose lm_head stays
whole for TRL's fused LM head (``fused_lm_head_refusal``, which ``DistSFTConfig`` asks too).

Not here: the trainers themselves (``hf_dist.trainer.dpo``, ``hf_dist.trainer.grpo``) and the layouts
(``DistTrainer``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import field

import torch
from torch import nn

from hf_dist.parallelism import parallelize
from hf_dist.strategy import Layout
from hf_dist.trainer import launch_env
from hf_dist.trainer.layout import resolve_layout

MODEL_PARALLEL_SIZES = ("tp_size", "pp_size", "cp_size", "ep_size")
_FIX = "drop it and shard with FSDP2 instead (--fsdp2, or accelerate_configs/fsdp.yaml), or run DDP"


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


def trl_layout_refusal(layout: Layout, args, *, config: str, model_parallel: Mapping[str, str],
                       fsdp2_options: Mapping[str, str]) -> str | None:
    """Why a TRL trainer does not run on ``layout`` with ``args`` (pure), or None.

    ``config`` names the config class in the message; ``model_parallel`` maps each of ``MODEL_PARALLEL_SIZES`` to why
    that axis does not run; ``fsdp2_options`` maps a boolean option to why hf_dist's FSDP2 does not take it."""
    sizes = {"tp_size": layout.tp, "pp_size": layout.pp, "cp_size": layout.cp, "ep_size": layout.ep}
    trainer = config.replace("Config", "Trainer")
    for name in MODEL_PARALLEL_SIZES:
        if sizes[name] > 1 and name in model_parallel:
            return (f"{name}={sizes[name]} in {config}: {model_parallel[name]}, and {trainer} has no parity test for "
                    f"it yet; {_FIX}")
    if (layout.tp > 1 or layout.cp > 1) and (why := _model_parallel_refusal(layout, config, trainer)) is not None:
        return why
    if layout.is_deepspeed:
        return (f"DeepSpeed {layout.strategy} with {config}: the reference would be prepared by TRL's DeepSpeed path, "
                f"which no {trainer} parity test covers yet; {_FIX}")
    if layout.strategy == "fsdp_hybrid_shard":
        return (f"fsdp2_dp_replicate={layout.dp_replicate} (HYBRID_SHARD) with {config}: no {trainer} parity test "
                f"covers the reference model under HSDP yet; drop fsdp2_dp_replicate (FULL_SHARD)")
    if layout.offload != "none":
        return (f"fsdp2_cpu_offload=True with {config}: no {trainer} parity test covers an offloaded reference model "
                f"yet; drop --fsdp2_cpu_offload")
    if layout.is_fsdp:
        for name, why in fsdp2_options.items():
            if getattr(args, name, False):
                return f"{name}=True with FSDP2 in {config}: {why}; drop --{name}, or run it under DDP"
    return None


def fused_lm_head_refusal(*, tp: int, sequence_parallel: bool, vocab_parallel: bool, config: str) -> str | None:
    """Why TRL's fused LM head does not run with these TP options (pure), or None. It multiplies plain hidden states
    by the whole ``lm_head`` weight; hf_dist's default TP plan keeps both whole (replicated on every TP rank), and
    these two options shard them."""
    for name, value in (("tp_vocab_parallel", vocab_parallel), ("tp_sequence_parallel", sequence_parallel)):
        if value and tp > 1:
            return (f"{name}=True with tp_size={tp} in {config}: TRL's fused LM head needs the whole lm_head weight "
                    f"and hidden states, which {name.removeprefix('tp_')} parallelism shards; drop --{name} (the "
                    f"decoder blocks stay tensor-parallel)")
    return None


def _model_parallel_refusal(layout: Layout, config: str, trainer: str) -> str | None:
    """Why a TRL trainer with a frozen reference does not run this TP or CP layout, or None. What runs is what
    ``tests/test_trl_model_parallel.py`` proves: every rank in one TP group, or one CP group (DPO), with no data
    parallelism beside it; under TP the default plan (whole lm_head); full fine-tune and LoRA."""
    if (why := fused_lm_head_refusal(tp=layout.tp, sequence_parallel=layout.sequence_parallel,
                                     vocab_parallel=layout.vocab_parallel, config=config)) is not None:
        return why
    if layout.tp > 1 and layout.cp > 1:
        return (f"tp_size={layout.tp} with cp_size={layout.cp} in {config}: {trainer} has no parity test for the two "
                f"together yet; use one of them")
    name, size = ("tp_size", layout.tp) if layout.tp > 1 else ("cp_size", layout.cp)
    if layout.is_fsdp or layout.is_deepspeed or layout.dp > 1:
        engine = f"{layout.strategy} over {layout.dp} data-parallel rank(s)"
        return (f"{name}={size} with {engine} in {config}: {trainer} runs {name.removesuffix('_size')} with every rank "
                f"in one group (world size {layout.world_size} = {name} x 1) and has no parity test beside data "
                f"parallelism or a sharded engine yet; launch {name} processes without FSDP2/DeepSpeed, or drop "
                f"{name} and shard with FSDP2")
    return None


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
