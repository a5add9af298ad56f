"""``DistDPOTrainer`` under PP: TRL's DPO loss and metrics through the pipeline (``pipeline_parallel.pair_loss``).

Under PP no rank holds the whole model, so TRL's ``compute_loss`` (one forward of the whole policy, one of the
reference) cannot run. Instead ``DpoPipeline`` puts TRL's own fused LM head (``trl.trainer.utils.add_fused_lm_head``)
on the view of the last stage of the policy's pipeline and of the reference's, makes that stage return each row's
summed log-probability (``SequenceHead``), and runs TRL's default loss (``loss_type="sigmoid"``, reverse KL; the
others are refused by ``hf_dist.trl_support``) as the schedule's loss, micro-batches holding whole pairs:

- the reference: under LoRA the policy's own pipeline with its adapters disabled (TRL's ``use_adapter``, as TRL
  does); for a full fine-tune TRL's frozen reference split into the same stages (a ``PipelinedCausalLM`` of its own,
  each rank keeping its stages only), never in the optimizer. Its log-probabilities are computed first, forward only,
  one micro-batch at a time, and reach the last stage as the loss's target;
- the metrics TRL logs (loss, ``rewards/*``, ``logps/*``, ``logits/*``, ``entropy``, ``mean_token_accuracy``,
  ``num_tokens``) are made on the last stage from the same quantities, one entry per micro-batch as one process
  appends one per accumulation step, summed over dp as TRL gathers them, and sent to every rank;
- evaluation (``compute_loss`` outside training) runs both forwards and the same figures, for this dp rank's batch.

Not for: which layouts and options run (``hf_dist.trl_support``), the pipeline itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_dist.pipeline_parallel.model import PipelineModel
from hf_dist.pipeline_parallel.pair_loss import (
    PAIR_SUMS, SigmoidPairLoss, install_sequence_head, pair_sums, pair_train_step, sequence_logps,
)
from hf_dist.pipeline_parallel.pipeline import PipelinedCausalLM
from hf_dist.pipeline_parallel.microbatches import microbatches_for_rows

POLICY_FIELDS = ("log_probs", "entropy", "mean_logits", "is_top1")
"""What the policy's fused head computes (TRL's DPOTrainer asks the same of its own, without WPO weighting)."""
_COL = {name: i for i, name in enumerate(PAIR_SUMS)}


def _install_head(pipe: PipelinedCausalLM, outputs: tuple[str, ...]) -> None:
    """TRL's fused LM head (computing ``outputs``) on the last stage's view of the model, and its per-row head."""
    from trl.trainer.utils import add_fused_lm_head

    install_sequence_head(pipe, lambda view: add_fused_lm_head(view, outputs=outputs))


def _peft_adapter(pipe: PipelinedCausalLM):
    """``(PEFT model, adapter TRL's reference uses)`` when the policy is a PEFT model, else None."""
    from hf_dist.models.peft_utils import is_peft_model

    source = pipe.source_model
    if not is_peft_model(source):
        return None
    return source, "ref" if "ref" in source.peft_config else None


class DpoPipeline:
    """TRL's DPO step and evaluation for a ``DistDPOTrainer`` whose model is a ``PipelineModel``."""

    def __init__(self, trainer) -> None:
        self.policy: PipelinedCausalLM = trainer.model.pipeline
        if trainer.aux_loss_enabled or any(stage.router_stats is not None for stage in self.policy.modules):
            raise ValueError(f"pp_size={self.policy.dims.pp} with the mixture-of-experts "
                             f"{type(self.policy.source_model).__name__} in DistDPOTrainer: its router aux loss would "
                             f"travel through the stages beside the pair loss, which no parity test covers yet; set "
                             f"router_aux_loss_coef=0.0 (and the config's output_router_logits=False), or drop pp_size")
        self.beta = trainer.beta
        self.loss = SigmoidPairLoss(self.beta)
        _install_head(self.policy, POLICY_FIELDS)
        self.adapter = _peft_adapter(self.policy)
        self.reference_pipe = None
        if self.adapter is not None:  # TRL cannot tell a pipeline holds a PEFT model and loaded a copy: not needed
            trainer.ref_model = None
        elif trainer.ref_model is not None:
            trainer.ref_model = PipelineModel(self._reference_pipeline(trainer.ref_model))

    def _reference_pipeline(self, reference) -> PipelinedCausalLM:
        """The frozen reference split into the policy's stages (same plan, same ranks), no optimizer, TRL's head."""
        reference.requires_grad_(False)
        vars(reference).pop("forward", None)  # TRL's fused forward, bound to the whole model: each view gets its own
        pipe = PipelinedCausalLM(reference, dims=self.policy.dims, config=self.policy.config, device=self.policy.device,
                                 chunked_loss=False)
        if pipe.plan.stages != self.policy.plan.stages:
            raise RuntimeError(f"the reference split {pipe.plan.stages} differs from the policy's "
                               f"{self.policy.plan.stages}")
        _install_head(pipe, ("log_probs",))
        self.reference_pipe = pipe
        return pipe

    def _reference_logps(self, batch: dict) -> torch.Tensor | None:
        """The reference's per-row log-probabilities on the last stage's rank (None elsewhere)."""
        if self.adapter is None:
            out = sequence_logps(self.reference_pipe, batch)
        else:
            from trl.trainer.utils import use_adapter

            with use_adapter(*self.adapter):
                out = sequence_logps(self.policy, batch)
        return None if out is None else out[0]

    @staticmethod
    def _batch(inputs: dict) -> dict:
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        return {"input_ids": inputs["input_ids"], "attention_mask": inputs.get("attention_mask"), "labels": labels}

    def _to_every_rank(self, sums: torch.Tensor) -> torch.Tensor:
        """The last stage's sums on every pp rank (zeros elsewhere before the sum)."""
        sums = sums.to(self.policy.device)
        dist.all_reduce(sums, group=self.policy.pp_group)
        return sums

    def train_step(self, trainer, inputs: dict) -> torch.Tensor:
        """One optimizer step; appends TRL's training metrics (one entry per micro-batch) on every rank."""
        pairs = inputs["input_ids"].shape[0] // 2
        microbatches = microbatches_for_rows(trainer.args, pairs)
        loss, records = pair_train_step(self.policy, self._batch(inputs), loss=self.loss, microbatches=microbatches,
                                        reference=self._reference_logps)
        sums = torch.zeros(microbatches, len(PAIR_SUMS), dtype=torch.float64)
        for i, (logps, reference, figures) in enumerate(records):
            sums[i] = pair_sums(logps, reference, figures, self.beta).cpu()
        sums = self.policy._dp_sum(self._to_every_rank(sums))
        tokens = self.policy._dp_sum(inputs["attention_mask"].sum().to(self.policy.device))
        trainer._total_train_tokens += int(tokens.item())
        _append_metrics(trainer, "train", sums)
        return loss

    def evaluate(self, trainer, model, inputs: dict, return_outputs: bool):
        """``compute_loss`` in evaluation: this dp rank's batch mean loss on every rank; TRL's eval metrics."""
        if model.training and torch.is_grad_enabled():
            raise RuntimeError("DistDPOTrainer under pp_size > 1 trains through its pipeline step, not compute_loss")
        batch = self._batch(inputs)
        policy = sequence_logps(self.policy, batch)
        reference = self._reference_logps(batch)
        sums = torch.zeros(len(PAIR_SUMS), dtype=torch.float64)
        if policy is not None:
            sums = pair_sums(policy[0], reference, policy[1], self.beta).cpu()
        sums = self._to_every_rank(sums)
        loss = (sums[_COL["loss"]] / sums[_COL["pairs"]]).to(torch.float32)
        _append_metrics(trainer, "eval", self.policy._dp_sum(sums.clone())[None])
        if not return_outputs:
            return loss
        with torch.no_grad():  # TRL's deprecated logits for compute_metrics: one more forward, whole logits (on
            # every pp rank when metrics need them: PipelineModel.logits_everywhere; its token loss is not used)
            outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                            labels=inputs["input_ids"])
        return loss, outputs


