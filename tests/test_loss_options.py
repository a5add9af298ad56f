"""The Trainer's loss options crossed with each layout: equal to one process, or refused before training.

``label_smoothing_factor`` (the Trainer's label smoother), ``compute_loss_func`` (a user loss) and
``average_tokens_across_devices=False`` change what the Trainer computes from the model's outputs; a layout that
changes those outputs (FSDP2 renames the model's class, TP shards the vocabulary, CP splits the targets) must give
the same numbers as one process or stop by name. Every case trains a tiny Llama loaded from disk (eval mode, as a
user's; the TP sweep's non-default Llama, ``parity.tiny_config``), 3 AdamW steps of global batch 4 on distinct rows,
on 2 gloo ranks in one spawn, and compares with the one-process run of the same option through the parity harness
(``trainer_harness.trainer_run``, ``parity.assert_parity``, fp32, 1e-5): losses, the first optimizer step's gradients
(not under PP: each rank holds its stages' only) and every parameter after the last step; and the evaluation loss of
the initial weights on rows whose label counts differ (batches of 2, the same batches as one process).
"""

from __future__ import annotations

import pytest

from dist_utils import run_distributed
from parity import assert_parity, masked_batches, tiny_config, tiny_model
from trainer_harness import VOCAB, train_tiny, trainer_run

STEPS, GLOBAL = 3, 4
LAYOUTS = {"ddp": {}, "fsdp2": dict(fsdp="full_shard", fsdp_config={"version": 2}), "tp2": dict(tp_size=2),
           "tp2vp": dict(tp_size=2, tp_vocab_parallel=True), "cp2": dict(cp_size=2), "pp2": dict(pp_size=2)}


def token_mean_loss(outputs, labels, num_items_in_batch=None):
    """A user's ``compute_loss_func``: transformers' causal-LM loss on the whole logits."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(outputs.logits, labels, VOCAB, num_items_in_batch=num_items_in_batch)


OPTIONS = {"label_smoothing": dict(label_smoothing_factor=0.1), "compute_loss_func": {},
           "tokens_per_device": dict(average_tokens_across_devices=False)}
REFUSED = {(layout, option): f"{name} with {size}" for layout, size in (
    ("tp2vp", "tp_size=2 and tp_vocab_parallel=True"), ("cp2", "cp_size=2"), ("pp2", "pp_size=2"))
    for option, name in (("label_smoothing", "label_smoothing_factor=0.1"), ("compute_loss_func", "compute_loss_func"))}
"""(layout, option) -> the start of the refusal (raised before any process group or weight load)."""


def eval_rows() -> list[dict]:
    """8 evaluation rows whose label counts differ (right padding, labels -100): batches of 2 weigh differently by
    tokens than one by one, so a loss weighed over the ranks' batches by their tokens shows."""
    batch = masked_batches(VOCAB, 16, 1, rows=8)[0]
    return [{key: value[i] for key, value in batch.items()} for i in range(8)]


def _train(option: str, output_dir: str, **layout) -> dict:
    """The run in ``assert_parity``'s shape (under PP losses and parameters: ``trainer_run`` needs whole models),
    and ``eval``: the evaluation loss of the initial weights on ``eval_rows`` (batches of 2)."""
    trainer_kwargs = {"compute_loss_func": token_mean_loss} if option == "compute_loss_func" else {}
    model = tiny_model(tiny_config("llama", "tp"), loaded=True)
    assert model.config.vocab_size == VOCAB
    box = {}
    kwargs = dict(model=model, max_steps=STEPS, global_batch_size=GLOBAL, per_device_train_batch_size=2,
                  per_device_eval_batch_size=2, trainer_kwargs={**trainer_kwargs, "eval_dataset": eval_rows()},
                  before_train=lambda trainer: box.update(eval=trainer.evaluate()["eval_loss"]),
                  **OPTIONS[option], **layout)
    if layout.get("pp_size", 1) > 1:
        losses, params, _ = train_tiny(output_dir, **kwargs)
        return {"losses": losses, "state": params, **box}
    return {**trainer_run(output_dir, **kwargs)[0], **box}


def _ranks(rank, world_size, root):
    out = {}
    for layout, fields in LAYOUTS.items():
        for option in OPTIONS:
            output_dir = f"{root}/{layout}-{option}"  # shared by the ranks (PP gathers the model through it)
            if (layout, option) in REFUSED:
                try:
                    _train(option, output_dir, **fields)
                except ValueError as err:
                    out[(layout, option)] = str(err)
                continue
            out[(layout, option)] = _train(option, output_dir, **fields)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("loss_options")
    references = {option: _train(option, str(root / f"reference-{option}")) for option in OPTIONS}
    return references, run_distributed(_ranks, 2, str(root))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_loss_option_equals_one_process_or_is_refused(runs, layout, option):
    references, results = runs
    for rank in (0, 1):
        got = results[rank][(layout, option)]
        if (layout, option) in REFUSED:
            assert isinstance(got, str) and got.startswith(REFUSED[(layout, option)]), got
            continue
        want = references[option] if "grads" in got else {k: references[option][k] for k in ("losses", "state")}
        assert_parity(got, want, rtol=1e-5, state_rtol=1e-5, what=f"rank {rank} {layout} {option}")
        # the evaluation too: each batch's own loss, as one process weighs it (DDP / FSDP2 pair two batches a step)
        assert got["eval"] == pytest.approx(references[option]["eval"], abs=1e-6), (layout, option)


def test_the_options_change_the_training(runs):
    """The option cases are not the plain loss under another name: label smoothing moves the weights elsewhere."""
    references, _ = runs
    smoothed, plain = references["label_smoothing"]["state"], references["tokens_per_device"]["state"]
    assert max(float((smoothed[k] - plain[k]).abs().max()) for k in plain) > 1e-4
