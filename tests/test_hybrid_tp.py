"""Pure checks of the hybrid TP overlays (hf_dist/tensor_parallel/hybrid.py): the sizes they split are checked
before launch, and what they cannot shard exactly is refused by name. Parity itself: tests/test_tp_sweep.py."""

from __future__ import annotations

import importlib.util

import pytest
from transformers import AutoConfig

from hf_dist.tensor_parallel import check_tp_sizes
from hf_dist.tensor_parallel.support import tp_refusal
from pp_sweep_cases import HYBRID


def _config(name: str, **changes):
    model_type, values = HYBRID[name]
    return AutoConfig.for_model(model_type, **{**values, **changes})


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("qwen3_5_text:deltanet", {"linear_num_key_heads": 1, "linear_num_value_heads": 3},
         "tp=2 does not divide.*linear_num_key_heads=1, linear_num_value_heads=3"),
        ("falcon_h1:mamba2", {"mamba_n_groups": 1}, "tp=2 does not divide.*mamba_n_groups=1"),
        ("bamba:mamba2", {"mamba_n_groups": 1}, "tp=2 does not divide.*mamba_n_groups=1"),
        ("lfm2:conv", {"hidden_size": 33, "num_attention_heads": 3, "num_key_value_heads": 3},
         r"tp=2 does not divide.*hidden_size \(short-conv channels\)=33"),
    ],
)
def test_sizes_the_overlays_split_are_checked_before_launch(name, changes, message):
    with pytest.raises(ValueError, match=message):
        check_tp_sizes(_config(name, **changes), 2)


def test_every_hybrid_case_is_accepted_at_tp2():
    for name in ("qwen3_5_text:deltanet", "lfm2:conv", "falcon_h1:mamba2", "bamba:mamba2"):
        check_tp_sizes(_config(name), 2)


def test_fused_mamba_kernel_is_refused(monkeypatch):
    """With mamba_ssm installed the fused training path applies out_proj.weight whole: refused, not wrong."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "mamba_ssm" else real(n, *a))
    assert "mamba_ssm is installed" in tp_refusal(_config("falcon_h1:mamba2"))
    assert tp_refusal(_config("lfm2:conv")) is None  # no Mamba2 mixer: unaffected
