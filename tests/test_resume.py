"""Which checkpoint `--resume_from_checkpoint` picks, and which checkpoints a fresh start moves aside (pure)."""

from __future__ import annotations

import json

import pytest

from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.kind import checkpoint_kind
from hf_dist.trainer import resume


def _hf_dist_checkpoint(root, step: int, complete: bool = True):
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    manifest = mf.Manifest(step=step, samples_consumed=step * 8, world_size=2, layout={}, batch_contract=None,
                           contents=["model"])
    (path / mf.MANIFEST_NAME).write_text(manifest.to_json())
    if complete:
        mf.commit_marker(path)
        mf.point_latest(root, path.name)
    return path


def _native_checkpoint(root, step: int, complete: bool = True):
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x")
    if complete:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


@pytest.mark.parametrize("value, expected", [
    (None, None), (False, None), ("false", None), ("", None), (True, True), ("true", True), ("True", True),
    ("auto", "auto"), ("runs/x/checkpoint-4", "runs/x/checkpoint-4"),
])
def test_parse_resume(value, expected):
    assert resume.parse_resume(value) == expected


def test_a_fresh_start_sets_aside_every_checkpoint_it_does_not_continue(tmp_path):
    _hf_dist_checkpoint(tmp_path, 2)
    _native_checkpoint(tmp_path, 3, complete=False)  # an unfinished save is an earlier run's too
    everything = [tmp_path / "checkpoint-2", tmp_path / "checkpoint-3", tmp_path / "latest"]
    for fresh in (None, False, "false", str(tmp_path / "elsewhere" / "checkpoint-2")):
        assert resume.earlier_run_checkpoints(tmp_path, fresh) == everything, fresh
    for continuing in ("true", "auto", str(tmp_path / "checkpoint-3"), str(tmp_path)):
        assert resume.earlier_run_checkpoints(tmp_path, continuing) == [], continuing
    # resuming an earlier step: the later ones are an abandoned continuation (`latest` goes with the one it names)
    assert resume.earlier_run_checkpoints(tmp_path, str(tmp_path / "checkpoint-2")) == [tmp_path / "checkpoint-3"]
    _hf_dist_checkpoint(tmp_path, 10)  # numerically after 3, not by name
    assert resume.earlier_run_checkpoints(tmp_path, str(tmp_path / "checkpoint-3")) == [
        tmp_path / "checkpoint-10", tmp_path / "latest"]
    (tmp_path / "data").mkdir()  # a folder that is not a checkpoint does not count
    assert resume.earlier_run_checkpoints(tmp_path / "data", None) == []
    assert resume.earlier_run_checkpoints(tmp_path / "missing", None) == []


def test_moved_aside_checkpoints_keep_their_content_and_still_resume_by_path(tmp_path):
    _hf_dist_checkpoint(tmp_path, 2)
    _native_checkpoint(tmp_path, 4)
    (tmp_path / "notes.txt").write_text("mine")
    first = resume.move_aside(tmp_path, resume.earlier_run_checkpoints(tmp_path, None))
    assert first.parent == tmp_path and first.name.startswith(resume.PREVIOUS_RUN_PREFIX)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, "notes.txt"])
    assert sorted(p.name for p in first.iterdir()) == ["checkpoint-2", "checkpoint-4", "latest"]
    assert mf.is_complete(first / "checkpoint-2") and checkpoint_kind(first / "checkpoint-4") == "trainer_native"
    # the Trainer's own look-up and `true` no longer see them; the moved folder resumes as a run folder
    from transformers.trainer_utils import get_last_checkpoint

    assert get_last_checkpoint(str(tmp_path)) is None and resume.newest_checkpoint(tmp_path) is None
    assert resume.resolve_resume(str(first), tmp_path, native_only=False) == str(first / "checkpoint-4")
    # resuming the moved-aside checkpoint sets aside what a later fresh run saved, into a second folder
    _native_checkpoint(tmp_path, 6)
    assert resume.earlier_run_checkpoints(tmp_path, str(first / "checkpoint-4")) == [tmp_path / "checkpoint-6"]
    assert resume.earlier_run_checkpoints(tmp_path, str(first)) == [tmp_path / "checkpoint-6"]
    second = resume.move_aside(tmp_path, [tmp_path / "checkpoint-6"])  # same second: a distinct name
    assert second != first and (second / "checkpoint-6").is_dir() and (first / "checkpoint-4").is_dir()


def test_true_takes_the_newest_complete_checkpoint_of_any_format(tmp_path):
    _hf_dist_checkpoint(tmp_path, 2)
    _native_checkpoint(tmp_path, 4)
    _hf_dist_checkpoint(tmp_path, 6, complete=False)  # a save that died: skipped
    _native_checkpoint(tmp_path, 8, complete=False)  # no trainer_state.json yet: skipped
    assert resume.resolve_resume("true", tmp_path, native_only=False) == str(tmp_path / "checkpoint-4")
    assert resume.resolve_resume(True, tmp_path, native_only=True) == str(tmp_path / "checkpoint-4")
    _hf_dist_checkpoint(tmp_path, 5)
    assert resume.resolve_resume("auto", tmp_path, native_only=False) == str(tmp_path / "checkpoint-5")
    assert resume.resolve_resume("auto", tmp_path, native_only=True) == str(tmp_path / "checkpoint-4")
    # a run folder as the path: its newest; a checkpoint folder: itself
    assert resume.resolve_resume(str(tmp_path), tmp_path / "other", native_only=False) == str(tmp_path / "checkpoint-5")
    assert resume.resolve_resume(str(tmp_path / "checkpoint-2"), tmp_path, native_only=False) == str(
        tmp_path / "checkpoint-2")


def test_missing_checkpoint_errors_start_with_the_trainers_wording(tmp_path):
    with pytest.raises(ValueError, match=r"^No valid checkpoint found in output directory \(.*\): "
                                         r"resume_from_checkpoint=true needs .*--resume_from_checkpoint auto"):
        resume.resolve_resume("true", tmp_path, native_only=False)
    assert resume.resolve_resume("auto", tmp_path, native_only=False) is None
    with pytest.raises(ValueError, match=r"^Can't find a valid checkpoint at .*nowhere: .* is not a folder"):
        resume.resolve_resume(str(tmp_path / "nowhere"), tmp_path, native_only=False)
    with pytest.raises(ValueError, match=r"^Can't find a valid checkpoint at .*: it is neither a checkpoint"):
        resume.resolve_resume(str(tmp_path), tmp_path, native_only=False)
    (tmp_path / "previous_run-20261124-101500").mkdir()  # where a fresh start moved an earlier run's
    with pytest.raises(ValueError, match=r"moved aside into .*previous_run-20261124-101500"):
        resume.resolve_resume("true", tmp_path, native_only=False)


def test_overwrite_removes_only_checkpoints(tmp_path):
    _hf_dist_checkpoint(tmp_path, 2)
    _native_checkpoint(tmp_path, 4)
    (tmp_path / "data").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    resume.remove_checkpoints(resume.earlier_run_checkpoints(tmp_path, None))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]


def test_set_aside_moves_another_format_out_and_drops_latest(tmp_path):
    old = _hf_dist_checkpoint(tmp_path, 4)
    aside = resume.set_aside(old)
    assert not old.exists() and (aside / mf.MANIFEST_NAME).is_file()
    assert not (tmp_path / mf.LATEST_NAME).exists()
    assert resume.set_aside(tmp_path / "checkpoint-9") is None
