"""Preemption: on SIGTERM / SIGUSR1 every rank finishes its optimizer step, a checkpoint is saved, and the job
exits with ``PREEMPTED_EXIT_CODE`` (75, ``EX_TEMPFAIL``: "try again"), so a scheduler can requeue it.

SLURM sends SIGTERM before killing a preempted or cancelled job (and SIGUSR1 ahead of the time limit with
``--signal=USR1@SECONDS``); Kubernetes sends SIGTERM and waits ``terminationGracePeriodSeconds``. The handler
only records the signal; at the end of each optimizer step the ranks agree (a max all-reduce of one flag, so a
signal seen by any rank stops all of them at the same step), the Trainer saves ``checkpoint-N`` the usual way
(atomic hf_dist checkpoint for FSDP2/TP/PP, the Trainer's own for DDP/DeepSpeed), the main process writes
``output_dir/preempted.json``, and ``DistTrainer.train`` raises ``SystemExit(75)``. A second signal while the
save runs restores the default action (the process dies as it would have without hf_dist). Relaunch with
``--resume_from_checkpoint auto`` to continue.

Through ``torchrun`` / ``accelerate launch`` the launcher reports a failed worker with its own exit status, so
batch scripts should test ``preempted.json`` as well as 75 (``examples/multinode/harbor_13b_2x8.sbatch``).

Not here: the checkpoint format (``hf_dist.checkpoint``), choosing what to resume (``resume``).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # sysexits.h EX_TEMPFAIL
MARKER_NAME = "preempted.json"
_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}


def parse_signals(spec: str | None) -> tuple[signal.Signals, ...]:
    """``"SIGTERM,SIGUSR1"`` (or ``"TERM,USR1"``, ``"none"``) as signals; ``ValueError`` naming a bad one."""
    if spec is None or spec.strip().lower() in ("", "none"):
        return ()
    out = []
    for raw in spec.split(","):
        name = raw.strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name in _UNCATCHABLE or not hasattr(signal.Signals, name):
            raise ValueError(
                f"preemption_signals={spec!r}: {raw.strip()!r} is not a signal a process can handle; use names such "
                f"as SIGTERM,SIGUSR1 (SIGKILL and SIGSTOP cannot be caught), or 'none' to turn preemption saves off"
            )
        out.append(signal.Signals[name])
    return tuple(dict.fromkeys(out))


class PreemptionCallback(TrainerCallback):
    """Turn a preemption signal into "finish this step, save, stop" on every rank at the same step."""

    def __init__(self, signals: tuple[signal.Signals, ...]):
        self.signals = signals
        self.received: signal.Signals | None = None
        self.preempted_at: int | None = None
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # a second notice: stop waiting for the save
            signal.signal(signum, self._previous.get(signal.Signals(signum), signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.received = signal.Signals(signum)

    def on_train_begin(self, args, state, control, **kwargs):
        self.received, self.preempted_at = None, None
        if threading.current_thread() is not threading.main_thread():  # Python handles signals there only
            logger.warning("train() runs outside the main thread: preemption signals are not handled")
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        if state.is_world_process_zero:
            (Path(args.output_dir) / MARKER_NAME).unlink(missing_ok=True)  # a resumed run is no longer preempted

    def on_step_end(self, args, state, control, **kwargs):
        if self._any_rank_signalled(args):
            self.preempted_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _any_rank_signalled(self, args) -> bool:
        flag = self.received is not None
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return flag
        tensor = torch.tensor([1 if flag else 0], dtype=torch.int32, device=args.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return bool(tensor.item())


def exit_if_preempted(trainer, callback: PreemptionCallback | None) -> None:
    """After ``train()``: when it stopped for a preemption, record it and exit with ``PREEMPTED_EXIT_CODE``."""
    if callback is None or callback.preempted_at is None:
        return
    step = callback.preempted_at
    name = callback.received.name if callback.received is not None else "a signal on another rank"
    if trainer.is_world_process_zero():
        record = {"step": step, "signal": name, "checkpoint": f"checkpoint-{step}", "exit_code": PREEMPTED_EXIT_CODE}
        (Path(trainer.args.output_dir) / MARKER_NAME).write_text(json.dumps(record) + "\n")
        logger.warning(
            "preempted (%s): saved checkpoint-%d in %s; exiting with %d. Relaunch with --resume_from_checkpoint auto",
            name, step, trainer.args.output_dir, PREEMPTED_EXIT_CODE,
        )
    trainer.accelerator.wait_for_everyone()
    raise SystemExit(PREEMPTED_EXIT_CODE)
