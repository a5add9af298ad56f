"""TRL's SFTTrainer under hf_dist's layouts: DistSFTTrainer on 2 gloo ranks against one-process SFTTrainer.

A tiny Llama, a byte-level BPE tokenizer trained here on the same text, a plain-text dataset of varying lengths
that SFTTrainer tokenizes itself, global batch 8 for 3 optimizer steps (fp32, no gradient checkpointing), then an evaluation.
DDP, FSDP2, TP=2, PP=2 and LoRA (over FSDP2) all run in one spawned 2-rank group, one after the other; each
must give the reference's per-step losses, evaluation loss and final weights within 1e-5.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from parity import assert_parity

STEPS = 3
GLOBAL_BATCH = 8
EXPECTED_DIMS = {"ddp": (2, 1, 1, 1), "fsdp2": (2, 2, 1, 1), "tp": (2, 1, 2, 1), "pp": (2, 1, 1, 2), "lora": (2, 2, 1, 1)}
LAYOUTS = {  # name -> DistSFTConfig fields (2 ranks)
    "ddp": {},
    "fsdp2": {"fsdp2": True, "fsdp2_reshard_after_forward": False},
    "tp": {"tp_size": 2},
    "pp": {"pp_size": 2, "pp_schedule": "gpipe"},
    "lora": {"fsdp2": True},
}
WORDS = "the ship sails north while a crew of seven reads maps and charts under lamps at night".split()


def _texts(n: int = 48, seed: int = 0) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 20, (n,), generator=gen)
    return [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(int(k))) for i, k in enumerate(lengths)]


def _tokenizer(directory: Path):
    from transformers import AutoTokenizer

    from hf_dist.data.tokenizer import train_tokenizer_from_texts

    if not (directory / "tokenizer.json").is_file():
        train_tokenizer_from_texts(_texts(), directory, vocab_size=320)
    return AutoTokenizer.from_pretrained(str(directory))


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj"])


def _run(tokenizer_dir: Path, config_cls, trainer_cls, *, lora: bool, **overrides):
    from datasets import Dataset

    from hf_dist.models import build_tiny_model

    tokenizer = _tokenizer(tokenizer_dir)
    model = build_tiny_model(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, seed=0,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                             bos_token_id=tokenizer.bos_token_id)
    with tempfile.TemporaryDirectory() as out:
        args = config_cls(
            output_dir=out, max_steps=STEPS, learning_rate=2e-3, lr_scheduler_type="constant", logging_steps=1,
            save_strategy="no", report_to=[], seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0,
            bf16=False, gradient_checkpointing=False, max_length=24, max_grad_norm=1.0, **overrides,
        )
        trainer = trainer_cls(model=model, args=args, train_dataset=Dataset.from_dict({"text": _texts()}),
                              eval_dataset=Dataset.from_dict({"text": _texts(8, seed=1)}),
                              processing_class=tokenizer, peft_config=_lora_config() if lora else None)
        trainer.train()
        eval_loss = trainer.evaluate()["eval_loss"]
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if getattr(trainer, "owns_layout", False) and not trainer.dims.pp_enabled:
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    elif getattr(trainer, "owns_layout", False):
        from hf_dist.pipeline_parallel.save import gather_state_dict

        state = gather_state_dict(trainer.model.pipeline)  # on rank 0; None elsewhere
    else:
        state = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log] + [eval_loss]
    trainable = {n for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters() if p.requires_grad}
    state = None if state is None else {k: v.detach().cpu().clone() for k, v in state.items()}
    dims = getattr(trainer, "dims", None)
    layout = (trainer.accelerator.num_processes, dims.dp_shard, dims.tp, dims.pp) if dims is not None else None
    return losses, state, len(trainable), layout


def _rank_runs(rank, world_size, tokenizer_dir, names):
    from hf_dist.trainer.sft import DistSFTConfig, DistSFTTrainer

    results = {}
    for name in names:
        results[name] = _run(tokenizer_dir, DistSFTConfig, DistSFTTrainer, lora=name == "lora",
                             global_batch_size=GLOBAL_BATCH, per_device_train_batch_size=2, **LAYOUTS[name])
    return results


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sft_tokenizer")
    _tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def references(tokenizer_dir):
    from trl import SFTConfig, SFTTrainer

    os.environ.pop("WORLD_SIZE", None)
    common = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, use_cpu=True)
    return {lora: _run(tokenizer_dir, SFTConfig, SFTTrainer, lora=lora, **common) for lora in (False, True)}


@pytest.fixture(scope="module")
def distributed(tokenizer_dir):
    return run_distributed(_rank_runs, 2, tokenizer_dir, list(LAYOUTS))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_match_one_process_sft_trainer(references, distributed, layout):
    ref_losses, ref_state, ref_trainable, _ = references[layout == "lora"]
    assert len(ref_losses) == STEPS + 1  # the training steps, then the evaluation loss
    gathered = next(r[layout][1] for r in distributed if r[layout][1] is not None)  # PP gathers on rank 0 only
    for rank, rank_results in enumerate(distributed):
        losses, state, trainable, dims = rank_results[layout]
        assert dims == EXPECTED_DIMS[layout]  # (processes, dp_shard, tp, pp): the layout really ran
        assert_parity({"losses": losses, "state": gathered if state is None else state},
                      {"losses": ref_losses, "state": ref_state}, what=f"{layout} rank {rank}")
        if layout == "lora":
            assert 0 < trainable == ref_trainable  # only the adapter trains


@pytest.mark.parametrize("option", ["tp_vocab_parallel", "tp_sequence_parallel"])
def test_tp_options_trl_cannot_run_are_refused_before_start(tmp_path, option):
    from hf_dist.trainer.sft import DistSFTConfig

    with pytest.raises(ValueError, match=f"{option}=True with tp_size=2 .* drop --{option}"):
        DistSFTConfig(output_dir=str(tmp_path), tp_size=2, **{option: True})


def test_an_sft_config_converts_field_by_field(tmp_path):
    from trl import SFTConfig

    from hf_dist.trainer.sft import DistSFTConfig, as_dist_sft_config

    plain = SFTConfig(output_dir=str(tmp_path), learning_rate=3e-4, max_length=20, packing=True, use_cpu=True)
    converted = as_dist_sft_config(plain)
    assert isinstance(converted, DistSFTConfig)
    assert (converted.learning_rate, converted.max_length, converted.packing) == (3e-4, 20, True)
    assert DistSFTConfig(output_dir=str(tmp_path), use_cpu=True).learning_rate == SFTConfig.learning_rate  # TRL's


def test_without_args_it_writes_where_sft_trainer_would(tmp_path, monkeypatch):
    # SFTTrainer(model) with no args writes to "<model name>-SFT" (name from the id, or the model's config), not to
    # the Trainer's "trainer_output"
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trl import SFTTrainer

    from hf_dist.trainer.sft import DistSFTConfig, DistSFTTrainer

    monkeypatch.chdir(tmp_path)
    tokenizer = _tokenizer(tmp_path / "tok")
    folder = tmp_path / "org" / "tiny-thing"
    AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = Dataset.from_dict({"text": _texts(4)})

    outcomes = []  # SFTConfig's default bf16=None means bf16 where supported: on a CPU, TRL's own error
    for trainer_cls in (SFTTrainer, DistSFTTrainer):
        try:
            outcomes.append(Path(trainer_cls(str(folder), train_dataset=data).args.output_dir).name)
        except ValueError as error:
            outcomes.append(str(error))
    assert outcomes[0] == outcomes[1] and (outcomes[0] == "tiny-thing-SFT" or "bf16" in outcomes[0]), outcomes
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)  # as on a GPU
    by_name = DistSFTTrainer(str(folder), train_dataset=data)
    by_model = DistSFTTrainer(AutoModelForCausalLM.from_pretrained(folder), train_dataset=data,
                              processing_class=tokenizer)
    for trainer in (by_name, by_model):
        assert isinstance(trainer.args, DistSFTConfig)
        assert Path(trainer.args.output_dir).name == "tiny-thing-SFT"


@pytest.mark.parametrize("names", [("trl.SFTConfig", "hf_dist.trainer.sft.DistSFTConfig"),
                                   ("trl.DPOConfig", "hf_dist.trainer.dpo.DistDPOConfig"),
                                   ("trl.GRPOConfig", "hf_dist.trainer.grpo.DistGRPOConfig")])
def test_the_dist_configs_keep_trls_defaults(names):
    """Every field TRL's config defaults differently from the Trainer keeps TRL's default in the Dist config
    (``DistTrainingArguments`` comes first in the MRO and would restore the Trainer's); the learning rate is
    ``None`` there on purpose (the batch contract decides it) and resolves to TRL's in ``__post_init__``."""
    import dataclasses
    import importlib

    trl_cls, dist_cls = (getattr(importlib.import_module(n.rsplit(".", 1)[0]), n.rsplit(".", 1)[1]) for n in names)
    trl_fields = {f.name: f for f in dataclasses.fields(trl_cls)}
    differ = {f.name: (f.default, trl_fields[f.name].default) for f in dataclasses.fields(dist_cls)
              if f.name in trl_fields and f.name != "learning_rate" and f.default != trl_fields[f.name].default}
    assert differ == {}, differ
    made = dist_cls(output_dir="unused", use_cpu=True)
    assert made.learning_rate == trl_fields["learning_rate"].default


@pytest.mark.parametrize("name", ["hf_dist.trainer.sft.DistSFTConfig", "hf_dist.trainer.dpo.DistDPOConfig",
                                  "hf_dist.trainer.grpo.DistGRPOConfig", "hf_dist.DistTrainingArguments"])
def test_trls_fused_head_keeps_an_untied_head_in_the_fsdp2_root(name):
    """TRL's fused LM head multiplies by ``lm_head.weight`` outside the head's forward: under FSDP2 the TRL configs
    keep the head in the root (gathered in the root's forward); DistTrainer's own loss gathers a head unit itself."""
    import importlib

    module, cls = name.rsplit(".", 1)
    args = getattr(importlib.import_module(module), cls)(output_dir="unused", use_cpu=True, fsdp2=True)
    assert args.hf_dist_fsdp.head_unit is (cls == "DistTrainingArguments")
