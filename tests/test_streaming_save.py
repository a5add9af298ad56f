"""Final saves that never gather the whole model: pipeline stages (also x FSDP2 and x TP) and LoRA adapters.

A model is loaded with ``hf_dist.from_pretrained`` into the layout, every tensor is moved by a constant that
depends on its name (added to the local shards, so the whole tensor moves by it too), and the save is compared
with ``save_pretrained`` of one process's model moved the same way: the same keys, the same tensors exactly, a
tied weight written once (the embedding's copy: the lm_head copy on the last stage moves by another constant),
and the directory loads with ``AutoModelForCausalLM.from_pretrained``.
``hf_dist.state_dict.gather_meter`` counts the whole tensors a rank holds: rank 0's peak must stay within one
output file plus one tensor (files far smaller than the model), the other ranks' within one tensor.
A LoRA model saved through ``DistTrainer.save_model`` gathers its adapter only, and equals PEFT's own save.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.dist_utils import run_distributed

VOCAB = 160
SHARD_BYTES = 30_000  # the tiny models hold ~200 kB: several output files


def _config(tied: bool):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = {}
    for name, tied in (("llama", False), ("tied", True)):
        torch.manual_seed(11)
        model = AutoModelForCausalLM.from_config(_config(tied), dtype=torch.float32)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory, max_shard_size="50KB")
        out[name] = str(directory)
    return out


def _shift(name: str) -> float:
    return (zlib.crc32(name.encode()) % 997 + 1) / 1e4


def _move(named_params) -> None:
    """Each tensor + a constant of its name (on the local shard: the whole tensor moves by the same)."""
    with torch.no_grad():
        for name, param in named_params:
            getattr(param, "_local_tensor", param).add_(_shift(name))


def _args(output_dir: str, layout: dict):
    from hf_dist import DistTrainingArguments

    fsdp = {"fsdp": "full_shard", "fsdp_config": {"version": 2}} if layout.get("fsdp") else {}
    return DistTrainingArguments(
        output_dir=output_dir, report_to=[], per_device_train_batch_size=1, gradient_accumulation_steps=2,
        tp_size=layout.get("tp", 1), pp_size=layout.get("pp", 1), save_strategy="no", **fsdp,
    )


def _read_dir(directory: str) -> dict[str, torch.Tensor]:
    import os

    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def _pp_case(directory: str, output_dir: str, layout: dict) -> dict:
    import os

    import torch.distributed as dist

    import hf_dist
    from hf_dist.pipeline_parallel.save import save_pretrained
    from hf_dist.state_dict import gather_meter

    args = _args(output_dir, layout)
    model = hf_dist.from_pretrained(directory, args)
    pipe = model.pipeline
    for module in pipe.modules:
        _move(module.named_parameters(remove_duplicate=False))
    with gather_meter() as meter:
        save_pretrained(pipe, f"{output_dir}/saved", max_shard_bytes=SHARD_BYTES)
    result = {"peak_bytes": meter.peak_bytes, "peak_tensors": meter.peak_tensors, "live_after": meter.live_bytes}
    if dist.get_rank() == 0:
        result["saved"] = _read_dir(f"{output_dir}/saved")
        result["files"] = sum(n.endswith(".safetensors") for n in os.listdir(f"{output_dir}/saved"))
    dist.barrier()
    return result


def _reference(directory: str, output_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    _move(model.named_parameters())
    model.save_pretrained(output_dir)
    return _read_dir(output_dir)


def _lora_case(directory: str, output_dir: str) -> dict:
    """FSDP2 + LoRA through DistTrainer.save_model: only the adapter is gathered; equals PEFT's one-process save."""
    import torch.distributed as dist
    from peft import LoraConfig

    import hf_dist
    from hf_dist.state_dict import full_state_dict, gather_meter

    lora = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")
    args = _args(output_dir, {"fsdp": True})
    model = hf_dist.from_pretrained(directory, args, peft_config=lora)
    _move((n, p) for n, p in model.named_parameters() if "lora_" in n)  # lora_B is zero after init
    trainer = hf_dist.DistTrainer(model=model, args=args)
    with gather_meter() as meter:
        trainer.save_model(f"{output_dir}/adapter")
    whole = full_state_dict(trainer.model)  # the reference's weights (a tiny model: gathering it is fine here)
    result = {"peak_bytes": meter.peak_bytes}
    if dist.get_rank() == 0:
        result["saved"] = _read_dir(f"{output_dir}/adapter")
        result["whole"] = whole
    dist.barrier()
    return result


