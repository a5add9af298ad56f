"""TRL's SFTTrainer on a mixture-of-experts model as a user runs it: ``DistSFTTrainer`` on a tiny Qwen3-MoE.

The model (4 experts, top-2, ``norm_topk_prob`` on, router aux loss on at 0.1 -- TRL adds the weighted term itself)
is saved and loaded as users do; SFTTrainer tokenizes a plain-text dataset of varying lengths itself. On 2 gloo
ranks, in one spawn: EP=2 x FSDP2, EP=2 x DDP, and LoRA (attention and, through PEFT's ``target_parameters``, the
stacked expert weights) under EP=2 x FSDP2 and EP=2 x DDP; and EP=2 x FSDP2, full and LoRA, saved at step 2 and
resumed. On 4 ranks, in one spawn: EP=2 inside each of 2 pipeline stages, EP=2 beside TP=2, and EP=2 x CP=2 on TRL's
packed, padding-free rows (``packing=True``), each saved at step 2 and resumed; and a dense Qwen3 under CP=2 on
packed rows. Each equals a one-process ``DistSFTTrainer`` on the same global
batch and micro-batches (per-step losses, evaluation loss -- aux term included, as the model's own loss has it -- and
every trained weight, routers, norms and experts included, within 1e-5).

Under CP each rank routes half of every packed row; the aux loss is the micro-batch's, from router statistics pooled
over the cp ranks, and a row of odd length is padded by one position that the aux leaves out (counted, it moves the
evaluation loss by 3e-3 and a weight by 4e-2 after three steps).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from parity import ADAM_NOISE, assert_parity

STEPS, SAVE_AT, GLOBAL_BATCH, MICRO = 3, 2, 8, 2
EP = {"ep_size": 2}
LAYOUTS = {  # name -> (DistSFTConfig fields on 2 ranks, LoRA)
    "ep_fsdp2": (EP | {"fsdp2": True}, False),
    "ep_ddp": (EP, False),
    "ep_fsdp2_lora": (EP | {"fsdp2": True}, True),
    "ep_ddp_lora": (EP, True),
}
PHRASES = "a gull circles the harbor wall as two boats trade nets and rope before the tide turns at dusk".split()


def texts(n: int, seed: int) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 18, (n,), generator=gen)
    return [" ".join(PHRASES[(i * 5 + j) % len(PHRASES)] for j in range(int(k))) for i, k in enumerate(lengths)]


def _tokenizer(directory: Path):
    from transformers import AutoTokenizer

    from hf_dist.data.tokenizer import train_tokenizer_from_texts

    if not (directory / "tokenizer.json").is_file():
        train_tokenizer_from_texts(texts(64, 0), directory, vocab_size=300)
    return AutoTokenizer.from_pretrained(str(directory))


def _config(tokenizer, dense: bool = False):
    from trainer_harness import tiny_moe_config

    return tiny_moe_config(tokenizer, dense=True) if dense else tiny_moe_config(tokenizer, output_router_logits=True)


def _model(tokenizer, dense: bool = False):
    from transformers import AutoModelForCausalLM
    from trainer_harness import as_loaded

    config = _config(tokenizer, dense)
    torch.manual_seed(0)
    return as_loaded(AutoModelForCausalLM.from_config(config))


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def _trained(trainer, lora: bool) -> dict[str, torch.Tensor]:
    """Every weight (the adapters only, under LoRA), gathered whole."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if trainer.dims.pp_enabled:
        from hf_dist.pipeline_parallel.save import gather_state_dict

        state = gather_state_dict(trainer.model.pipeline)  # on rank 0; None elsewhere
        if state is None:
            return None
    else:
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in state.items() if not lora or "lora_" in k}


def _run(tokenizer_dir: Path, out: str, *, lora: bool, save_steps: int | None = None, resume: str | None = None,
         dense: bool = False, **layout):
    from datasets import Dataset

    from hf_dist.trainer.sft import DistSFTConfig, DistSFTTrainer

    tokenizer = _tokenizer(tokenizer_dir)
    args = DistSFTConfig(
        output_dir=out, max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, report_to=[], seed=0,
        data_seed=0, disable_tqdm=True, dataloader_num_workers=0, bf16=False, gradient_checkpointing=False,
        max_length=24, max_grad_norm=1.0, global_batch_size=GLOBAL_BATCH, per_device_train_batch_size=MICRO,
        use_cpu=int(os.environ.get("WORLD_SIZE", "1")) == 1, **layout,
    )
    trainer = DistSFTTrainer(model=_model(tokenizer, dense), args=args,
                             train_dataset=Dataset.from_dict({"text": texts(48, 0)}),
                             eval_dataset=Dataset.from_dict({"text": texts(8, 1)}), processing_class=tokenizer,
                             peft_config=_lora_config() if lora else None)
    trainer.train(resume_from_checkpoint=resume)
    eval_loss = trainer.evaluate()["eval_loss"]
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log] + [eval_loss]
    return {"losses": losses, "trained": _trained(trainer, lora), "ep": trainer.dims.ep, "tp": trainer.dims.tp,
            "pp": trainer.dims.pp, "cp": trainer.dims.cp}


