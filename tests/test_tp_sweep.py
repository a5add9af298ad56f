"""TP coverage sweep: every model type hf_dist supports for tensor parallelism equals one process at TP=2,
and every dense causal-LM type with a plan is either supported or refused by name before anything runs.

One 2-rank spawn runs all supported model types through the parity harness (``tp_sweep_run.compare``): each type's
tiny config with non-default values (``parity.tiny_config(case, "tp")``), the model loaded from disk as users load
theirs, fresh right-padded rows every step (``masked_batches``), 3 plain SGD steps with clipping active (``TP_SGD``),
fp32; ``assert_parity``: losses, gradient norms, the first step's gradients and every parameter after the steps within
1e-5 of one process (``reference_run``).
"""

from __future__ import annotations

import tempfile

import pytest

from dist_utils import spawn_once
from hf_dist.tensor_parallel.support import TP_TESTED_MODEL_TYPES, TP_TESTED_MOE_TYPES, tp_refusal
from parity import cases
from tp_sweep_cases import TP_VARIANTS, VARIANTS, dense_plan_types, sweep_config
from tp_sweep_run import sweep_rank

SWEEP_TYPES = list(cases("tp")["tests/test_tp_sweep.py"])
"""The registry's TP-proven dense, classic and hybrid types, and the variants TP must run (``TP_VARIANTS``)."""


def _sweep() -> list[dict]:
    """The one spawn's per-rank results (its failure raised again by every test, not rerun)."""
    with tempfile.TemporaryDirectory() as output_dir:  # used by the first call only
        return spawn_once("tp_sweep", sweep_rank, 2, SWEEP_TYPES, output_dir, timeout_s=900)


@pytest.mark.parametrize("model_type", SWEEP_TYPES)
def test_tp2_equals_one_process(model_type):
    for rank, by_type in enumerate(_sweep()):
        result = by_type[model_type]
        assert not isinstance(result, dict), f"rank {rank} refused a supported type: {result['refused']}"
        assert result is None, f"rank {rank}: {result}"


def test_dist_trainer_refuses_an_unsupported_type_before_touching_it():
    for by_type in _sweep():
        message = by_type["trainer_refusal"]["message"]
        assert "model_type='xglm': transformers ships no base_model_tp_plan" in message, message
        assert message.endswith("[model untouched: True]"), message


REFUSED_VARIANTS = {
    "falcon:mqa": "num_key_value_heads=1 is not divisible by tp=2",
    "falcon:alibi": "model_type='falcon': alibi=True",
    "bloom:slow_but_exact": "model_type='bloom': slow_but_exact=True with pretraining_tp=2",
    "gpt_bigcode:mqa": "num_key_value_heads=1 is not divisible by tp=2",
    "stablelm:qk_layernorm": "model_type='stablelm': qk_layernorm=True keeps one LayerNorm per head",
    "codegen": "model_type='codegen': its qkv_proj packs q, v and k in blocks of a hard-coded mp_num=4",
}


@pytest.mark.parametrize("case", sorted(REFUSED_VARIANTS))
def test_variants_tp_cannot_reproduce_are_refused_by_name_before_launch(case):
    from hf_dist.tensor_parallel import check_tp_sizes

    assert case in VARIANTS and case not in TP_VARIANTS
    with pytest.raises(ValueError, match=REFUSED_VARIANTS[case]):
        check_tp_sizes(sweep_config(case), 2)


def test_the_sweep_is_large_enough():
    assert len(SWEEP_TYPES) >= 30


@pytest.mark.parametrize("model_type", dense_plan_types())
def test_every_type_with_a_plan_is_supported_or_refused_by_name(model_type):
    try:
        config = sweep_config(model_type)
    except Exception:  # a config class that needs more than sizes: decide on its defaults
        from transformers import AutoConfig

        config = AutoConfig.for_model(model_type)
    reason = tp_refusal(config)
    if model_type in TP_TESTED_MODEL_TYPES | TP_TESTED_MOE_TYPES:
        assert reason is None, reason
    else:
        assert reason, f"{model_type} neither supported nor refused"
