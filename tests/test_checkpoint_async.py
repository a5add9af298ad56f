"""Asynchronous saves (``AsyncCheckpointer``) write exactly what a synchronous save writes.

FSDP2 on 2 gloo ranks: two consecutive async saves through one checkpointer (its staging buffers reused), with
training between them and a step taken while each write runs, in both staging modes; every tensor of both
checkpoints equals the synchronous run's bit for bit, and resuming from them continues the uninterrupted run
exactly. TP and PP (2 ranks): the same equality with the copy made in the background. One process: a failed commit leaves ``latest`` on the previous complete checkpoint and the checkpointer
saves again; ``optimizer.step`` waits for a background copy; a run that never waits still commits before exit;
``DistTrainingArguments(async_save=True)`` is refused where the Trainer writes the checkpoints (DDP, DeepSpeed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from test_checkpoint_loop import as_tensors, build, full_params, picklable, train

from hf_dist.checkpoint import AsyncCheckpointer, load_checkpoint, read_manifest, save_checkpoint
from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint import writer

STEPS, SAVE_AT = 5, (2, 4)
MODES = {"caller": False, "background": True}  # stage_in_background
OTHER_LAYOUTS = ("tp", "pp")


def _runs(rank, world, root):
    out = {"sync": picklable(train("fsdp", steps=STEPS, save_at=SAVE_AT, root=f"{root}/sync"))}
    for mode, background in MODES.items():
        with AsyncCheckpointer(stage_in_background=background) as saver:
            out[mode] = picklable(train("fsdp", steps=STEPS, save_at=SAVE_AT, root=f"{root}/{mode}", async_save=saver))
        out[f"{mode}<-2"] = picklable(train("fsdp", steps=STEPS, resume=f"{root}/{mode}/step_2"))
    for kind in OTHER_LAYOUTS:  # TP's sharded DTensors, PP's per-stage plain tensors: staged as DistTrainer does
        train(kind, steps=STEPS, save_at=SAVE_AT, root=f"{root}/{kind}_sync")
        with AsyncCheckpointer(stage_in_background=True) as saver:
            train(kind, steps=STEPS, save_at=SAVE_AT, root=f"{root}/{kind}_background", async_save=saver)
    return out


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds: DCP shards (model and optimizer, whole), RNG and scheduler state."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path / "dcp", path.parent / f"{path.name}.pt")
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        else:
            flat[prefix] = value

    walk("dcp", torch.load(path.parent / f"{path.name}.pt", weights_only=False))
    walk("train_state", torch.load(path / "train_state.pt", weights_only=True))
    for rng in sorted((path / "rng").glob("*.safetensors")):
        walk(rng.stem, load_file(rng))
    return flat


def _assert_same_checkpoints(sync_root: Path, async_root: Path) -> None:
    for step in SAVE_AT:
        sync_ckpt, async_ckpt = sync_root / f"step_{step}", async_root / f"step_{step}"
        assert mf.is_complete(async_ckpt) and read_manifest(async_ckpt).step == step
        expected, got = _checkpoint_tensors(sync_ckpt), _checkpoint_tensors(async_ckpt)
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():  # nothing of a later step or of the previous save (buffers reused)
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(got[key], value, atol=0, rtol=0,
                                           msg=lambda m, k=key, s=step: f"{async_root.name} step {s} {k}: {m}")
            else:
                assert got[key] == value, (async_root.name, step, key)
    assert (async_root / "latest").read_text().strip() == f"step_{SAVE_AT[-1]}"


def test_async_saves_equal_sync_saves_and_resume_exactly(tmp_path):
    ranks = run_distributed(_runs, 2, str(tmp_path))
    full = ranks[0]["sync"]
    for kind in OTHER_LAYOUTS:
        _assert_same_checkpoints(tmp_path / f"{kind}_sync", tmp_path / f"{kind}_background")
    for mode in MODES:
        for r in (0, 1):  # saving asynchronously changed nothing in training
            assert ranks[r][mode]["losses"] == ranks[r]["sync"]["losses"], mode
        _assert_same_checkpoints(tmp_path / "sync", tmp_path / mode)
        resumed = ranks[0][f"{mode}<-2"]
        torch.testing.assert_close(resumed["losses"], full["losses"][2:], atol=0, rtol=0)
        torch.testing.assert_close(as_tensors(resumed["params"]), as_tensors(full["params"]), atol=0, rtol=0)
        for r in (0, 1):
            assert ranks[r][f"{mode}<-2"]["draws"] == ranks[r]["sync"]["draws"][2:]


def _save(root: Path, step: int, model, optimizer, scheduler, layout, contract, **kwargs):
    return save_checkpoint(root / f"step_{step}", model=model, optimizer=optimizer, lr_scheduler=scheduler, step=step,
                           samples_consumed=4 * step, layout=layout, batch_contract=contract, **kwargs)


def _one_step(model, optimizer):
    ids = torch.randint(0, 128, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_failed_commit_keeps_latest_and_the_checkpointer_saves_again(tmp_path, monkeypatch):
    model, optimizer, scheduler, layout, contract = build("single", 1)
    with AsyncCheckpointer(stage_in_background=True) as saver:
        _save(tmp_path, 1, model, optimizer, scheduler, layout, contract, async_save=saver).result()
        _one_step(model, optimizer)
        real = writer._replace_dir
        monkeypatch.setattr(writer, "_replace_dir", lambda partial, target: (_ for _ in ()).throw(OSError("disk")))
        handle = _save(tmp_path, 2, model, optimizer, scheduler, layout, contract, async_save=saver)
        with pytest.raises(OSError, match="disk"):
            handle.result()
        assert (tmp_path / "latest").read_text().strip() == "step_1"
        assert not (tmp_path / "step_2").exists() and (tmp_path / ".step_2.partial").is_dir()
        assert [p.name for p in mf.complete_checkpoints(tmp_path)] == ["step_1"]
        monkeypatch.setattr(writer, "_replace_dir", real)
        _one_step(model, optimizer)
        expected = full_params(model)
        _save(tmp_path, 3, model, optimizer, scheduler, layout, contract, async_save=saver)
        _one_step(model, optimizer)  # waits for the background copy (optimizer pre-hook), then changes everything
    assert (tmp_path / "latest").read_text().strip() == "step_3"
    fresh, fresh_optimizer, fresh_scheduler, _, _ = build("single", 1)
    load_checkpoint(tmp_path, model=fresh, optimizer=fresh_optimizer, lr_scheduler=fresh_scheduler)
    torch.testing.assert_close(full_params(fresh), expected, atol=0, rtol=0)
    with pytest.raises(mf.CheckpointError, match="closed"):
        _save(tmp_path, 4, model, optimizer, scheduler, layout, contract, async_save=saver)


def test_a_run_that_never_waits_still_commits_and_exits_zero(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_checkpoint_loop import build
        from hf_dist.checkpoint import AsyncCheckpointer, save_checkpoint
        model, optimizer, scheduler, layout, contract = build("single", 1)
        saver = AsyncCheckpointer(stage_in_background=True)
        save_checkpoint({str(tmp_path / "step_1")!r}, model=model, optimizer=optimizer, step=1, samples_consumed=4,
                        layout=layout, batch_contract=contract, async_save=saver)
    """)  # neither result() nor close(): interpreter exit joins the writer thread
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert mf.is_complete(tmp_path / "step_1") and (tmp_path / "latest").read_text().strip() == "step_1"


def test_async_save_is_refused_where_the_trainer_writes_the_checkpoints(tmp_path):
    from hf_dist import DistTrainingArguments

    with pytest.raises(ValueError, match="async_save=True applies to the checkpoints hf_dist writes .* --async_save"):
        DistTrainingArguments(output_dir=str(tmp_path), async_save=True, report_to=[], use_cpu=True)
