"""TRL's DPOTrainer under hf_dist's layouts: DistDPOTrainer on 2 gloo ranks against one-process DPOTrainer.

A tiny Llama, a byte-level BPE tokenizer trained here, 24 distinct preference rows (prompt, chosen, rejected) whose
chosen and rejected completions differ in length (so each pair pads differently), beta=0.3, global batch 8 for 3
plain-SGD steps (fp32, gradient clipping at 1.0), then an evaluation. DDP and FSDP2 with full fine-tuning (a frozen
reference copy; FSDP2 as FULL_SHARD and SHARD_GRAD_OP) and with LoRA (the reference is the policy with its adapters
disabled) run in one spawned 2-rank group; each must give the one-process reference's per-step losses,
rewards/chosen, rewards/rejected and rewards/margins (training and evaluation) and the weights after the steps within
1e-5. The reference model is checked to be frozen, absent from the optimizer, and sharded under FSDP2.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from trl_parity import assert_trl_parity

STEPS = 3
GLOBAL_BATCH = 8
BETA = 0.3
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins")
EVAL_METRICS = ("eval_loss", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/margins")
LAYOUTS = {  # name -> (lora, DistDPOConfig fields on 2 ranks)
    "ddp": (False, {}),
    "fsdp2": (False, {"fsdp2": True}),  # FULL_SHARD
    "fsdp2_shard_grad_op": (False, {"fsdp2": True, "fsdp2_reshard_after_forward": False}),
    "ddp_lora": (True, {}),
    "fsdp2_lora": (True, {"fsdp2": True, "fsdp2_reshard_after_forward": False}),
}
WORDS = "the ship sails north while a crew of seven reads maps and charts under lamps at night".split()


def _phrase(start: int, length: int) -> str:
    return " ".join(WORDS[(start + j) % len(WORDS)] for j in range(length))


def _pairs(n: int, seed: int) -> dict[str, list[str]]:
    """``n`` distinct rows; chosen and rejected lengths drawn apart so the two halves of a batch pad differently."""
    gen = torch.Generator().manual_seed(seed)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(n):
        prompt_len, chosen_len, rejected_len = (int(v) for v in torch.randint(2, 9, (3,), generator=gen))
        if chosen_len == rejected_len:
            rejected_len += 3
        rows["prompt"].append(f"{WORDS[i % len(WORDS)]} {i} " + _phrase(i, prompt_len))
        rows["chosen"].append(" " + _phrase(i + 3, chosen_len))
        rows["rejected"].append(" " + _phrase(i + 7, rejected_len))
    return rows


def _tokenizer(directory: Path):
    from transformers import AutoTokenizer

    from hf_dist.data.tokenizer import train_tokenizer_from_texts

    if not (directory / "tokenizer.json").is_file():
        rows = _pairs(24, seed=0)
        train_tokenizer_from_texts(rows["prompt"] + rows["chosen"] + rows["rejected"], directory, vocab_size=320)
    return AutoTokenizer.from_pretrained(str(directory))


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj"])


def _model(tokenizer):
    from hf_dist.models import build_tiny_model

    return build_tiny_model(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, seed=0,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id)


def _full_state(trainer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if getattr(trainer, "owns_layout", False):
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    else:
        state = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _reference_facts(trainer) -> dict:
    """What the frozen reference is on this rank: trainable, in the optimizer, sharded (FSDP2)."""
    from torch.distributed.tensor import DTensor

    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    policy = trainer.accelerator.unwrap_model(trainer.model)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    facts = {"policy_trainable": len(trainable), "optimizer_params": len(in_optimizer),
             "optimizer_is_policy": in_optimizer == {id(p) for p in trainable}}
    if trainer.ref_model is not None:
        params = list(trainer.ref_model.parameters())
        facts |= {"ref_trainable": sum(p.requires_grad for p in params),
                  "ref_in_optimizer": sum(id(p) in in_optimizer for p in params),
                  "ref_sharded": all(isinstance(p, DTensor) and p.to_local().numel() < p.numel() or p.numel() < 2
                                     for p in params),
                  "ref_local_fraction": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                                            for p in params) / sum(p.numel() for p in params)}
    return facts


def _run(tokenizer_dir: Path, config_cls, trainer_cls, *, lora: bool, model_path: Path | None = None, watch=None,
         **overrides):
    """Train and evaluate; ``model_path``: the saved model's folder, from which TRL loads the policy and (full
    fine-tune) the reference, as a user's run does; else both are built here. ``watch(trainer)``, called before
    training, returns a list it fills during the run (``facts["watched"]``)."""
    from datasets import Dataset

    tokenizer = _tokenizer(tokenizer_dir)
    model = str(model_path) if model_path is not None else _model(tokenizer)
    # the frozen copy (TRL loads it from the model's folder when given one)
    ref_model = None if lora or model_path is not None else _model(tokenizer)
    with tempfile.TemporaryDirectory() as out:
        args = config_cls(
            output_dir=out, max_steps=STEPS, learning_rate=4.0 if lora else 0.5, optim="sgd",
            lr_scheduler_type="constant",
            logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0, disable_tqdm=True,
            dataloader_num_workers=0, bf16=False, gradient_checkpointing=False, max_length=32, max_grad_norm=1.0,
            beta=BETA, per_device_eval_batch_size=overrides.get("per_device_train_batch_size", 4), **overrides,
        )
        trainer = trainer_cls(model=model, ref_model=ref_model, args=args,
                              train_dataset=Dataset.from_dict(_pairs(24, seed=0)),
                              eval_dataset=Dataset.from_dict(_pairs(8, seed=1)),
                              processing_class=tokenizer, peft_config=_lora_config() if lora else None)
        watched = watch(trainer) if watch is not None else None
        trainer.train()
        evaluation = trainer.evaluate()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    metrics = {name: [log[name] for log in logs] for name in METRICS}
    metrics |= {name: evaluation[name] for name in EVAL_METRICS}
    facts = _reference_facts(trainer)
    facts["logs"], facts["evaluation"] = logs, evaluation  # every logged figure, for the layouts compared in full
    facts["watched"] = watched
    dims = getattr(trainer, "dims", None)
    facts["layout"] = (trainer.accelerator.num_processes, dims.dp_shard if dims is not None else None)
    return metrics, _full_state(trainer), facts


def _rank_runs(rank, world_size, tokenizer_dir, names):
    from hf_dist.trainer.dpo import DistDPOConfig, DistDPOTrainer

    results = {}
    for name in names:
        lora, fields = LAYOUTS[name]
        results[name] = _run(tokenizer_dir, DistDPOConfig, DistDPOTrainer, lora=lora, global_batch_size=GLOBAL_BATCH,
                             per_device_train_batch_size=2, **fields)
    return results


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dpo_tokenizer")
    _tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def references(tokenizer_dir):
    from trl import DPOConfig, DPOTrainer

    os.environ.pop("WORLD_SIZE", None)
    common = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, use_cpu=True)
    return {lora: _run(tokenizer_dir, DPOConfig, DPOTrainer, lora=lora, **common) for lora in (False, True)}


@pytest.fixture(scope="module")
def distributed(tokenizer_dir):
    return run_distributed(_rank_runs, 2, tokenizer_dir, list(LAYOUTS))


def test_reference_run_learns(references, tokenizer_dir):
    """The comparison means something: rewards move away from 0 (policy == reference at step 1), weights move."""
    initial = _model(_tokenizer(tokenizer_dir)).state_dict()
    for lora in (False, True):
        metrics, state, _ = references[lora]
        assert metrics["rewards/margins"][0] == 0.0 and metrics["loss"][0] == pytest.approx(0.6931, abs=1e-4)
        assert abs(metrics["rewards/margins"][-1]) > 1e-3 and abs(metrics["eval_rewards/margins"]) > 1e-3
        if lora:  # the adapters' B start at zero
            moved = max(v.abs().max().item() for k, v in state.items() if "lora_B" in k)
        else:
            moved = max((state[k] - v).abs().max().item() for k, v in initial.items())
        assert moved > 1e-3


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_match_one_process_dpo_trainer(references, distributed, layout):
    lora = LAYOUTS[layout][0]
    ref_metrics, ref_state, ref_facts = references[lora]
    for rank_results in distributed:
        metrics, state, facts = rank_results[layout]
        assert facts["layout"] == (2, 2 if "fsdp2" in layout else 1)  # (processes, dp_shard): the layout really ran
        assert all(len(metrics[name]) == STEPS for name in METRICS)
        assert_trl_parity(metrics, state, ref_metrics, ref_state, what=layout)
        assert facts["optimizer_is_policy"] and facts["policy_trainable"] == ref_facts["policy_trainable"]
        if lora:  # the reference is the adapter-disabled policy: no second model
            assert "ref_trainable" not in facts and facts["policy_trainable"] < len(state) / 2
            continue
        assert facts["ref_trainable"] == 0 and facts["ref_in_optimizer"] == 0
        if "fsdp2" in layout:  # each rank holds about half the reference
            assert facts["ref_sharded"] and facts["ref_local_fraction"] < 0.6
        else:  # DDP: a whole replica per rank, as TRL's DPOTrainer has it
            assert facts["ref_local_fraction"] == 1.0


def test_one_process_without_hf_dist_fields_is_dpo_trainer(references, tokenizer_dir):
    """Drop-in: DistDPOTrainer with no hf_dist field gives DPOTrainer's numbers in one process (identical batches)."""
    from hf_dist.trainer.dpo import DistDPOConfig, DistDPOTrainer

    metrics, state, _ = _run(tokenizer_dir, DistDPOConfig, DistDPOTrainer, lora=False, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, use_cpu=True)
    ref_metrics, ref_state, _ = references[False]
    assert metrics == ref_metrics
    assert_trl_parity(metrics, state, ref_metrics, ref_state, atol=0)


