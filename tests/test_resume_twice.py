"""Training twice into one output_dir: allowed as the Trainer allows it, without losing the first run.

Run A saves checkpoint-2 and -4. Run B starts fresh in the same folder with ``save_total_limit=1``, as the plain
Trainer lets a notebook cell run twice: it trains the Trainer's losses, says once where A's checkpoints went,
and neither overwrites nor rotates them away (byte for byte). ``true`` then finds B's checkpoint-4, and run C
resuming A's moved-aside checkpoint-2 continues A exactly (and sets B's aside in turn); D resuming C's checkpoint-4
in place sets C's checkpoint-6 aside rather than saving over it. In one process (the
Trainer's own checkpoints, against ``transformers.Trainer``) and on 2 gloo ranks under FSDP2 (hf_dist's
checkpoints and their retention). ``--overwrite_output_dir`` still deletes the earlier run instead. DistSFTTrainer
trains twice into one folder as TRL's SFTTrainer does.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from trainer_harness import VOCAB, token_dataset

LAYOUTS = {"one process": dict(use_cpu=True), "fsdp2": dict(fsdp2=True)}
MOVED = "moved them into"


def _train(out: str, layout: str, *, resume=None, lr=1e-3, limit: int | None = None, steps=4, plain=False,
           **extra):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_dist import DistTrainer, DistTrainingArguments
    from hf_dist.models import build_tiny_model

    args_cls, trainer_cls = (TrainingArguments, Trainer) if plain else (DistTrainingArguments, DistTrainer)
    args = args_cls(
        output_dir=out, max_steps=steps, per_device_train_batch_size=2, learning_rate=lr, lr_scheduler_type="constant",
        logging_steps=1, save_strategy="steps", save_steps=2, save_total_limit=limit, report_to=[], seed=0,
        data_seed=0, disable_tqdm=True, dataloader_num_workers=0, **LAYOUTS[layout], **extra,
    )
    model = build_tiny_model(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2)
    trainer = trainer_cls(model=model, args=args, train_dataset=token_dataset())
    first_step = []
    trainer.add_callback(type("First", (TrainerCallback,), {
        "on_step_end": lambda self, args, state, control, **kw: first_step.append(state.global_step)})())
    trainer.train(resume_from_checkpoint=resume)
    losses = {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}
    return dict(losses, steps_run=first_step)


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _twice(rank, world, root: str, layout: str) -> dict:
    """A, then B fresh into A's folder, then C resuming A's moved-aside checkpoint-2 (on every rank)."""
    from hf_dist.trainer.resume import resolve_resume

    out = Path(root) / layout
    result = {"a": _train(str(out), layout)}
    result["a_files"] = {name: _digest(out / name) for name in ("checkpoint-2", "checkpoint-4")}
    with contextlib.redirect_stdout(io.StringIO()) as said:
        result["b"] = _train(str(out), layout, lr=3e-3, limit=1)
    result["said"] = said.getvalue()
    result["after_b"] = sorted(p.name for p in out.iterdir())
    (aside,) = out.glob("previous_run-*")
    result["true_after_b"] = resolve_resume(True, out, native_only=False)
    result["aside_files"] = {name: _digest(aside / name) for name in ("checkpoint-2", "checkpoint-4")}
    result["aside_names"] = sorted(p.name for p in aside.iterdir())
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has looked before C moves B's checkpoints
    result["c"] = _train(str(out), layout, resume=str(aside / "checkpoint-2"), steps=6)
    result["after_c"] = sorted(p.name for p in out.iterdir())
    result["c6"] = _digest(out / "checkpoint-6")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    # D resumes C's checkpoint-4 in place: C's checkpoint-6 is an abandoned continuation, set aside, not replaced
    result["d"] = _train(str(out), layout, resume=str(out / "checkpoint-4"), steps=6)
    newest_aside = max(out.glob("previous_run-*"), key=lambda p: p.stat().st_mtime_ns)
    result["d_aside"] = {p.name: _digest(p) for p in newest_aside.glob("checkpoint-*")}
    return result


def _check(result: dict, out: Path) -> None:
    assert result["aside_files"] == result["a_files"]  # A's checkpoints, untouched by B's saves and rotation
    assert sum(said.count(MOVED) for said in result["said"]) == 1, result["said"]  # once, by the main process
    assert "checkpoint-2, checkpoint-4" in "".join(result["said"])
    aside = [name for name in result["after_b"] if name.startswith("previous_run-")]
    assert len(aside) == 1 and "checkpoint-4" in result["after_b"] and "checkpoint-2" not in result["after_b"]
    assert result["true_after_b"] == str(out / "checkpoint-4")  # B's (save_total_limit=1 rotated B's own -2)
    assert result["b"][4] != pytest.approx(result["a"][4])  # B really trained anew (another learning rate)
    assert result["c"]["steps_run"] == [3, 4, 5, 6]  # C continued A at step 3 ...
    for step in (3, 4):  # ... exactly
        torch.testing.assert_close(result["c"][step], result["a"][step], atol=1e-6, rtol=0)
    assert len([n for n in result["after_c"] if n.startswith("previous_run-")]) == 2  # B's moved aside in turn
    assert result["d"]["steps_run"] == [5, 6] and result["d_aside"] == {"checkpoint-6": result["c6"]}
    torch.testing.assert_close(result["d"][6], result["c"][6], atol=1e-6, rtol=0)


def test_one_process_trains_twice_like_the_trainer_and_keeps_the_first_run(tmp_path):
    result = _twice(0, 1, str(tmp_path), "one process")
    result["said"] = [result["said"]]
    _check(result, tmp_path / "one process")
    assert "trainer_state.json" in result["a_files"]["checkpoint-4"] and "latest" not in result["aside_names"]
    plain = tmp_path / "plain"  # the Trainer itself, the same two runs into one folder
    first, second = _train(str(plain), "one process", plain=True), _train(str(plain), "one process", lr=3e-3,
                                                                          limit=1, plain=True)
    torch.testing.assert_close(result["a"], first, atol=1e-6, rtol=0)
    torch.testing.assert_close(result["b"], second, atol=1e-6, rtol=0)


def test_overwrite_output_dir_still_discards_the_earlier_run(tmp_path, capsys):
    _train(str(tmp_path), "one process", steps=2)
    capsys.readouterr()
    _train(str(tmp_path), "one process", steps=2, lr=3e-3, overwrite_output_dir=True)
    said = capsys.readouterr().out
    assert "--overwrite_output_dir: deleted the earlier run's checkpoint-2" in said and MOVED not in said
    assert not list(tmp_path.glob("previous_run-*"))
    state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["log_history"][-1]["learning_rate"] == pytest.approx(3e-3)  # the second run's, not the first's


def test_fsdp2_trains_twice_and_keeps_the_first_runs_sharded_checkpoints(tmp_path):
    results = run_distributed(_twice, 2, str(tmp_path), "fsdp2")
    result = dict(results[0], said=[r["said"] for r in results])
    _check(result, tmp_path / "fsdp2")
    assert "manifest.json" in result["a_files"]["checkpoint-4"]  # hf_dist's format, with its `latest` pointer
    assert result["aside_names"] == ["checkpoint-2", "checkpoint-4", "latest"]


def _sft_twice(out: Path, tokenizer_dir: Path, config_cls, trainer_cls) -> list[dict]:
    from datasets import Dataset
    from test_sft import _texts, _tokenizer

    from hf_dist.models import build_tiny_model

    tokenizer = _tokenizer(tokenizer_dir)
    runs = []
    for lr in (2e-3, 5e-3):  # the same notebook cell, run twice with another learning rate
        model = build_tiny_model(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, seed=0,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        args = config_cls(output_dir=str(out), max_steps=2, save_steps=2, learning_rate=lr, logging_steps=1,
                          report_to=[], seed=0, disable_tqdm=True, dataloader_num_workers=0, bf16=False,
                          max_length=24, per_device_train_batch_size=2, use_cpu=True)
        trainer = trainer_cls(model=model, args=args, train_dataset=Dataset.from_dict({"text": _texts(16)}),
                              processing_class=tokenizer)
        trainer.train()
        runs.append({log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log})
    return runs


def test_dist_sft_trainer_trains_twice_into_one_folder_like_sft_trainer(tmp_path):
    from trl import SFTConfig, SFTTrainer

    from hf_dist.trainer.sft import DistSFTConfig, DistSFTTrainer

    plain = _sft_twice(tmp_path / "trl", tmp_path / "tok", SFTConfig, SFTTrainer)
    ours = _sft_twice(tmp_path / "dist", tmp_path / "tok", DistSFTConfig, DistSFTTrainer)
    torch.testing.assert_close(ours, plain, atol=1e-6, rtol=0)
    (aside,) = (tmp_path / "dist").glob("previous_run-*")  # TRL overwrote its first checkpoint; we kept it
    for folder, run in ((aside, ours[0]), (tmp_path / "dist", ours[1])):
        state = json.loads((folder / "checkpoint-2" / "trainer_state.json").read_text())
        assert state["log_history"][1]["loss"] == pytest.approx(run[2]), folder
