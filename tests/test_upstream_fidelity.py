"""Behaviour transformers' own Trainer tests (tests/trainer) observe, checked on ``DistTrainer`` in one process.

Each test is one found by running the Trainer's suite with ``Trainer`` swapped for ``DistTrainer``: it passed with
the Trainer and failed with ``DistTrainer``.
"""

from __future__ import annotations

import numpy as np
import torch

from hf_dist import DistTrainer, DistTrainingArguments


class _Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(0.0))

    def forward(self, input_x, labels=None):
        y = input_x * self.a
        return (torch.nn.functional.mse_loss(y, labels), y)


class _Data:
    def __init__(self, n):
        self.x = np.random.default_rng(0).normal(size=n).astype(np.float32)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_x": self.x[i], "labels": self.x[i]}


def test_train_dataloader_total_batch_size_and_length_are_the_trainers(tmp_path):
    # upstream test_trainer_data.py::test_train_and_eval_dataloaders reads accelerate's total_batch_size
    args = DistTrainingArguments(str(tmp_path), per_device_train_batch_size=16, report_to=[])
    trainer = DistTrainer(_Regression(), args, train_dataset=_Data(66))
    loader = trainer.get_train_dataloader()
    assert loader.total_batch_size == 16
    assert len(loader) == 66 // 16 + 1

    args = DistTrainingArguments(str(tmp_path), per_device_train_batch_size=16, dataloader_drop_last=True,
                                 report_to=[])
    loader = DistTrainer(_Regression(), args, train_dataset=_Data(66)).get_train_dataloader()
    assert loader.total_batch_size == 16
    assert len(loader) == 66 // 16


class _Classifier(torch.nn.Module):
    """A model with no ``config`` and no output head (upstream test_trainer_resume.py's ``DummyModel`` kind)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 2)

    def forward(self, input_ids, labels=None):
        logits = self.linear(input_ids)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


class _Rows:
    def __init__(self, n):
        gen = torch.Generator().manual_seed(0)
        self.x = torch.rand(n, 8, generator=gen)
        self.y = torch.randint(0, 2, (n,), generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


def _train_and_resume(trainer_cls, args_cls, out):
    """Two steps saving every step, then a fresh trainer resuming from checkpoint-1 to step 3: its log and weights."""
    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, save_strategy="steps", save_steps=1,
                  logging_steps=1, learning_rate=0.1, report_to=[], seed=0)
    trainer_cls(_Classifier(), args_cls(str(out), max_steps=2, **common), train_dataset=_Rows(13)).train()
    resumed = trainer_cls(_Classifier(), args_cls(str(out), max_steps=3, **common), train_dataset=_Rows(13))
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    losses = [entry["loss"] for entry in resumed.state.log_history if "loss" in entry]
    return losses, {k: v.detach().clone() for k, v in resumed.model.state_dict().items()}


def test_resume_a_model_without_config_as_the_trainer(tmp_path):
    # upstream test_trainer_resume.py::test_resume_with_original_trainer and test_trainer_checkpointing.py's
    # TrainerInterruptedTrainingTest: the default chunked loss read ``model.config`` of a model that has none
    from transformers import Trainer, TrainingArguments

    losses, weights = _train_and_resume(DistTrainer, DistTrainingArguments, tmp_path / "dist")
    ref_losses, ref_weights = _train_and_resume(Trainer, TrainingArguments, tmp_path / "trainer")
    assert len(losses) == 3  # step 1 from the checkpoint's state, steps 2 and 3 trained after the resume
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=1e-6)
    torch.testing.assert_close(weights, ref_weights, rtol=0, atol=1e-6)


def _tiny_moe(coef=0.5):
    """A tiny Qwen3-MoE whose loss includes the router aux term (coefficient large enough to matter), as loaded."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.trainer_harness import as_loaded

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=coef,
                            output_router_logits=True, pad_token_id=0, use_cache=False)
    return as_loaded(Qwen3MoeForCausalLM(config))


