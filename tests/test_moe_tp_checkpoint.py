"""DistTrainer ``tp_size=2`` on MoE types whose experts fuse ``[gate | up]`` (qwen3_moe, mixtral, deepseek_v3), with
the Trainer's default ``save_strategy="steps"``: each rank holds ``[gate_r | up_r]``, two blocks of the fused tensor,
written and read block by block (``hf_dist/checkpoint/blocks.py``).

One 2-rank spawn runs, per type (``parity.tiny_config(name, "tp")``, loaded from disk; router aux loss on where the
type has one): 4 steps saving every step and the final ``save_model``; then a new run resumed from ``checkpoint-2``.
In this process: the same 4 steps in one process (the reference), the TP=2 ``checkpoint-2`` resumed in one process
(plain model), and ``checkpoint-4`` exported to the Hub format. Through ``parity.assert_parity`` (routers and experts
required): the TP run equals one process from its first optimizer step (gradients, losses, every parameter, 1e-5), and
so does the resumed TP run's first step against the one-process resume from the same checkpoint; resumed losses and
parameters equal the uninterrupted run (1e-6 on the same layout, 1e-5 in one process); the final save and the export
load with ``from_pretrained`` to the trained parameters exactly.
"""

from __future__ import annotations

import pytest
from dist_utils import run_distributed
from parity import assert_parity, tiny_config, tiny_model
from test_checkpoint_trainer import _step_counter
from trainer_harness import VOCAB, trainer_run

CASES = ("qwen3_moe", "mixtral", "deepseek_v3")
STEPS, RESUME_AT, MAX_NORM = 4, 2, 0.5


def _config(name: str):
    config = tiny_config(name, "tp")
    config.vocab_size = VOCAB
    return config


def _train(name: str, output_dir: str, *, tp: int, resume: str | None = None, final: str | None = None) -> dict:
    from transformers import TrainingArguments

    counter = _step_counter()
    run, trainer = trainer_run(
        output_dir, model=tiny_model(_config(name), loaded=True), resume=resume, callbacks=[counter],
        max_steps=STEPS, save_strategy=TrainingArguments.save_strategy, save_steps=1, per_device_train_batch_size=4,
        global_batch_size=8, lr_scheduler_type="linear", warmup_steps=1, max_grad_norm=MAX_NORM, use_cpu=tp == 1,
        **({"tp_size": tp} if tp > 1 else {}))  # save_strategy: the Trainer's default ("steps")
    assert trainer.args.save_strategy == "steps"
    assert trainer.dims.tp == tp
    if final is not None:
        trainer.save_model(final)
    logs = trainer.state.log_history
    return {**run, "norms": [log["grad_norm"] for log in logs if "grad_norm" in log], "steps_run": counter.steps_run}


def _two_ranks(rank, world, root):
    out = {}
    for name in CASES:
        full = _train(name, f"{root}/{name}/full", tp=2, final=f"{root}/{name}/final")
        resumed = _train(name, f"{root}/{name}/resumed", tp=2, resume=f"{root}/{name}/full/checkpoint-{RESUME_AT}")
        out[name] = {"full": full, "resumed": resumed}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_tp_ckpt")
    return root, run_distributed(_two_ranks, 2, str(root))


def _after_resume(run: dict) -> dict:
    return {"losses": run["losses"][RESUME_AT:], "state": run["state"]}


@pytest.mark.parametrize("name", CASES)
def test_tp2_checkpoint_of_split_gate_up_resumes_exactly_and_equals_one_process(runs, name, tmp_path):
    from hf_dist.checkpoint import read_manifest

    root, ranks = runs
    assert read_manifest(root / name / "full" / f"checkpoint-{RESUME_AT}").layout["tp"] == 2
    reference = _train(name, str(tmp_path / "one"), tp=1)
    assert min(reference["norms"]) > MAX_NORM  # clipping active on every step
    for rank, result in enumerate(ranks):
        full, resumed = result[name]["full"], result[name]["resumed"]
        assert resumed["steps_run"] == STEPS - RESUME_AT
        assert_parity({k: resumed[k] for k in ("losses", "state")}, _after_resume(full), atol=1e-6,
                      config=_config(name), what=f"rank {rank}: TP resumed vs uninterrupted")
        assert_parity(full, reference, config=_config(name), what=f"rank {rank}: TP vs one process, first step")


@pytest.mark.parametrize("name", CASES)
def test_tp2_checkpoint_resumes_in_one_process(runs, name, tmp_path):
    """TP=2 -> one process (plain model): the fused tensor is read from both ranks' blocks; the resumed first step
    equals the TP run's resumed from the same checkpoint, and the run continues the uninterrupted TP run."""
    root, ranks = runs
    resumed = _train(name, str(tmp_path / "one"), tp=1, resume=str(root / name / "full" / f"checkpoint-{RESUME_AT}"))
    assert resumed["steps_run"] == STEPS - RESUME_AT
    assert_parity(ranks[0][name]["resumed"], resumed, config=_config(name),
                  what="TP vs one process, first step of a resumed run")
    assert_parity({k: resumed[k] for k in ("losses", "state")}, _after_resume(ranks[0][name]["full"]),
                  config=_config(name), what="one process resumed from TP vs uninterrupted TP")


@pytest.mark.parametrize("name", CASES)
def test_final_save_and_export_load_with_from_pretrained_to_the_trained_weights(runs, name, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from hf_dist.checkpoint.export import export_checkpoint

    root, ranks = runs
    trained = {"losses": [], "state": ranks[0][name]["full"]["state"]}
    report = export_checkpoint(root / name / "full" / f"checkpoint-{STEPS}", tmp_path / "export")
    assert report.verification == "tensors" and report.tensors_verified
    for folder in (root / name / "final", tmp_path / "export"):
        loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).state_dict()
        assert_parity({"losses": [], "state": loaded}, trained, atol=0, config=_config(name), what=str(folder))