def _rank_runs(rank, world_size, tokenizer_dir, root):
    results = {}
    for name, (layout, lora) in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as out:
            results[name] = _run(tokenizer_dir, out, lora=lora, **layout)
    for name, lora in (("resumed", False), ("lora_resumed", True)):  # EP x FSDP2, full and LoRA: saved, resumed
        out = f"{root}/{name}"  # the same on every rank: the checkpoint is written together
        _run(tokenizer_dir, out, lora=lora, save_steps=SAVE_AT, **LAYOUTS["ep_fsdp2"][0])
        results[name] = _run(tokenizer_dir, out, lora=lora, resume=f"{out}/checkpoint-{SAVE_AT}",
                             **LAYOUTS["ep_fsdp2"][0])
    return results


EP_CP = LAYOUTS["ep_fsdp2"][0] | {"cp_size": 2, "packing": True}
"""EP=2 x CP=2 on 4 ranks (ep 2 = dp 2, each sequence split over 2 cp ranks), TRL's packing (padding-free rows)."""


def _four_rank_runs(rank, world_size, tokenizer_dir, root):
    """On 4 ranks: EP=2 inside each of 2 pipeline stages (pp 2 x dp 2: the evaluation loss keeps the aux term), EP=2
    beside TP=2 (tp 2 x dp 2: attention split by TP, experts whole on each TP rank and split by EP), and EP=2 x CP=2
    on packed rows, saved at step 2 (the run itself is the uninterrupted one) and resumed from there."""
    from unittest import mock

    from hf_dist.trainer import context

    results = {}
    for name, extra in (("ep_pp", {"pp_size": 2, "pp_schedule": "gpipe"}), ("ep_tp", {"tp_size": 2})):
        out = f"{root}/{name}"  # saved at step 2 (the run itself is the uninterrupted one), resumed from there
        results[name] = _run(tokenizer_dir, out, lora=False, save_steps=SAVE_AT, **extra, **LAYOUTS["ep_fsdp2"][0])
        results[f"{name}_resumed"] = _run(tokenizer_dir, out, lora=False, resume=f"{out}/checkpoint-{SAVE_AT}",
                                          **extra, **LAYOUTS["ep_fsdp2"][0])
    padded, pad = [], context.pad_to_slices  # positions the CP step added per micro-batch

    def recording(inputs, size):
        out, extra = pad(inputs, size)
        padded.append(extra)
        return out, extra

    out = f"{root}/ep_cp"  # the same on every rank: the checkpoint is written together
    with mock.patch.object(context, "pad_to_slices", recording):
        results["ep_cp"] = _run(tokenizer_dir, out, lora=False, save_steps=SAVE_AT, **EP_CP)
    results["ep_cp_resumed"] = _run(tokenizer_dir, out, lora=False, resume=f"{out}/checkpoint-{SAVE_AT}", **EP_CP)
    results["ep_cp"]["padded"] = padded
    with tempfile.TemporaryDirectory() as out:  # a dense model, CP=2 x dp 2 on packed rows
        results["dense_cp"] = _run(tokenizer_dir, out, lora=False, dense=True, cp_size=2, packing=True,
                                   fsdp="full_shard", fsdp_config={"version": 2})
    return results


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sft_moe_tokenizer")
    _tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def references(tokenizer_dir):
    os.environ.pop("WORLD_SIZE", None)
    refs = {}
    for lora in (False, True):
        with tempfile.TemporaryDirectory() as out:
            refs[lora] = _run(tokenizer_dir, out, lora=lora)
    with tempfile.TemporaryDirectory() as out:
        refs["packed"] = _run(tokenizer_dir, out, lora=False, packing=True)
    with tempfile.TemporaryDirectory() as out:
        refs["dense_packed"] = _run(tokenizer_dir, out, lora=False, dense=True, packing=True)
    return refs


