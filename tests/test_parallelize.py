"""``hf_dist.parallelize`` -- the one apply path -- on dp x tp = 2 x 2 (4 gloo ranks, one spawn) against one process.

The FSDP root decision (``hf_dist.parallelism`` docstring): the root stays gathered between forward and backward,
and every unit reshards after a forward without autograd. The cases run an evaluation *before* the optimizer is
built and then train several clipped AdamW steps, which trains wrong values if an evaluation leaves unsharded
parameters registered (the optimizer would hold them):

- ``api_*``: ``parallelize`` called directly, FULL_SHARD and SHARD_GRAD_OP (blocks kept gathered too), TP2;
- ``trainer_*``: ``DistTrainer``'s own path at dp x tp = 2 x 2, FSDP2 and replicated dp, ``evaluate()`` first,
  against the one-process HF ``Trainer``: losses, grad norms (clipping active) and the saved weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from dist_utils import run_distributed
from pp_harness import LR, PaddedDataset, dp_slice, padded_batch, tiny_model

STEPS, GLOBAL_BATCH, MICRO, MAX_NORM = 4, 8, 2, 0.5
API_CASES = {"api_full_shard": True, "api_shard_grad_op": False}
"""name -> FSDP reshard_after_forward"""
TRAINER_CASES = {"trainer_fsdp_x_tp": {"fsdp": "full_shard", "fsdp_config": {"version": 2}}, "trainer_dp_x_tp": {}}


def _api_steps(model, batches, *, parallel: bool) -> dict:
    """An evaluation forward, then the optimizer, then ``STEPS`` clipped AdamW steps."""
    from transformers import Trainer

    with torch.no_grad():
        model(**batches[0])
    sharded_after_eval = all(
        "Shard" in str(getattr(p, "placements", "")) for p in model.parameters()
    ) if parallel else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, norms = [], []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        norm = Trainer._mixed_mesh_grad_norm(None, model, MAX_NORM) if parallel else \
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
        norms.append(float(norm))
    return {"losses": losses, "norms": norms, "sharded_after_eval": sharded_after_eval}


def _api_case(reshard: bool) -> dict:
    from hf_dist import FsdpRequest, ParallelDims, parallelize
    from hf_dist.state_dict import full_state_dict

    dims = ParallelDims(world_size=4, tp=2, dp_shard=2)
    dims.build_mesh("cpu")
    dp_rank, dp_group = dims.dp_rank(dist.get_rank()), dims.get_mesh("dp").get_group()
    # uniform lengths: each dp rank's mean loss then averages to the global mean, as the reference computes it
    batches = [{k: v for k, v in padded_batch(GLOBAL_BATCH, 100 + i).items() if k == "input_ids"} for i in range(STEPS)]
    for b in batches:
        b["labels"] = b["input_ids"]
    reference_model = tiny_model()
    reference = _api_steps(reference_model, batches, parallel=False)
    model = parallelize(tiny_model(), dims, fsdp=FsdpRequest(reshard_after_forward=reshard))
    result = _api_steps(model, [dp_slice(b, dp_rank, dims.dp) for b in batches], parallel=True)
    for loss in result["losses"]:
        dist.all_reduce(loss, group=dp_group)
        loss /= dims.dp
    ref_state = {k: v.detach().clone() for k, v in reference_model.state_dict().items()}
    return {"ref": reference, "run": result, "state": full_state_dict(model), "ref_state": ref_state}


def _trainer_args(output_dir: str, **overrides) -> dict:
    return dict(
        output_dir=output_dir, max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.1,
        max_grad_norm=MAX_NORM, logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[], seed=0,
        disable_tqdm=True, dataloader_num_workers=0, train_sampling_strategy="sequential",
        per_device_eval_batch_size=2, **overrides,
    )


def _trainer_run(trainer, output_dir: str) -> dict:
    before = trainer.evaluate()["eval_loss"]  # an evaluation forward before the optimizer exists
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    trainer.save_model(f"{output_dir}/final")
    history = [log for log in trainer.state.log_history if "loss" in log and "train_runtime" not in log]
    return {
        "losses": [log["loss"] for log in history], "norms": [log["grad_norm"] for log in history],
        "eval": [before, after],
    }


def _four_ranks(rank, world_size, output_dir):
    from hf_dist import DistTrainer, DistTrainingArguments

    results = {name: _api_case(reshard) for name, reshard in API_CASES.items()}
    for name, overrides in TRAINER_CASES.items():
        out = f"{output_dir}/{name}"
        args = DistTrainingArguments(
            **_trainer_args(out, **overrides), per_device_train_batch_size=MICRO, global_batch_size=GLOBAL_BATCH,
            tp_size=2,
        )
        trainer = DistTrainer(
            model=tiny_model(), args=args, train_dataset=PaddedDataset(32, seed=1), eval_dataset=PaddedDataset(6, 2)
        )
        assert trainer.dims.dp == 2 and trainer.dims.tp == 2 and args.gradient_accumulation_steps == 2
        results[name] = _trainer_run(trainer, out)
    return results


def _reference_trainer(output_dir: str) -> dict:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(**_trainer_args(output_dir), per_device_train_batch_size=GLOBAL_BATCH, use_cpu=True)
    trainer = Trainer(
        model=tiny_model(), args=args, train_dataset=PaddedDataset(32, seed=1), eval_dataset=PaddedDataset(6, 2)
    )
    return _trainer_run(trainer, output_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallelize")
    return root, run_distributed(_four_ranks, 4, str(root / "dist")), _reference_trainer(str(root / "ref"))


@pytest.mark.parametrize("case", list(API_CASES))
def test_parallelize_trains_like_one_process_after_an_evaluation(runs, case):
    _, per_rank, _ = runs
    for rank, results in enumerate(per_rank):
        r = results[case]
        assert r["run"]["sharded_after_eval"], f"rank {rank}: unsharded parameters registered after a no_grad forward"
        assert min(r["ref"]["norms"]) > MAX_NORM  # clipping active: the global norm matters
        assert_close(torch.stack(r["run"]["losses"]), torch.stack(r["ref"]["losses"]), atol=1e-5, rtol=0)
        assert_close(torch.tensor(r["run"]["norms"]), torch.tensor(r["ref"]["norms"]), atol=0, rtol=1e-5)
        assert r["state"].keys() == r["ref_state"].keys()
        for key, value in r["state"].items():
            assert_close(value, r["ref_state"][key], atol=5e-5, rtol=0, msg=lambda m: f"rank {rank} {key}: {m}")


def _saved_weights(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("case", list(TRAINER_CASES))
def test_dist_trainer_dp2_x_tp2_matches_single_process_trainer(runs, case):
    root, per_rank, ref = runs
    assert len(ref["losses"]) == STEPS and min(ref["norms"]) > MAX_NORM
    for result in (results[case] for results in per_rank):
        assert_close(result["losses"], ref["losses"], atol=1e-4, rtol=0)  # the Trainer logs 4 significant digits
        assert_close(result["norms"], ref["norms"], atol=1e-5, rtol=1e-5)
        # eval losses: the same in both layouts (the plain Trainer's own DDP eval loss already differs from one
        # process in the 4th digit, so the one-process Trainer is not the reference for them)
        assert_close(result["eval"], per_rank[0]["trainer_fsdp_x_tp"]["eval"], atol=1e-5, rtol=0)
        assert result["eval"][1] < result["eval"][0]
    saved, expected = _saved_weights(root / "dist" / case / "final"), _saved_weights(root / "ref" / "final")
    assert saved.keys() == expected.keys()
    for key, value in saved.items():
        assert_close(value, expected[key], atol=1e-5, rtol=0, msg=lambda m: f"{case} {key}: {m}")
