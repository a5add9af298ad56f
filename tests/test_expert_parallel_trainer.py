"""DistTrainer with ``ep_size=2`` on 2 gloo ranks (tiny qwen3_moe from ``parity.tiny_config``, router aux loss on,
loaded from a folder transformers' ``save_pretrained`` wrote, per-expert keys as on the Hub, as a user's): EP x FSDP2 and EP x DDP equal one process (accumulation 4 instead of 2: the same global
batch) from their first optimizer step (gradients, losses, every parameter: ``trainer_harness.trainer_run``,
``parity.assert_parity``), evaluate as one process does, save hf_dist checkpoints that resume exactly (on the
same layout, and in one process: the resumed first step gradient by gradient), and the final ``save_model`` folder,
written in the model's own per-expert key format, loads with ``from_pretrained`` to the trained weights."""

from __future__ import annotations

import shutil

import pytest
import torch
from dist_utils import run_distributed
from parity import assert_parity, tiny_config, tiny_model
from test_checkpoint_trainer import _step_counter, _stop_after
from trainer_harness import VOCAB, token_dataset, trainer_run

STEPS, SAVE_EVERY = 6, 3
LAYOUTS = {"ep_fsdp2": dict(fsdp="full_shard", fsdp_config={"version": 2}, ep_size=2), "ep_ddp": dict(ep_size=2),
           "one process": {}}
TWO_RANK = ("ep_fsdp2", "ep_ddp")


def _config():
    config = tiny_config("qwen3_moe", "ep")
    config.vocab_size = VOCAB
    return config


def _write_base(folder) -> str:
    """``save_pretrained`` of the tiny model (the Hub's per-expert keys), written once before any rank starts."""
    tiny_model(_config()).save_pretrained(folder)
    return str(folder)


