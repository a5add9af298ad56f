"""TRL's ``SFTTrainer`` with hf_dist's layouts: ``DistSFTTrainer`` and ``DistSFTConfig``.

``DistSFTConfig`` is TRL's ``SFTConfig`` with ``DistTrainingArguments``' fields (global batch, LR scaling,
``tp_size``, ``pp_size``, ``fsdp2*``); ``DistSFTTrainer`` is ``SFTTrainer`` over ``DistTrainer``. The order is
what makes it correct: ``SFTTrainer.__init__`` prepares the model first (PEFT adapter, pad/eos tokens), then
``DistTrainer.__init__`` applies the layout to that prepared model, then the Trainer is built; after it,
``SFTTrainer`` adds TRL's fused LM head to the laid-out model. Every other method chains through both classes.

Not here: TRL's other trainers (DPO, GRPO, ...), which build reference models of their own; and the layouts
themselves (``DistTrainer``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transformers import Trainer, TrainingArguments
from trl import SFTConfig, SFTTrainer
from trl.trainer.utils import get_config_model_id

from hf_dist.trainer.args import DistTrainingArguments
from hf_dist.trainer.trainer import DistTrainer
from hf_dist.trainer.trl_layout import default_trl_learning_rate, trl_default
from hf_dist.trl_support import fused_lm_head_refusal



@dataclass
class DistSFTConfig(DistTrainingArguments, SFTConfig):
    """``trl.SFTConfig`` plus hf_dist's batch contract and layout fields (see ``DistTrainingArguments``).
    ``SFTConfig``'s defaults stay TRL's (learning rate 2e-5, gradient checkpointing, bf16 when available, logging
    every 10 steps)."""

    reads_lm_head_weight = True  # TRL's fused LM head (add_fused_lm_head) multiplies by lm_head.weight

    bf16: bool | None = trl_default(SFTConfig, "bf16")
    gradient_checkpointing: bool = trl_default(SFTConfig, "gradient_checkpointing")
    logging_steps: float = trl_default(SFTConfig, "logging_steps")

    def __post_init__(self):
        # before any process group: TRL's fused LM head (used for the loss and its metrics) needs the whole lm_head
        why = fused_lm_head_refusal(tp=self.tp_size, sequence_parallel=self.tp_sequence_parallel,
                                    vocab_parallel=self.tp_vocab_parallel, config="DistSFTConfig")
        if why is not None:
            raise ValueError(why)
        default_trl_learning_rate(self, SFTConfig)
        super().__post_init__()


def as_dist_sft_config(args: TrainingArguments | None) -> DistSFTConfig | None:
    """``args`` as ``DistSFTConfig`` (an ``SFTConfig`` or ``TrainingArguments`` is converted field by field)."""
    if args is None or isinstance(args, DistSFTConfig):
        return args
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return DistSFTConfig(**values)


def default_output_dir(model, suffix: str = "SFT") -> str:
    """TRL's ``output_dir`` when its trainer is given no args: ``<model name>-<suffix>`` (name from the id or
    config; ``SFT``, ``DPO``, ...)."""
    name = model if isinstance(model, str) else get_config_model_id(model.config)
    return f"{name.split('/')[-1]}-{suffix}"


class DistSFTTrainer(SFTTrainer, DistTrainer):
    """``trl.SFTTrainer`` with hf_dist's parallel layouts (DDP, FSDP2, TP, PP, EP, CP, LoRA) and batch contract.
    Under CP TRL's fused LM head scores each rank's slice of the shifted labels
    (``hf_dist.trainer.trl_context_parallel``)."""

    def __init__(self, model, args: TrainingArguments | None = None, *positional, **kwargs):
        if args is None:  # where SFTTrainer would write, not the Trainer's "trainer_output"
            args = DistSFTConfig(output_dir=default_output_dir(model))
        super().__init__(model, as_dist_sft_config(args), *positional, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.dims.pp_enabled:
            # Pipeline stages run the model's own forward and loss (training goes through the schedule; this is
            # evaluation). TRL's fused LM head needs the whole backbone in one module, so its entropy and token
            # accuracy metrics are not logged under PP.
            return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
