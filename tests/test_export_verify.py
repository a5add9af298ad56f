"""The default, bounded verification of ``hf-dist checkpoint export`` (``export.verify``, ``export.lora_verify``).

It passes on good exports of every kind (TP and PP hf_dist checkpoints from 2 ranks, fused rows, LoRA adapter and
merged, Trainer-native folders, tied embeddings) and fails, naming the tensor, when the folder is changed between
writing and checking: one value flipped, a tensor removed or added, a merged weight built with the wrong scale.
The FSDP2 export is covered in ``test_checkpoint_export.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from test_checkpoint_atomic import _save
from test_checkpoint_loop import MODEL_KWARGS, build, train

from hf_dist.checkpoint import CheckpointError
from hf_dist.checkpoint.export import lora_verify
from hf_dist.checkpoint.export import verify as export_verify
from hf_dist.checkpoint.export import export_checkpoint
from hf_dist.cli import main


def _rewrite(out: Path, change) -> None:
    """Apply ``change(tensors)`` to every safetensors file of ``out`` (it acts on the one with its key)."""
    from safetensors.torch import load_file, save_file

    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(path))
        change(tensors)
        save_file(tensors, str(path), metadata={"format": "pt"})


def _flip(key: str):
    def change(tensors):
        if key in tensors:
            tensors[key] = tensors[key].clone()
            tensors[key].view(-1)[3] += 0.5
    return change


def _drop(key: str):
    return lambda tensors: tensors.pop(key, None)


def _add_extra(tensors):
    if "model.norm.weight" in tensors:
        tensors["extra"] = torch.zeros(2)


def _to_bf16(key: str):
    def change(tensors):
        if key in tensors:
            tensors[key] = tensors[key].to(torch.bfloat16)
    return change


def _tamper(monkeypatch, module, attr: str, out: Path, change) -> None:
    """Rewrite the exported folder ``out`` right before ``module.attr`` (the first step of verification) runs."""
    original = getattr(module, attr)

    def tampered(*args):
        _rewrite(out, change)
        return original(*args)

    monkeypatch.setattr(module, attr, tampered)


@pytest.fixture()
def single_checkpoint(tmp_path):
    model, optimizer, scheduler, layout, contract = build("single", 1)
    _save(tmp_path / "ckpt", 1, model, optimizer, scheduler, layout, contract)
    return tmp_path / "ckpt" / "step_1", {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_tensor_verification_passes_and_names_a_changed_tensor(single_checkpoint, tmp_path, monkeypatch, capsys):
    ckpt, state = single_checkpoint
    report = export_checkpoint(ckpt, tmp_path / "good", max_shard_size="20KB")
    assert report.verification == "tensors" and report.tensors_verified == len(state) and report.max_logit_diff is None
    key = "model.layers.1.self_attn.q_proj.weight"
    with monkeypatch.context() as patch:
        _tamper(patch, export_verify, "check_structure", tmp_path / "flipped", _flip(key))
        with pytest.raises(CheckpointError, match=rf"tensor model\.layers\.1\.self_attn\.q_proj\.weight .*1 values"):
            export_checkpoint(ckpt, tmp_path / "flipped")
    with monkeypatch.context() as patch:
        _tamper(patch, export_verify, "check_structure", tmp_path / "missing", _drop("model.norm.weight"))
        with pytest.raises(CheckpointError, match=r"\['model\.norm\.weight'\] .* are missing"):
            export_checkpoint(ckpt, tmp_path / "missing")
    with monkeypatch.context() as patch:
        _tamper(patch, export_verify, "check_structure", tmp_path / "extra", _add_extra)
        with pytest.raises(CheckpointError, match=r"\['extra'\] are not parameters of the LlamaForCausalLM"):
            export_checkpoint(ckpt, tmp_path / "extra")
    with monkeypatch.context() as patch:
        _tamper(patch, export_verify, "check_structure", tmp_path / "dtype", _to_bf16(key))
        assert main(["checkpoint", "export", str(ckpt), str(tmp_path / "dtype")]) == 2
        assert f"tensor {key} (in model.safetensors) is torch.bfloat16" in capsys.readouterr().err


def test_verify_modes(single_checkpoint, tmp_path, capsys):
    ckpt, _ = single_checkpoint
    with pytest.raises(ValueError, match="verify='bogus' is not a verification"):
        export_checkpoint(ckpt, tmp_path / "x", verify="bogus")
    assert not (tmp_path / "x").exists()
    report = export_checkpoint(ckpt, tmp_path / "logits", verify="logits")
    assert report.verification == "logits" and report.max_logit_diff == 0.0 and report.tensors_verified is None
    assert main(["checkpoint", "export", str(ckpt), str(tmp_path / "cli")]) == 0
    assert "verified tensor by tensor" in capsys.readouterr().out
    assert main(["checkpoint", "export", str(ckpt), str(tmp_path / "none"), "--verify", "none"]) == 0
    assert "not verified (--verify none)" in capsys.readouterr().out


def test_fused_rows_are_checked_in_hf_order(tmp_path):
    from safetensors.torch import load_file

    from hf_dist.tensor_parallel.styles import FUSED_PARTS_ATTR, deinterleave_parts

    model, optimizer, scheduler, layout, contract = build("single", 1)
    gate = model.model.layers[0].mlp.gate_proj  # stands in for a fused gate/up projection saved rank-major (tp=2)
    half = gate.weight.shape[0] // 2
    setattr(gate, FUSED_PARTS_ATTR, ((half, half), 2))
    _save(tmp_path / "ckpt", 1, model, optimizer, scheduler, layout, contract)
    report = export_checkpoint(tmp_path / "ckpt" / "step_1", tmp_path / "out")
    assert report.verification == "tensors"
    written = load_file(str(tmp_path / "out" / "model.safetensors"))["model.layers.0.mlp.gate_proj.weight"]
    expected = deinterleave_parts(gate.weight.detach(), (half, half), 2)
    assert not torch.equal(expected, gate.weight.detach())
    torch.testing.assert_close(written, expected, atol=0, rtol=0)


def _train_tp_and_pp(rank, world, root):
    train("tp", steps=1, save_at=(1,), root=f"{root}/tp")
    train("pp", steps=1, save_at=(1,), root=f"{root}/pp")


def test_tp_and_pp_checkpoints_verify(tmp_path, monkeypatch):
    run_distributed(_train_tp_and_pp, 2, str(tmp_path))
    for kind in ("tp", "pp"):
        report = export_checkpoint(tmp_path / kind, tmp_path / f"{kind}_out", max_shard_size="30KB")
        assert report.verification == "tensors" and report.tensors_verified > 10, kind
    with monkeypatch.context() as patch:
        _tamper(patch, export_verify, "check_structure", tmp_path / "pp_flipped", _flip("lm_head.weight"))
        with pytest.raises(CheckpointError, match=r"tensor lm_head\.weight"):
            export_checkpoint(tmp_path / "pp", tmp_path / "pp_flipped", max_shard_size="30KB")


def _lora_checkpoint(root: Path) -> Path:
    from peft import LoraConfig, get_peft_model

    from hf_dist import ParallelDims
    from hf_dist.checkpoint import save_checkpoint
    from hf_dist.models import build_tiny_model

    model = get_peft_model(build_tiny_model(seed=0, **MODEL_KWARGS),
                           LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, MODEL_KWARGS["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # lora_B starts at zero: train so that the merge changes the weights
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    save_checkpoint(root / "step_2", model=model, optimizer=optimizer, step=2, samples_consumed=4,
                    layout=ParallelDims(world_size=1), batch_contract=None)
    return root / "step_2"


def test_lora_adapter_and_merged_verify_with_peft(tmp_path, monkeypatch):
    from hf_dist.checkpoint.export import lora

    ckpt = _lora_checkpoint(tmp_path / "ckpt")
    assert export_checkpoint(ckpt, tmp_path / "adapter", adapter="adapter").tensors_verified == 8
    merged = export_checkpoint(ckpt, tmp_path / "merged", adapter="merged")
    assert merged.verification == "tensors" and merged.tensors_verified > 10
    with monkeypatch.context() as patch:  # hf_dist's merge with the wrong scale: PEFT's merge disagrees
        patch.setattr(lora, "_scale", lambda config: 2.0)  # lora_alpha / r = 3
        with pytest.raises(CheckpointError, match=r"tensor model\.layers\.0\.self_attn\.q_proj\.weight .*differs"):
            export_checkpoint(ckpt, tmp_path / "wrong_scale", adapter="merged")
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    with monkeypatch.context() as patch:
        _tamper(patch, lora_verify, "meta_model", tmp_path / "adapter_flipped", _flip(key))
        with pytest.raises(CheckpointError, match=rf"tensor {key} differs"):
            export_checkpoint(ckpt, tmp_path / "adapter_flipped", adapter="adapter")
    with monkeypatch.context() as patch:
        _tamper(patch, lora_verify, "meta_model", tmp_path / "adapter_missing", _drop(key))
        with pytest.raises(CheckpointError, match=rf"PEFT expects tensors \['{key}'\] that are missing"):
            export_checkpoint(ckpt, tmp_path / "adapter_missing", adapter="adapter")


@pytest.mark.parametrize("tied", [False, True])
def test_trainer_native_folder_verifies_tensor_by_tensor(tmp_path, monkeypatch, tied):
    from hf_dist.models import build_tiny_model

    model = build_tiny_model(seed=1, **MODEL_KWARGS, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path / "checkpoint-3")
    report = export_checkpoint(tmp_path / "checkpoint-3", tmp_path / "out", max_shard_size="30KB")
    assert report.verification == "tensors" and report.tensors_verified == len(model.state_dict()) - tied
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    key = "model.embed_tokens.weight"
    with monkeypatch.context() as patch:
        _tamper(patch, export_verify, "check_structure", tmp_path / "flipped",
                _flip(key if tied else "model.norm.weight"))
        with pytest.raises(CheckpointError, match=key if tied else r"model\.norm\.weight"):
            export_checkpoint(tmp_path / "checkpoint-3", tmp_path / "flipped")


def test_trainer_native_folder_is_checked_before_writing(tmp_path):
    from safetensors.torch import load_file, save_file

    from hf_dist.models import build_tiny_model

    build_tiny_model(seed=1, **MODEL_KWARGS).save_pretrained(tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    original = load_file(str(weights))
    report = export_checkpoint(tmp_path / "ckpt", tmp_path / "logits", verify="logits")
    assert report.verification == "logits" and report.max_logit_diff == 0.0
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an earlier export")
    bad = dict(original, **{"model.norm.weight": torch.full_like(original["model.norm.weight"], float("nan"))})
    save_file(bad, str(weights), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"NaN or Inf values: \['model\.norm\.weight'\]"):
        export_checkpoint(tmp_path / "ckpt", out, overwrite=True)
    save_file({k: v for k, v in original.items() if k != "model.layers.0.mlp.up_proj.weight"}, str(weights),
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"checkpoint .*\['model\.layers\.0\.mlp\.up_proj\.weight'\] .* missing"):
        export_checkpoint(tmp_path / "ckpt", out, overwrite=True)
    assert (out / "model.safetensors").read_bytes() == b"an earlier export"  # refused before touching it


def test_tied_gpt2_and_per_expert_mixtral(tmp_path, monkeypatch):
    """Tied aliases by the model's own ``_tied_weights_keys`` (not Llama names); per-expert MoE folders, which
    transformers assembles on load, are checked stored tensor against stored tensor."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_dist import ParallelDims
    from hf_dist.checkpoint import save_checkpoint

    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", vocab_size=96, n_embd=32, n_layer=2,
                                                                 n_head=4, n_positions=32))
    save_checkpoint(tmp_path / "gpt2", model=gpt2, optimizer=None, step=0, samples_consumed=0,
                    layout=ParallelDims(world_size=1), batch_contract=None)
    report = export_checkpoint(tmp_path / "gpt2", tmp_path / "gpt2_out")
    assert report.tensors_verified == len(gpt2.state_dict()) - 1  # lm_head.weight is transformer.wte.weight
    config = AutoConfig.for_model("mixtral", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=3)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "checkpoint-1")
    report = export_checkpoint(tmp_path / "checkpoint-1", tmp_path / "moe_out")
    assert report.verification == "tensors" and report.tensors_verified > 20
    key = "model.layers.1.block_sparse_moe.experts.2.w1.weight"  # as save_pretrained stores it
    with monkeypatch.context() as patch:
        _tamper(patch, export_verify, "verify_same_files", tmp_path / "moe_flipped", _flip(key))
        with pytest.raises(CheckpointError, match=rf"tensor {key} \(in model\.safetensors\) differs"):
            export_checkpoint(tmp_path / "checkpoint-1", tmp_path / "moe_flipped")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merged_export_equals_peft_merge_and_unload(tmp_path, dtype):
    """The whole-model PEFT path as reference: a half-precision base with PEFT's fp32 adapters merges in one
    rounding, as ``merge_and_unload`` does (hf_dist once rounded the delta first: 2% of bf16 values differed)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from hf_dist import ParallelDims
    from hf_dist.checkpoint import save_checkpoint
    from hf_dist.models import build_tiny_model

    model = get_peft_model(build_tiny_model(seed=0, dtype=dtype, **MODEL_KWARGS),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "down_proj"]))
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=None, step=0, samples_consumed=0,
                    layout=ParallelDims(world_size=1), batch_contract=None)
    assert export_checkpoint(tmp_path / "ckpt", tmp_path / "out", adapter="merged").verification == "tensors"
    expected = model.merge_and_unload().state_dict()
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert written["model.layers.0.mlp.down_proj.weight"].dtype == dtype
    torch.testing.assert_close(written, {k: v for k, v in expected.items() if k in written}, atol=0, rtol=0)
