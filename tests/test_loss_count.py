"""A causal LM whose ``loss_type`` is None (GPT-2) trains the token mean of its shifted labels under DistTrainer,
as it does under PP: the Trainer alone would count one label too many per row."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from hf_dist import DistTrainer, DistTrainingArguments


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
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model.loss_type = loss_type
    return model


def _losses(trainer_cls, args_cls, model, tmp_path):
    args = args_cls(str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2,
                    learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                    disable_tqdm=True, lr_scheduler_type="constant", train_sampling_strategy="sequential")
    trainer = trainer_cls(model, args, train_dataset=_Rows())
    trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log and "train_runtime" not in log]


def test_gpt2_loss_counts_shifted_labels(tmp_path):
    assert _model(None).loss_type is None
    named = _losses(Trainer, TrainingArguments, _model("ForCausalLM"), tmp_path / "named")
    plain = _losses(Trainer, TrainingArguments, _model(None), tmp_path / "plain")
    dist = _losses(DistTrainer, DistTrainingArguments, _model(None), tmp_path / "dist")
    assert abs(plain[0] - named[0]) > 1e-3  # the Trainer alone scales GPT-2's loss by the unshifted count
    torch.testing.assert_close(dist, named, rtol=1e-5, atol=1e-6)
