"""TRL's GRPOTrainer under hf_dist's layouts: DistGRPOTrainer on 2 gloo ranks against one-process GRPOTrainer.

A tiny 4-layer Llama saved and loaded from disk (GRPO loads the frozen reference from the policy's path), the
byte-level tokenizer of ``test_dpo``, 12 distinct prompts, 2 generations each, up to 6 new tokens with extra
end-of-sequence tokens so completions end at different lengths (on different ranks too), a character-count reward,
beta=0.2, global batch 8 completions (4 prompts x 2) for 3 plain-SGD steps with gradient clipping at 1.0.

Greedy decoding gives every completion of a prompt the same reward, so the advantages are zero and what trains is
the KL term: the policy starts away from its reference (full fine-tune: the loaded weights perturbed after loading;
LoRA: adapters initialised non-zero), so the reference model's log-probabilities drive the update. DDP and FSDP2
(FULL_SHARD, SHARD_GRAD_OP), full fine-tune and LoRA, run in one spawned 2-rank group and must give the one-process
run's completions token for token, its loss, grad norm, rewards, reward std and completion lengths, and its weights
after the steps within 1e-5. kl, entropy and the clip ratios depend on how TRL cuts each rank's shuffled generation
batch into micro-batches (``_split_invariant``), so every logged metric is also compared with TRL's own GRPOTrainer
on the same 2 ranks. The test also counts the blocks FSDP2 holds gathered during generation, and resumes from an
hf_dist FSDP2 checkpoint.

Sampling: with do_sample, each rank draws from its own seed (TRL seeds per process), so one process cannot draw the
same tokens; the fixed-seed case compares DistGRPOTrainer under FSDP2 with TRL's own GRPOTrainer on the same 2
ranks (accelerate's DDP): completions, metrics (non-zero advantages) and weights.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from trl_parity import assert_trl_parity
from test_dpo import _pairs, _tokenizer

STEPS = 3
GLOBAL_BATCH = 8  # completions per optimizer step: 4 prompts x NUM_GENERATIONS
NUM_GENERATIONS = 2
MAX_COMPLETION = 6
BETA = 0.2
LAYERS = 4
EXTRA_EOS = [194, 223, 180, 176, 17]  # tokens the tiny model produces often: completions end at different lengths
# Of the policy's 4 blocks, the most whose parameters are gathered at a block's no-grad forward (generation, old
# and reference log-probabilities). FULL_SHARD: the running block; with LoRA also the last block, which FSDP keeps
# gathered after forward for backward and which is resharded when the PeftModel root's generate ends (its forward
# is not called per token). SHARD_GRAD_OP: every block, until the end of each forward.
GATHERED_BLOCKS = {"fsdp2": 1, "fsdp2_lora": 2, "fsdp2_shard_grad_op": LAYERS}
SKIPPED = ("step_time", "learning_rate")  # wall clock; the rate is the schedule's
LAYOUTS = {  # name -> (lora, DistGRPOConfig fields on 2 ranks)
    "ddp": (False, {}),
    "fsdp2": (False, {"fsdp2": True}),  # FULL_SHARD
    "fsdp2_shard_grad_op": (False, {"fsdp2": True, "fsdp2_reshard_after_forward": False}),
    "ddp_lora": (True, {}),
    "fsdp2_lora": (True, {"fsdp2": True}),
}


def character_reward(completions, **kwargs) -> list[float]:
    """Deterministic: how many 'a' and 'e' a completion holds, plus a little for its length."""
    return [float(c.count("a") + c.count("e")) + 0.1 * len(c) for c in completions]


def _saved_model(folder: Path, tokenizer) -> Path:
    from hf_dist.models import build_tiny_model

    path = folder / "tiny-llama"
    if not (path / "config.json").is_file():
        model = build_tiny_model(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=LAYERS, seed=0,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                 bos_token_id=tokenizer.bos_token_id)
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, *EXTRA_EOS]
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def _policy(path: Path, lora: bool):
    """The policy as loaded; a full fine-tune's is moved away from the saved weights (its reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path))
    if not lora:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return model


def _lora_config():
    from peft import LoraConfig

    # init_lora_weights=False: B is not zero, so the adapted policy differs from its adapter-free reference
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj"],
                      init_lora_weights=False)


