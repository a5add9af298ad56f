"""The Harbor recipe with context parallelism and packing pads its batches itself, and trains as one process does
(issue 27.6).

Packed rows have any length; CP gives each rank an equal slice of every sequence, so a row of odd length stopped the
first step ("sequence length 999 is not divisible by cp_size=2"). The recipe's collator now pads every batch to a
multiple of cp_size (``data_collator(..., cp_size=)``, labels -100), whether cp comes from ``--cp_size 2`` or from an
accelerate YAML's ``parallelism_config_cp_size: 2``: on 2 gloo ranks its run equals the same recipe on one
process (unpadded) through ``parity.assert_parity``: logged losses and gradient norms, and the saved final weights. A ``--max_seq_len`` the padding would overrun is refused before anything loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch.testing import assert_close

from dist_utils import load_recipe, run_distributed
from launch_harness import ADAM_EPSILON, launched_run
from parity import assert_parity

FLAGS = [
    "--preset", "tiny", "--packed", "true", "--max_seq_len", "512", "--per_device_train_batch_size", "1",
    "--global_batch_size", "2", "--max_steps", "3", "--logging_steps", "1", "--warmup_steps", "0",
    "--lr_scheduler_type", "constant", "--base_learning_rate", "3e-3", "--base_batch_size", "2",
    "--num_conversations", "60", "--eval_fraction", "0.1", "--train_sampling_strategy", "sequential",
    "--adam_epsilon", ADAM_EPSILON,  # the weights compare at 1e-5 (launch_harness.ADAM_EPSILON says why)
]
"""With the recipe's evaluation before training: it leaves the model in eval mode, which under CP once made the first
step count a micro-batch twice."""
CP_REQUESTS = {"flag": (["--cp_size", "2"], {}),
               "accelerate_yaml": ([], {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "2"})}


def _run(output_dir: str, extra: list[str], rank: int = 0) -> None:
    assert load_recipe().main([*FLAGS, *extra, "--output_dir", output_dir]) == 0


def _cp_ranks(rank, world_size, root: str) -> None:
    for name, (extra, env) in CP_REQUESTS.items():
        with mock.patch.dict(os.environ, env):
            _run(f"{root}/{name}", extra, rank)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The folder of the runs: ``one_process`` and one per way of asking for CP (``CP_REQUESTS``)."""
    root = tmp_path_factory.mktemp("runs")
    _run(str(root / "one_process"), ["--use_cpu", "true"])
    run_distributed(_cp_ranks, 2, str(root))
    return root


def test_the_rows_trained_have_odd_lengths(runs):
    """The case can fail: the rows of the 3 steps (sequential, one per micro-batch) include odd lengths."""
    from transformers import AutoTokenizer

    from hf_dist import data

    data_dir = runs / "one_process" / "data"
    train, _ = data.build_datasets(data_dir / "transcripts.jsonl", AutoTokenizer.from_pretrained(data_dir / "tokenizer"),
                                   max_seq_len=512, loss_on="assistant", eval_fraction=0.0, seed=0, packed=True)
    assert any(len(ids) % 2 for ids in train["input_ids"][:6])


@pytest.mark.parametrize("request_", list(CP_REQUESTS))
def test_recipe_packed_cp2_equals_one_process(runs, request_):
    layout = json.loads((runs / request_ / "summary.json").read_text())["layout"]  # rank 0 writes the summary
    assert layout.endswith("x CP2 (all-to-all attention)"), layout
    got, reference = launched_run(runs / request_), launched_run(runs / "one_process")
    assert len(got["losses"]) == len(reference["losses"]) == 3
    assert_parity(got, reference, what=f"CP2 ({request_})")


def test_collators_pad_to_a_multiple_of_cp_and_the_loss_is_unchanged():
    """One process: each collator's cp-padded batch gives the unpadded batch's loss (padding is labelled -100)."""
    from types import SimpleNamespace

    from hf_dist.models import build_tiny_model, tiny_llama_config

    from hf_dist import data

    model = build_tiny_model(tiny_llama_config(vocab_size=64, hidden_size=32, num_hidden_layers=2), seed=0)
    model.config.use_cache = False
    tok = SimpleNamespace(pad_token_id=0, padding_side="right", model_input_names=["input_ids", "attention_mask"])
    gen = torch.Generator().manual_seed(0)
    packed_rows = [data.packing.pack_rows([{"input_ids": torch.randint(1, 64, (n,), generator=gen).tolist()}
                                           for n in lengths]) for lengths in ((7, 5), (9,))]  # 12 and 9 tokens
    assert data.data_collator(tok, packed=True).pad_to_multiple_of is None
    for collator in (data.data_collator(tok, packed=True, cp_size=2),
                     data.data_collator(tok, packed=True, cp_size=3, pad_to_multiple_of=2)):
        batch = collator(packed_rows)
        assert batch["input_ids"].shape[1] % collator.pad_to_multiple_of == 0  # 14 and 12 (lcm 6): any cp slices
        unpadded = data.data_collator(tok, packed=True)(packed_rows)
        with torch.no_grad():
            assert_close(model(**batch).loss, model(**unpadded).loss, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match=r"cp_size=0 must be a positive integer"):
        data.data_collator(tok, cp_size=0)


def test_a_max_seq_len_the_padding_would_overrun_is_refused_before_anything_loads():
    from types import SimpleNamespace

    recipe = load_recipe()  # parse() calls this check; cp_size=2 arguments need 2 launched ranks, so it is called alone
    args = SimpleNamespace(layout=SimpleNamespace(cp=2))
    with pytest.raises(ValueError, match=r"--max_seq_len 999 with cp_size=2: .*would become 1000, longer than "
                                         r"--max_seq_len; use --max_seq_len 998 or 1000"):
        recipe.check_sequence_length(recipe.ScriptArguments(max_seq_len=999), args)
    recipe.check_sequence_length(recipe.ScriptArguments(max_seq_len=1024), args)
