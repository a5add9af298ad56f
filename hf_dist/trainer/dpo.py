"""TRL's ``DPOTrainer`` with hf_dist's layouts: ``DistDPOTrainer`` and ``DistDPOConfig``.

Built as ``DistSFTTrainer`` is (``hf_dist.trainer.sft``): ``DistDPOConfig`` is TRL's ``DPOConfig`` with
``DistTrainingArguments``' fields, ``DistDPOTrainer`` is ``DPOTrainer`` over ``DistTrainer``. ``DPOTrainer.__init__``
prepares the policy (PEFT adapter, pad token, tokenized pairs), ``DistTrainer.__init__`` lays it out, then TRL adds
its fused LM head and builds the frozen reference. The reference is then laid out here like the policy's data
parallelism: under FSDP2 it is sharded by hf_dist's own ``fully_shard`` (each rank holds its shards, gathered one
block at a time in its no-grad forward); under DDP every rank holds a whole replica, as TRL's ``DPOTrainer`` has it.
It is frozen (``requires_grad=False``) and never in the optimizer. Under LoRA there is no second model: the
reference is the policy with its adapters disabled (TRL's own path).

What runs is decided in one place, ``check_dpo_layout`` (called from ``DistDPOConfig.__post_init__``, before any
process group): DDP and FSDP2 (FULL_SHARD / SHARD_GRAD_OP), full fine-tune and LoRA, each proven equal to one process
in ``tests/test_dpo.py``. TP, PP, CP, EP, DeepSpeed ZeRO, HSDP and FSDP2 CPU offload are refused with the reason;
with no hf_dist field set nothing is refused and the trainer is TRL's.

Not here: GRPO, precomputed reference log-probs or a synced reference under FSDP2 (refused), the layouts themselves
(``DistTrainer``).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import TrainingArguments
from trl import DPOConfig, DPOTrainer

from hf_dist.parallelism import parallelize
from hf_dist.strategy import Layout
from hf_dist.trainer import launch_env
from hf_dist.trainer.args import DistTrainingArguments
from hf_dist.trainer.layout import resolve_layout
from hf_dist.trainer.sft import default_output_dir
from hf_dist.trainer.trainer import DistTrainer

_DPO_FIELDS = {f.name: f for f in dataclasses.fields(DPOConfig)}
_DPO_LEARNING_RATE = _DPO_FIELDS["learning_rate"].default


def _dpo_default(name: str):
    """``DPOConfig``'s own default for a Trainer field it changes (``DistTrainingArguments`` would restore the
    Trainer's: dataclass fields of the later base in the MRO win)."""
    return field(default=_DPO_FIELDS[name].default, metadata=_DPO_FIELDS[name].metadata)


def dpo_layout_refusal(layout: Layout, args) -> str | None:
    """Why DPO does not run on ``layout`` with ``args`` (pure), or None. The layouts it runs are the ones
    ``tests/test_dpo.py`` proves against one process: DDP and FSDP2 FULL_SHARD / SHARD_GRAD_OP, full and LoRA."""
    fix = "drop it and shard with FSDP2 instead (--fsdp2, or accelerate_configs/fsdp.yaml), or run DDP"
    model_parallel = (
        ("tp_size", layout.tp, "tensor parallelism shards lm_head and hidden states, which TRL's fused LM head "
         "multiplies whole to sum each sequence's log-probabilities (a vocabulary-parallel log-softmax is needed)"),
        ("pp_size", layout.pp, "the policy and reference forwards run TRL's fused LM head over the whole model and "
         "the chosen/rejected log-probability sums exist only on the last stage"),
        ("cp_size", layout.cp, "each sequence's log-probability sum would cross the cp ranks' sequence shards"),
        ("ep_size", layout.ep, "experts are exchanged all-to-all in the policy and would have to be in the frozen "
         "reference as well"),
    )
    for name, value, why in model_parallel:
        if value > 1:
            return (f"{name}={value} in DistDPOConfig: {why}, and DistDPOTrainer has no parity test for it yet; "
                    f"{fix}")
    if layout.is_deepspeed:
        return (f"DeepSpeed {layout.strategy} with DistDPOConfig: the reference would be prepared by TRL's DeepSpeed "
                f"path, which no DistDPOTrainer parity test covers yet; {fix}")
    if layout.strategy == "fsdp_hybrid_shard":
        return (f"fsdp2_dp_replicate={layout.dp_replicate} (HYBRID_SHARD) with DistDPOConfig: no DistDPOTrainer parity "
                f"test covers the reference model under HSDP yet; drop fsdp2_dp_replicate (FULL_SHARD)")
    if layout.offload != "none":
        return (f"fsdp2_cpu_offload=True with DistDPOConfig: no DistDPOTrainer parity test covers an offloaded "
                f"reference model yet; drop --fsdp2_cpu_offload")
    if layout.is_fsdp:
        for name in ("precompute_ref_log_probs", "sync_ref_model"):
            if getattr(args, name, False):
                return (f"{name}=True with FSDP2 in DistDPOConfig: TRL handles the reference under its own FSDP only "
                        f"(hf_dist's fully_shard is not accelerate's FSDP), and no parity test covers it; drop "
                        f"--{name}, or run it under DDP")
    return None