def _full_state(trainer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if getattr(trainer, "owns_layout", False):
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    else:
        state = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _gathered_blocks(trainer) -> list[int]:
    """Records, at each no-grad decoder-block forward (generation, old and reference log-probabilities), how many
    of the policy's blocks hold gathered (non-DTensor) parameters."""
    from torch.distributed.tensor import DTensor

    from hf_dist.models.peft_utils import unwrap_peft

    blocks = list(unwrap_peft(trainer.model).model.layers)
    counts: list[int] = []

    def count(module, args):
        if not torch.is_grad_enabled():
            counts.append(sum(not isinstance(next(b.parameters()), DTensor) for b in blocks))

    for block in blocks:
        block.register_forward_pre_hook(count)
    return counts


def _run(folder: Path, config_cls, trainer_cls, *, lora: bool, sample: bool = False, output_dir: Path | None = None,
         resume: str | None = None, model_path: Path | None = None, lora_config=None, **overrides):
    """``model_path``: a saved policy other than the tiny Llama; ``lora_config``: other than ``_lora_config()``."""
    from datasets import Dataset

    tokenizer = _tokenizer(folder / "tokenizer")
    path = model_path or _saved_model(folder, tokenizer)
    generated: list[list[list[int]]] = []

    def reward(completions, completion_ids, **kwargs):
        generated.append([list(ids) for ids in completion_ids])
        return character_reward(completions)

    reward.__name__ = "character_reward"
    settings = dict(
        max_steps=STEPS, learning_rate=2.0 if lora else 0.5, optim="sgd", lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0, disable_tqdm=True,
        dataloader_num_workers=0, bf16=False, gradient_checkpointing=False, max_grad_norm=1.0, beta=BETA,
        num_generations=NUM_GENERATIONS, max_completion_length=MAX_COMPLETION,
        generation_kwargs=None if sample else {"do_sample": False},
    )
    with contextlib.nullcontext(output_dir) if output_dir else tempfile.TemporaryDirectory() as out:
        args = config_cls(output_dir=str(out), **(settings | overrides))
        trainer = trainer_cls(model=_policy(path, lora), reward_funcs=reward, args=args,
                              train_dataset=Dataset.from_dict({"prompt": _pairs(12, seed=0)["prompt"]}),
                              processing_class=tokenizer, peft_config=(lora_config or _lora_config()) if lora else None)
        gathered = _gathered_blocks(trainer) if getattr(trainer, "owns_layout", False) else []
        trainer.train(resume_from_checkpoint=resume)
    logs = [log for log in trainer.state.log_history if "loss" in log]
    metrics = {k: [log[k] for log in logs] for k in logs[0] if k not in SKIPPED and "time" not in k}
    dims = getattr(trainer, "dims", None)
    facts = {"layout": (trainer.accelerator.num_processes, dims.dp_shard if dims is not None else None),
             "ep": dims.ep if dims is not None else None,
             "max_gathered_blocks": max(gathered, default=None),
             "steps_per_generation": trainer.args.steps_per_generation,
             "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps}
    if trainer.ref_model is not None:
        in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
        facts["ref_frozen"] = not any(p.requires_grad or id(p) in in_optimizer for p in trainer.ref_model.parameters())
        params = list(trainer.ref_model.parameters())  # the share of the reference this rank holds
        facts["ref_local_fraction"] = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                          for p in params) / sum(p.numel() for p in params)
    return metrics, _full_state(trainer), generated, facts


def _rank_runs(rank, world_size, folder, names):
    from trl import GRPOConfig, GRPOTrainer

    from hf_dist.trainer.grpo import DistGRPOConfig, DistGRPOTrainer

    results = {}
    for name in names:
        lora, fields = LAYOUTS[name]
        results[name] = _run(folder, DistGRPOConfig, DistGRPOTrainer, lora=lora, global_batch_size=GLOBAL_BATCH,
                             per_device_train_batch_size=2, **fields)
    trl_ddp = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, use_cpu=True, ddp_backend="gloo")
    for lora in (False, True):  # TRL's own GRPOTrainer on these ranks (accelerate's DDP)
        results[f"trl_ddp{'_lora' if lora else ''}"] = _run(folder, GRPOConfig, GRPOTrainer, lora=lora, **trl_ddp)
    results["sampled_fsdp2"] = _run(folder, DistGRPOConfig, DistGRPOTrainer, lora=False, sample=True,
                                    global_batch_size=GLOBAL_BATCH, per_device_train_batch_size=2, fsdp2=True)
    results["sampled_trl"] = _run(folder, GRPOConfig, GRPOTrainer, lora=False, sample=True, **trl_ddp)
    # hf_dist's sharded FSDP2 checkpoint at step 2 (one folder for both ranks), then a fresh trainer resumes from it
    saving = dict(global_batch_size=GLOBAL_BATCH, per_device_train_batch_size=2, fsdp2=True, save_strategy="steps",
                  save_steps=2, output_dir=Path(folder) / "resume")
    results["saved"] = _run(folder, DistGRPOConfig, DistGRPOTrainer, lora=False, **saving)
    results["resumed"] = _run(folder, DistGRPOConfig, DistGRPOTrainer, lora=False, **saving,
                              resume=str(Path(folder) / "resume" / "checkpoint-2"))
    return results


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo")
    _saved_model(folder, _tokenizer(folder / "tokenizer"))
    return folder


