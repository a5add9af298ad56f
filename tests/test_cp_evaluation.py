"""``DistTrainer.evaluate()`` under context parallelism: the evaluation loss one process reports.

A tiny qwen3_moe (``parity.tiny_config``, router aux loss on at coefficient 0.5, so the aux term is a visible part
of the loss) and the TP sweep's non-default Llama, loaded from disk as users load theirs, evaluate their initial
weights on 10 rows whose label counts differ (right padding, labels -100; batches of 2, the last step's batch
only on the first dp rank): ``cp_size=2`` (the Trainer's default token averaging, the per-device count, FSDP2) on 2
gloo ranks in one spawn, and ``dp=2 x cp=2`` (and EP=2 x CP=2 for the MoE) on 4 ranks in another. Each rank's
``eval_loss`` equals one process's ``trainer.evaluate()`` on the same rows within 1e-5: each batch's own loss (the
model's, aux term once), whatever the data-parallel ranks and the cp ranks, which evaluate the whole sequence.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from parity import masked_batches, tiny_config, tiny_model
from trainer_harness import VOCAB, evaluate_tiny

AUX = 0.5
ROWS, SEQ, BATCH = 10, 16, 2
FSDP2 = dict(fsdp="full_shard", fsdp_config={"version": 2})
TWO_RANKS = {"cp2": dict(cp_size=2), "cp2_tokens_per_device": dict(cp_size=2, average_tokens_across_devices=False),
             "cp2_fsdp2": dict(cp_size=2, **FSDP2)}
FOUR_RANKS = {"dp2_cp2": dict(cp_size=2), "dp2_cp2_fsdp2": dict(cp_size=2, **FSDP2),
              "ep2_cp2": dict(cp_size=2, ep_size=2)}
MODELS = ("qwen3_moe", "llama")
MOE_ONLY = ("ep2_cp2",)
"""EP holds experts: the MoE only."""


def _cases(layouts: dict) -> list[tuple[str, str]]:
    return [(name, layout) for name in MODELS for layout in layouts if name == "qwen3_moe" or layout not in MOE_ONLY]


def _config(name: str, aux: float = AUX):
    config = tiny_config(name, "cp" if name == "qwen3_moe" else "tp")
    config.vocab_size = VOCAB
    if name == "qwen3_moe":
        assert config.output_router_logits
        config.router_aux_loss_coef = aux
    return config


def eval_rows() -> list[dict]:
    """Rows of 16, 11, 8, 15, 13, 8, 5, 12, 10 and 5 tokens: batches of 2 weigh differently by tokens than one
    by one, and the fifth batch has no partner on the second dp rank."""
    batch = masked_batches(VOCAB, SEQ, 1, rows=ROWS)[0]
    return [{key: value[i] for key, value in batch.items()} for i in range(ROWS)]


def _evaluate(name: str, output_dir: str, aux: float = AUX, **layout) -> tuple[float, tuple[int, int, int]]:
    """The evaluation loss and the run's ``(dp, cp, ep)``."""
    loss, trainer = evaluate_tiny(output_dir, tiny_model(_config(name, aux), loaded=True), eval_rows(),
                                  per_device_eval_batch_size=BATCH, **layout)
    return loss, (trainer.dims.dp, trainer.dims.cp, trainer.dims.ep)


def _ranks(rank, world_size, root, layouts):
    return {(name, layout): _evaluate(name, f"{root}/{name}-{layout}", **layouts[layout])
            for name, layout in _cases(layouts)}


def _check(results: list[dict], one_process: dict, name: str, layout: str, dims: tuple[int, int, int]) -> None:
    assert [result[(name, layout)][1] for result in results] == [dims] * len(results)
    got = [result[(name, layout)][0] for result in results]
    torch.testing.assert_close(got, [one_process[name]] * len(results), atol=1e-5, rtol=0,
                               msg=lambda m: f"{name} {layout}: {m}")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_eval_one")
    return {name: _evaluate(name, str(root / name))[0] for name in MODELS}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_distributed(_ranks, 2, str(tmp_path_factory.mktemp("cp_eval_2")), TWO_RANKS)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_distributed(_ranks, 4, str(tmp_path_factory.mktemp("cp_eval_4")), FOUR_RANKS)


@pytest.mark.parametrize(("name", "layout"), _cases(TWO_RANKS))
def test_cp_evaluates_as_one_process(two_ranks, one_process, name, layout):
    _check(two_ranks, one_process, name, layout, dims=(1, 2, 1))


@pytest.mark.parametrize(("name", "layout"), _cases(FOUR_RANKS))
def test_dp_cp_evaluates_as_one_process(four_ranks, one_process, name, layout):
    _check(four_ranks, one_process, name, layout, dims=(2, 2, 2 if layout == "ep2_cp2" else 1))


def test_the_aux_term_is_in_the_evaluation_loss(one_process, tmp_path):
    """The comparison can fail on the aux term: without it the MoE's evaluation loss moves far beyond 1e-5."""
    without, _ = _evaluate("qwen3_moe", str(tmp_path), aux=0.0)
    assert abs(one_process["qwen3_moe"] - without) > 1e-2, (one_process["qwen3_moe"], without)
