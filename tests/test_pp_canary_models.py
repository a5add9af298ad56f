"""The layout canary on the model types it refused or crashed on (issue 27, cases 3-5), on 2 gloo ranks, PP=2.

- MoE with the router aux loss (qwen3_moe, mixtral, gpt_oss: the harness's PP cases, ``parity.tiny_config``, aux on
  at coefficient 5):
  the pipeline weighs each micro-batch's aux (``coef x mean over micro-batches``, as the model, the Trainer and
  tests/test_pp_moe.py do), so the canary's reference must too (``hf_dist.models.reference``); with the aux over
  the whole batch it refused these correct pipelines. A pipeline weighing ``coef x sum`` (the Trainer's old
  accumulation bug) is still refused, and the whole-batch definition differs from the run's by far more than
  the canary's limit (so a reference with it cannot pass).
- deepseek_v3 (multi-head latent attention, ``num_key_value_heads`` at its default 128): the canary crashed in sdpa.
- 2-layer models with explicit ``layer_types`` (gpt_oss, qwen3_5_text, lfm2): the canary's 4-layer twin crashed.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from dist_utils import run_distributed
from hf_dist.models.reference import reference_step, split_rows
from hf_dist.pipeline_parallel.pipeline import PipelinedCausalLM
from parity import tiny_config

MOE = ("qwen3_moe", "mixtral", "gpt_oss")
DEEPSEEK = {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
            "first_k_dense_replace": 1, "moe_intermediate_size": 16, "num_attention_heads": 4}


def user_config(name: str):
    """The configs of the issue: the MoE types' PP parity cases (``parity.tiny_config``: aux loss on), the others as
    a user writes them (the canary shrinks them to its twin)."""
    from transformers import AutoConfig

    kind, _, variant = name.partition(":")
    if kind == "moe":
        config = tiny_config(variant, "pp")
        assert config.output_router_logits and config.router_aux_loss_coef >= 1, variant  # the aux term matters
        return config
    if kind == "deepseek_v3":
        hidden, layers = {"h64l4": (64, 4), "h32l2": (32, 2)}[variant]
        return AutoConfig.for_model("deepseek_v3", hidden_size=hidden, num_hidden_layers=layers, **DEEPSEEK)
    types = {"gpt_oss": None, "qwen3_5_text": ["linear_attention", "full_attention"], "lfm2": ["conv", "full_attention"]}
    extra = {"layer_types": types[variant]} if types[variant] else {"num_local_experts": 4, "num_experts_per_tok": 2}
    return AutoConfig.for_model(variant, num_hidden_layers=2, **extra)


PASSING = [f"moe:{t}" for t in MOE] + ["deepseek_v3:h64l4", "deepseek_v3:h32l2"] + [
    f"layers2:{t}" for t in ("gpt_oss", "qwen3_5_text", "lfm2")]


class SummedAuxPipeline(PipelinedCausalLM):
    """Weighs the router aux ``coef x sum`` over micro-batches instead of the mean (the accumulation bug the
    Trainer had): the canary must still stop it."""

    def train_step(self, batch, *, microbatches=None):
        self.router_aux_coef *= microbatches or self.config.microbatches
        try:
            return super().train_step(batch, microbatches=microbatches)
        finally:
            self.router_aux_coef /= microbatches or self.config.microbatches


def _outcome(config, dims, layout) -> str | None:
    from hf_dist.pipeline_parallel.canary import check_pipeline_layout

    try:
        check_pipeline_layout(config, dims, layout)
        return None
    except Exception as error:  # noqa: BLE001 - a crash is reported as the test's failure, with its message
        return f"{type(error).__name__}: {error}"


def _canary(rank, world_size):
    from hf_dist import ParallelDims
    from hf_dist.pipeline_parallel import PipelineConfig
    from hf_dist.pipeline_parallel import pipeline as pipeline_module

    dims = ParallelDims(world_size=2, pp=2, dp_shard=1)
    dims.build_mesh("cpu")
    layout = PipelineConfig(schedule="1f1b", microbatches=4)
    results = {name: _outcome(user_config(name), dims, layout) for name in PASSING}
    pipeline_module.PipelinedCausalLM = SummedAuxPipeline
    try:
        for name in MOE:
            results[f"summed:{name}"] = _outcome(user_config(f"moe:{name}"), dims, layout)
    finally:
        pipeline_module.PipelinedCausalLM = PipelinedCausalLM
    return results


@pytest.fixture(scope="module")
def canary_run():
    return run_distributed(_canary, 2, timeout_s=900)


@pytest.mark.parametrize("name", PASSING)
def test_canary_passes_a_correct_pipeline(canary_run, name):
    for rank in (0, 1):
        assert canary_run[rank][name] is None, f"rank {rank}: {canary_run[rank][name]}"


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_canary_refuses_an_aux_summed_over_micro_batches(canary_run, model_type):
    for rank in (0, 1):
        message = canary_run[rank][f"summed:{model_type}"]
        assert message is not None and message.startswith("ValueError: layout canary: pp=2"), message
        assert f"model_type={model_type!r}" in message and "loss differs by" in message


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_whole_batch_aux_is_a_different_loss(model_type):
    """One process: the run's definition (aux per micro-batch) and the whole-batch one differ by far more than
    the canary's loss limit, and the language-model part alone does not depend on the split."""
    from transformers import AutoModelForCausalLM

    from hf_dist.models.twin import tiny_twin
    from hf_dist.pipeline_parallel.canary import LOSS_ATOL, _twin_batch

    twin = tiny_twin(user_config(f"moe:{model_type}"))
    batch = _twin_batch(4, twin.vocab_size)
    losses = {}
    for split, aux in ((4, True), (1, True), (4, False), (1, False)):
        torch.manual_seed(0)
        losses[split, aux] = reference_step(AutoModelForCausalLM.from_config(twin).float(), split_rows(batch, split),
                                            aux=aux)
    assert_close(losses[4, False], losses[1, False], atol=1e-6, rtol=0)
    assert abs(losses[4, True] - losses[1, True]) > 20 * LOSS_ATOL
