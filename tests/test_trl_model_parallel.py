"""TRL's DPO and GRPO trainers under model parallelism: DistDPOTrainer with tp_size=2 and with cp_size=2, and
DistGRPOTrainer with tp_size=2, on 2 gloo ranks against one-process DPOTrainer / GRPOTrainer.

DPO: a tiny Qwen3 (q/k norms) saved to disk and given by its folder, as a user's run does (TRL loads the policy and,
for a full fine-tune, the frozen reference from it; the reference is laid out like the policy; under LoRA it is the
adapter-disabled policy), on ``test_dpo``'s preference rows, global batch 8 in micro-batches of 4 for 3 plain-SGD
steps, then an evaluation. Under CP each rank runs its half of every sequence and the per-token log-probabilities
are gathered over the two ranks before TRL sums them. GRPO: ``test_grpo``'s tiny Llama, prompts, reward and settings
(the policy away from its reference, extra end-of-sequence tokens), global batch 8 completions in micro-batches of 2.
Each rank reads the whole batch (one TP or CP group, no data parallelism), so every logged figure (losses, rewards
and margins, log-probs, kl, entropy, clip ratios, token counts, grad norm) and every weight after the steps must
equal one process within 1e-5, and GRPO's completions must equal one process token for token, greedy and sampled
with a fixed seed (the TP ranks draw as one process does: seeded by their data-parallel rank; the sampled run scales
advantages by the whole batch's reward std, which TRL would take over a copy of the batch per TP rank). The policy's
decoder blocks hold only their shards at every no-grad forward (generation, old and reference log-probabilities):
nothing gathers the model.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from trl_parity import assert_trl_parity
import test_dpo
import test_grpo

TIMING_KEYS = ("step_time", "_runtime", "_samples_per_second", "_steps_per_second", "epoch")
DPO = {"dpo_tp": (False, {"tp_size": 2}), "dpo_tp_lora": (True, {"tp_size": 2}),  # name -> (lora, fields)
       "dpo_cp": (False, {"cp_size": 2}), "dpo_cp_lora": (True, {"cp_size": 2})}
DPO_PP = {"dpo_pp": (False, {"pp_schedule": "1f1b"}),  # name -> (lora, fields beside pp_size=2)
          "dpo_pp_lora": (True, {"pp_schedule": "gpipe", "fsdp2": True})}  # FSDP2 over 1 dp rank: as hf-dist plan says
GRPO = {"grpo_tp": (False, False), "grpo_tp_lora": (True, False), "grpo_tp_sampled": (False, True)}  # (lora, sample)
SAMPLED = {"scale_rewards": "batch"}  # sampled: non-zero advantages, scaled by the whole batch's reward std


def _qwen3_folder(folder: Path) -> Path:
    """A tiny Qwen3 with ``test_dpo``'s tokenizer, written with ``save_pretrained`` (once per folder)."""
    from transformers import Qwen3Config

    from hf_dist.models import build_tiny_model

    path = folder / "tiny-qwen3"
    if not (path / "config.json").is_file():
        tokenizer = test_dpo._tokenizer(folder / "tokenizer")
        config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_sliding_window=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                             bos_token_id=tokenizer.bos_token_id)
        build_tiny_model(config, seed=0).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def _dpo(folder: Path, config_cls, trainer_cls, lora: bool, **fields):
    return test_dpo._run(folder / "tokenizer", config_cls, trainer_cls, lora=lora, model_path=_qwen3_folder(folder),
                         **fields)


def _sequence_split(trainer) -> list[tuple[str, bool, float]]:
    """Records, at every forward of the policy's and the reference's last decoder layer, (which model, grad enabled,
    the layer's sequence length / the input_ids' length): 0.5 where the forward ran on this rank's half."""
    from hf_dist.models.peft_utils import unwrap_peft

    seen: list[tuple[str, bool, float]] = []
    models = {"policy": unwrap_peft(trainer.model)}
    if trainer.ref_model is not None:
        models["reference"] = trainer.ref_model
    for name, model in models.items():
        lengths = {}
        model.get_input_embeddings().register_forward_pre_hook(
            lambda module, args, lengths=lengths: lengths.update(full=args[0].shape[1]))
        model.model.layers[-1].register_forward_pre_hook(
            lambda module, args, kwargs, name=name, lengths=lengths: seen.append(
                (name, torch.is_grad_enabled(), (args[0] if args else kwargs["hidden_states"]).shape[1] /
                 lengths["full"])), with_kwargs=True)
    return seen


