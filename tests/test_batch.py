"""The global-batch contract, LR scaling and the `hf-dist batch` CLI (pure)."""

import math
import subprocess
import sys

import pytest

from hf_dist.batch import BatchContract, nearest_valid_global_batches, scale_learning_rate
from hf_dist.cli import main


def test_harbor_contract():
    c = BatchContract(
        world_size=8, global_batch_size=64, micro_batch_size=1, seq_len=4096,
        base_learning_rate=2e-5, base_batch_size=32, lr_scaling="linear",
    )
    assert c.dp == 8 and c.gradient_accumulation_steps == 8
    assert c.learning_rate == pytest.approx(4e-5)
    assert c.tokens_per_step == 64 * 4096
    assert "64 = 1 x 8 x 8" in c.table()


def test_tp_and_pp_ranks_are_not_data_parallel():
    c = BatchContract(world_size=16, global_batch_size=64, micro_batch_size=2, tp=4, pp=2)
    assert c.dp == 2 and c.gradient_accumulation_steps == 16


@pytest.mark.parametrize(
    "rule,expected", [("none", 2e-5), ("linear", 4e-5), ("sqrt", 2e-5 * math.sqrt(2))]
)
def test_lr_scaling_rules(rule, expected):
    assert scale_learning_rate(2e-5, 32, 64, rule) == pytest.approx(expected)


def test_unknown_rule():
    with pytest.raises(ValueError, match="lr_scaling='cubic'"):
        scale_learning_rate(1e-3, 32, 64, "cubic")


def test_indivisible_global_batch_names_the_numbers_and_the_nearest():
    with pytest.raises(ValueError) as err:
        BatchContract(world_size=8, global_batch_size=60, micro_batch_size=1)
    message = str(err.value)
    assert "global_batch_size=60" in message and "micro_batch_size=1" in message and "8" in message
    assert "[56, 64]" in message
    assert nearest_valid_global_batches(60, 1, 8) == [56, 64]


def test_tp_pp_must_divide_world():
    with pytest.raises(ValueError, match="does not divide world_size=6"):
        BatchContract(world_size=6, global_batch_size=8, micro_batch_size=1, tp=4)


def test_resized_keeps_the_global_batch():
    c = BatchContract(world_size=8, global_batch_size=64, micro_batch_size=1)
    r = c.resized(4)
    assert r.global_batch_size == 64 and r.gradient_accumulation_steps == 16
    with pytest.raises(ValueError):
        c.resized(3)  # 64 is not a multiple of 3


def test_cli_prints_the_table(capsys):
    assert main(["batch", "--world-size", "8", "--global-batch", "64", "--micro-batch", "1",
                 "--base-lr", "2e-5", "--base-batch", "32", "--lr-scaling", "linear"]) == 0
    out = capsys.readouterr().out
    assert "gradient accumulation   8" in out and "4e-05" in out


def test_cli_entry_point_fails_with_the_numbers():
    proc = subprocess.run(
        [sys.executable, "-m", "hf_dist.cli", "batch", "--world-size", "8", "--global-batch", "60", "--micro-batch", "1"],
        capture_output=True, text=True,
    )
    assert proc.returncode != 0
    assert "60" in proc.stderr and "micro_batch_size=1" in proc.stderr and "8" in proc.stderr
