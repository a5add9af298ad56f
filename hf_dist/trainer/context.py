"""DistTrainer's context-parallel step: the training batch's targets split over the cp ranks.

The Trainer calls ``_prepare_context_parallel_inputs(model, inputs)`` at the start of every training step and
runs forward and backward inside the context it returns; ``prepare_inputs`` gives it this rank's slice of the
shifted labels (``hf_dist.context_parallel.inputs.split_targets``) and the model's ``split()`` (the sequence split
active for forward, backward and recomputation), the batch first padded to a multiple of cp where it is not one
(``pad_to_slices``: packed rows have any length; the padding changes no figure). The Trainer's own
``num_items_in_batch`` arithmetic, with ``get_cp_size`` returning the cp degree, weights each rank's loss by tokens
(``hf_dist.context_parallel.inputs``).

Evaluation runs the whole sequence on every cp rank (no split: the predictions are whole, for metrics);
``eval_loss_share`` corrects the loss the Trainer's arithmetic then over-counts by cp.
Not here: the attention exchange and the hooks (``hf_dist.context_parallel``).
"""

from __future__ import annotations

import contextlib
import functools

from hf_dist.context_parallel import context_parallel_state, split_targets
from hf_dist.context_parallel.inputs import pad_to_slices


@contextlib.contextmanager
def training_step(trainer):
    """Marks the Trainer's ``training_step``: the batch prepared inside it is a training batch, split over cp, and
    the loss computed inside it is one micro step of an optimizer step (``in_training_step``).

    The Trainer prepares the CP inputs *before* it calls ``model.train()``, so ``model.training`` cannot tell a
    training step from an evaluation: a model loaded with ``from_pretrained`` (eval mode) or left in eval mode by an
    ``evaluate()`` would see its first micro-batch whole on every cp rank, counted cp times."""
    trainer._in_training_step = True
    try:
        yield
    finally:
        trainer._in_training_step = False


def in_training_step(trainer) -> bool:
    """Whether the Trainer is inside ``training_step`` (not evaluating, nor ``compute_loss`` called on its own, as
    transformers' tests and subclasses do outside ``train()``, where no accumulation is under way)."""
    return getattr(trainer, "_in_training_step", False)


def prepare_inputs(trainer, model, inputs: dict):
    """``(context, inputs)`` for one training step under CP; evaluation and layouts without CP are left alone."""
    state = context_parallel_state(trainer.model)
    if state is None or not in_training_step(trainer):
        return contextlib.nullcontext, inputs
    inputs, padding = pad_to_slices(inputs, state.size)  # a packed row of any length: equal slices
    return functools.partial(state.split, padding=padding), split_targets(inputs, state)


def eval_loss_share(trainer, loss):
    """The evaluation loss of one cp rank: it computed the whole sequence's token sum, where the Trainer's weighting
    (count divided by cp, loss multiplied by dp x cp) expects a 1/cp share of the tokens."""
    if loss is None or not trainer.dims.cp_enabled:
        return loss
    return loss / trainer.dims.cp
