"""A tiny DistTrainer run that tests call in one process or on every rank of a gloo group.

``train_tiny(output_dir, **overrides)`` trains a tiny Llama for a few optimizer steps on a fixed synthetic
token dataset and returns the per-step losses and the full (gathered) parameters, so a test can compare
any layout against a single-process reference with ``torch.testing.assert_close``.

The model is loaded as users load theirs: built from its config, written with ``save_pretrained`` and read back with
``from_pretrained`` (``as_loaded``), which returns it in eval mode. A model built with ``from_config`` is in train
mode, and a CP run that split its batch only in train mode counted the first micro-batch of every ``train()`` call
twice while every test built its model with ``from_config``.
"""

from __future__ import annotations

import os

import torch

VOCAB = 256
SEQ = 32


def token_dataset(n: int = 64, seed: int = 0):
    """Sequences with a learnable pattern (each token predicts the next), as a ``datasets.Dataset``."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n, 1), generator=gen)
    steps = torch.randint(1, 4, (n, 1), generator=gen)
    ids = (starts + steps * torch.arange(SEQ)) % VOCAB
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def full_parameters(trainer) -> dict[str, torch.Tensor]:
    """Every parameter gathered to full tensors on CPU (collective for sharded layouts)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if trainer.dims.pp_enabled:  # each rank holds its stages: rank 0 writes the whole model and sends it to all
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        folder = os.path.join(trainer.args.output_dir, "gathered_for_test")  # rank 0's output_dir is the one used
        trainer.save_model(folder)
        box = [None]
        if dist.get_rank() == 0:
            box[0] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
        dist.broadcast_object_list(box, src=0)
        sd = box[0]
    elif trainer.owns_layout:
        sd = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    else:
        sd = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


def as_loaded(model, **load_kwargs):
    """``model`` written with ``save_pretrained`` and read back with ``from_pretrained(**load_kwargs)`` (eval mode, as
    a user's)."""
    import tempfile

    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    # One folder per process, so no rank races another. save_pretrained writes only on rank 0 of an initialised
    # group: write the same two files (config, safetensors) directly.
    with tempfile.TemporaryDirectory(prefix="hf_dist_tiny_") as folder:
        model.config.save_pretrained(folder)
        save_model(model, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=model.dtype, **load_kwargs)
    assert not loaded.training  # what from_pretrained returns; the layouts must not depend on train mode
    return loaded


def tiny_args(output_dir: str, **overrides) -> dict:
    """The ``DistTrainingArguments`` fields of the harness's runs (fp32, seeded, no saves, CPU on one process),
    ``overrides`` applied."""
    args = dict(
        output_dir=output_dir,
        max_steps=5,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        max_grad_norm=1.0,
        use_cpu=not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) == 1,
    )
    args.update(overrides)
    return args


def train_tiny(output_dir: str, *, max_steps: int = 5, model_kwargs: dict | None = None, model=None,
               trainer_kwargs: dict | None = None, resume: str | None = None, dataset=None, before_train=None,
               **overrides):
    """Train for ``max_steps`` optimizer steps; return ``(losses, params, trainer)``. Overrides go to
    DistTrainingArguments, ``trainer_kwargs`` to DistTrainer; ``model`` (built the same on every rank) replaces the
    tiny Llama; ``resume``: the checkpoint ``train`` resumes from; ``dataset`` replaces ``token_dataset()``;
    ``before_train(trainer)`` runs before ``train`` (an evaluation before the optimizer exists, say)."""
    from hf_dist import DistTrainer, DistTrainingArguments
    from hf_dist.models import build_tiny_model

    args = tiny_args(output_dir, max_steps=max_steps, **overrides)
    if model is None:
        model = as_loaded(build_tiny_model(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                           **(model_kwargs or {})))
    train = dataset if dataset is not None else token_dataset()
    trainer = DistTrainer(model=model, args=DistTrainingArguments(**args), train_dataset=train,
                          **(trainer_kwargs or {}))
    if before_train is not None:
        before_train(trainer)
    trainer.train(resume_from_checkpoint=resume)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return losses, full_parameters(trainer), trainer


def evaluate_tiny(output_dir: str, model, eval_dataset, **overrides) -> tuple[float, object]:
    """``DistTrainer.evaluate()``'s ``eval_loss`` of ``model`` on ``eval_dataset`` (no training), and the trainer;
    overrides go to DistTrainingArguments (``per_device_eval_batch_size``, the layout)."""
    from hf_dist import DistTrainer, DistTrainingArguments

    trainer = DistTrainer(model=model, args=DistTrainingArguments(**tiny_args(output_dir, **overrides)),
                          eval_dataset=eval_dataset)
    return trainer.evaluate()["eval_loss"], trainer