def _append_metrics(trainer, mode: str, sums: torch.Tensor) -> None:
    """TRL's DPO metrics from ``PAIR_SUMS`` rows (one per micro-batch or eval batch, summed over dp), appended to
    ``trainer._metrics[mode]`` as ``DPOTrainer`` appends them; ``num_tokens`` is the training tokens so far."""
    metrics = trainer._metrics[mode]

    def ratio(row, top: str, bottom: str) -> float:
        return row[_COL[top]] / row[_COL[bottom]] if row[_COL[bottom]] > 0 else 0.0

    for row in sums.tolist():
        metrics["entropy"].append(ratio(row, "entropy", "tokens"))
        metrics["logits/chosen"].append(ratio(row, "chosen_logits", "chosen_tokens"))
        metrics["logits/rejected"].append(ratio(row, "rejected_logits", "rejected_tokens"))
        metrics["mean_token_accuracy"].append(ratio(row, "chosen_top1", "chosen_tokens"))
        for name, column in (("rewards/chosen", "chosen_rewards"), ("rewards/rejected", "rejected_rewards"),
                             ("rewards/accuracies", "accurate"), ("rewards/margins", "margins"),
                             ("logps/chosen", "chosen_logps"), ("logps/rejected", "rejected_logps")):
            metrics[name].append(ratio(row, column, "pairs"))
    metrics["num_tokens"] = [trainer._total_train_tokens]
