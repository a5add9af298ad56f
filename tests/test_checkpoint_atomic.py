"""Atomic commit, ``latest``, retention, damaged files, safe loading and async staging (one process, no spawn)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from test_checkpoint_loop import build, full_params, train

from hf_dist.checkpoint import (
    CheckpointError,
    RetentionPolicy,
    ResumableSampler,
    apply_retention,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from hf_dist.checkpoint import writer
from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.retention import select_to_delete


def _save(root: Path, step: int, model, optimizer, scheduler, layout, contract, **kwargs):
    return save_checkpoint(root / f"step_{step}", model=model, optimizer=optimizer, lr_scheduler=scheduler, step=step,
                           samples_consumed=4 * step, layout=layout, batch_contract=contract, **kwargs)


def _load_fresh(path):
    model, optimizer, scheduler, _, _ = build("single", 1)
    return load_checkpoint(path, model=model, optimizer=optimizer, lr_scheduler=scheduler), model


@pytest.fixture()
def saved(tmp_path):
    train("single", steps=4, save_at=(2, 4), root=str(tmp_path))
    return tmp_path


def test_manifest_latest_and_marker(saved):
    assert (saved / "latest").read_text().strip() == "step_4"
    manifest = read_manifest(saved / "step_4")
    assert (manifest.step, manifest.samples_consumed, manifest.world_size) == (4, 16, 1)
    assert manifest.layout == {"world_size": 1, "pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1, "ep": 1}
    assert manifest.batch_contract["global_batch_size"] == 4
    assert {"model", "optimizer", "lr_scheduler", "rng", "hf_config"} <= set(manifest.contents)
    paths = {entry.path for entry in manifest.files}
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "rng/rank_00000.safetensors", "hf/config.json"} <= paths
    assert all(entry.sha256 for entry in manifest.files)
    info, _ = _load_fresh(saved)  # the root resolves through `latest`
    assert info.step == 4 and info.path.name == "step_4"
    assert not list(saved.glob(".*partial"))


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_shard_is_named(saved, damage):
    shard = saved / "step_4" / "dcp" / "__0_0.distcp"
    if damage == "truncate":
        with open(shard, "r+b") as handle:
            handle.truncate(shard.stat().st_size // 2)
    else:
        shard.unlink()
    with pytest.raises(CheckpointError, match=str(shard)):
        _load_fresh(saved / "step_4")


def test_corrupt_bytes_caught_by_sha256(saved):
    shard = saved / "step_4" / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    model, optimizer, _, _, _ = build("single", 1)
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_checkpoint(saved / "step_4", model=model, optimizer=optimizer, verify="sha256")


def test_crash_before_marker_keeps_latest_on_complete(saved, monkeypatch):
    model, optimizer, scheduler, layout, contract = build("single", 1)
    monkeypatch.setattr(mf, "commit_marker", lambda path: (_ for _ in ()).throw(KeyboardInterrupt("killed")))
    with pytest.raises(KeyboardInterrupt):
        _save(saved, 6, model, optimizer, scheduler, layout, contract)
    assert (saved / "step_6").is_dir() and not mf.is_complete(saved / "step_6")
    assert (saved / "latest").read_text().strip() == "step_4"
    with pytest.raises(CheckpointError, match="did not finish"):
        _load_fresh(saved / "step_6")
    assert _load_fresh(saved)[0].step == 4
    monkeypatch.undo()
    _save(saved, 8, model, optimizer, scheduler, layout, contract, retention=RetentionPolicy(keep_last=2))
    assert not (saved / "step_6").exists()  # the dead save is cleared once a later one completed
    assert [p.name for p in mf.complete_checkpoints(saved)] == ["step_4", "step_8"]
    _save(saved, 8, model, optimizer, scheduler, layout, contract)  # saving the same step again replaces it
    assert mf.is_complete(saved / "step_8") and (saved / "latest").read_text().strip() == "step_8"


def test_crash_before_rename_leaves_no_checkpoint(saved, monkeypatch):
    model, optimizer, scheduler, layout, contract = build("single", 1)
    monkeypatch.setattr(writer, "_replace_dir", lambda partial, target: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        _save(saved, 6, model, optimizer, scheduler, layout, contract)
    assert not (saved / "step_6").exists() and (saved / ".step_6.partial").is_dir()
    assert [p.name for p in mf.complete_checkpoints(saved)] == ["step_2", "step_4"]


def test_metadata_pickle_with_foreign_globals_is_refused(saved):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    ckpt = saved / "step_4"
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(Evil()))
    model, optimizer, _, _, _ = build("single", 1)
    with pytest.raises(CheckpointError, match="posix.system, which is not DCP checkpoint metadata"):
        load_checkpoint(ckpt, model=model, optimizer=optimizer, verify="none")


def test_retention_keeps_last_and_best(tmp_path):
    model, optimizer, scheduler, layout, contract = build("single", 1)
    policy = RetentionPolicy(keep_last=1, best_metric="eval_loss", mode="min")
    for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0)):
        _save(tmp_path, step, model, optimizer, scheduler, layout, contract, metrics={"eval_loss": loss}, hash_files=False)
    assert sorted(apply_retention(tmp_path, policy)) == ["step_1"]
    _save(tmp_path, 4, model, optimizer, scheduler, layout, contract, metrics={"eval_loss": 2.5}, retention=policy)
    assert [p.name for p in mf.complete_checkpoints(tmp_path)] == ["step_2", "step_4"]


def test_retention_never_deletes_the_only_complete_one():
    policy = RetentionPolicy(keep_last=1)
    assert select_to_delete([("a", 1, {})], policy) == []
    # `latest` names the older one (a newer one was saved elsewhere by hand): both stay
    assert select_to_delete([("a", 1, {}), ("b", 2, {})], policy, latest="a") == []
    assert select_to_delete([("a", 1, {}), ("b", 2, {}), ("c", 3, {})], policy) == ["a", "b"]
    with pytest.raises(ValueError, match="keep_last=0"):
        RetentionPolicy(keep_last=0)


def test_async_save_stages_a_copy(tmp_path):
    model, optimizer, scheduler, layout, contract = build("single", 1)
    before = full_params(model)
    handle = _save(tmp_path, 1, model, optimizer, scheduler, layout, contract, async_save=True)
    with torch.no_grad():  # training goes on while the shards are written
        for param in model.parameters():
            param.add_(1.0)
    handle.result()
    _, loaded = _load_fresh(tmp_path / "step_1")
    torch.testing.assert_close(full_params(loaded), before, atol=0, rtol=0)


def test_bad_inputs_are_value_errors(tmp_path):
    model, optimizer, scheduler, layout, contract = build("single", 1)
    from hf_dist import ParallelDims

    with pytest.raises(ValueError, match="layout.world_size=2"):
        save_checkpoint(tmp_path / "x", model=model, optimizer=optimizer, step=0, samples_consumed=0,
                        layout=ParallelDims(world_size=2), batch_contract=None)
    with pytest.raises(ValueError, match="samples_consumed=3"):
        ResumableSampler(40, seed=0, dp_rank=0, dp_size=2, micro_batch_size=1, samples_consumed=3)
    _save(tmp_path, 1, model, None, None, layout, contract)
    with pytest.raises(ValueError, match="no optimizer state"):
        load_checkpoint(tmp_path / "step_1", model=model, optimizer=optimizer)


def test_rank_major_fused_rows_refuse_another_tp(tmp_path):
    from hf_dist.tensor_parallel.styles import FUSED_PARTS_ATTR

    model, optimizer, scheduler, layout, contract = build("single", 1)
    gate_up = model.model.layers[0].mlp.gate_proj  # stands in for a fused gate/up projection sharded with tp=2
    setattr(gate_up, FUSED_PARTS_ATTR, ((64, 64), 2))
    _save(tmp_path, 1, model, optimizer, scheduler, layout, contract)
    assert read_manifest(tmp_path / "step_1").fused_rows == {
        "model.layers.0.mlp.gate_proj.weight": {"parts": [64, 64], "tp": 2}
    }
    with pytest.raises(ValueError, match="stored rank-major for tp=2 .* the model has tp=1"):
        _load_fresh(tmp_path / "step_1")
