"""Which step ``DistTrainer`` is in, and what that decides: a training batch split over the cp ranks, an evaluation
batch's loss as one process computes it.

Training (``training_step``): the Trainer calls ``_prepare_context_parallel_inputs(model, inputs)`` at the start of
every training step and runs forward and backward inside the context it returns; ``prepare_inputs`` gives it this
rank's slice of the shifted labels (``hf_dist.context_parallel.inputs.split_targets``) and the model's ``split()``
(the sequence split active for forward, backward and recomputation), the batch first padded to a multiple of cp where
it is not one (``pad_to_slices``: packed rows have any length; the padding changes no figure). The Trainer's own
``num_items_in_batch`` arithmetic, with ``get_cp_size`` returning the cp degree, weights each rank's loss by tokens
(``hf_dist.context_parallel.inputs``).

Evaluation (``prediction_step``): each batch's loss is the model's own on that batch (``loss_count`` hands
``compute_loss`` no token count), on every layout. Evaluation runs the whole sequence on every cp rank (no split: the
predictions are whole, for metrics), so each rank holds the batch's whole loss; the Trainer's evaluation loop then
averages the batches' losses row by row, as in one process. With the count the Trainer gathers over the ranks it
would multiply the loss by the ``dp x cp`` ranks and divide the model's token sum by the step's tokens: a MoE's aux
term, which the count does not divide, came out ``dp`` times too large (``cp`` times too small with
``average_tokens_across_devices=False``), and the batches of one step were weighed by their tokens, not one by one
(``tests/test_cp_evaluation.py``, ``tests/test_loss_options.py``, ``tests/test_expert_parallel_trainer.py``).
Not here: the attention exchange and the hooks (``hf_dist.context_parallel``), the router aux term of a training step
(``hf_dist.trainer.router_loss``).
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


@contextlib.contextmanager
def prediction_step(trainer):
    """Marks the Trainer's ``prediction_step``: the loss computed inside it is one evaluation batch's
    (``loss_count``)."""
    trainer._in_prediction_step = True
    try:
        yield
    finally:
        trainer._in_prediction_step = False


def loss_count(trainer, num_items_in_batch):
    """The ``num_items_in_batch`` ``compute_loss`` weighs this batch's loss by: none in an evaluation batch (the
    model's own loss on the batch, as one process computes it; see the module doc), else the Trainer's."""
    return None if getattr(trainer, "_in_prediction_step", False) else num_items_in_batch
