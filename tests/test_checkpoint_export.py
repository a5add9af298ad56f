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
    assert "verified tensor by tensor" in capsys.readouterr().out
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
    from hf_dist.checkpoint.export.dcp import check_complete_tensor

    half = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([8, 4]),
                                 chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 4]))])
    with pytest.raises(CheckpointError, match="covering 16 of 32 elements"):
        check_complete_tensor("lora_A", half)
    empty = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([0]), chunks=[])
    with pytest.raises(CheckpointError, match="empty"):
        check_complete_tensor("lora_B", empty)


def _train_lora_fsdp_and_save(rank, world, root):
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import fully_shard

    from hf_dist import ParallelDims
    from hf_dist.checkpoint import save_checkpoint
    from hf_dist.models import build_tiny_model

    layout = ParallelDims(world_size=world, dp_shard=world)
    mesh = layout.build_mesh("cpu")["dp_shard"]
    model = get_peft_model(build_tiny_model(seed=0, tie_word_embeddings=True, **MODEL_KWARGS),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for block in model.base_model.model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, MODEL_KWARGS["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # lora_B starts at zero: train so that the adapter changes the logits
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    save_checkpoint(f"{root}/step_2", model=model, optimizer=optimizer, step=2, samples_consumed=8, layout=layout,
                    batch_contract=None)


def test_lora_export_adapter_and_merged(tmp_path):
    from safetensors.torch import load_file

    run_distributed(_train_lora_fsdp_and_save, 2, str(tmp_path / "ckpt"))
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), str(tmp_path / "adapter"), "--adapter", "adapter"]) == 0
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert all(".default." not in key for key in adapter)
    assert any(key.endswith("lora_B.weight") and value.abs().sum() > 0 for key, value in adapter.items())
    assert not (tmp_path / "adapter" / "config.json").exists()
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), str(tmp_path / "merged"), "--adapter", "merged"]) == 0
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert not any("lora" in name for name, _ in merged.named_parameters())
    # the tied head once, as save_pretrained writes the merged model (and the plain export a tied pair)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    merged.save_pretrained(tmp_path / "resaved")
    assert set(load_file(str(tmp_path / "merged" / "model.safetensors"))) == set(
        load_file(str(tmp_path / "resaved" / "model.safetensors")))


def _zero3_train_and_save(rank, world, root):
    import deepspeed

    from hf_dist.models import build_tiny_model

    model = build_tiny_model(seed=0, **MODEL_KWARGS)
    if rank == 0:
        model.config.save_pretrained(root)  # the HF Trainer writes config.json beside global_stepN/
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    ids = torch.randint(0, MODEL_KWARGS["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(root)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {name: p.detach().clone().numpy() for name, p in engine.module.named_parameters()}


def _load_into_fsdp2(rank, world, ckpt):
    from test_checkpoint_loop import build, full_params

    from hf_dist.checkpoint import load_checkpoint

    model, _, _, _, _ = build("fsdp", world)
    info = load_checkpoint(ckpt, model=model, optimizer=None)
    return {"step": info.step, "params": {k: v.numpy() for k, v in full_params(model).items()}}


def test_zero3_converts_to_fsdp2_and_exports(tmp_path):
    from hf_dist.checkpoint.zero import convert_zero_checkpoint

    zero_dir = tmp_path / "zero"
    zero_dir.mkdir()
    trained = as_tensors(run_distributed(_zero3_train_and_save, 2, str(zero_dir))[0])
    with pytest.raises(ValueError, match="trust_pickles=True"):
        convert_zero_checkpoint(zero_dir, tmp_path / "converted")
    convert_zero_checkpoint(zero_dir, tmp_path / "converted", trust_pickles=True)
    loaded = run_distributed(_load_into_fsdp2, 2, str(tmp_path / "converted"))[0]
    assert loaded["step"] == 2
    torch.testing.assert_close(as_tensors(loaded["params"]), trained, atol=0, rtol=0)
    out = tmp_path / "hub"
    assert main(["checkpoint", "export", str(zero_dir), str(out)]) == 2  # refuses without the trust flag
    assert main(["checkpoint", "export", str(zero_dir), str(out), "--trust-deepspeed-pickles",
                 "--max-shard-size", "40KB"]) == 0
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(out))
    torch.testing.assert_close(dict(exported.state_dict()), trained, atol=0, rtol=0)


def test_same_size_bit_flip_is_caught_by_default(fsdp_checkpoint, tmp_path, capsys):
    """The manifest's SHA-256 is checked by default: a flipped byte that keeps the size is named."""
    root, _ = fsdp_checkpoint
    shard = root / "step_2" / "dcp" / "__0_0.distcp"
    original = shard.read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    try:
        shard.write_bytes(bytes(flipped))
        assert main(["checkpoint", "inspect", str(root)]) == 1
        assert f"{shard} does not match its SHA-256" in capsys.readouterr().out
        assert main(["checkpoint", "inspect", str(root), "--verify", "size"]) == 0  # asked for sizes only
        capsys.readouterr()
        out = tmp_path / "out"
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"an earlier export")
        assert main(["checkpoint", "export", str(root), str(out), "--overwrite"]) == 2
        assert f"{shard} does not match its SHA-256" in capsys.readouterr().err
        assert (out / "model.safetensors").read_bytes() == b"an earlier export"  # refused before touching it
    finally:
        shard.write_bytes(original)


