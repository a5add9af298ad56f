"""A causal LM whose ``loss_type`` is None (GPT-2) trains the token mean of its shifted labels under DistTrainer,
as it does under PP: the Trainer alone would count one label too many per row.

DistTrainer (``trainer_harness.trainer_run``) against the parity harness's reference (``parity.reference_run``,
the loss over the shifted label tokens of the step) on the micro-batches the Trainer ran: losses, the first step's
gradients and the parameters after 2 plain SGD steps (AdamW at this learning rate moved two weights 1.2e-5
apart: its rounding noise, not the loss)."""

from __future__ import annotations

import torch
from transformers import Trainer, TrainingArguments

from parity import Recipe, assert_parity, reference_run, tiny_config, tiny_model

STEPS, MICRO, ACCUMULATION, LR = 2, 4, 2, 1e-2


class _Rows(torch.utils.data.Dataset):
    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (8, 12), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[len(labels) - 1 - i % 3:] = -100  # padding of different lengths; position 0 is a label
        return {"input_ids": self.ids[i], "labels": labels}


def _model(loss_type):
    model = tiny_model(tiny_config("gpt2", "tp"), loaded=True)
    model.loss_type = loss_type
    return model


def _trainer_losses(model, output_dir) -> list[float]:
    args = TrainingArguments(output_dir, per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUMULATION,
                             max_steps=1, learning_rate=LR, logging_steps=1, report_to=[], save_strategy="no",
                             seed=0, disable_tqdm=True, lr_scheduler_type="constant",
                             train_sampling_strategy="sequential", use_cpu=True)
    trainer = Trainer(model, args, train_dataset=_Rows())
    trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log and "train_runtime" not in log]


def test_gpt2_loss_counts_shifted_labels(tmp_path):
    from trainer_harness import RecordingCollator, trainer_run

    assert _model(None).loss_type is None
    named = _trainer_losses(_model("ForCausalLM"), tmp_path / "named")
    plain = _trainer_losses(_model(None), tmp_path / "plain")
    assert abs(plain[0] - named[0]) > 1e-3  # the Trainer alone scales GPT-2's loss by the unshifted count
    collator = RecordingCollator()
    run, _ = trainer_run(str(tmp_path / "dist"), model=_model(None), dataset=_Rows(), max_steps=STEPS,
                         per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUMULATION,
                         learning_rate=LR, optim="sgd", max_grad_norm=0.0, train_sampling_strategy="sequential",
                         trainer_kwargs={"data_collator": collator})
    steps = [collator.batches[i * ACCUMULATION:(i + 1) * ACCUMULATION] for i in range(STEPS)]
    ref = reference_run(_model(None), steps, Recipe(lr=LR, optimizer="sgd"), grads=True)
    assert_parity(run, ref, what="DistTrainer vs reference, GPT-2 with loss_type None")
