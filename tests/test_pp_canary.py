"""The layout canary on 2 gloo ranks: it passes the real stages and stops deliberately wrong ones.

The wrong stages are the two ways the removed Llama re-implementation was wrong: a head that ends with
``lm_head(norm(h))`` (no logit scale, multiplier or soft-cap) and a full causal mask (no sliding window).
"""

from __future__ import annotations

import copy

import pytest

from dist_utils import run_distributed
from hf_dist.pipeline_parallel.stage_module import CausalLMStage


class OldHeadStage(CausalLMStage):
    """Last stage as the old module had it: ``lm_head`` on the base model's output, nothing after it (whole logits,
    so without the chunked loss)."""

    def __init__(self, model, fqns, **_chunked_loss):
        super().__init__(model, fqns)

    def forward(self, inputs, attention_mask=None, position_ids=None, labels=None):
        if not self.is_last:
            return super().forward(inputs, attention_mask, position_ids)
        kwargs = {"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": False}
        kwargs["inputs_embeds"] = inputs
        self._inbox.received = inputs
        try:
            hidden = self._lm.get_submodule(self.parts.base)(**kwargs).last_hidden_state
        finally:
            self._inbox.received = None
        return self._lm.lm_head(hidden)


class FullMaskStage(CausalLMStage):
    """Every stage builds a full causal mask, as the old module did (the sliding window is lost)."""

    def __init__(self, model, fqns, **kwargs):
        super().__init__(model, fqns, **kwargs)
        config = copy.deepcopy(self.config)
        config.sliding_window = None
        self._lm.get_submodule(self.parts.base).config = config  # the view's own attribute only


def _user_config(name: str):
    from transformers import AutoConfig

    return {
        "cohere": lambda: AutoConfig.for_model("cohere"),
        "granite": lambda: AutoConfig.for_model(
            "granite", embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
            attention_multiplier=0.0078,
        ),
        "gemma2": lambda: AutoConfig.for_model("gemma2", final_logit_softcapping=5.0),
        "mistral": lambda: AutoConfig.for_model("mistral", sliding_window=8),
    }[name]()


CASES = {"cohere": "OldHeadStage", "granite": "OldHeadStage", "gemma2": "OldHeadStage", "mistral": "FullMaskStage"}


def _canary(rank, world_size):
    from hf_dist import ParallelDims
    from hf_dist.pipeline_parallel import PipelineConfig
    from hf_dist.pipeline_parallel import pipeline as pipeline_module
    from hf_dist.pipeline_parallel.canary import check_pipeline_layout

    dims = ParallelDims(world_size=2, pp=2, dp_shard=1)
    dims.build_mesh("cpu")
    layout = PipelineConfig(schedule="1f1b", microbatches=4)
    results = {}
    for name, wrong in CASES.items():
        config = _user_config(name)
        check_pipeline_layout(config, dims, layout)  # the real stages pass (raises otherwise)
        pipeline_module.CausalLMStage = globals()[wrong]
        try:
            check_pipeline_layout(config, dims, layout)
            results[name] = None
        except ValueError as error:
            results[name] = str(error)
        finally:
            pipeline_module.CausalLMStage = CausalLMStage
    results["trainer"] = _through_dist_trainer(pipeline_module)
    return results


def _through_dist_trainer(pipeline_module):
    """DistTrainer runs the canary before training (refusing the wrong stage); ``layout_canary=False`` skips it."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from hf_dist import DistTrainer, DistTrainingArguments
    from hf_dist.models.twin import tiny_twin

    outcome = {}
    pipeline_module.CausalLMStage = OldHeadStage
    try:
        for canary in (True, False):
            model = AutoModelForCausalLM.from_config(tiny_twin(_user_config("cohere")))
            args = DistTrainingArguments(output_dir=tempfile.mkdtemp(), pp_size=2, use_cpu=True, report_to=[],
                                         per_device_train_batch_size=1, pp_microbatches=4, layout_canary=canary)
            try:
                DistTrainer(model=model, args=args)
                outcome[canary] = "built"
            except ValueError as error:
                outcome[canary] = str(error)
    finally:
        pipeline_module.CausalLMStage = CausalLMStage
    return outcome


@pytest.fixture(scope="module")
def canary_run():
    return run_distributed(_canary, 2, timeout_s=600)


@pytest.mark.parametrize("name", list(CASES))
def test_canary_stops_a_wrong_stage_on_every_rank(canary_run, name):
    for rank in (0, 1):
        message = canary_run[rank][name]
        assert message is not None, f"{name}: the canary let {CASES[name]} through on rank {rank}"
        assert f"model_type={name!r}" in message and "pp=2" in message and "schedule=1f1b" in message
        assert "loss differs by" in message and "layout_canary=False" in message


def test_dist_trainer_runs_the_canary_and_the_flag_skips_it(canary_run):
    for rank in (0, 1):
        outcome = canary_run[rank]["trainer"]
        assert outcome[True].startswith("layout canary: pp=2") and "model_type='cohere'" in outcome[True]
        assert outcome[False] == "built"  # --layout_canary false: the (deliberately wrong) stages are trusted
