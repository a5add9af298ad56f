"""TRL's GRPOTrainer on a mixture-of-experts policy under expert parallelism: DistGRPOTrainer with ep_size=2 on 2 gloo
ranks against one-process GRPOTrainer.

A tiny Qwen3-MoE (4 experts, top-2, ``norm_topk_prob`` on, router aux loss at 0.1 -- TRL asks the model for its
router logits in the training forward and adds the weighted load-balancing term to the loss; generation runs without
them) saved and loaded from disk, with ``test_grpo``'s prompts, reward and settings (the policy away from its
reference, extra end-of-sequence tokens so completions end at different lengths, on different ranks too). EP=2 over
the two data-parallel ranks, with DDP and with FSDP2 for the rest of the model, full fine-tune and LoRA (attention;
experts and router frozen), in one spawned 2-rank group.

Generation exchanges tokens between the ranks' experts at every forward, so a rank whose completions all ended keeps
stepping until the other's are done (``synced_gpus``); the frozen reference (full fine-tune) has its experts laid out
as the policy's.

Micro-batches of one completion: the load-balancing loss is not a sum over completions, so it depends on which
completions share a micro-batch, and TRL cuts each process's shuffled generation batch into micro-batches (one process
and two ranks would cut different groups). With one completion per micro-batch each completion's term is the same
wherever it runs, and the greedy completions must equal one process token for token, its loss, aux loss, rewards,
completion lengths, token count and grad norm and every weight after 3 plain-SGD steps (routers and norms included)
within 1e-5. kl, entropy and the clip ratios are token-weighted over the ranks' micro-batches of each micro step
(``test_grpo._split_invariant``), so every logged metric is also compared with TRL's own GRPOTrainer on the same 2
ranks (accelerate's DDP, no EP).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dist_utils import run_distributed
from trl_parity import assert_trl_parity
import test_dpo
import test_grpo

EP = {"ep_size": 2}
LAYOUTS = {  # name -> (lora, DistGRPOConfig fields on 2 ranks)
    "ep_ddp": (False, EP),
    "ep_fsdp2": (False, EP | {"fsdp2": True}),
    "ep_ddp_lora": (True, EP),
    "ep_fsdp2_lora": (True, EP | {"fsdp2": True}),
}
EXTRA_EOS = [286, 186, 305, 107]  # tokens that end all of one rank's first completions early, not the other's


def _moe_folder(folder: Path) -> Path:
    """A tiny Qwen3-MoE with ``test_dpo``'s tokenizer, written with ``save_pretrained`` (once per folder)."""
    from trainer_harness import tiny_moe_config

    from hf_dist.models import build_tiny_model

    path = folder / "tiny-qwen3-moe"
    if not (path / "config.json").is_file():
        tokenizer = test_dpo._tokenizer(folder / "tokenizer")
        config = tiny_moe_config(tokenizer)
        model = build_tiny_model(config, seed=0)
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, *EXTRA_EOS]
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def _lora_config():
    from peft import LoraConfig

    # attention only (experts and router frozen); B not zero, so the policy differs from its adapter-free reference
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      init_lora_weights=False)


def _run(folder: Path, config_cls, trainer_cls, *, lora: bool, **fields):
    return test_grpo._run(folder, config_cls, trainer_cls, lora=lora, model_path=_moe_folder(folder),
                          lora_config=_lora_config(), per_device_train_batch_size=1, **fields)


def _rank_runs(rank, world_size, folder):
    from trl import GRPOConfig, GRPOTrainer

    from hf_dist.trainer.grpo import DistGRPOConfig, DistGRPOTrainer

    results = {name: _run(folder, DistGRPOConfig, DistGRPOTrainer, lora=lora, global_batch_size=test_grpo.GLOBAL_BATCH,
                          **fields) for name, (lora, fields) in LAYOUTS.items()}
    for lora in (False, True):  # TRL's own GRPOTrainer on these ranks (accelerate's DDP, no EP)
        results[f"trl_ddp{'_lora' if lora else ''}"] = _run(folder, GRPOConfig, GRPOTrainer, lora=lora, use_cpu=True,
                                                            ddp_backend="gloo", gradient_accumulation_steps=4)
    return results


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo_moe")
    _moe_folder(folder)
    return folder


@pytest.fixture(scope="module")
def references(folder):
    from trl import GRPOConfig, GRPOTrainer

    os.environ.pop("WORLD_SIZE", None)
    return {lora: _run(folder, GRPOConfig, GRPOTrainer, lora=lora, use_cpu=True,
                       gradient_accumulation_steps=test_grpo.GLOBAL_BATCH) for lora in (False, True)}


@pytest.fixture(scope="module")
def distributed(folder):
    return run_distributed(_rank_runs, 2, folder)


def test_reference_runs_learn_with_the_aux_loss(references, distributed):
    """The comparison means something: the aux loss is logged and non-zero, the KL term moves the weights,
    completions end at different lengths, and in some generation call one rank's completions all end before the
    other's (so it must keep stepping through the other rank's expert exchanges)."""
    for lora in (False, True):
        metrics, _, generated, _ = references[lora]
        assert min(metrics["aux_loss"]) > 0.1 and min(metrics["kl"]) > 1e-4
        assert metrics["kl"][0] != metrics["kl"][-1]
        lengths = {len(ids) for call in generated for ids in call}
        assert min(lengths) < test_grpo.MAX_COMPLETION and test_grpo.MAX_COMPLETION in lengths
    for name in ("ep_ddp", "ep_ddp_lora"):
        rank0, rank1 = (rank_results[name][2] for rank_results in distributed)
        assert any(max(map(len, a)) != max(map(len, b)) for a, b in zip(rank0, rank1))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_grpo_under_ep2_matches_one_process(references, distributed, folder, name):
    """Greedy completions token for token, every logged metric (aux loss included) and every weight within 1e-5; the
    frozen reference (full fine-tune) holds half the experts on each rank, as the policy does."""
    from transformers import AutoConfig

    lora, fields = LAYOUTS[name]
    ref_metrics, ref_state, ref_generated, _ = references[lora]
    assert test_grpo._both_ranks(distributed, name) == ref_generated
    config = AutoConfig.from_pretrained(_moe_folder(folder))  # assert_parity requires its router and expert weights
    for rank_results in distributed:
        metrics, state, _, facts = rank_results[name]
        assert facts["layout"] == (2, 2 if "fsdp2" in fields else 1) and facts["ep"] == 2  # the layout really ran
        assert (facts["steps_per_generation"], facts["gradient_accumulation_steps"]) == (4, 4)
        assert all(len(values) == test_grpo.STEPS for values in metrics.values())
        assert_trl_parity(metrics, state, ref_metrics, ref_state, names=test_grpo._split_invariant(ref_metrics),
                          config=config, what=name)
        trl_metrics, trl_state, _, _ = rank_results["trl_ddp_lora" if lora else "trl_ddp"]
        assert_trl_parity(metrics, state, trl_metrics, trl_state, config=config, what=f"{name} vs TRL on 2 ranks")
        assert facts.get("ref_frozen", True) and ("ref_frozen" in facts) == (not lora)
        if not lora:  # experts halved (and, under FSDP2, everything else)
            assert facts["ref_local_fraction"] < (0.51 if "fsdp2" in fields else 0.99)
