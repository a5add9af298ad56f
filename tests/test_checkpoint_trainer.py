"""DistTrainer on 2 gloo ranks with FSDP2, TP and PP: save_steps writes hf_dist checkpoints, a resumed run
continues the uninterrupted one exactly, and load_best_model_at_end reloads from them. FSDP2 also with
``async_save=True``: the same losses and parameters as the synchronous runs, resumed from background-written
checkpoints."""

from __future__ import annotations

import shutil

import pytest
import torch
from dist_utils import run_distributed
from trainer_harness import VOCAB, full_parameters, token_dataset

STEPS, SAVE_EVERY = 6, 3


def _stop_after(step: int):
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                control.should_training_stop = True  # as if the job died right after this step

    return Stop()


def _step_counter():
    from transformers import TrainerCallback

    class Count(TrainerCallback):
        steps_run = 0

        def on_step_end(self, args, state, control, **kwargs):
            Count.steps_run += 1

    return Count()


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    return root, run_distributed(_uninterrupted_then_resumed, 2, str(root))[0]


LAYOUTS = {"fsdp2": dict(fsdp="full_shard", fsdp_config={"version": 2}), "tp": dict(tp_size=2), "pp": dict(pp_size=2)}
LAYOUTS["fsdp2_async"] = dict(LAYOUTS["fsdp2"], async_save=True)  # written and committed by a background thread
TWO_RANK = ("fsdp2", "tp", "pp", "fsdp2_async")
LAYOUTS["one process"] = {}  # plain model, not a layout hf_dist owns: loading still goes through hf_dist


def _run(output_dir: str, *, layout: str, resume: bool | str, stop_after: int | None = None,
         load_best: str | None = None):
    from hf_dist import DistTrainer, DistTrainingArguments
    from hf_dist.models import build_tiny_model

    args = DistTrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2, global_batch_size=8,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1, save_strategy="steps",
        save_steps=SAVE_EVERY, save_total_limit=1, report_to=[], seed=0, data_seed=0, disable_tqdm=True,
        dataloader_num_workers=0, max_grad_norm=1.0, use_cpu=layout == "one process", **LAYOUTS[layout],
    )
    model = build_tiny_model(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2)
    counter = _step_counter()
    callbacks = [counter] + ([_stop_after(stop_after)] if stop_after else [])
    trainer = DistTrainer(model=model, args=args, train_dataset=token_dataset(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume or None)
    losses = {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}
    params = {k: v.numpy() for k, v in full_parameters(trainer).items()}
    out = {"losses": losses, "params": params, "steps_run": counter.steps_run}
    if load_best is not None:  # what load_best_model_at_end does, with the best checkpoint named here
        trainer.state.best_model_checkpoint = f"{output_dir}/{load_best}"
        trainer._load_best_model()
        out["best_params"] = {k: v.numpy() for k, v in full_parameters(trainer).items()}
    return out


def _uninterrupted_then_resumed(rank, world, root):
    from hf_dist.checkpoint import load_checkpoint
    from hf_dist.models import build_tiny_model

    out = {}
    for layout in TWO_RANK:
        full = _run(f"{root}/{layout}/full", layout=layout, resume=False)
        cut = _run(f"{root}/{layout}/cut", layout=layout, resume=False, stop_after=SAVE_EVERY + 1,  # last ckpt: 3
                   load_best=f"checkpoint-{SAVE_EVERY}" if layout == "fsdp2" else None)
        if layout == "fsdp2":
            step3 = build_tiny_model(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2)  # plain, every rank
            load_checkpoint(f"{root}/{layout}/cut/checkpoint-{SAVE_EVERY}", model=step3, optimizer=None)
            out["step3_params"] = {k: v.detach().clone().numpy() for k, v in step3.state_dict().items()}
            out["best_params"], out["cut_params"] = cut["best_params"], cut["params"]
            if rank == 0:  # kept for the one-process resume below (retention deletes it after step 6)
                shutil.copytree(f"{root}/{layout}/cut/checkpoint-{SAVE_EVERY}", f"{root}/{layout}/kept")
            torch.distributed.barrier()
        out[layout] = {"full": full, "resumed": _run(f"{root}/{layout}/cut", layout=layout, resume=True)}
    return out


@pytest.mark.parametrize("layout", TWO_RANK)
def test_trainer_resume_matches_uninterrupted(two_rank_runs, layout):
    tmp_path, result = two_rank_runs
    full, resumed = result[layout]["full"], result[layout]["resumed"]
    assert (tmp_path / layout / "full" / "checkpoint-6" / "trainer_state.json").is_file()
    assert not (tmp_path / layout / "full" / "checkpoint-3").exists()  # save_total_limit=1
    assert (tmp_path / layout / "cut" / "latest").read_text().strip() == "checkpoint-6"
    assert resumed["steps_run"] == STEPS - SAVE_EVERY  # it resumed, not retrained from step 0
    for step in range(SAVE_EVERY + 1, STEPS + 1):
        torch.testing.assert_close(resumed["losses"][step], full["losses"][step], atol=1e-6, rtol=0)
    # (under PP these are rank 0's stage only: each rank's parameters are its stage's)
    torch.testing.assert_close({k: torch.as_tensor(v) for k, v in resumed["params"].items()},
                               {k: torch.as_tensor(v) for k, v in full["params"].items()}, atol=1e-6, rtol=0)


def test_async_saving_trainer_equals_the_sync_one(two_rank_runs):
    tmp_path, result = two_rank_runs
    for run in ("full", "resumed"):
        sync, asynchronous = result["fsdp2"][run], result["fsdp2_async"][run]
        assert asynchronous["losses"] == sync["losses"], run
        torch.testing.assert_close({k: torch.as_tensor(v) for k, v in asynchronous["params"].items()},
                                   {k: torch.as_tensor(v) for k, v in sync["params"].items()}, atol=0, rtol=0)


def test_trainer_manifest_and_best_model(two_rank_runs):
    from hf_dist.checkpoint import read_manifest

    tmp_path, result = two_rank_runs
    for layout, factor in (("fsdp2", "dp_shard"), ("tp", "tp"), ("pp", "pp")):
        manifest = read_manifest(tmp_path / layout / "full" / "checkpoint-6")
        assert manifest.layout[factor] == 2 and manifest.samples_consumed == 6 * 8, layout
    # load_best_model_at_end brought back the step-3 weights, not the step-4 ones the cut run ended with
    best = {k: torch.as_tensor(v) for k, v in result["best_params"].items()}
    torch.testing.assert_close(best, {k: torch.as_tensor(v) for k, v in result["step3_params"].items()}, atol=0, rtol=0)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(best, {k: torch.as_tensor(v) for k, v in result["cut_params"].items()})


def test_fsdp2_checkpoint_resumes_in_one_process(two_rank_runs):
    """2 ranks (FSDP2, accumulation 2) -> 1 process (plain model, accumulation 4): same global batch and losses."""
    tmp_path, result = two_rank_runs
    resumed = _run(str(tmp_path / "one"), layout="one process", resume=str(tmp_path / "fsdp2" / "kept"))
    assert resumed["steps_run"] == STEPS - SAVE_EVERY
    full = result["fsdp2"]["full"]
    for step in range(SAVE_EVERY + 1, STEPS + 1):
        torch.testing.assert_close(resumed["losses"][step], full["losses"][step], atol=1e-5, rtol=0)
    torch.testing.assert_close({k: torch.as_tensor(v) for k, v in resumed["params"].items()},
                               {k: torch.as_tensor(v) for k, v in full["params"].items()}, atol=1e-5, rtol=0)
