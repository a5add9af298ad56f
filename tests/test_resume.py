"""Which checkpoint `--resume_from_checkpoint` picks, and the refusal to start fresh over checkpoints (pure)."""

from __future__ import annotations

import json

import pytest

from hf_dist.checkpoint import manifest as mf
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


def test_fresh_start_over_checkpoints_is_refused(tmp_path):
    _hf_dist_checkpoint(tmp_path, 2)
    with pytest.raises(ValueError, match=r"already holds checkpoints \(checkpoint-2, latest\).*"
                                         r"--resume_from_checkpoint true.*--overwrite_output_dir"):
        resume.check_output_dir(tmp_path, None, overwrite_output_dir=False)
    for allowed in ("true", "auto", str(tmp_path / "checkpoint-2")):
        resume.check_output_dir(tmp_path, allowed, overwrite_output_dir=False)
    resume.check_output_dir(tmp_path, "false", overwrite_output_dir=True)
    resume.check_output_dir(tmp_path / "new", None, overwrite_output_dir=False)  # missing or empty: fine
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "data").mkdir()  # a folder that is not a checkpoint does not count
    resume.check_output_dir(tmp_path / "empty", None, overwrite_output_dir=False)


def test_an_unfinished_save_alone_still_blocks_a_fresh_start(tmp_path):
    _native_checkpoint(tmp_path, 3, complete=False)
    with pytest.raises(ValueError, match="checkpoint-3"):
        resume.check_output_dir(tmp_path, None, overwrite_output_dir=False)


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


def test_true_without_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match=r"resume_from_checkpoint=true but output_dir .* holds no complete "
                                         r"checkpoint.*--resume_from_checkpoint auto"):
        resume.resolve_resume("true", tmp_path, native_only=False)
    assert resume.resolve_resume("auto", tmp_path, native_only=False) is None
    with pytest.raises(ValueError, match=r"resume_from_checkpoint='.*nowhere' is not a folder"):
        resume.resolve_resume(str(tmp_path / "nowhere"), tmp_path, native_only=False)
    with pytest.raises(ValueError, match="neither a checkpoint"):
        resume.resolve_resume(str(tmp_path), tmp_path, native_only=False)


def test_overwrite_removes_only_checkpoints(tmp_path):
    _hf_dist_checkpoint(tmp_path, 2)
    _native_checkpoint(tmp_path, 4)
    (tmp_path / "data").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    resume.remove_checkpoints(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]


def test_set_aside_moves_another_format_out_and_drops_latest(tmp_path):
    old = _hf_dist_checkpoint(tmp_path, 4)
    aside = resume.set_aside(old)
    assert not old.exists() and (aside / mf.MANIFEST_NAME).is_file()
    assert not (tmp_path / mf.LATEST_NAME).exists()
    assert resume.set_aside(tmp_path / "checkpoint-9") is None
