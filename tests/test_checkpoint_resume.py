"""Exact resume and resharding on 2 gloo ranks against one process: DDP, FSDP2, TP, 2->1, 1->2, DDP<->FSDP2,
FSDP2<->TP, TP<->PP, PP->1; and on 4 ranks, FSDP2 x TP (2 x 2) exact resume and FSDP2 x TP -> one process.

One spawn per world size runs every case (start-up dominates the cost); the 1-rank cases run in the test process.
Same layout, same world: losses, final parameters and the RNG stream equal the uninterrupted run (1e-6).
Across layouts the reduction order changes, so the comparison is against the one-process reference at 1e-5 (the
loop's AdamW has eps=1e-5 so that Adam does not turn the rounding of a near-zero gradient into a visible step).
"""

from __future__ import annotations

import torch
from dist_utils import run_distributed
from test_checkpoint_loop import DATA_SEED, GLOBAL_BATCH, NUM_SAMPLES, as_tensors, merged_ids, picklable, train

from hf_dist.checkpoint.sampler import global_slice

STEPS, SAVE_AT = 6, 3
SAME = dict(atol=1e-6, rtol=0)
CROSS = dict(atol=1e-5, rtol=0)


SAME_LAYOUT = (("ddp", "ddp"), ("fsdp", "fsdp"), ("tp", "tp"), ("pp", "pp"))
CROSS_LAYOUT = (("fsdp", "ddp"), ("ddp", "fsdp"), ("fsdp", "single"), ("tp", "fsdp"), ("fsdp", "tp"), ("tp", "pp"),
                ("pp", "tp"))
CASES = SAME_LAYOUT + CROSS_LAYOUT


def _two_rank_matrix(rank, world, root):
    out = {}
    for kind in ("ddp", "fsdp", "tp", "pp"):  # FSDP2 saves asynchronously: training goes on during the write
        out[kind] = picklable(train(kind, steps=STEPS, save_at=(SAVE_AT,), root=f"{root}/{kind}",
                                    async_save=kind == "fsdp"))
    for kind, source in CASES:
        out[f"{kind}<-{source}"] = picklable(train(kind, steps=STEPS, resume=f"{root}/{source}"))
    return out


def _assert_ids_continue(before: list[dict], after: list[dict]):
    """Steps < SAVE_AT from the saving run plus steps >= SAVE_AT from the resumed run = the global stream."""
    ids = {s: v for s, v in merged_ids(before).items() if s < SAVE_AT}
    ids.update(merged_ids(after))
    expected = global_slice(NUM_SAMPLES, DATA_SEED, 0, STEPS * GLOBAL_BATCH)
    for step in range(STEPS):
        assert sorted(ids[step]) == sorted(expected[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]), step


def test_exact_resume_and_reshard(tmp_path):
    reference = train("single", steps=STEPS, save_at=(SAVE_AT,), root=str(tmp_path / "single"))
    ranks = run_distributed(_two_rank_matrix, 2, str(tmp_path))
    for kind, _ in SAME_LAYOUT:
        full = ranks[0][kind]
        torch.testing.assert_close(full["losses"], reference["losses"], **CROSS)
        resumed = [r[f"{kind}<-{kind}"] for r in ranks]
        torch.testing.assert_close(resumed[0]["losses"], full["losses"][SAVE_AT:], **SAME)
        torch.testing.assert_close(as_tensors(resumed[0]["params"]), as_tensors(full["params"]), **SAME)
        for r in (0, 1):  # per-rank RNG restored: each rank's random stream continues
            assert resumed[r]["draws"] == ranks[r][kind]["draws"][SAVE_AT:]
        _assert_ids_continue([r[kind] for r in ranks], resumed)
    for kind, source in CROSS_LAYOUT:
        resumed = [r[f"{kind}<-{source}"] for r in ranks]
        torch.testing.assert_close(resumed[0]["losses"], reference["losses"][SAVE_AT:], **CROSS,
                                   msg=lambda m, k=kind, s=source: f"{k} resumed from {s}: {m}")
        torch.testing.assert_close(as_tensors(resumed[0]["params"]), reference["params"], **CROSS,
                                   msg=lambda m, k=kind, s=source: f"{k} resumed from {s}: {m}")
        before = [reference] if source == "single" else [r[source] for r in ranks]
        _assert_ids_continue(before, resumed)
    # 2 -> 1: both 2-rank checkpoints resume in one process with accumulation 4 instead of 2
    for source in ("ddp", "fsdp", "tp", "pp"):
        resumed = train("single", steps=STEPS, resume=str(tmp_path / source))
        torch.testing.assert_close(resumed["losses"], reference["losses"][SAVE_AT:], **CROSS)
        torch.testing.assert_close(resumed["params"], reference["params"], **CROSS)
        _assert_ids_continue([r[source] for r in ranks], [resumed])
    # one process, same layout: exact
    resumed = train("single", steps=STEPS, resume=str(tmp_path / "single"))
    torch.testing.assert_close(resumed["losses"], reference["losses"][SAVE_AT:], **SAME)
    torch.testing.assert_close(resumed["params"], reference["params"], **SAME)
    assert resumed["draws"] == reference["draws"][SAVE_AT:]


def _fsdp_tp_save_and_resume(rank, world, root):
    full = picklable(train("fsdp_tp", steps=STEPS, save_at=(SAVE_AT,), root=f"{root}/fsdp_tp"))
    return {"full": full, "resumed": picklable(train("fsdp_tp", steps=STEPS, resume=f"{root}/fsdp_tp"))}


def test_fsdp_tp_exact_resume_and_reshard_to_one_process(tmp_path):
    """FSDP2 x TP on a (dp_shard=2, tp=2) mesh: resumed = uninterrupted (1e-6); its checkpoint resumes in one process."""
    from hf_dist.checkpoint import read_manifest

    reference = train("single", steps=STEPS)
    ranks = run_distributed(_fsdp_tp_save_and_resume, 4, str(tmp_path))
    manifest = read_manifest(tmp_path / "fsdp_tp" / f"step_{SAVE_AT}")
    assert (manifest.layout["dp_shard"], manifest.layout["tp"], manifest.world_size) == (2, 2, 4)
    full, resumed = ranks[0]["full"], ranks[0]["resumed"]
    torch.testing.assert_close(full["losses"], reference["losses"], **CROSS)
    torch.testing.assert_close(resumed["losses"], full["losses"][SAVE_AT:], **SAME)
    torch.testing.assert_close(as_tensors(resumed["params"]), as_tensors(full["params"]), **SAME)
    for r in range(4):
        assert ranks[r]["resumed"]["draws"] == ranks[r]["full"]["draws"][SAVE_AT:]
    _assert_ids_continue([r["full"] for r in ranks], [r["resumed"] for r in ranks])
    one = train("single", steps=STEPS, resume=str(tmp_path / "fsdp_tp"))  # 4 ranks, accumulation 2 -> 1, 4
    torch.testing.assert_close(one["losses"], reference["losses"][SAVE_AT:], **CROSS)
    torch.testing.assert_close(one["params"], reference["params"], **CROSS)
    _assert_ids_continue([r["full"] for r in ranks], [one])