REFUSED = [  # (fields, environment, what the message must say)
    ({"pp_size": 2}, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
     r"pp_size=2 with ddp over 2 data-parallel rank\(s\) in DistDPOConfig: .* launch pp_size processes"),
    ({"pp_size": 2, "loss_type": ["ipo"]}, {},
     r"loss_type=\['ipo'\] with pp_size=2 in DistDPOConfig: .*sigmoid.* use loss_type='sigmoid'"),
    ({"pp_size": 2, "ld_alpha": 0.5}, {}, r"ld_alpha=0.5 with pp_size=2 in DistDPOConfig: .* use ld_alpha=None"),
    ({"pp_size": 2, "pp_schedule": "interleaved_1f1b"}, {},
     r"pp_schedule='interleaved_1f1b' with DistDPOConfig: .* use pp_schedule='1f1b'"),
    ({"ep_size": 2}, {}, r"ep_size=2 in DistDPOConfig: .*reference.* drop it and shard with FSDP2"),
    ({}, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
     r"DeepSpeed zero3 with DistDPOConfig: .* shard with FSDP2"),
    ({"fsdp2": True, "fsdp2_dp_replicate": 2}, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
     r"fsdp2_dp_replicate=2 \(HYBRID_SHARD\) .* drop fsdp2_dp_replicate"),
    ({"fsdp2": True, "fsdp2_cpu_offload": True}, {}, r"fsdp2_cpu_offload=True .* drop --fsdp2_cpu_offload"),
    ({"fsdp2": True, "precompute_ref_log_probs": True}, {},
     r"precompute_ref_log_probs=True with FSDP2 .* drop --precompute_ref_log_probs, or run it under DDP"),
    ({"fsdp2": True, "sync_ref_model": True}, {}, r"sync_ref_model=True with FSDP2 .* drop --sync_ref_model"),
]