def _lm_batch(rows=4, length=9):
    ids = (torch.arange(rows * length).reshape(rows, length) * 7 + 3) % 93 + 3
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def test_compute_loss_called_outside_train_is_the_trainers(tmp_path):
    # upstream test_trainer_moe_loss.py calls compute_loss on a model in train mode before any train(): DistTrainer
    # read the accumulation of a training step that had not started (AttributeError), and its chunked loss broke a
    # return_dict=False forward ('tuple' object has no attribute 'logits')
    from transformers import Trainer, TrainingArguments

    def ce(outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                 reduction="sum") / num_items_in_batch

    cases = [({}, {}, {}), ({}, {"return_dict": False, "output_router_logits": False}, {}),
             ({"label_smoothing_factor": 0.1}, {}, {}), ({}, {}, {"compute_loss_func": ce}),
             ({"average_tokens_across_devices": False}, {}, {})]
    for args, forward, extra in cases:
        losses = []
        for trainer_cls, args_cls in ((Trainer, TrainingArguments), (DistTrainer, DistTrainingArguments)):
            model = _tiny_moe().train()
            trainer = trainer_cls(model=model, args=args_cls(str(tmp_path / trainer_cls.__name__), report_to=[],
                                                             **args), **extra)
            losses.append(trainer.compute_loss(trainer.model, {**_lm_batch(), **forward}, num_items_in_batch=32))
        torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-6, msg=f"{args} {forward} {list(extra)}")


def _train_moe_two_micro_steps(out, model, **args):
    """One SGD step of 2 micro-batches (accumulation 2): the trained weights and the logged loss."""
    from torch.utils.data import Dataset

    batch = _lm_batch(rows=4)

    class Rows(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {k: v[i] for k, v in batch.items()}

    trainer_args = DistTrainingArguments(str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                         max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
                                         save_strategy="no", report_to=[], seed=0,
                                         train_sampling_strategy="sequential", **args)
    trainer = DistTrainer(model=model, args=trainer_args, train_dataset=Rows())
    trainer.train()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_router_aux_weight_uses_the_coefficient_the_models_forward_uses(tmp_path):
    # the model's forward adds ``self.router_aux_loss_coef x aux`` (an attribute set from the config, which upstream
    # test_trainer_moe_loss.py changes); the reweighing read the config's, so its correction missed by the difference
    changed = _tiny_moe(coef=0.5)
    changed.router_aux_loss_coef = 0.05
    reference = _tiny_moe(coef=0.05)
    got = _train_moe_two_micro_steps(tmp_path / "attribute", changed)
    want = _train_moe_two_micro_steps(tmp_path / "config", reference)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_router_aux_is_not_reweighed_in_a_loss_without_it(tmp_path):
    # with a label smoother the Trainer's loss is not the model's and holds no aux term; the reweighing subtracted
    # ``coef x aux x (1 - 1/accumulation)`` from it anyway. The Trainer itself trains on the smoothed loss alone.
    from transformers import Trainer, TrainingArguments

    want = None
    for trainer_cls, args_cls in ((Trainer, TrainingArguments), (DistTrainer, DistTrainingArguments)):
        batch = _lm_batch(rows=4)
        rows = [{k: v[i] for k, v in batch.items()} for i in range(4)]
        args = args_cls(str(tmp_path / trainer_cls.__name__), per_device_train_batch_size=2,
                        gradient_accumulation_steps=2, max_steps=1, learning_rate=1.0, optim="sgd",
                        lr_scheduler_type="constant", save_strategy="no", report_to=[], seed=0,
                        train_sampling_strategy="sequential", label_smoothing_factor=0.1)
        trainer = trainer_cls(model=_tiny_moe(), args=args, train_dataset=rows)
        trainer.train()
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        if want is None:
            want = weights
    torch.testing.assert_close(weights, want, rtol=0, atol=1e-6)
