"""``examples/moe/train.py`` as a user launches it, on its CPU twin: the script unchanged under ``torchrun`` (gloo), a
tiny Qwen3-MoE saved as a model folder (its tokenizer beside it) in place of Qwen3-30B-A3B / Qwen3-235B-A22B, and a
JSONL of texts, for 2 optimizer steps.

- ``qwen3-30b-a3b`` on 4 ranks: the recipe's own layout, EP2 x FSDP2 (experts split over 2 ranks, sharded over the
  other 2, as over 4 of the real node's 8), a full fine-tune;
- ``qwen3-235b-a22b`` on 2 ranks with ``--ep_size 2`` (the twin's ranks): EP x FSDP2 with LoRA on attention and the
  stacked expert weights.

Each must load through ``hf_dist.from_pretrained``, pack, train both steps with a finite loss that moves, print the
layout it ran and save ``final/``. That these layouts equal one process is ``tests/test_sft_moe.py``'s; that the
README's ``hf-dist plan`` lines choose the recipes' layouts is ``tests/test_docs_commands.py``'s.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the harbor pilot guides each tanker past the breakwater while gulls circle the grain silos at dawn".split()
TWIN = {  # recipe -> (ranks, extra flags, layout line printed)
    "qwen3-30b-a3b": (4, [], r"FSDP2 FULL_SHARD .* x EP2 "),
    "qwen3-235b-a22b": (2, ["--ep_size", "2"], r"FSDP2 FULL_SHARD .* x EP2 "),
}


@pytest.fixture(scope="module")
def twin(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen3-MoE folder (config, safetensors, tokenizer) and a JSONL of texts of varying length."""
    import torch
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM
    from trainer_harness import tiny_moe_config

    from hf_dist.data.tokenizer import train_tokenizer_from_texts

    root = tmp_path_factory.mktemp("moe_twin")
    texts = [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(6 + i % 13)) for i in range(96)]
    train_tokenizer_from_texts(texts, root / "model", vocab_size=300)
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    config = tiny_moe_config(tokenizer)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(root / "model")
    data = root / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return root / "model", data


@pytest.mark.parametrize("recipe", list(TWIN))
def test_the_example_trains_its_cpu_twin(recipe, twin, tmp_path):
    model, data = twin
    ranks, extra, layout = TWIN[recipe]
    out = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               str(ROOT / "examples" / "moe" / "train.py"), "--recipe", recipe, "--model_name_or_path", str(model),
               "--dataset_path", str(data), "--output_dir", str(out), "--max_steps", "2", "--max_length", "48",
               "--global_batch_size", str(2 * ranks), "--bf16", "false", "--save_strategy", "no",
               "--learning_rate", "1e-2", "--warmup_steps", "0", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert re.search(rf"^layout +{layout}", proc.stdout, flags=re.M), proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    losses = [step["loss"] for step in summary["steps"]]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and losses[0] != losses[1], losses
    assert "aux_loss" in summary["steps"][0]  # the router's load-balancing loss is on (TRL logs it)
    saved = out / "final"
    if recipe == "qwen3-235b-a22b":  # the adapter, on attention and on the stacked expert weights
        from safetensors.torch import load_file

        names = list(load_file(saved / "adapter_model.safetensors"))
        assert any(".self_attn.q_proj.lora_A" in n for n in names) and any(".mlp.experts." in n for n in names), names
    else:
        assert (saved / "config.json").is_file() and (saved / "model.safetensors").is_file()