@pytest.mark.parametrize("fields, environment, message", REFUSED, ids=[m.split(" ")[0] for _, _, m in REFUSED])
def test_what_dpo_does_not_run_is_refused_before_any_process_group(tmp_path, monkeypatch, fields, environment,
                                                                   message):
    import torch.distributed as dist

    from hf_dist.trainer.dpo import DistDPOConfig

    for name, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", **environment}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        DistDPOConfig(output_dir=str(tmp_path), use_cpu=True, **fields)
    assert not dist.is_initialized()


def test_dpo_config_defaults_stay_trls(tmp_path):
    """Every Trainer default DPOConfig changes keeps TRL's value in DistDPOConfig; a DPOConfig converts field by
    field."""
    import dataclasses

    from transformers import TrainingArguments
    from trl import DPOConfig

    from hf_dist.trainer.dpo import DistDPOConfig, as_dist_dpo_config

    trainer_defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    changed = {f.name for f in dataclasses.fields(DPOConfig)
               if f.name in trainer_defaults and f.default != trainer_defaults[f.name]}
    assert {"learning_rate", "gradient_checkpointing", "logging_steps"} <= changed
    ours, trls = DistDPOConfig(output_dir=str(tmp_path), use_cpu=True), DPOConfig(output_dir=str(tmp_path),
                                                                                use_cpu=True)
    assert {name: getattr(ours, name) for name in changed} == {name: getattr(trls, name) for name in changed}
    plain = DPOConfig(output_dir=str(tmp_path), learning_rate=3e-4, beta=0.3, max_length=20, use_cpu=True)
    converted = as_dist_dpo_config(plain)
    assert isinstance(converted, DistDPOConfig)
    assert (converted.learning_rate, converted.beta, converted.max_length) == (3e-4, 0.3, 20)


def test_without_args_it_does_what_dpo_trainer_does(tmp_path, monkeypatch):
    """DPOTrainer(model_id) with no args: "<model name>-DPO" and TRL's defaults (bf16 where supported; on a machine
    without it, TRL's own error). With args, the reference is loaded from the same id, frozen, not optimized."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, LlamaConfig
    from trl import DPOTrainer

    from hf_dist.trainer.dpo import DistDPOConfig, DistDPOTrainer

    monkeypatch.chdir(tmp_path)
    tokenizer = _tokenizer(tmp_path / "tok")
    folder = tmp_path / "org" / "tiny-thing"
    AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = Dataset.from_dict(_pairs(4, seed=0))
    outcomes = []
    for trainer_cls in (DPOTrainer, DistDPOTrainer):
        try:
            outcomes.append(Path(trainer_cls(str(folder), train_dataset=data).args.output_dir).name)
        except ValueError as error:  # no bf16 here: DPOConfig's default refuses the CPU
            outcomes.append(str(error))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0] == "tiny-thing-DPO" or "bf16" in outcomes[0]
    trainer = DistDPOTrainer(str(folder), train_dataset=data, args=DistDPOConfig(output_dir="out", use_cpu=True))
    assert isinstance(trainer.args, DistDPOConfig) and trainer.ref_model is not None
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
