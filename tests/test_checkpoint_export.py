"""``hf-dist checkpoint export`` / ``inspect`` of a 2-rank FSDP2 checkpoint: from_pretrained loads it, logits match."""

from __future__ import annotations

import json

import pytest
import torch
from dist_utils import run_distributed
from test_checkpoint_loop import MODEL_KWARGS, as_tensors, picklable, tiny_tokenizer, train

from hf_dist.cli import main


def _train_fsdp_and_save(rank, world, root):
    return picklable(train("fsdp", steps=2, save_at=(2,), root=root, tokenizer=tiny_tokenizer()))


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    result = run_distributed(_train_fsdp_and_save, 2, str(root))[0]
    return root, as_tensors(result["params"])


def test_export_loads_with_from_pretrained_and_matches(fsdp_checkpoint, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, params = fsdp_checkpoint
    out = tmp_path / "hub"
    assert main(["checkpoint", "export", str(root), str(out), "--max-shard-size", "40KB"]) == 0
    assert "verified with from_pretrained" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and all((out / name).is_file() for name in shards)
    assert set(index["weight_map"]) == set(params)
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (out / name).is_file(), name
    exported = AutoModelForCausalLM.from_pretrained(str(out))
    torch.testing.assert_close(dict(exported.state_dict()), params, atol=0, rtol=0)
    assert AutoTokenizer.from_pretrained(str(out))("w5 w7")["input_ids"] == [5, 7]


def test_inspect_prints_layout_and_detects_damage(fsdp_checkpoint, capsys):
    root, _ = fsdp_checkpoint
    assert main(["checkpoint", "inspect", str(root)]) == 0
    text = capsys.readouterr().out
    assert "step              2" in text and "dp_shard=2" in text and "complete          yes" in text
    shard = root / "step_2" / "dcp" / "__1_0.distcp"
    original = shard.read_bytes()
    try:
        shard.write_bytes(original[:-10])
        assert main(["checkpoint", "inspect", str(root)]) == 1
        assert str(shard) in capsys.readouterr().out
        assert main(["checkpoint", "export", str(root), str(root.parent / "x")]) == 2
        assert str(shard) in capsys.readouterr().err
    finally:
        shard.write_bytes(original)


def test_export_refuses_one_rank_shard(fsdp_checkpoint):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    from hf_dist.checkpoint import CheckpointError
    from hf_dist.checkpoint.export import check_complete_tensor

    half = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([8, 4]),
                                 chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 4]))])
    with pytest.raises(CheckpointError, match="covering 16 of 32 elements"):
        check_complete_tensor("lora_A", half)
    empty = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([0]), chunks=[])
    with pytest.raises(CheckpointError, match="empty"):
        check_complete_tensor("lora_B", empty)
