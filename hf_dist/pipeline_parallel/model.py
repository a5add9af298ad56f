"""``PipelineModel``: this rank's pipeline stages as one ``nn.Module`` with HF parameter names.

What ``DistTrainer`` (and any training loop wanting one module) holds under PP: optimizers, ``zero_grad``,
``train()`` and checkpoints see exactly the local parameters under their HF names. Not for: running the schedule
(``PipelinedCausalLM.train_step``) or the Trainer hooks (``hf_dist.trainer``).
"""

from __future__ import annotations

import torch
from torch import nn

from hf_dist.pipeline_parallel.pipeline import PipelinedCausalLM


class PipelineModel(nn.Module):
    """What ``DistTrainer`` holds as its model under PP: this rank's stages, parameters under HF names.

    The decoder layers, embeddings, norm and lm_head of every local stage are registered here with their HF
    names (``model.layers.3...``), so optimizers, ``zero_grad``, ``train()`` and checkpoints see exactly the
    local parameters. Calling it runs the pipeline forward only (evaluation); training goes through
    ``training_step``.
    """

    # The loss it returns is already the token mean over the dp group: the Trainer must not rescale it by
    # world size (what it does for models that take ``num_items_in_batch``).
    accepts_loss_kwargs = False
    logits_everywhere = False
    """True when the Trainer computes metrics from logits: every pp rank then gets them (a broadcast)."""

    def __init__(self, pipe: PipelinedCausalLM) -> None:
        super().__init__()
        object.__setattr__(self, "pipeline", pipe)  # not a submodule: its stages share the modules below
        for stage in pipe.modules:
            for fqn, module in stage.owned_modules().items():
                parent = self
                *path, leaf = fqn.split(".")
                for part in path:
                    if not hasattr(parent, part):
                        parent.add_module(part, nn.Module())
                    parent = getattr(parent, part)
                parent.add_module(leaf, module)
        self.config = pipe.modules[0].config

    @property
    def dtype(self) -> torch.dtype:
        """The model's parameter dtype (``PreTrainedModel.dtype``; TRL loads its reference in it)."""
        return self.pipeline.hidden_dtype

    def train(self, mode: bool = True) -> PipelineModel:
        """Train or eval mode for the local parameters *and* each stage's view of the base model, which is not a
        child here: a model loaded in eval mode (``from_pretrained``) would otherwise keep its base model's forward
        in eval mode while training (OPT's LayerDrop reads it), and one built in train mode in training while
        evaluating."""
        super().train(mode)
        self.pipeline.train(mode)
        return self

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, **_ignored) -> None:
        """Called by ``Trainer.train``; ``apply_pipeline`` already enabled it per layer before the split."""
        layers = [layer for stage in self.pipeline.modules for layer in stage.owned_layers()]
        if not all(getattr(layer, "gradient_checkpointing", False) for layer in layers):
            raise RuntimeError("activation checkpointing must be enabled before the split (apply_pipeline does it)")

    gradient_checkpointing_enable = activation_checkpointing_enable  # the deprecated name (TRL, older callers)

    def add_model_tags(self, tags: list[str] | str) -> None:
        """Tags for the model card (``PreTrainedModel`` API; TRL calls it): kept on the HF model the stages share."""
        self.pipeline.source_model.add_model_tags(tags)

    def forward(self, input_ids, attention_mask=None, labels=None, position_ids=None, **unused):
        from transformers.modeling_outputs import CausalLMOutput

        if self.training and torch.is_grad_enabled():
            raise RuntimeError(
                "a pipelined model trains through DistTrainer.training_step (PipelinedCausalLM.train_step), "
                "not through forward; call it under torch.no_grad() or in eval mode for evaluation"
            )
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        if labels is None:
            return CausalLMOutput(logits=self.pipeline.forward_only(batch))
        loss, logits = self.pipeline.eval_step(
            {**batch, "labels": labels}, logits_everywhere=self.logits_everywhere, reduce_dp=False
        )  # this dp rank's batch loss, as under DDP: the Trainer gathers over dp
        return CausalLMOutput(loss=loss, logits=logits)
