"""The PP coverage sweep: every pipeline-proven dense, classic and hybrid model type trains with PP=2 exactly as
one process.

For each case (``parity.tiny_config(case, "pp")``: a tiny config with non-default values of every field read outside
the decoder layers, see ``pp_sweep_cases``; hybrids and the named cases written out there) two gloo ranks train 3
fp32 steps with the 1F1B schedule over 4 micro-batches of fresh padded rows (``parity.pipelined_run``: plain SGD with
clipping active on every step, ``parity.PP_SGD``, so the global norm across the stages matters), and the harness's
one process trains the same model on the whole batch (``parity.reference_run``; each rank runs half the cases'
references once its pipelines are done). ``parity.assert_parity`` holds losses and gradient norms on every rank, the
first step's gradients of every parameter (each rank's stages, a tied weight under both names) and every parameter
after the last step (rank 0's gathered state) to 1e-5; every case's gradient norm must stay above ``max_norm``.
Several architectures share one spawned group. ``PIPELINE_PROVEN_MODEL_TYPES`` (the registry's PP-proven types) must
be exactly the model types proven here, so support is never claimed without this test.
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from dist_utils import run_distributed
from parity import PP_SGD, assert_parity, cases, masked_batches, pipelined_run, reference_run, tiny_config, tiny_model
from pp_sweep_cases import HYBRID, NAMED, SEQ, hybrid_config, named_config, non_default_config

STEPS, MICROBATCHES = 3, 4


def _cases() -> list[str]:
    """Generic cases for dense types, written-out cases for hybrids (``tiny_twin`` does not shrink their layers)."""
    return list(cases("pp")["tests/test_pp_sweep.py"])


def _steps(config) -> list[dict]:
    return masked_batches(config.vocab_size, SEQ, STEPS)


def _reference(case: str) -> dict:
    """The harness's one process on the whole batch of every step, first-step gradients kept."""
    config = tiny_config(case, "pp")
    return reference_run(tiny_model(config), [[batch] for batch in _steps(config)], PP_SGD, grads=True)


def _sweep(rank, world_size, cases):
    """Each case's ``pipelined_run`` on this rank (its stages' first-step gradients; the gathered state on rank 0),
    then every other case's one-process reference (the two ranks share that work, with each model's code imported)."""
    from hf_dist import ParallelDims
    from hf_dist.pipeline_parallel import PipelineConfig, PipelinedCausalLM

    dims = ParallelDims(world_size=2, pp=2, dp_shard=1)
    dims.build_mesh("cpu")
    runs = {}
    for case in cases:
        config = tiny_config(case, "pp")
        pipe = PipelinedCausalLM(tiny_model(config), dims=dims,
                                 config=PipelineConfig(schedule="1f1b", microbatches=MICROBATCHES))
        runs[case] = pipelined_run(pipe, _steps(config), PP_SGD, grads=True)
    return {"runs": runs, "refs": {case: _reference(case) for case in cases[rank::world_size]}}


def _compare(case: str, runs: list[dict], ref: dict) -> str | None:
    """None where ``case``'s pipeline (``runs``: per rank) equals one process on every rank, else the message."""
    if min(ref["norms"]) <= PP_SGD.max_norm:
        return f"{case}: clipping inactive (norms {ref['norms']}, max_norm {PP_SGD.max_norm})"
    # each rank holds its own stages' gradients; losses and the global norm reach every rank; rank 0 the state
    grads = {name: grad for run in runs for name, grad in run["grads"].items()}
    try:
        for rank, run in enumerate(runs):
            assert_parity(runs[0] | {"grads": grads, "losses": run["losses"], "norms": run["norms"]}, ref,
                          config=tiny_config(case, "pp"), what=f"{case}, rank {rank}")
        assert all(run["state"] is None for run in runs[1:]), f"{case}: state off rank 0"
    except AssertionError as error:
        return str(error)
    return None


GROUPS = 3


@pytest.fixture(scope="module", params=range(GROUPS), ids=lambda i: f"group{i}")
def sweep_group(request):
    cases = _cases()[request.param :: GROUPS]
    return cases, run_distributed(_sweep, 2, cases, timeout_s=900)


def test_pp2_matches_one_process(sweep_group):
    cases, results = sweep_group
    refs = {case: ref for result in results for case, ref in result["refs"].items()}
    assert set(refs) == set(cases) and all(set(result["runs"]) == set(cases) for result in results)
    errors = {case: _compare(case, [result["runs"][case] for result in results], refs[case]) for case in cases}
    assert {case: error for case, error in errors.items() if error} == {}


def test_sweep_configs_are_non_default():
    """The named cases hold what the issue names; the generic cases move every field they have."""
    granite = named_config("granite:multipliers")
    assert (granite.embedding_multiplier, granite.logits_scaling) == (12.0, 8.0)
    assert named_config("mistral:window8").sliding_window == 8 < SEQ
    gemma2 = non_default_config("gemma2")
    assert gemma2.final_logit_softcapping == 5.0 and gemma2.sliding_window == 8
    assert "full_attention" in gemma2.layer_types and "sliding_attention" in gemma2.layer_types
    assert non_default_config("cohere").logit_scale == 0.5


def test_support_claims_only_what_the_sweep_proves():
    from transformers import AutoConfig

    from hf_dist.pipeline_parallel.support import (
        PIPELINE_PROVEN_HYBRID_TYPES,
        PIPELINE_PROVEN_MODEL_TYPES,
        PIPELINE_PROVEN_MOE_TYPES,
        pipeline_coverage,
        pipeline_refusal,
    )
    from pp_sweep_cases import MOE

    moe_by_default = {"qwen3_next"}  # proven dense (num_experts=0); its default config is MoE and refused as such
    for model_type in PIPELINE_PROVEN_MODEL_TYPES - moe_by_default:
        assert pipeline_refusal(AutoConfig.for_model(model_type)) is None, model_type
    for model_type in moe_by_default:
        assert "mixture-of-experts" in pipeline_refusal(AutoConfig.for_model(model_type))
    for _, (model_type, _) in NAMED.items():
        assert model_type in PIPELINE_PROVEN_MODEL_TYPES, model_type
    assert {model_type for model_type, _ in HYBRID.values()} == set(PIPELINE_PROVEN_HYBRID_TYPES)
    for name in HYBRID:
        assert pipeline_refusal(hybrid_config(name)) is None, name
    table = pipeline_coverage()
    assert set(MOE) == set(PIPELINE_PROVEN_MOE_TYPES)  # each trained by tests/test_pp_moe.py
    for model_type in PIPELINE_PROVEN_MOE_TYPES:
        assert pipeline_refusal(AutoConfig.for_model(model_type)) is None, model_type
    # an alias type builds its proven type's config (gpt-sw3 is a GPT-2): judged as that type
    yes = {AutoConfig.for_model(t).model_type for t, status in table.items() if status == "yes"}
    assert yes == (set(PIPELINE_PROVEN_MODEL_TYPES) - moe_by_default) | set(PIPELINE_PROVEN_MOE_TYPES)


def test_hybrid_refusals_name_the_reason():
    """Bamba's z-loss and Zamba2's shared blocks are refused by name, before any process starts."""
    from hf_dist.pipeline_parallel.support import check_pipeline_support

    _, values = HYBRID["bamba:mamba2"]
    with pytest.raises(ValueError, match="z_loss_coefficient=0.1"):
        check_pipeline_support(AutoConfig.for_model("bamba", **{**values, "z_loss_coefficient": 0.1}))
    with pytest.raises(ValueError, match="zamba2.*shared attention blocks"):
        check_pipeline_support(AutoConfig.for_model("zamba2"))