@pytest.fixture(scope="module")
def references(folder):
    from trl import GRPOConfig, GRPOTrainer

    os.environ.pop("WORLD_SIZE", None)
    # micro-batches of 2 completions, as each rank's: TRL logs kl, entropy and clip ratios as a mean of per-micro-batch
    # means, so one process must split the generation batch into the same micro-batches
    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, use_cpu=True)
    return {lora: _run(folder, GRPOConfig, GRPOTrainer, lora=lora, **common) for lora in (False, True)}


@pytest.fixture(scope="module")
def distributed(folder):
    return run_distributed(_rank_runs, 2, folder, list(LAYOUTS))


def _split_invariant(metrics) -> list[str]:
    """The metrics that do not depend on how a rank's generation batch is cut into micro-batches. TRL shuffles each
    rank's generation batch with the process's RNG before cutting it, and logs kl, entropy and the clip ratios as
    the mean of per-micro-batch means: one process and 2 ranks cut differently, so TRL's own DDP run differs from
    one process there. Those are compared with TRL's GRPOTrainer on the same 2 ranks instead."""
    return [name for name in metrics if not name.startswith(("kl", "entropy", "clip_ratio"))]


def _both_ranks(distributed, name) -> list[list[list[int]]]:
    """Per generation call, rank 0's completions then rank 1's (each rank generates its half of the batch)."""
    rank0, rank1 = (rank_results[name][2] for rank_results in distributed)
    assert len(rank0) == len(rank1) == STEPS
    return [a + b for a, b in zip(rank0, rank1)]


def test_reference_run_learns_and_completions_end_unevenly(references, distributed):
    """The comparison means something: the KL term is non-zero and moves the weights; completions end at different
    lengths, and in some generation call one rank's completions all end before the other's (so it must keep
    stepping through the other rank's gathers under FSDP2)."""
    for lora in (False, True):
        metrics, state, generated, _ = references[lora]
        assert min(metrics["kl"]) > 1e-4 and metrics["reward"][0] > 0
        assert len(generated) == STEPS and all(len(call) == GLOBAL_BATCH for call in generated)
        lengths = {len(ids) for call in generated for ids in call}
        assert min(lengths) < MAX_COMPLETION and MAX_COMPLETION in lengths
        assert metrics["kl"][0] != metrics["kl"][-1]  # the weights moved between steps
    rank0, rank1 = (rank_results["fsdp2"][2] for rank_results in distributed)
    assert any(max(map(len, a)) != max(map(len, b)) for a, b in zip(rank0, rank1))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_match_one_process_grpo_trainer(references, distributed, layout):
    """Greedy: the one-process run's completions token for token, its loss, grad norm, rewards, reward std,
    completion lengths and weights; every logged metric (kl, entropy, clip ratios too) equals TRL's GRPOTrainer on
    the same 2 ranks."""
    lora = LAYOUTS[layout][0]
    ref_metrics, ref_state, ref_generated, _ = references[lora]
    assert _both_ranks(distributed, layout) == ref_generated  # greedy: token for token
    assert {"loss", "reward", "reward_std", "rewards/character_reward/mean", "kl"} <= set(ref_metrics)
    for rank_results in distributed:
        metrics, state, _, facts = rank_results[layout]
        assert facts["layout"] == (2, 2 if "fsdp2" in layout else 1)  # (processes, dp_shard): the layout really ran
        assert (facts["steps_per_generation"], facts["gradient_accumulation_steps"]) == (2, 2)
        assert all(len(values) == STEPS for values in metrics.values())
        assert_trl_parity(metrics, state, ref_metrics, ref_state, names=_split_invariant(ref_metrics), what=layout)
        trl_metrics, trl_state, _, _ = rank_results["trl_ddp_lora" if lora else "trl_ddp"]
        assert_trl_parity(metrics, state, trl_metrics, trl_state, what=f"{layout} vs TRL on 2 ranks")
        assert facts.get("ref_frozen", True) and ("ref_frozen" in facts) == (not lora)
        if "fsdp2" in layout:
            assert facts["max_gathered_blocks"] == GATHERED_BLOCKS[layout]