def test_overwrite_replaces_only_the_model_files(fsdp_checkpoint, tmp_path, capsys):
    root, params = fsdp_checkpoint
    out = tmp_path / "hub"
    assert main(["checkpoint", "export", str(root), str(out), "--max-shard-size", "40KB", "--no-verify"]) == 0
    assert "checked" in capsys.readouterr().out and len(list(out.glob("model-*-of-*.safetensors"))) > 2
    (out / "README.md").write_text("my model card")
    (out / "eval").mkdir()
    (out / "eval" / "scores.json").write_text("{}")
    assert main(["checkpoint", "export", str(root), str(out)]) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "(--overwrite) to replace the model files in it" in err
    assert main(["checkpoint", "export", str(root), str(out), "--overwrite", "--no-verify"]) == 0
    assert (out / "README.md").read_text() == "my model card" and (out / "eval" / "scores.json").is_file()
    assert not list(out.glob("model-*-of-*.safetensors")) and not (out / "model.safetensors.index.json").exists()
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(out))
    torch.testing.assert_close(dict(exported.state_dict()), params, atol=0, rtol=0)


def test_export_into_a_file_is_refused(fsdp_checkpoint, tmp_path, capsys):
    root, _ = fsdp_checkpoint
    target = tmp_path / "model.bin"
    target.write_text("keep me")
    assert main(["checkpoint", "export", str(root), str(target)]) == 2
    assert f"output {target} is a file, not a folder" in capsys.readouterr().err
    assert target.read_text() == "keep me"


def test_tokenizer_from_a_model_folder_brings_only_the_tokenizer(fsdp_checkpoint, tmp_path, capsys):
    """``--tokenizer`` may name a whole model folder: its config and weights must not replace the export's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, params = fsdp_checkpoint
    donor = tmp_path / "donor"
    assert main(["checkpoint", "export", str(root), str(donor)]) == 0
    config = json.loads((donor / "config.json").read_text())
    config["num_hidden_layers"] += 1  # a different model in the donor folder, same tokenizer
    (donor / "config.json").write_text(json.dumps(config))
    out = tmp_path / "hub"
    assert main(["checkpoint", "export", str(root), str(out), "--tokenizer", str(donor)]) == 0
    capsys.readouterr()
    exported = AutoModelForCausalLM.from_pretrained(str(out))
    torch.testing.assert_close(dict(exported.state_dict()), params, atol=0, rtol=0)
    assert AutoTokenizer.from_pretrained(str(out))("w5 w7")["input_ids"] == [5, 7]