# -- the first step of a train() call and of a resumed run ------------------------------------------------------

WRAPPERS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})
"""Name parts activation checkpointing, torch.compile and FSDP1 add (the state dict's names have none)."""


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every gradient of ``model`` whole, in HF layout and on CPU (``parity.full_grads``: collective for DTensors), by
    state-dict name (the wrappers' name parts dropped)."""
    import parity

    return {".".join(p for p in name.split(".") if p not in WRAPPERS): grad.cpu()
            for name, grad in parity.full_grads(model).items()}


def first_step_grads():
    """A callback holding (``.grads``) the gradients of the first optimizer step of a ``train()`` call as the
    backward left them, before clipping (as ``parity.reference_run`` records them), gathered whole, and that step's
    number (``.step``). ``watch(trainer)`` before ``train``: DistTrainer sums the TP partial gradients just before
    the norm reads them (``_reduce_partial_grads``, with or without clipping); the capture follows that sum."""
    from transformers import TrainerCallback

    class FirstStepGrads(TrainerCallback):
        grads: dict | None = None
        step: int | None = None

        def capture(self, model, step: int) -> None:
            if self.grads is None:
                self.grads, self.step = full_grads(model), step

        def watch(self, trainer) -> None:
            reduce = trainer._reduce_partial_grads

            def reduce_then_capture(model):
                reduce(model)
                self.capture(trainer.model, trainer.state.global_step + 1)  # not the DDP wrapper's names

            trainer._reduce_partial_grads = reduce_then_capture

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.capture(model, state.global_step + 1)  # where no norm was taken: nothing was clipped either

    return FirstStepGrads()


def trainer_run(output_dir: str, *, callbacks: list | None = None, before_train=None, **kwargs) -> tuple[dict, object]:
    """``train_tiny(output_dir, **kwargs)`` (``resume=`` a checkpoint: a resumed run) in ``parity.assert_parity``'s
    shape: ``losses`` and ``norms`` (the gradient norm the Trainer logged, before clipping) of each logged step of
    this ``train()`` call, ``grads`` (its first optimizer step's, before clipping) and ``state`` (every parameter at
    the end); and the trainer. The same call in one process is the reference: a layout's first step and a resumed
    run's first step are compared with it gradient by gradient. Not under PP (each rank holds its stages'
    gradients only)."""
    if kwargs.get("pp_size", 1) > 1:
        raise ValueError("trainer_run gathers gradients from every rank's whole model; pp_size > 1 holds stages")
    grads = first_step_grads()
    trainer_kwargs = dict(kwargs.pop("trainer_kwargs", None) or {})
    trainer_kwargs["callbacks"] = [grads, *(callbacks or []), *trainer_kwargs.get("callbacks", [])]

    def watch_then(trainer):
        grads.watch(trainer)
        if before_train is not None:
            before_train(trainer)

    _, params, trainer = train_tiny(output_dir, trainer_kwargs=trainer_kwargs, before_train=watch_then, **kwargs)
    assert grads.grads and set(grads.grads) <= set(params), "no first-step gradients, or names not the model's"
    logs = [log for log in trainer.state.log_history if "loss" in log and log["step"] >= grads.step]
    run = {"losses": [log["loss"] for log in logs], "grads": grads.grads, "state": params}
    if all("grad_norm" in log for log in logs):
        run["norms"] = [log["grad_norm"] for log in logs]
    return run, trainer


class RecordingCollator:
    """``transformers.default_data_collator`` keeping every batch it made (``.batches``): the micro-batches a
    one-process run trained on, for ``parity.reference_run``."""

    def __init__(self):
        self.batches: list[dict[str, torch.Tensor]] = []

    def __call__(self, features):
        from transformers import default_data_collator

        batch = default_data_collator(features)
        self.batches.append({k: v.clone() for k, v in batch.items()})
        return batch


def tiny_moe_config(tokenizer, *, dense: bool = False, **overrides):
    """The tiny Qwen3-MoE the TRL-level tests and the MoE example's CPU twin train (4 experts, top-2,
    ``norm_topk_prob``, router aux loss 0.1), sized to ``tokenizer``; ``dense``: the same attention with a dense MLP
    (Qwen3). ``overrides`` set further config fields (``output_router_logits=True``)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    if dense:
        return Qwen3Config(**common, **overrides)
    return Qwen3MoeConfig(**common, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                          norm_topk_prob=True, router_aux_loss_coef=0.1, **overrides)