def test_fixed_seed_sampling_under_fsdp2_matches_trls_grpo_trainer_on_the_same_ranks(distributed):
    """do_sample with seed 0: hf_dist's FSDP2 draws the tokens TRL's own GRPOTrainer (accelerate DDP) draws on the
    same 2 ranks, with the same metrics (advantages non-zero: completions of a prompt differ) and weights."""
    assert _both_ranks(distributed, "sampled_fsdp2") == _both_ranks(distributed, "sampled_trl")
    for rank_results in distributed:
        metrics, state, _, _ = rank_results["sampled_fsdp2"]
        ref_metrics, ref_state, _, _ = rank_results["sampled_trl"]
        assert min(ref_metrics["reward_std"]) > 0
        assert_trl_parity(metrics, state, ref_metrics, ref_state, what="sampled")


def test_resumed_from_an_fsdp2_checkpoint_equals_the_uninterrupted_run(distributed, folder):
    """save_steps=2 writes hf_dist's sharded checkpoint; a fresh DistGRPOTrainer resumed from it trains step 3 to the
    same completions, loss, rewards and weights as the run that never stopped."""
    from hf_dist.checkpoint.kind import checkpoint_kind

    for rank_results in distributed:
        metrics, state, generated, _ = rank_results["saved"]
        resumed_metrics, resumed_state, resumed_generated, _ = rank_results["resumed"]
        assert resumed_generated == generated[-1:]  # only step 3 generated after the resume
        # steps 1-2 logged in the checkpoint's state
        assert_trl_parity(resumed_metrics, resumed_state, metrics, state, what="resumed")
    assert checkpoint_kind(folder / "resume" / "checkpoint-2") == "hf_dist"


def test_one_process_without_hf_dist_fields_is_grpo_trainer(references, folder):
    """Drop-in: DistGRPOTrainer with no hf_dist field gives GRPOTrainer's numbers in one process, exactly."""
    from hf_dist.trainer.grpo import DistGRPOConfig, DistGRPOTrainer

    metrics, state, generated, _ = _run(folder, DistGRPOConfig, DistGRPOTrainer, lora=False,
                                        per_device_train_batch_size=2, gradient_accumulation_steps=4, use_cpu=True)
    ref_metrics, ref_state, ref_generated, _ = references[False]
    assert generated == ref_generated and metrics == ref_metrics
    assert_trl_parity(metrics, state, ref_metrics, ref_state, atol=0)


def test_global_batch_counts_completions(tmp_path):
    """global_batch_size = prompts x num_generations per step: accumulation, the generation batch and the learning
    rate's scaling all follow it."""
    from hf_dist.trainer.grpo import DistGRPOConfig

    os.environ.pop("WORLD_SIZE", None)
    args = DistGRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2, global_batch_size=16,
                          num_generations=4, base_learning_rate=1e-6, base_batch_size=8)
    assert (args.gradient_accumulation_steps, args.steps_per_generation, args.generation_batch_size) == (8, 8, 16)
    assert args.learning_rate == pytest.approx(2e-6)
    with pytest.raises(ValueError, match=r"global_batch_size=10 counts completions .* use global_batch_size in "
                                         r"\[8, 12\]"):
        DistGRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2, global_batch_size=10,
                       num_generations=4)


