"""TRL's ``DPOTrainer`` with hf_dist's layouts: ``DistDPOTrainer`` and ``DistDPOConfig``.

Built as ``DistSFTTrainer`` is (``hf_dist.trainer.sft``): ``DistDPOConfig`` is TRL's ``DPOConfig`` with
``DistTrainingArguments``' fields, ``DistDPOTrainer`` is ``DPOTrainer`` over ``DistTrainer``. ``DPOTrainer.__init__``
prepares the policy (PEFT adapter, pad token, tokenized pairs), ``DistTrainer.__init__`` lays it out, then TRL adds
its fused LM head and builds the frozen reference. The reference is then laid out here like the policy
(``lay_out_reference``): under FSDP2 it is sharded by hf_dist's own ``fully_shard`` (each rank holds its shards,
gathered one block at a time in its no-grad forward); under TP it is sharded with the policy's plan; under CP it
splits sequences as the policy does; under DDP every rank holds a whole replica, as TRL's ``DPOTrainer`` has it. It
is frozen (``requires_grad=False``) and never in the optimizer. Under LoRA there is no second model: the reference is
the policy with its adapters disabled (TRL's own path). Under CP the fused LM heads of both return whole-sequence
per-token log-probabilities (``hf_dist.trainer.trl_context_parallel``). Under PP the reference is split into the
policy's stages, and the loss and TRL's metrics are made on the last stage (``hf_dist.trainer.dpo_pipeline``).

What runs is decided in one place, ``check_dpo_layout`` (called from ``DistDPOConfig.__post_init__``, before any
process group; the shared rules are ``hf_dist.trainer.trl_layout``'s): DDP and FSDP2 (FULL_SHARD / SHARD_GRAD_OP),
proven in ``tests/test_dpo.py``, and TP, CP or PP with every rank in that one group (PP: TRL's default sigmoid loss),
proven in ``tests/test_trl_model_parallel.py``, each full fine-tune and LoRA, equal to one process. EP, TP/CP/PP beside
data parallelism, DeepSpeed ZeRO, HSDP and FSDP2 CPU offload are refused with the reason; with no hf_dist field set
nothing is refused and the trainer is TRL's.

Not here: GRPO (``hf_dist.trainer.grpo``), precomputed reference log-probs or a synced reference under FSDP2
(refused), the layouts themselves (``DistTrainer``).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import TrainingArguments
from trl import DPOConfig, DPOTrainer

from hf_dist.trainer.args import DistTrainingArguments
from hf_dist.trainer.sft import default_output_dir
from hf_dist.trainer.trainer import DistTrainer
from hf_dist.trainer.trl_context_parallel import split_trl_heads
from hf_dist.trainer.trl_layout import as_config, check_trl_layout, default_trl_learning_rate, lay_out_reference, \
    trl_default
from hf_dist.trl_support import dpo_layout_refusal


def pad_to_cp_slices(args) -> None:
    """Under CP every rank holds an equal slice of each sequence: ``pad_to_multiple_of="auto"`` pads batches to a
    multiple of ``cp_size`` (padding is masked: no figure changes); a value that is not such a multiple is refused
    (pure, before any process group)."""
    cp = args.cp_size
    if cp <= 1:
        return
    value = args.pad_to_multiple_of
    if isinstance(value, str) and value.strip().isdigit():  # from a command line
        value = args.pad_to_multiple_of = int(value)
    if value == "auto":
        args.pad_to_multiple_of = cp
    elif not isinstance(value, int) or value % cp:
        raise ValueError(f"pad_to_multiple_of={args.pad_to_multiple_of!r} with cp_size={cp} in DistDPOConfig: every cp "
                         f"rank holds an equal slice of each sequence; use pad_to_multiple_of a multiple of {cp} "
                         f"(\"auto\" picks {cp})")


def check_dpo_layout(args) -> None:
    """Refuse, before any process group, a layout DPO does not run (``dpo_layout_refusal``)."""
    check_trl_layout(args, dpo_layout_refusal)


@dataclass
class DistDPOConfig(DistTrainingArguments, DPOConfig):
    """``trl.DPOConfig`` plus hf_dist's batch contract and layout fields (see ``DistTrainingArguments``).

    ``DPOConfig``'s defaults stay TRL's (learning rate 1e-6, gradient checkpointing, bf16 when available, logging
    every 10 steps)."""

    reads_lm_head_weight = True  # TRL's fused LM head (add_fused_lm_head) multiplies by lm_head.weight

    bf16: bool | None = trl_default(DPOConfig, "bf16")
    gradient_checkpointing: bool = trl_default(DPOConfig, "gradient_checkpointing")
    logging_steps: float = trl_default(DPOConfig, "logging_steps")

    def __post_init__(self):
        check_dpo_layout(self)
        pad_to_cp_slices(self)
        default_trl_learning_rate(self, DPOConfig)
        super().__post_init__()


def as_dist_dpo_config(args: TrainingArguments | None) -> DistDPOConfig | None:
    """``args`` as ``DistDPOConfig`` (a ``DPOConfig`` or ``TrainingArguments`` is converted field by field)."""
    return as_config(args, DistDPOConfig)


class DistDPOTrainer(DPOTrainer, DistTrainer):
    """``trl.DPOTrainer`` with hf_dist's parallel layouts (DDP, FSDP2, TP, CP, PP, LoRA) and batch contract."""

    def __init__(self, model, ref_model=None, args: TrainingArguments | None = None, *positional, **kwargs):
        if args is None:  # where DPOTrainer would write, not the Trainer's "trainer_output"
            args = DistDPOConfig(output_dir=default_output_dir(model, suffix="DPO"))
        super().__init__(model, ref_model, as_dist_dpo_config(args), *positional, **kwargs)
        self.dpo_pipeline = None
        if self.dims.pp_enabled:  # the loss and metrics on the last stage, the reference split into the same stages
            from hf_dist.trainer.dpo_pipeline import DpoPipeline

            self.dpo_pipeline = DpoPipeline(self)
        elif self.ref_model is not None:
            self.ref_model = lay_out_reference(self.ref_model, self.args, self.dims, self.owns_layout)
        if self.dims.cp_enabled:  # TRL sums each sequence's log-probabilities: whole sequences on every cp rank
            split_trl_heads(self)

    def pipeline_step(self, pipeline, inputs):
        return self.dpo_pipeline.train_step(self, inputs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.dpo_pipeline is not None:  # evaluation: training runs pipeline_step
            return self.dpo_pipeline.evaluate(self, model, inputs, return_outputs)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
