"""A run's training logs as a JSON-lines file, written while it trains and read back by ``hf-dist report``.

The Trainer keeps ``state.log_history`` in memory and writes it to ``trainer_state.json`` only inside
checkpoints, so a run saved with ``save_strategy="no"`` (or one that crashed) leaves no log curve behind.
``LogHistoryCallback`` appends each log dict, as the main process sees it, to ``OUTPUT_DIR/log_history.jsonl``
the moment it is logged. ``read_log_history`` reads that file back, or, for runs made without the callback, the
``log_history`` of the newest ``trainer_state.json`` it finds. Not for metrics that never reach ``Trainer.log``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from transformers import TrainerCallback

LOG_FILE = "log_history.jsonl"


class LogHistoryCallback(TrainerCallback):
    """Append every ``Trainer.log`` dict (with its ``step``) to ``args.output_dir/log_history.jsonl``.

    When training begins, lines an earlier run left behind are dropped unless they come at or before the step
    this run starts at (a resume keeps the history up to its checkpoint); lines this run already wrote (an
    ``evaluate()`` before ``train()``) stay. Logs outside any ``train()`` call are appended.
    """

    def __init__(self) -> None:
        self._written = 0

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        path = Path(args.output_dir) / LOG_FILE
        records = _read_jsonl(path)
        split = len(records) - self._written
        # A resume at step N keeps lines up to N: step N trained and logged before its checkpoint was saved.
        kept = [r for r in records[:split] if 0 < state.global_step and r.get("step", 0) <= state.global_step]
        kept += records[split:]
        if path.is_file():
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._written = len(kept)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        path = Path(args.output_dir) / LOG_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {**{k: _plain(v) for k, v in logs.items()}, "step": state.global_step}
        with path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        self._written += 1


def _plain(value):
    """A JSON-safe scalar: tensors and numpy numbers become floats, NaN/inf become None."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_log_history(run_dir: str | Path) -> list[dict]:
    """The run's log dicts in order: ``log_history.jsonl``, else the newest ``trainer_state.json`` under it."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {str(run_dir)!r} does not exist; pass the training output_dir")
    records = _read_jsonl(run_dir / LOG_FILE)
    if records:
        return records
    states = sorted(
        run_dir.glob("**/trainer_state.json"), key=lambda p: json.loads(p.read_text()).get("global_step", 0)
    )
    if states:
        return json.loads(states[-1].read_text()).get("log_history", [])
    raise ValueError(
        f"{str(run_dir)!r} holds neither {LOG_FILE} nor a trainer_state.json; train with DistTrainer and "
        f"--dist_logging true (it writes {LOG_FILE}) or add hf_dist.report.LogHistoryCallback() to a plain "
        f"Trainer's callbacks"
    )
