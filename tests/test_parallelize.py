"""``hf_dist.parallelize`` -- the one apply path -- on dp x tp = 2 x 2 (4 gloo ranks, one spawn) against one process.

The FSDP root decision (``hf_dist.parallelism`` docstring): the root stays gathered between forward and backward,
and every unit reshards after a forward without autograd. The cases run an evaluation *before* the optimizer is
built and then train several clipped SGD steps, which trains wrong values if an evaluation leaves unsharded
parameters registered (the optimizer would hold them):

- ``api_*``: ``parallelize`` called directly, FULL_SHARD and SHARD_GRAD_OP (blocks kept gathered too), TP2, run by the
  parity harness's ``layout_run`` on fresh padded rows every step (``masked_batches``: the dp ranks count different
  tokens);
- ``trainer_*``: ``DistTrainer``'s own path at dp x tp = 2 x 2, FSDP2 and replicated dp, ``evaluate()`` first.

Both against the harness's one process (``reference_run``) through ``assert_parity``: losses, grad norms (clipping
active), the first step's gradients (api) and every parameter after the steps (the DistTrainer's saved weights too).
The model is the harness's untied Llama case (``parity.tiny_config("llama:untied", "tp")``), loaded from disk.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from dist_utils import run_distributed
from parity import TP_SGD, assert_parity, layout_run, masked_batches, reference_run, split_rows, tiny_config
from parity import tiny_model
from pp_harness import PaddedDataset
from tp_sweep_cases import SEQ
from trainer_harness import train_tiny

CASE = "llama:untied"
STEPS, GLOBAL_BATCH, MICRO = 4, 8, 2
API_CASES = {"api_full_shard": True, "api_shard_grad_op": False}
"""name -> FSDP reshard_after_forward"""
TRAINER_CASES = {"trainer_fsdp_x_tp": {"fsdp": "full_shard", "fsdp_config": {"version": 2}}, "trainer_dp_x_tp": {}}


def _model():
    return tiny_model(tiny_config(CASE, "tp"), loaded=True)


def _api_batches() -> list[dict[str, torch.Tensor]]:
    return masked_batches(tiny_config(CASE, "tp").vocab_size, SEQ, STEPS)


def _api_case(reshard: bool) -> dict:
    from hf_dist import FsdpRequest, ParallelDims, parallelize

    dims = ParallelDims(world_size=4, tp=2, dp_shard=2)
    dims.build_mesh("cpu")
    dp_rank = dims.dp_rank(dist.get_rank())
    model = parallelize(_model(), dims, fsdp=FsdpRequest(reshard_after_forward=reshard))
    batches = _api_batches()
    with torch.no_grad():  # an evaluation forward before the optimizer exists
        model(**{k: v for k, v in split_rows(batches[0], dims.dp)[dp_rank].items() if k != "labels"})
    sharded_after_eval = all("Shard" in str(getattr(p, "placements", "")) for p in model.parameters())
    run = layout_run(model, batches, TP_SGD, dp_rank=dp_rank, dp=dims.dp, dp_group=dims.get_mesh("dp").get_group(),
                     grads=True)
    return {"run": run, "sharded_after_eval": sharded_after_eval}


def _trainer_case(output_dir: str, overrides: dict) -> dict:
    evaluations = []
    losses, params, trainer = train_tiny(
        output_dir, model=_model(), dataset=PaddedDataset(4 * GLOBAL_BATCH, seed=1),
        trainer_kwargs={"eval_dataset": PaddedDataset(6, 2)}, before_train=lambda t: evaluations.append(t.evaluate()),
        max_steps=STEPS, per_device_train_batch_size=MICRO, global_batch_size=GLOBAL_BATCH, tp_size=2,
        learning_rate=TP_SGD.lr, optim="sgd", max_grad_norm=TP_SGD.max_norm, train_sampling_strategy="sequential",
        per_device_eval_batch_size=2, **overrides,
    )
    assert trainer.dims.dp == 2 and trainer.dims.tp == 2 and trainer.args.gradient_accumulation_steps == 2
    evaluations.append(trainer.evaluate())
    trainer.save_model(f"{output_dir}/final")
    norms = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
    return {"run": {"losses": losses, "norms": norms, "state": params},
            "eval": [e["eval_loss"] for e in evaluations]}


def _four_ranks(rank, world_size, output_dir):
    results = {name: _api_case(reshard) for name, reshard in API_CASES.items()}
    for name, overrides in TRAINER_CASES.items():
        results[name] = _trainer_case(f"{output_dir}/{name}", overrides)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallelize")
    return root, run_distributed(_four_ranks, 4, str(root / "dist"))


@pytest.fixture(scope="module")
def references():
    """The harness's one process: on the api cases' batches (first-step gradients kept), and on the Trainer's steps
    (sequential rows, ``GLOBAL_BATCH`` per step)."""
    api = reference_run(_model(), [[batch] for batch in _api_batches()], TP_SGD, grads=True)
    rows = PaddedDataset(4 * GLOBAL_BATCH, seed=1).rows
    steps = [[{k: v[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH] for k, v in rows.items()}] for s in range(STEPS)]
    return {"api": api, "trainer": reference_run(_model(), steps, TP_SGD)}


@pytest.mark.parametrize("case", list(API_CASES))
def test_parallelize_trains_like_one_process_after_an_evaluation(runs, references, case):
    _, per_rank = runs
    ref = references["api"]
    assert min(ref["norms"]) > TP_SGD.max_norm  # clipping active: the global norm matters
    for rank, results in enumerate(per_rank):
        r = results[case]
        assert r["sharded_after_eval"], f"rank {rank}: unsharded parameters registered after a no_grad forward"
        assert_parity(r["run"], ref, what=f"rank {rank} {case}")


def _saved_weights(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("case", list(TRAINER_CASES))
def test_dist_trainer_dp2_x_tp2_matches_single_process(runs, references, case):
    root, per_rank = runs
    ref = references["trainer"]
    assert len(ref["losses"]) == STEPS and min(ref["norms"]) > TP_SGD.max_norm
    for rank, result in enumerate(results[case] for results in per_rank):
        # the Trainer logs losses to 4 decimals
        assert_parity(result["run"], ref, atol=1e-4, state_atol=1e-5, what=f"rank {rank} {case}")
        # eval losses: the same in both layouts (the plain Trainer's own DDP eval loss already differs from one
        # process in the 4th digit, so the one-process Trainer is not the reference for them)
        assert_close(result["eval"], per_rank[0]["trainer_fsdp_x_tp"]["eval"], atol=1e-5, rtol=0)
        assert result["eval"][1] < result["eval"][0]
    saved, expected = _saved_weights(root / "dist" / case / "final"), ref["state"]
    assert saved.keys() == expected.keys()
    for key, value in saved.items():
        assert_close(value, expected[key], atol=1e-5, rtol=0, msg=lambda m: f"{case} {key}: {m}")
