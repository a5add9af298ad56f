"""A run resumed at its last step trains nothing more (one process).

The Trainer checks ``max_steps`` only after a step, so resuming from ``checkpoint-N`` with ``max_steps=N`` in the
middle of an epoch trained step N+1 (seen when a preempted elastic run was restarted after its last save).
"""

from __future__ import annotations

import torch
from trainer_harness import train_tiny

STEPS = 3  # 64 samples / 2 per step: 32 steps an epoch, so step 3 is mid-epoch


def test_resuming_the_last_checkpoint_trains_no_further(tmp_path):
    out = str(tmp_path / "run")
    before, params, _ = train_tiny(out, max_steps=STEPS, save_strategy="steps", save_steps=STEPS)
    losses, again, trainer = train_tiny(out, max_steps=STEPS, resume=f"{out}/checkpoint-{STEPS}")
    assert trainer.state.global_step == STEPS
    assert losses == before  # the checkpoint's log history, no step logged after the resume
    torch.testing.assert_close(again, params, atol=0, rtol=0)


def test_resuming_with_more_steps_trains_the_rest(tmp_path):
    out = str(tmp_path / "run")
    train_tiny(out, max_steps=STEPS, save_strategy="steps", save_steps=STEPS)
    losses, _, trainer = train_tiny(out, max_steps=STEPS + 2, resume=f"{out}/checkpoint-{STEPS}")
    assert trainer.state.global_step == STEPS + 2 and len(losses) == STEPS + 2