def _run(rank: int, world_size: int, checkpoints: dict, output_dir: str, cases: dict) -> dict:
    out = {}
    for name, (model, layout) in cases.items():
        if layout.get("lora"):
            out[name] = _lora_case(checkpoints[model], f"{output_dir}/{name}")
        else:
            out[name] = _pp_case(checkpoints[model], f"{output_dir}/{name}", layout)
    return out


def _sizes(tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    return sum(sizes), max(sizes)


def _check_pp(per_rank: list[dict], name: str, checkpoint: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    want = _reference(checkpoint, str(tmp_path / f"ref_{name}"))
    got = per_rank[0][name]["saved"]
    assert sorted(got) == sorted(want), (name, set(got) ^ set(want))
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"{name} {key}")
    total, largest = _sizes(want)
    bound = SHARD_BYTES + largest
    assert bound < total / 2  # the check below tells a streamed save from a gathered one
    assert per_rank[0][name]["files"] > 2, name
    for rank, result in enumerate(per_rank):
        peak = result[name]["peak_bytes"]
        assert peak <= (bound if rank == 0 else largest), (name, rank, peak, bound, total)
        assert result[name]["live_after"] == 0, (name, rank)  # nothing gathered is kept after the save
    loaded, info = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / name / "saved"), output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)


CASES_2 = {
    "llama_pp2": ("llama", {"pp": 2}),
    "tied_pp2": ("tied", {"pp": 2}),
    "lora_fsdp2": ("llama", {"lora": True}),
}
CASES_4 = {
    "tied_pp2_x_fsdp2": ("tied", {"pp": 2, "fsdp": True}),
    "llama_pp2_x_tp2": ("llama", {"pp": 2, "tp": 2}),  # phi3 under pp x tp: refused by the layout canary
}


def test_pipeline_and_lora_saves_stream_on_2_ranks(checkpoints, tmp_path):
    per_rank = run_distributed(_run, 2, checkpoints, str(tmp_path), CASES_2, timeout_s=600)
    for name in ("llama_pp2", "tied_pp2"):
        _check_pp(per_rank, name, checkpoints[CASES_2[name][0]], tmp_path)
    _check_lora(per_rank, tmp_path)


def test_pipeline_saves_stream_with_fsdp2_and_tp_on_4_ranks(checkpoints, tmp_path):
    per_rank = run_distributed(_run, 4, checkpoints, str(tmp_path), CASES_4, timeout_s=600)
    for name, (model, _) in CASES_4.items():
        _check_pp(per_rank, name, checkpoints[model], tmp_path)


def _check_lora(per_rank: list[dict], tmp_path) -> None:
    result = per_rank[0]["lora_fsdp2"]
    whole = result["whole"]
    _peft_twin(whole).save_pretrained(str(tmp_path / "ref_lora"))
    want = _read_dir(str(tmp_path / "ref_lora"))  # what PEFT's own save writes for these weights
    got = result["saved"]
    assert sorted(got) == sorted(want) and want, set(got) ^ set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    adapter_bytes, _ = _sizes(want)
    model_bytes, _ = _sizes(whole)
    assert adapter_bytes * 4 < model_bytes  # the bound below tells an adapter-only gather from a whole one
    for rank, r in enumerate(per_rank):  # the adapter gathered once, plus its CPU copy: never a base weight
        assert r["lora_fsdp2"]["peak_bytes"] <= 2 * adapter_bytes, (rank, r["lora_fsdp2"]["peak_bytes"], adapter_bytes)


def _peft_twin(whole: dict[str, torch.Tensor]):
    """A one-process PeftModel holding ``whole`` (to let PEFT pick and name what its save_pretrained writes)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(AutoModelForCausalLM.from_config(_config(False)), lora)
    model.load_state_dict(whole, strict=True)
    return model
