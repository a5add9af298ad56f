"""Straggler detection, busy time and DDP all-reduce wait (2 gloo ranks, one made slow), and the JSONL log."""

import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dist_utils import run_distributed
from hf_dist.report import LOG_FILE, LogHistoryCallback
from hf_dist.trainer.throughput import ThroughputMeter, find_stragglers

SLEEP_S = 0.2  # injected into rank 1's every micro step, before backward


def test_find_stragglers_uses_the_median():
    assert find_stragglers([1.0, 1.0, 1.0, 1.3]) == [3]
    assert find_stragglers([1.0, 1.1, 1.0, 1.19]) == []
    assert find_stragglers([1.0, 1.6]) == [1]  # 2 ranks: the median is the mean, so 1.5 x the other rank
    assert find_stragglers([5.0]) == []


def test_warning_once_per_occurrence():
    meter = ThroughputMeter(flops=None, model_parallel=1, peak_flops=None)
    for busy in ([1.0, 1.0, 2.0], [1.0, 1.0, 2.0], [1.0, 1.0, 1.0], [1.0, 1.0, 2.0], [3.0, 1.0, 2.0]):
        meter._warn_new_stragglers(busy, sorted(busy)[1])
    assert [m.split(" is busy")[0] for m in meter.warnings] == [
        "straggler: rank 2", "straggler: rank 2", "straggler: rank 0"
    ]


def _slow_rank_run(rank, world_size):
    import torch

    from hf_dist import DistTrainer, DistTrainingArguments
    from hf_dist.models import build_tiny_model
    from trainer_harness import VOCAB, token_dataset

    class SlowRankTrainer(DistTrainer):
        def compute_loss(self, *args, **kwargs):
            if rank == 1:
                time.sleep(SLEEP_S)
            return super().compute_loss(*args, **kwargs)

    with tempfile.TemporaryDirectory() as out:
        args = DistTrainingArguments(
            output_dir=out, max_steps=3, global_batch_size=8, per_device_train_batch_size=2, logging_steps=1,
            save_strategy="no", report_to=[], seed=0, disable_tqdm=True, dataloader_num_workers=0,
            learning_rate=1e-3, dist_logging=True,
        )
        model = build_tiny_model(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2)
        trainer = SlowRankTrainer(model=model, args=args, train_dataset=token_dataset())
        trainer.train()
        jsonl = Path(out, LOG_FILE)
        records = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else None
    return {
        "num_processes": trainer.accelerator.num_processes,
        "ddp": isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel),
        "logs": [log for log in trainer.state.log_history if "loss" in log],
        "warnings": trainer.throughput.warnings,
        "jsonl": records,
    }


@pytest.fixture(scope="module")
def slow_rank_results():
    return run_distributed(_slow_rank_run, 2)


def test_slow_rank_is_flagged_once_by_the_main_process(slow_rank_results):
    main, other = slow_rank_results
    assert main["num_processes"] == 2 and main["ddp"]
    assert len(main["warnings"]) == 1 and main["warnings"][0].startswith("straggler: rank 1 ")
    assert other["warnings"] == []  # printed by the main process only
    assert len(main["logs"]) == 3
    for log in main["logs"]:
        assert log["straggler_ratio"] > 1.2
        assert log["busy_seconds/rank1"] >= SLEEP_S


def test_busy_time_excludes_the_all_reduce_wait(slow_rank_results):
    # rank 0 reaches the all-reduce ~2 x SLEEP_S before rank 1 at every sync step (2 micro steps per step);
    # counted as busy, its time would equal rank 1's. The wait is the mean of both ranks' per-micro-step waits.
    for log in slow_rank_results[0]["logs"]:
        assert log["busy_seconds/rank0"] < 0.5 * log["busy_seconds/rank1"]
        assert log["comm_wait_seconds"] >= 0.5 * SLEEP_S * 0.8


def test_main_process_writes_the_log_history_jsonl(slow_rank_results):
    main, other = slow_rank_results
    assert other["jsonl"] is None  # each rank has its own tmp dir: only the main process wrote one
    steps = [r["step"] for r in main["jsonl"] if "loss" in r]
    assert steps == [1, 2, 3]
    assert all("tokens_per_second" in r and "peak_memory_gb/rank1" in r for r in main["jsonl"] if "loss" in r)


def test_log_history_keeps_this_runs_lines_and_a_resumes_earlier_steps(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path))
    path = tmp_path / LOG_FILE

    def state(step):
        return SimpleNamespace(is_world_process_zero=True, global_step=step)

    def lines():
        return [json.loads(line) for line in path.read_text().splitlines()]

    path.write_text('{"loss": 9.0, "step": 1}\n{"loss": 8.0, "step": 2}\n{"loss": 7.0, "step": 3}\n')
    resumed = LogHistoryCallback()
    resumed.on_log(args, state(0), None, logs={"before_loss": 5.0})  # evaluate() before train()
    resumed.on_train_begin(args, state(2), None)  # resumed from checkpoint-2: the old run's step 3 goes
    resumed.on_log(args, state(3), None, logs={"loss": 1.5})
    assert lines() == [{"loss": 9.0, "step": 1}, {"loss": 8.0, "step": 2}, {"before_loss": 5.0, "step": 0},
                       {"loss": 1.5, "step": 3}]

    fresh = LogHistoryCallback()
    fresh.on_train_begin(args, state(0), None)  # a new run in the same directory starts the file anew
    fresh.on_log(args, state(1), None, logs={"loss": 3.0})
    assert lines() == [{"loss": 3.0, "step": 1}]