REFUSED = [  # (fields, environment, what the message must say)
    ({"pp_size": 2}, {}, r"pp_size=2 in DistGRPOConfig: .*no pipelined generate.* drop it and shard with FSDP2"),
    ({"cp_size": 2}, {}, r"cp_size=2 in DistGRPOConfig: .*cp ranks.* drop it and shard with FSDP2"),
    ({"ep_size": 2}, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
     r"ep_size=2 over 4 data-parallel ranks in DistGRPOConfig: .* use ep_size=4, or drop ep_size"),
    ({"ep_size": 2, "fsdp2": True, "fsdp2_reshard_after_forward": False}, {},
     r"ep_size=2 with fsdp_shard_grad_op in DistGRPOConfig: .*DDP or FSDP2 FULL_SHARD only"),
    ({}, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
     r"DeepSpeed zero3 with DistGRPOConfig: .* shard with FSDP2"),
    ({"fsdp2": True, "fsdp2_dp_replicate": 2}, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
     r"fsdp2_dp_replicate=2 \(HYBRID_SHARD\) with DistGRPOConfig"),
    ({"fsdp2": True, "fsdp2_cpu_offload": True}, {}, r"fsdp2_cpu_offload=True with DistGRPOConfig"),
    ({"fsdp2": True, "use_vllm": True}, {}, r"use_vllm=True with FSDP2 .*weight sync.* drop --use_vllm"),
    ({"fsdp2": True, "use_transformers_continuous_batching": True}, {},
     r"use_transformers_continuous_batching=True with FSDP2 .* generate_batch"),
    ({"fsdp2": True, "sync_ref_model": True}, {}, r"sync_ref_model=True with FSDP2 .* drop --sync_ref_model"),
]


@pytest.mark.parametrize("fields, environment, message", REFUSED, ids=[m.split(" ")[0] for _, _, m in REFUSED])
def test_what_grpo_does_not_run_is_refused_before_any_process_group(tmp_path, monkeypatch, fields, environment,
                                                                    message):
    import torch.distributed as dist

    from hf_dist.trainer.grpo import DistGRPOConfig

    for name, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", **environment}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        DistGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **fields)
    assert not dist.is_initialized()


def test_expert_adapters_under_ep_are_refused_before_any_process_group(tmp_path):
    from types import SimpleNamespace

    import torch.distributed as dist
    from peft import LoraConfig

    from hf_dist.trainer.grpo import DistGRPOTrainer

    args = SimpleNamespace(ep_size=2)  # what DistGRPOConfig(ep_size=2) holds (building one starts the group)
    peft = LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])
    with pytest.raises(ValueError, match=r"target_parameters=\['mlp.experts.gate_up_proj'\] with ep_size=2 .* drop"):
        DistGRPOTrainer(model=str(tmp_path / "never_loaded"), reward_funcs=len, args=args, peft_config=peft)
    assert not dist.is_initialized()


def test_grpo_config_defaults_stay_trls(tmp_path):
    """Every Trainer default GRPOConfig changes keeps TRL's value in DistGRPOConfig; a GRPOConfig converts field
    by field."""
    import dataclasses

    from transformers import TrainingArguments
    from trl import GRPOConfig

    from hf_dist.trainer.grpo import DistGRPOConfig, as_dist_grpo_config

    os.environ.pop("WORLD_SIZE", None)
    trainer_defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    changed = {f.name for f in dataclasses.fields(GRPOConfig)
               if f.name in trainer_defaults and f.default != trainer_defaults[f.name]}
    assert {"learning_rate", "gradient_checkpointing", "logging_steps", "remove_unused_columns"} <= changed
    ours, trls = (cls(output_dir=str(tmp_path), use_cpu=True) for cls in (DistGRPOConfig, GRPOConfig))
    assert {name: getattr(ours, name) for name in changed} == {name: getattr(trls, name) for name in changed}
    plain = GRPOConfig(output_dir=str(tmp_path), learning_rate=3e-4, beta=0.3, num_generations=4,
                       per_device_train_batch_size=4, gradient_accumulation_steps=3, use_cpu=True)
    converted = as_dist_grpo_config(plain)
    assert isinstance(converted, DistGRPOConfig)
    assert (converted.learning_rate, converted.beta, converted.num_generations) == (3e-4, 0.3, 4)
    assert (converted.steps_per_generation, converted.generation_batch_size) == (3, 12)


def test_exported_from_hf_dist():
    import hf_dist
    from hf_dist.trainer.dpo import DistDPOConfig, DistDPOTrainer
    from hf_dist.trainer.grpo import DistGRPOConfig, DistGRPOTrainer

    assert (hf_dist.DistGRPOTrainer, hf_dist.DistGRPOConfig) == (DistGRPOTrainer, DistGRPOConfig)
    assert (hf_dist.DistDPOTrainer, hf_dist.DistDPOConfig) == (DistDPOTrainer, DistDPOConfig)