@pytest.fixture(scope="module")
def distributed(tokenizer_dir, tmp_path_factory):
    return run_distributed(_rank_runs, 2, tokenizer_dir, str(tmp_path_factory.mktemp("sft_moe_runs")))


def _run_of(result: dict) -> dict:
    """``assert_parity``'s run: per-step losses then the evaluation loss, and the trained weights (gathered whole)."""
    return {"losses": result["losses"], "state": result["trained"]}


@pytest.fixture(scope="module")
def moe_config(tokenizer_dir):
    """The MoE's config: ``assert_parity`` requires its router and expert weights among those compared."""
    return _config(_tokenizer(tokenizer_dir))


@pytest.mark.parametrize("name", [*LAYOUTS, "resumed", "lora_resumed"])
def test_sft_on_a_moe_equals_one_process(references, distributed, moe_config, name):
    lora = LAYOUTS.get(name, (None, name == "lora_resumed"))[1]
    reference = references[lora]
    assert len(reference["losses"]) == STEPS + 1
    assert any(".mlp.experts." in k for k in reference["trained"])  # experts (or their adapters) train
    assert any(".mlp.gate." in k for k in reference["trained"]) != lora  # the router trains unless under LoRA
    for rank, result in enumerate(distributed):
        assert result[name]["ep"] == 2  # the layout really ran
        if name.endswith("resumed"):  # the log history of the resumed run: the checkpoint's steps, then its own
            assert len(result[name]["losses"]) == len(reference["losses"])
        # under LoRA only the adapters train and are compared (the router has none): no router weight to require
        assert_parity(_run_of(result[name]), _run_of(reference), config=None if lora else moe_config,
                      what=f"{name} rank {rank}")


@pytest.fixture(scope="module")
def four_ranks(tokenizer_dir, tmp_path_factory):
    return run_distributed(_four_rank_runs, 4, tokenizer_dir, str(tmp_path_factory.mktemp("sft_moe_four")))


@pytest.mark.parametrize("name", ["ep_pp", "ep_tp", "ep_pp_resumed", "ep_tp_resumed"])
def test_sft_on_a_moe_under_ep_x_pp_and_ep_x_tp_equals_one_process(references, four_ranks, moe_config, name):
    reference = references[False]
    trained = four_ranks[0][name]["trained"]  # gathered whole (under PP: from every stage, on rank 0)
    for rank, result in enumerate(four_ranks):
        sizes = (result[name]["ep"], result[name]["tp"], result[name]["pp"])
        assert sizes == ((2, 1, 2) if name.startswith("ep_pp") else (2, 2, 1))  # the layout really ran
        assert_parity({"losses": result[name]["losses"], "state": trained}, _run_of(reference), config=moe_config,
                      what=f"{name} rank {rank}")


@pytest.mark.parametrize("name", ["ep_cp", "ep_cp_resumed"])
def test_sft_on_packed_rows_under_ep_x_cp_equals_one_process(references, four_ranks, moe_config, name):
    reference = references["packed"]
    assert len(reference["losses"]) == STEPS + 1
    assert any(p > 0 for p in four_ranks[0]["ep_cp"]["padded"])  # a packed row of odd length was split
    for rank, result in enumerate(four_ranks):
        assert (result[name]["ep"], result[name]["cp"], result[name]["tp"], result[name]["pp"]) == (2, 2, 1, 1)
        assert_parity(_run_of(result[name]), _run_of(reference), config=moe_config, what=f"{name} rank {rank}")


def test_sft_on_packed_rows_of_a_dense_model_under_cp_equals_one_process(references, four_ranks):
    """CP=2 through DistSFTTrainer without a router: the same sequence split, padding and per-rank loss weighting."""
    reference = references["dense_packed"]
    assert not any(".mlp.experts." in k for k in reference["trained"])
    trained = four_ranks[0]["dense_cp"]["trained"]
    for rank, result in enumerate(four_ranks):
        assert (result["dense_cp"]["ep"], result["dense_cp"]["cp"]) == (1, 2)
        # one weight element of a barely trained row: parity.ADAM_NOISE (measured 3.3e-5, head row 257)
        assert_parity({"losses": result["dense_cp"]["losses"], "state": trained}, _run_of(reference),
                      state_atol=ADAM_NOISE, what=f"dense_cp rank {rank}")
