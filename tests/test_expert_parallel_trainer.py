"""DistTrainer with ``ep_size=2`` on 2 gloo ranks (tiny qwen3_moe, router aux loss on): EP x FSDP2 and EP x DDP
evaluate as one process does, save hf_dist checkpoints that resume exactly, an EP=2 x FSDP2 checkpoint resumes in one process (plain model,
accumulation 4 instead of 2: the same global batch), and the final ``save_model`` folder, written in
the model's own per-expert key format, loads with ``from_pretrained`` to the trained weights."""

from __future__ import annotations

import shutil

import pytest
import torch
from dist_utils import run_distributed
from test_checkpoint_trainer import _step_counter, _stop_after
from trainer_harness import VOCAB, full_parameters, token_dataset

STEPS, SAVE_EVERY = 6, 3
LAYOUTS = {"ep_fsdp2": dict(fsdp="full_shard", fsdp_config={"version": 2}, ep_size=2), "ep_ddp": dict(ep_size=2),
           "one process": {}, "fsdp2": dict(fsdp="full_shard", fsdp_config={"version": 2})}
TWO_RANK = ("ep_fsdp2", "ep_ddp")


def _model():
    from ep_cases import moe_config

    from hf_dist.models.tiny import build_tiny_model

    config = moe_config("qwen3_moe")
    config.vocab_size = VOCAB
    return build_tiny_model(config, seed=0)


def _run(output_dir: str, *, layout: str, resume: bool | str, stop_after: int | None = None, save: bool = False):
    from hf_dist import DistTrainer, DistTrainingArguments

    args = DistTrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2, global_batch_size=8,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1, save_strategy="steps",
        save_steps=SAVE_EVERY, save_total_limit=1, report_to=[], seed=0, data_seed=0, disable_tqdm=True,
        dataloader_num_workers=0, max_grad_norm=0.5, use_cpu=layout == "one process", **LAYOUTS[layout],
    )
    counter = _step_counter()
    callbacks = [counter] + ([_stop_after(stop_after)] if stop_after else [])
    trainer = DistTrainer(model=_model(), args=args, train_dataset=token_dataset(), callbacks=callbacks,
                          eval_dataset=token_dataset(8, seed=3))
    assert trainer.dims.ep == (2 if layout in TWO_RANK else 1)
    before = trainer.evaluate()["eval_loss"]  # the initial weights (a checkpoint loads in train())
    trainer.train(resume_from_checkpoint=resume or None)
    losses = {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}
    norms = {log["step"]: log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log}
    if save:
        trainer.save_model(f"{output_dir}/final")
    params = {k: v.numpy() for k, v in full_parameters(trainer).items()}
    return {"losses": losses, "norms": norms, "params": params, "steps_run": counter.steps_run, "eval": before}


def _evaluation(output_dir: str, layout: str) -> float:
    from hf_dist import DistTrainer, DistTrainingArguments

    args = DistTrainingArguments(output_dir=output_dir, report_to=[], **LAYOUTS[layout])  # eval batch as _run
    return DistTrainer(model=_model(), args=args, eval_dataset=token_dataset(8, seed=3)).evaluate()["eval_loss"]


def _two_ranks(rank, world, root):
    # the router aux term is added per eval batch, and 2 ranks evaluate twice the batches of one process (its
    # weighting across splits is not settled here), so FSDP2 alone on the same 2 ranks is EP's reference
    out = {"fsdp2_eval": _evaluation(f"{root}/fsdp2_eval", "fsdp2")}
    for layout in TWO_RANK:
        full = _run(f"{root}/{layout}/full", layout=layout, resume=False, save=True)
        _run(f"{root}/{layout}/cut", layout=layout, resume=False, stop_after=SAVE_EVERY + 1)
        if rank == 0:  # kept for the one-process resume (retention deletes it after step 6)
            shutil.copytree(f"{root}/{layout}/cut/checkpoint-{SAVE_EVERY}", f"{root}/{layout}/kept")
        torch.distributed.barrier()
        out[layout] = {"full": full, "resumed": _run(f"{root}/{layout}/cut", layout=layout, resume=True)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep_trainer")
    return root, run_distributed(_two_ranks, 2, str(root))[0]


def _close(a: dict, b: dict, atol: float) -> None:
    torch.testing.assert_close({k: torch.as_tensor(v) for k, v in a.items()},
                               {k: torch.as_tensor(v) for k, v in b.items()}, atol=atol, rtol=0)


@pytest.mark.parametrize("layout", TWO_RANK)
def test_ep_checkpoint_resumes_exactly(runs, layout):
    from hf_dist.checkpoint import read_manifest

    root, result = runs
    manifest = read_manifest(root / layout / "full" / "checkpoint-6")
    assert manifest.layout["ep"] == 2 and "EP2" in manifest.layout["description"]
    full, resumed = result[layout]["full"], result[layout]["resumed"]
    assert resumed["steps_run"] == STEPS - SAVE_EVERY
    assert min(full["norms"].values()) > 0.5  # clipping active on every step
    for step in range(SAVE_EVERY + 1, STEPS + 1):
        torch.testing.assert_close(resumed["losses"][step], full["losses"][step], atol=1e-6, rtol=0)
    _close(resumed["params"], full["params"], 1e-6)


def test_ep_layouts_train_alike(runs):
    """EP x FSDP2 and EP x DDP: the same losses and weights (each equals one process: test_expert_parallel), and
    the same evaluation as FSDP2 without EP."""
    _, result = runs
    fsdp, ddp = result["ep_fsdp2"]["full"], result["ep_ddp"]["full"]
    torch.testing.assert_close([fsdp["eval"], ddp["eval"]], [result["fsdp2_eval"]] * 2, atol=1e-5, rtol=0)
    torch.testing.assert_close(fsdp["losses"], ddp["losses"], atol=1e-5, rtol=0)
    _close(fsdp["params"], ddp["params"], 1e-5)


@pytest.mark.parametrize("layout", TWO_RANK)
def test_ep_checkpoint_resumes_in_one_process(runs, layout):
    """EP=2 (2 ranks, accumulation 2) -> 1 process (plain model, accumulation 4): same global batch and losses."""
    root, result = runs
    resumed = _run(str(root / f"one_{layout}"), layout="one process", resume=str(root / layout / "kept"))
    assert resumed["steps_run"] == STEPS - SAVE_EVERY
    full = result[layout]["full"]
    for step in range(SAVE_EVERY + 1, STEPS + 1):
        torch.testing.assert_close(resumed["losses"][step], full["losses"][step], atol=1e-5, rtol=0)
    _close(resumed["params"], full["params"], 1e-5)


@pytest.mark.parametrize("layout", TWO_RANK)
def test_ep_final_save_loads_with_from_pretrained(runs, layout):
    from transformers import AutoModelForCausalLM

    from safetensors.torch import load_file

    root, result = runs
    final = root / layout / "full" / "final"
    stored = load_file(str(final / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in stored  # the model's own per-expert keys
    assert not any(key.endswith("experts.gate_up_proj") for key in stored)
    reference = _model()
    reference.save_pretrained(root / f"reference_{layout}")  # transformers' own save: the same keys and shapes
    expected = load_file(str(root / f"reference_{layout}" / "model.safetensors"))
    assert {k: v.shape for k, v in stored.items()} == {k: v.shape for k, v in expected.items()}
    loaded = AutoModelForCausalLM.from_pretrained(str(final))
    _close({k: v.detach() for k, v in loaded.state_dict().items()}, result[layout]["full"]["params"], 0)
