"""TP coverage sweep: every model type hf_dist supports for tensor parallelism equals one process at TP=2,
and every dense causal-LM type with a plan is either supported or refused by name before anything runs.

One 2-rank spawn runs all supported model types (tiny configs with non-default values, ``tp_sweep_cases``):
3 SGD steps, fp32, loss, logits and every gradient (every step) within 1e-5 of one process.
"""

from __future__ import annotations

import functools
import tempfile

import pytest

from dist_utils import run_distributed
from hf_dist.tensor_parallel.support import TP_TESTED_MODEL_TYPES, TP_TESTED_MOE_TYPES, tp_refusal
from parity import cases
from tp_sweep_cases import TP_VARIANTS, VARIANTS, dense_plan_types, sweep_config
from tp_sweep_run import sweep_rank

TOL = 1e-5
SWEEP_TYPES = list(cases("tp")["tests/test_tp_sweep.py"])
"""The registry's TP-proven dense, classic and hybrid types, and the variants TP must run (``TP_VARIANTS``)."""


@functools.lru_cache(maxsize=None)
def _sweep() -> list[dict]:
    with tempfile.TemporaryDirectory() as output_dir:
        return run_distributed(sweep_rank, 2, SWEEP_TYPES, output_dir, timeout_s=900)


@pytest.mark.parametrize("model_type", SWEEP_TYPES)
def test_tp2_equals_one_process(model_type):
    for rank, by_type in enumerate(_sweep()):
        result = by_type[model_type]
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert "refused" not in result, f"rank {rank} refused a supported type: {result.get('refused')}"
        for what in ("loss", "logits", "grads"):
            assert result[what] <= TOL, f"rank {rank} {model_type}: {what} differs by {result[what]:.3g}"


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
