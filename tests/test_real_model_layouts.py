"""The real pretrained SmolLM2-135M-Instruct (first layers, see real_model_harness) under every layout hf_dist offers.

Each layout: the loss over 3 steps equals one process within 1e-5 (fp32), and its checkpoint, exported with
``hf-dist checkpoint export`` and reloaded with ``from_pretrained``, generates the same greedy tokens as the
one-process model in memory. Layouts share spawned process groups by world size. TP=2 is refused (9 query
heads, 3 KV heads): the error names the valid sizes 1 and 3.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from real_model_harness import first_layers_copy, train_real

pytestmark = pytest.mark.real_model
TOL = dict(atol=1e-5, rtol=0)


def _group(rank, world_size, model_dir, root, layouts):
    return {name: train_real(model_dir, f"{root}/{name}", name) for name in layouts}


@pytest.fixture(scope="module")
def model_dir(demo_model, tmp_path_factory):
    return str(first_layers_copy(demo_model, tmp_path_factory.mktemp("smollm2-first-layers")))


@pytest.fixture(scope="module")
def references(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    return {name: train_real(model_dir, str(root / name), "ddp" if name == "full" else "lora")
            for name in ("full", "lora")}


def _check(results: dict, references: dict, expected_layout: dict) -> None:
    for name, result in results.items():
        reference = references["lora" if name.startswith("lora") else "full"]
        assert all(part in result["layout"] for part in expected_layout[name].split("+")), (name, result["layout"])
        assert len(result["losses"]) == 3
        torch.testing.assert_close(result["losses"], reference["losses"], **TOL, msg=name)
        assert result["tokens"] == reference["tokens"], name


def test_two_ranks_ddp_fsdp2_pp2_lora(model_dir, references, tmp_path):
    layouts = ("ddp", "fsdp2", "pp2", "lora_fsdp2")
    results = run_distributed(_group, 2, model_dir, str(tmp_path), layouts, timeout_s=1800)[0]
    _check(results, references, {"ddp": "DDP", "fsdp2": "FSDP2", "pp2": "PP2", "lora_fsdp2": "FSDP2"})


def test_two_ranks_deepspeed_zero2_zero3_lora(model_dir, references, tmp_path):
    layouts = ("zero2", "zero3", "lora_zero3")
    results = run_distributed(_group, 2, model_dir, str(tmp_path), layouts, timeout_s=1800)[0]
    _check(results, references, {"zero2": "ZeRO-2", "zero3": "ZeRO-3", "lora_zero3": "ZeRO-3"})


def test_three_ranks_tp3_pp3(model_dir, references, tmp_path):
    results = run_distributed(_group, 3, model_dir, str(tmp_path), ("tp3", "pp3"), timeout_s=1800)[0]
    _check(results, references, {"tp3": "TP3", "pp3": "PP3"})


def test_six_ranks_fsdp2_x_tp3(model_dir, references, tmp_path):
    results = run_distributed(_group, 6, model_dir, str(tmp_path), ("fsdp2_tp3",), timeout_s=1800)[0]
    _check(results, references, {"fsdp2_tp3": "FSDP2+TP3"})


def _tp2(rank, world_size, model_dir, out):
    """DistTrainer(tp_size=2) on 2 ranks: refused at construction, before any layout is applied or file written."""
    import os

    from hf_dist import DistTrainer, DistTrainingArguments
    from real_model_harness import load_model

    args = DistTrainingArguments(output_dir=out, tp_size=2, report_to=[], max_steps=1)
    try:
        DistTrainer(model=load_model(model_dir), args=args)
    except ValueError as err:
        return str(err), os.path.exists(out)
    return None, os.path.exists(out)


def test_tp2_is_refused_naming_the_valid_sizes(demo_model, tmp_path):
    from transformers import AutoConfig

    from hf_dist.tensor_parallel.checks import check_tp_sizes

    config = AutoConfig.from_pretrained(demo_model)
    with pytest.raises(ValueError, match=r"tp=2.*tp in \{1, 3\}"):
        check_tp_sizes(config, 2)
    check_tp_sizes(config, 3)
    for message, wrote in run_distributed(_tp2, 2, str(demo_model), str(tmp_path / "run")):
        assert message is not None and "tp=2" in message and "tp in {1, 3}" in message, message
        assert not wrote