def _model(base: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert not model.training
    return model


def _run(output_dir: str, base: str, *, layout: str, resume: bool | str | None = None, stop_after: int | None = None,
         save: bool = False) -> dict:
    counter = _step_counter()
    callbacks = [counter] + ([_stop_after(stop_after)] if stop_after else [])
    box = {}  # the evaluation of the initial weights (before train(), where a checkpoint loads)
    run, trainer = trainer_run(
        output_dir, model=_model(base), resume=resume or None, callbacks=callbacks, max_steps=STEPS,
        global_batch_size=8, lr_scheduler_type="linear", warmup_steps=2, save_strategy="steps", save_steps=SAVE_EVERY,
        save_total_limit=1, max_grad_norm=0.5, use_cpu=layout == "one process",
        trainer_kwargs={"eval_dataset": token_dataset(8, seed=3)},
        before_train=lambda t: box.update(eval=t.evaluate()["eval_loss"]), **LAYOUTS[layout])
    assert trainer.dims.ep == (2 if layout in TWO_RANK else 1)
    if save:
        trainer.save_model(f"{output_dir}/final")
    logs = trainer.state.log_history
    return {**run, "steps": [log["step"] for log in logs if "loss" in log][-len(run["losses"]):],
            "norms": [log["grad_norm"] for log in logs if "grad_norm" in log], "steps_run": counter.steps_run,
            "eval": box["eval"]}


def _two_ranks(rank, world, root, base):
    out = {}
    for layout in TWO_RANK:
        full = _run(f"{root}/{layout}/full", base, layout=layout, save=True)
        _run(f"{root}/{layout}/cut", base, layout=layout, stop_after=SAVE_EVERY + 1)
        if rank == 0:  # kept for the one-process resume (retention deletes it after step 6)
            shutil.copytree(f"{root}/{layout}/cut/checkpoint-{SAVE_EVERY}", f"{root}/{layout}/kept")
        torch.distributed.barrier()
        out[layout] = {"full": full, "resumed": _run(f"{root}/{layout}/cut", base, layout=layout, resume=True)}
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return _write_base(tmp_path_factory.mktemp("ep_trainer_base"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, base):
    root = tmp_path_factory.mktemp("ep_trainer")
    return root, run_distributed(_two_ranks, 2, str(root), base)[0]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, base):
    return _run(str(tmp_path_factory.mktemp("ep_trainer_one")), base, layout="one process")


def _after_resume(run: dict) -> dict:
    return {**run, "losses": run["losses"][SAVE_EVERY:]}


@pytest.mark.parametrize("layout", TWO_RANK)
def test_ep_run_equals_one_process_from_its_first_step(runs, one_process, layout):
    _, result = runs
    full = result[layout]["full"]
    assert full["steps"] == list(range(1, STEPS + 1))
    assert min(one_process["norms"]) > 0.5  # clipping active on every step
    assert_parity(full, one_process, config=_config(), what=f"{layout} vs one process, first step of train()")


@pytest.mark.parametrize("layout", TWO_RANK)
def test_ep_checkpoint_resumes_exactly(runs, layout):
    from hf_dist.checkpoint import read_manifest

    root, result = runs
    manifest = read_manifest(root / layout / "full" / "checkpoint-6")
    assert manifest.layout["ep"] == 2 and "EP2" in manifest.layout["description"]
    full, resumed = result[layout]["full"], result[layout]["resumed"]
    assert resumed["steps_run"] == STEPS - SAVE_EVERY
    assert resumed["steps"] == list(range(SAVE_EVERY + 1, STEPS + 1))
    assert min(full["norms"]) > 0.5  # clipping active on every step
    assert_parity({k: resumed[k] for k in ("losses", "state")}, _after_resume(full), atol=1e-6, config=_config(),
                  what=f"{layout} resumed vs uninterrupted")


def test_ep_layouts_evaluate_as_one_process(runs, one_process):
    """EP x FSDP2 and EP x DDP evaluate the initial weights as one process does: its eval batches' losses, the router
    aux term once (the Trainer's count gathered over the ranks made it count it once per dp rank: 8.53 for 7.03)."""
    _, result = runs
    fsdp, ddp = result["ep_fsdp2"]["full"], result["ep_ddp"]["full"]
    torch.testing.assert_close([fsdp["eval"], ddp["eval"]], [one_process["eval"]] * 2, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", TWO_RANK)
def test_ep_checkpoint_resumes_in_one_process(runs, base, layout):
    """EP=2 (2 ranks, accumulation 2) -> 1 process (plain model, accumulation 4): the resumed first step equals the
    EP run's resumed from the same checkpoint, and the losses and weights continue the uninterrupted EP run."""
    root, result = runs
    resumed = _run(str(root / f"one_{layout}"), base, layout="one process", resume=str(root / layout / "kept"))
    assert resumed["steps_run"] == STEPS - SAVE_EVERY
    assert_parity(result[layout]["resumed"], resumed, config=_config(),
                  what=f"{layout} vs one process, first step of a resumed run")
    assert_parity({k: resumed[k] for k in ("losses", "state")}, _after_resume(result[layout]["full"]),
                  config=_config(), what=f"one process resumed from {layout} vs uninterrupted {layout}")


@pytest.mark.parametrize("layout", TWO_RANK)
def test_ep_final_save_loads_with_from_pretrained(runs, base, layout):
    from transformers import AutoModelForCausalLM

    from safetensors.torch import load_file

    root, result = runs
    final = root / layout / "full" / "final"
    stored = load_file(str(final / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in stored  # the model's own per-expert keys
    assert not any(key.endswith("experts.gate_up_proj") for key in stored)
    reference = _model(base)
    reference.save_pretrained(root / f"reference_{layout}")  # transformers' own save: the same keys and shapes
    expected = load_file(str(root / f"reference_{layout}" / "model.safetensors"))
    assert {k: v.shape for k, v in stored.items()} == {k: v.shape for k, v in expected.items()}
    loaded = AutoModelForCausalLM.from_pretrained(str(final))
    trained = {"losses": [], "state": result[layout]["full"]["state"]}
    assert_parity({"losses": [], "state": loaded.state_dict()}, trained, atol=0, config=_config(),
                  what=f"{layout} final save")