def _dpo_pp(folder: Path, lora: bool, fields: dict):
    """DistDPOTrainer with pp_size=2; the state is each rank's stages joined (HF names; a PEFT policy's as its
    ``PeftModel`` names them), and what each rank holds of the policy and the reference."""
    import torch.distributed as dist

    from hf_dist.trainer.dpo import DistDPOConfig, DistDPOTrainer

    held = []
    _, _, facts = _dpo(folder, DistDPOConfig, DistDPOTrainer, lora, global_batch_size=test_dpo.GLOBAL_BATCH,
                       per_device_train_batch_size=4, pp_size=2, **fields,
                       watch=lambda trainer: held.append(trainer) or [])
    trainer = held.pop()
    local = {("base_model.model." if lora else "") + k: v.detach().cpu().clone()
             for k, v in trainer.model.state_dict().items()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    pipe = trainer.model.pipeline
    facts["pipeline"] = (pipe.pp_rank, pipe.plan.num_stages, pipe.has_last, trainer.args.layout.strategy)
    facts["policy_numel"] = sum(p.numel() for p in trainer.model.parameters())
    if trainer.ref_model is not None:  # the reference's stages are the policy's, on the same rank
        facts["ref_stages"] = [sorted(s.owned_modules()) for s in trainer.ref_model.pipeline.modules]
        facts["policy_stages"] = [sorted(s.owned_modules()) for s in pipe.modules]
        facts["ref_numel"] = sum(p.numel() for p in trainer.ref_model.parameters())
    trainable = [None] * dist.get_world_size()
    dist.all_gather_object(trainable, facts["policy_trainable"])
    facts["policy_trainable"] = sum(trainable)
    return None, {k: v for part in parts for k, v in part.items()}, facts


def _rank_runs(rank, world_size, folder, names=None):
    from hf_dist.trainer.dpo import DistDPOConfig, DistDPOTrainer
    from hf_dist.trainer.grpo import DistGRPOConfig, DistGRPOTrainer

    results = {}
    for name, (lora, fields) in DPO_PP.items():
        if names is None or name in names:
            results[name] = _dpo_pp(folder, lora, fields)
    if names is not None:
        return results
    for name, (lora, fields) in DPO.items():
        results[name] = _dpo(folder, DistDPOConfig, DistDPOTrainer, lora, global_batch_size=test_dpo.GLOBAL_BATCH,
                             per_device_train_batch_size=4, watch=_sequence_split, **fields)
    for name, (lora, sample) in GRPO.items():
        results[name] = test_grpo._run(folder, DistGRPOConfig, DistGRPOTrainer, lora=lora, sample=sample, tp_size=2,
                                       global_batch_size=test_grpo.GLOBAL_BATCH, per_device_train_batch_size=2,
                                       **(SAMPLED if sample else {}))
    return results


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trl_tp")
    _qwen3_folder(folder)
    test_grpo._saved_model(folder, test_dpo._tokenizer(folder / "tokenizer"))
    return folder


@pytest.fixture(scope="module")
def references(folder):
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

    os.environ.pop("WORLD_SIZE", None)
    results = {lora: _dpo(folder, DPOConfig, DPOTrainer, lora, per_device_train_batch_size=4,
                          gradient_accumulation_steps=2, use_cpu=True) for lora in (False, True)}
    for name, (lora, sample) in GRPO.items():
        results[name] = test_grpo._run(folder, GRPOConfig, GRPOTrainer, lora=lora, sample=sample, use_cpu=True,
                                       per_device_train_batch_size=2, gradient_accumulation_steps=4,
                                       **(SAMPLED if sample else {}))
    return results


@pytest.fixture(scope="module")
def distributed(folder):
    return run_distributed(_rank_runs, 2, folder)


def _figures(facts: dict) -> dict:
    """Every logged training figure per step and every evaluation figure, timings and the learning rate aside."""
    logs = facts["logs"]
    assert len(logs) == test_dpo.STEPS
    kept = [name for name in logs[0] if not name.endswith(TIMING_KEYS) and name != "learning_rate"]
    figures = {name: [log[name] for log in logs] for name in kept}
    return figures | {k: v for k, v in facts["evaluation"].items() if not k.endswith(TIMING_KEYS)}


def test_reference_runs_learn(references):
    """The comparisons mean something: DPO's margins and GRPO's kl move, sampling gives a prompt's completions
    different rewards."""
    for lora in (False, True):
        metrics = references[lora][0]
        assert metrics["rewards/margins"][0] == 0.0 and abs(metrics["rewards/margins"][-1]) > 1e-3
    for name in GRPO:
        metrics = references[name][0]
        assert min(metrics["kl"]) > 1e-4 and metrics["kl"][0] != metrics["kl"][-1]
    assert min(references["grpo_tp_sampled"][0]["reward_std"]) > 0


def _same_figures_and_state(facts: dict, state: dict, ref_facts: dict, ref_state: dict, what: str) -> None:
    """Every logged training figure, every evaluation figure (timings aside) and every weight equal one process's."""
    assert len([k for k in ref_facts["evaluation"] if not k.endswith(TIMING_KEYS)]) > 5
    assert_trl_parity(_figures(facts), state, _figures(ref_facts), ref_state, what=what)


@pytest.mark.parametrize("name", list(DPO))
def test_dpo_tp2_and_cp2_match_one_process(references, distributed, name):
    """Every logged training and evaluation figure and every weight; the reference (full fine-tune) is laid out like
    the policy (TP: sharded; CP: whole, as the policy), frozen and not optimized."""
    lora, fields = DPO[name]
    _, ref_state, ref_facts = references[lora]
    for rank_results in distributed:
        _, state, facts = rank_results[name]
        assert facts["layout"] == (2, 1)  # (processes, dp_shard)
        _same_figures_and_state(facts, state, ref_facts, ref_state, name)
        assert facts["optimizer_is_policy"] and facts["policy_trainable"] == ref_facts["policy_trainable"]
        split = set(facts["watched"])
        if "cp_size" in fields:  # training forwards (the policy's, the reference's) on half of each sequence
            reference = ("policy", False, 0.5) if lora else ("reference", False, 0.5)
            assert {("policy", True, 0.5), reference} <= split and ("policy", True, 1.0) not in split
        else:
            assert {ratio for _, _, ratio in split} == {1.0}
        if lora:
            assert "ref_trainable" not in facts
            continue
        assert facts["ref_trainable"] == 0 and facts["ref_in_optimizer"] == 0
        if "tp_size" in fields:  # blocks sharded; embeddings, norms and lm_head whole
            assert 0.5 < facts["ref_local_fraction"] < 0.9
        else:
            assert facts["ref_local_fraction"] == 1.0


@pytest.mark.parametrize("name", list(DPO_PP))
def test_dpo_pp2_matches_one_process(references, distributed, name):
    """pp_size=2 (one pipeline of two stages, 2 micro-batches of 4 pairs): every logged training and evaluation
    figure on both ranks and every weight (the stages joined) equal one process's; each rank holds one stage of the
    policy and, for a full fine-tune, the same stage of the frozen reference, which is not optimized; under LoRA there
    is no second model."""
    lora, fields = DPO_PP[name]
    _, ref_state, ref_facts = references[lora]
    whole = sum(v.numel() for k, v in ref_state.items() if "lora_" not in k)
    for rank, rank_results in enumerate(distributed):
        _, state, facts = rank_results[name]
        strategy = "fsdp_full_shard" if fields.get("fsdp2") else "ddp"
        assert facts["layout"] == (2, 1) and facts["pipeline"] == (rank, 2, rank == 1, strategy)
        _same_figures_and_state(facts, state, ref_facts, ref_state, f"{name} rank {rank}")
        assert facts["optimizer_is_policy"] and facts["policy_trainable"] == ref_facts["policy_trainable"]
        assert facts["policy_numel"] < 0.8 * whole  # this rank's stage only
        if lora:
            assert "ref_trainable" not in facts
            continue
        assert facts["ref_trainable"] == 0 and facts["ref_in_optimizer"] == 0
        assert facts["ref_stages"] == facts["policy_stages"] and facts["ref_numel"] == facts["policy_numel"]


@pytest.mark.parametrize("name", list(GRPO))
def test_grpo_tp2_matches_one_process(references, distributed, name):
    """Completions token for token (greedy, and sampled with seed 0), every logged figure and every weight; at every
    no-grad block forward no block of the policy holds gathered parameters."""
    ref_metrics, ref_state, ref_generated, _ = references[name]
    for rank_results in distributed:
        metrics, state, generated, facts = rank_results[name]
        assert generated == ref_generated  # each TP rank generates the whole batch
        assert facts["layout"] == (2, 1)
        assert (facts["steps_per_generation"], facts["gradient_accumulation_steps"]) == (4, 4)
        assert all(len(values) == test_grpo.STEPS for values in metrics.values())
        assert_trl_parity(metrics, state, ref_metrics, ref_state, what=name)
        assert facts["max_gathered_blocks"] == 0
        assert facts.get("ref_frozen", True) and ("ref_frozen" in facts) == (not GRPO[name][0])
        if not GRPO[name][0]:  # the reference TP-sharded: blocks halved, embeddings, norms and lm_head whole
            assert 0.5 < facts["ref_local_fraction"] < 0.9


REFUSED = [  # (config, fields, environment, what the message must say)
    ("DistDPOConfig", {"tp_size": 2, "tp_vocab_parallel": True}, {},
     r"tp_vocab_parallel=True with tp_size=2 in DistDPOConfig: TRL's fused LM head .* drop --tp_vocab_parallel"),
    ("DistGRPOConfig", {"tp_size": 2, "tp_sequence_parallel": True}, {},
     r"tp_sequence_parallel=True with tp_size=2 in DistGRPOConfig: .* drop --tp_sequence_parallel"),
    ("DistDPOConfig", {"tp_size": 2}, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
     r"tp_size=2 with ddp over 2 data-parallel rank\(s\) in DistDPOConfig: .* launch tp_size processes"),
    ("DistGRPOConfig", {"tp_size": 2, "fsdp2": True}, {},
     r"tp_size=2 with fsdp_full_shard over 1 data-parallel rank\(s\) in DistGRPOConfig"),
    ("DistDPOConfig", {"cp_size": 2}, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
     r"cp_size=2 with ddp over 2 data-parallel rank\(s\) in DistDPOConfig: .* launch cp_size processes"),
    ("DistDPOConfig", {"cp_size": 2, "tp_size": 2}, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
     r"tp_size=2 with cp_size=2 in DistDPOConfig: .* use one of them"),
    ("DistDPOConfig", {"cp_size": 2, "pad_to_multiple_of": 3}, {},
     r"pad_to_multiple_of=3 with cp_size=2 in DistDPOConfig: .* a multiple of 2"),
    ("DistGRPOConfig", {"cp_size": 2}, {}, r"cp_size=2 in DistGRPOConfig: generation .* drop it and shard with FSDP2"),
]


@pytest.mark.parametrize("config, fields, environment, message", REFUSED,
                         ids=[f"{c}-{'-'.join(f)}-{e.get('WORLD_SIZE', 2)}" for c, f, e, _ in REFUSED])
def test_model_parallel_beyond_what_is_proven_is_refused_before_any_process_group(tmp_path, monkeypatch, config, fields,
                                                                      environment, message):
    import torch.distributed as dist

    from hf_dist.trainer import dpo, grpo

    config_cls = {"DistDPOConfig": dpo.DistDPOConfig, "DistGRPOConfig": grpo.DistGRPOConfig}[config]
    for key, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", **environment}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        config_cls(output_dir=str(tmp_path), use_cpu=True, **fields)
    assert not dist.is_initialized()


def test_grpo_generation_batch_is_counted_over_dp_ranks():
    """TRL counts a generation batch over every process; under TP it is counted over the dp ranks, keeping what was
    given (the size, or the steps), and a size the dp ranks cannot split evenly is refused."""
    from types import SimpleNamespace

    from hf_dist.strategy import Layout
    from hf_dist.trainer.grpo import generation_batch_over_dp

    def args(**fields):
        layout = Layout(strategy="ddp", num_gpus=4, tp=2)  # dp = 2
        return SimpleNamespace(layout=layout, per_device_train_batch_size=2, **fields)

    given_size = args(generation_batch_size=16, steps_per_generation=2)  # TRL's 16 / (2 x 4 processes)
    generation_batch_over_dp(given_size, size_given=True)
    assert given_size.steps_per_generation == 4  # 16 / (2 x 2 dp ranks)
    given_steps = args(generation_batch_size=24, steps_per_generation=3)  # TRL's 2 x 4 processes x 3
    generation_batch_over_dp(given_steps, size_given=False)
    assert given_steps.generation_batch_size == 12  # 2 x 2 dp ranks x 3
    with pytest.raises(ValueError, match=r"generation_batch_size=6 must be divisible by .* 2 x 2 .* multiple of 4"):
        generation_batch_over_dp(args(generation_batch_size=6, steps_per_generation=1), size_given=True)
