"""Checkpoints stored under other names than the model's: transformers' renaming rules apply to the streaming load.

Checkpoints nobody here wrote in the model's in-memory form: a bare ``LlamaModel`` saved without the ``model.``
prefix (tied embeddings, so it is a whole causal LM), which must stream like any other; and a Mixtral and a
Qwen2-MoE (the parity harness's EP cases: router aux loss on, a sliding window, Qwen2-MoE's shared expert and dense
first layer), which transformers 5 saves one tensor per expert and assembles while loading: ``hf_dist.from_pretrained``
must stream them too (transformers' converter builds one expert tensor at a time, no fallback warning) and equal
transformers' ``from_pretrained`` plus the same layout, shard for shard. One 2-rank spawn runs all of them.
An hrm_text checkpoint, whose fused tensors transformers *splits*, is the one kind left to transformers' loader.
"""

from __future__ import annotations

import logging

import pytest
import torch

from parity import tiny_config
from tests.dist_utils import run_distributed
from tests.test_loading import BATCH, SEQ, VOCAB, _args, _case, _check, _local_state, _logits, loading_config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    tied = AutoModelForCausalLM.from_config(loading_config("llama", tied=True), dtype=torch.float32)
    bare = tmp_path_factory.mktemp("bare")
    tied.model.save_pretrained(bare)  # keys without the "model." prefix
    mixtral = tmp_path_factory.mktemp("mixtral")
    AutoModelForCausalLM.from_config(tiny_config("mixtral", "ep"), dtype=torch.float32).save_pretrained(mixtral)
    qwen2_moe = tmp_path_factory.mktemp("qwen2_moe")
    AutoModelForCausalLM.from_config(tiny_config("qwen2_moe", "ep"), dtype=torch.float32).save_pretrained(qwen2_moe)
    return {"bare": str(bare), "mixtral": str(mixtral), "qwen2_moe": str(qwen2_moe)}


def _moe_case(directory: str, output_dir: str, caplog) -> dict:
    """Streamed (laid out, no fallback warning) and equal to from_pretrained + the same layout, shard for shard."""
    import hf_dist
    from transformers import AutoModelForCausalLM

    from hf_dist.trainer.laid_out import LAYOUT_ATTR
    from hf_dist.trainer.trainer import apply_owned_layout

    args = _args(output_dir, {"fsdp": True})
    batch = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    with caplog.at_level(logging.WARNING, logger="hf_dist.trainer.pretrained"):
        streamed = hf_dist.from_pretrained(directory, args)
    warnings = [r.getMessage() for r in caplog.records]
    assert not warnings, warnings  # the fallback to transformers' loader warns
    assert LAYOUT_ATTR in streamed.__dict__  # laid out and streamed by hf_dist, not loaded whole
    assert streamed.__dict__[LAYOUT_ATTR].load.bytes_read > 0
    reference = apply_owned_layout(AutoModelForCausalLM.from_pretrained(directory), args, args.layout.dims)
    ref_state, got_state = _local_state(reference), _local_state(streamed)
    assert sorted(ref_state) == sorted(got_state), set(ref_state) ^ set(got_state)
    assert any("experts" in name for name in got_state), sorted(got_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(got_state[name], value, rtol=0, atol=0, msg=name)
    return {"logits": (_logits(reference, batch), _logits(streamed, batch))}


class _Records(logging.Handler):
    """A caplog stand-in inside spawned processes: collects records of one logger."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at_level(self, level: int, logger: str):
        import contextlib

        @contextlib.contextmanager
        def scope():
            target = logging.getLogger(logger)
            old = target.level
            target.setLevel(level)
            target.addHandler(self)
            try:
                yield
            finally:
                target.removeHandler(self)
                target.setLevel(old)

        return scope()


def _run(rank: int, world_size: int, checkpoints: dict, output_dir: str) -> dict:
    return {
        "bare_fsdp2": _case(checkpoints["bare"], f"{output_dir}/bare_fsdp2", {"fsdp": True}),
        "bare_tp2": _case(checkpoints["bare"], f"{output_dir}/bare_tp2", {"tp": 2}),
        "mixtral_fsdp2": _moe_case(checkpoints["mixtral"], f"{output_dir}/mixtral", _Records()),
        "qwen2_moe_fsdp2": _moe_case(checkpoints["qwen2_moe"], f"{output_dir}/qwen2_moe", _Records()),
    }


def test_renamed_and_assembled_checkpoints_stream(checkpoints, tmp_path):
    _check(run_distributed(_run, 2, checkpoints, str(tmp_path), timeout_s=600))


def test_key_map_follows_transformers_rules(checkpoints):
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_dist.loading.checkpoint_files import CheckpointFiles
    from hf_dist.loading.key_map import key_map

    for name, assembled in (("bare", 0), ("mixtral", 2 * 2)):  # gate_up_proj and down_proj of each layer
        config = AutoConfig.from_pretrained(checkpoints[name])
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        names = key_map(model, CheckpointFiles(checkpoints[name]).keys())
        assert len(names.assembled) == assembled and not names.unsupported, names.assembled
        if name == "bare":
            assert names.to_file["model.layers.1.mlp.down_proj.weight"] == "layers.1.mlp.down_proj.weight"
            assert "lm_head.weight" not in names.to_file  # tied: filled from the embedding
        else:
            assert names.to_file["model.layers.0.mlp.gate.weight"] == "model.layers.0.block_sparse_moe.gate.weight"
            sources = [key for key, _ in names.assembled["model.layers.1.mlp.experts.gate_up_proj"].sources]
            experts = [f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w3")]
            assert sources == experts, sources  # every expert, in the order transformers' loader feeds them


def test_split_checkpoint_falls_back_to_transformers_with_a_warning(tmp_path, caplog):
    """hrm_text stores q/k/v/gate as one tensor that transformers splits: not streamed, and the warning says so."""
    import transformers
    from transformers import AutoModelForCausalLM

    from hf_dist.loading.checkpoint_files import CheckpointFiles
    from hf_dist.loading.key_map import key_map
    from hf_dist.trainer.pretrained import _names_or_none

    config = transformers.HrmTextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        head_dim=8, num_layers_per_stack=2, H_cycles=1, L_cycles=1,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = key_map(model, CheckpointFiles(tmp_path).keys())
    assert not names.assembled and len(names.unsupported) == 2 * 4, names.unsupported  # attn + mlp of each layer
    with caplog.at_level(logging.WARNING, logger="hf_dist.trainer.pretrained"):
        assert _names_or_none(model, str(tmp_path)) is None
    assert any("splits" in r.getMessage() and "hrm_text" in r.getMessage() for r in caplog.records)
