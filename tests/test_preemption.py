"""Preemption on 2 gloo ranks: a signal to ONE rank mid-step stops every rank after that step, a checkpoint is
saved, train() exits with 75; the relaunch with resume "auto" ends equal to an uninterrupted run (1e-6).
FSDP2 (hf_dist checkpoint, also written asynchronously) and DDP (the Trainer's own checkpoint)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from dist_utils import run_distributed
from trainer_harness import VOCAB, full_parameters, token_dataset

from hf_dist.trainer.preemption import PREEMPTED_EXIT_CODE, parse_signals

STEPS, SIGNAL_DURING = 6, 3
LAYOUTS = {"fsdp2": dict(fsdp="full_shard", fsdp_config={"version": 2}), "ddp": {}}
LAYOUTS["fsdp2_async"] = dict(LAYOUTS["fsdp2"], async_save=True)  # the preemption save committed before exit 75


def _signal_rank1_during(step: int):
    from transformers import TrainerCallback

    class SendSignal(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step - 1 and args.process_index == 1:
                os.kill(os.getpid(), signal.SIGUSR1)  # delivered through the real handler, mid-step

    return SendSignal()


def _run(output_dir: str, layout: str, *, resume: str | None, signal_during: int | None = None) -> dict:
    from transformers import TrainerCallback

    from hf_dist import DistTrainer, DistTrainingArguments
    from hf_dist.models import build_tiny_model

    args = DistTrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2, global_batch_size=8,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1, save_strategy="no",
        report_to=[], seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=1.0,
        preemption_signals="SIGTERM,USR1", resume_from_checkpoint=resume, **LAYOUTS[layout],
    )

    class Count(TrainerCallback):
        steps_run = 0

        def on_step_end(self, args, state, control, **kwargs):
            Count.steps_run += 1

    callbacks = [Count()] + ([_signal_rank1_during(signal_during)] if signal_during else [])
    model = build_tiny_model(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2)
    trainer = DistTrainer(model=model, args=args, train_dataset=token_dataset(), callbacks=callbacks)
    exit_code = 0
    try:
        trainer.train()
    except SystemExit as stop:
        exit_code = stop.code
    latest = os.path.join(output_dir, "latest")  # hf_dist's pointer, moved by the commit
    latest_at_exit = open(latest).read().strip() if os.path.isfile(latest) else None
    losses = {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}
    params = {k: v.numpy() for k, v in full_parameters(trainer).items()}
    return {"losses": losses, "params": params, "steps_run": Count.steps_run, "exit_code": exit_code,
            "latest_at_exit": latest_at_exit, "handler_restored": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL}


def _three_runs(rank, world, root):
    out = {}
    for layout in LAYOUTS:
        full = _run(f"{root}/{layout}/full", layout, resume=None)
        cut = _run(f"{root}/{layout}/cut", layout, resume="auto", signal_during=SIGNAL_DURING)  # first start
        resumed = _run(f"{root}/{layout}/cut", layout, resume="auto")  # the requeued job: same command line
        out[layout] = {"full": full, "cut": cut, "resumed": resumed}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preempt")
    return root, run_distributed(_three_runs, 2, str(root))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_signal_saves_exits_75_and_resume_equals_uninterrupted(runs, layout):
    root, per_rank = runs
    for rank_result in per_rank:
        cut = rank_result[layout]["cut"]
        assert cut["exit_code"] == PREEMPTED_EXIT_CODE  # every rank, though only rank 1 got the signal
        assert cut["steps_run"] == SIGNAL_DURING  # it finished the step it was in, and no more
        assert cut["handler_restored"]
        if layout != "ddp":  # committed before train() raised SystemExit, also when written in the background
            assert cut["latest_at_exit"] == f"checkpoint-{SIGNAL_DURING}"
    ckpt = root / layout / "cut" / f"checkpoint-{SIGNAL_DURING}"
    assert (ckpt / "trainer_state.json").is_file()
    assert (ckpt / "manifest.json").is_file() == (layout != "ddp")  # hf_dist's (atomic) or the Trainer's own
    full, resumed = per_rank[0][layout]["full"], per_rank[0][layout]["resumed"]
    assert resumed["exit_code"] == 0 and resumed["steps_run"] == STEPS - SIGNAL_DURING
    assert not (root / layout / "cut" / "preempted.json").exists()  # cleared by the resumed run
    for step in range(SIGNAL_DURING + 1, STEPS + 1):
        torch.testing.assert_close(resumed["losses"][step], full["losses"][step], atol=1e-6, rtol=0)
    torch.testing.assert_close({k: torch.as_tensor(v) for k, v in resumed["params"].items()},
                               {k: torch.as_tensor(v) for k, v in full["params"].items()}, atol=1e-6, rtol=0)


def test_parse_signals():
    assert parse_signals("SIGTERM,USR1") == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals("none") == ()
    for bad in ("SIGKILL", "SIGTERM,SIGNOPE"):
        with pytest.raises(ValueError, match=r"is not a signal a process can handle.*SIGTERM,SIGUSR1"):
            parse_signals(bad)


def test_marker_names_the_checkpoint(tmp_path):
    """What a batch script reads (the launcher may hide the exit code)."""
    from types import SimpleNamespace

    from hf_dist.trainer.preemption import MARKER_NAME, PreemptionCallback, exit_if_preempted

    callback = PreemptionCallback((signal.SIGUSR1,))
    callback.received, callback.preempted_at = signal.SIGUSR1, 7
    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path)), is_world_process_zero=lambda: True,
                              accelerator=SimpleNamespace(wait_for_everyone=lambda: None))
    with pytest.raises(SystemExit) as stop:
        exit_if_preempted(trainer, callback)
    assert stop.value.code == 75
    assert json.loads((tmp_path / MARKER_NAME).read_text()) == {
        "step": 7, "signal": "SIGUSR1", "checkpoint": "checkpoint-7", "exit_code": 75}