def check_dpo_layout(args) -> None:
    """Refuse, before any process group, a layout DPO does not run (``dpo_layout_refusal``).

    The layout is resolved from every source (fields, accelerate launch config, DeepSpeed, WORLD_SIZE) on a copy of
    ``args``, by the same functions ``DistTrainingArguments.__post_init__`` then runs on ``args`` itself, because the
    Trainer's own ``__post_init__`` starts the process group."""
    probe = copy.copy(args)
    launch_env.prepare_environment(probe)  # fills the fsdp2 fields from an accelerate launch (on the copy)
    if (why := dpo_layout_refusal(resolve_layout(probe), probe)) is not None:
        raise ValueError(why)


@dataclass
class DistDPOConfig(DistTrainingArguments, DPOConfig):
    """``trl.DPOConfig`` plus hf_dist's batch contract and layout fields (see ``DistTrainingArguments``).

    ``DPOConfig``'s defaults stay TRL's (learning rate 1e-6, gradient checkpointing, bf16 when available, logging
    every 10 steps)."""

    bf16: bool | None = _dpo_default("bf16")
    gradient_checkpointing: bool = _dpo_default("gradient_checkpointing")
    logging_steps: float = _dpo_default("logging_steps")

    def __post_init__(self):
        check_dpo_layout(self)
        if self.learning_rate is None and self.base_learning_rate is None:
            self.learning_rate = _DPO_LEARNING_RATE  # DPOConfig's default, not the Trainer's
        super().__post_init__()


def as_dist_dpo_config(args: TrainingArguments | None) -> DistDPOConfig | None:
    """``args`` as ``DistDPOConfig`` (a ``DPOConfig`` or ``TrainingArguments`` is converted field by field)."""
    if args is None or isinstance(args, DistDPOConfig):
        return args
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return DistDPOConfig(**values)


def lay_out_reference(reference: nn.Module, args: DistDPOConfig, dims, owns_layout: bool) -> nn.Module:
    """The frozen reference with the policy's data-parallel layout: FSDP2-sharded when hf_dist shards the policy,
    a whole replica per rank otherwise (DDP: accelerate placed it without a DDP wrap, it never needs gradients)."""
    reference.requires_grad_(False)
    if not owns_layout:
        return reference
    param_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    # no activation checkpointing and no compile: it only runs forwards without autograd
    return parallelize(reference, dims, fsdp=args.hf_dist_fsdp, param_dtype=param_dtype)


class DistDPOTrainer(DPOTrainer, DistTrainer):
    """``trl.DPOTrainer`` with hf_dist's parallel layouts (DDP, FSDP2, LoRA) and batch contract."""

    def __init__(self, model, ref_model=None, args: TrainingArguments | None = None, *positional, **kwargs):
        if args is None:  # where DPOTrainer would write, not the Trainer's "trainer_output"
            args = DistDPOConfig(output_dir=default_output_dir(model, suffix="DPO"))
        super().__init__(model, ref_model, as_dist_dpo_config(args), *positional, **kwargs)
        if self.ref_model is not None:
            self.ref_model = lay_out_reference(self.ref_model, self.args, self.dims, self.owns_layout)
