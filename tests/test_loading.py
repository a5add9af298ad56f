"""The streaming load (meta init, layout, each rank reads its slices) against from_pretrained + the same layout.

Every case builds the reference the ordinary way (transformers' ``from_pretrained`` on the rank, then the layout
DistTrainer applies) and the streamed model with ``hf_dist.from_pretrained``, then compares every local shard
exactly (LoRA adapters included: both paths draw them from the run's seed), the logits (1e-6), and one step of the
parity harness on both, laid out alike (``parity.layout_run``; ``parity.pipelined_run`` under PP), plain SGD with
clipping active: losses, gradient norms, the first step's gradients and the state after it, exactly
(``parity.assert_parity``, atol 0). Models: an untied Llama, a tied-embedding Llama, and Phi-3 (fused ``qkv_proj`` /
``gate_up_proj``), the parity harness's tiny configs (``parity.tiny_config``: non-default values), saved as several
safetensors shards. One spawn per world size runs all its cases.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

VOCAB, SEQ, BATCH = 128, 12, 4
"""Token ids are below ``VOCAB``: the smallest vocabulary of the configs here and in ``test_loading_names``."""


def loading_config(arch: str, *, tied: bool = False):
    """The parity harness's tiny config of ``arch`` (``parity.tiny_config``: the registry's non-default values),
    its embedding tied or not."""
    from parity import tiny_config

    config = tiny_config(arch)
    config.tie_word_embeddings = tied
    return config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{name: directory}`` of sharded safetensors checkpoints written by ``save_pretrained``."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name, arch, tied in (("llama", "llama", False), ("tied", "llama", True), ("phi3", "phi3", False)):
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_config(loading_config(arch, tied=tied), dtype=torch.float32)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory, max_shard_size="40KB")
        out[name] = str(directory)
    return out


def _args(output_dir: str, layout: dict, **extra):
    from hf_dist import DistTrainingArguments

    fsdp = {"fsdp": "full_shard", "fsdp_config": {"version": 2}} if layout.get("fsdp") else {}
    return DistTrainingArguments(
        output_dir=output_dir, report_to=[], per_device_train_batch_size=2, gradient_accumulation_steps=2,
        tp_size=layout.get("tp", 1), pp_size=layout.get("pp", 1), bf16=layout.get("bf16", False), **fsdp, **extra,
    )


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")


def _reference(directory: str, args, dims, dtype, lora: bool):
    from transformers import AutoModelForCausalLM

    from hf_dist.trainer.trainer import apply_owned_layout

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    if lora:
        from hf_dist.models import add_adapters

        model = add_adapters(model, _lora(), seed=args.seed)  # what the plain path (one process, DDP) does
    return apply_owned_layout(model, args, dims)


def _local_state(model) -> dict[str, torch.Tensor]:
    return {n: getattr(p, "_local_tensor", p).detach().clone() for n, p in model.named_parameters()}


def _logits(model, batch: torch.Tensor) -> torch.Tensor | None:
    with torch.no_grad():
        if hasattr(model, "pipeline"):
            out = model.pipeline.forward_only({"input_ids": batch})
            return None if out is None else out.float()
        return model(input_ids=batch).logits.float()


def _step(model, batch: torch.Tensor, dims) -> dict:
    """One step of the parity harness on this rank of ``model`` (``pipelined_run`` for a pipeline, else
    ``layout_run``), the first step's gradients kept; the state where this rank holds it (a pipeline gathers it on
    rank 0 only)."""
    import torch.distributed as dist

    from parity import TP_SGD, layout_run, pipelined_run

    steps, dp_rank = [{"input_ids": batch, "labels": batch}], dims.dp_rank(dist.get_rank())
    if hasattr(model, "pipeline"):
        run = pipelined_run(model.pipeline, steps, TP_SGD, dp_rank=dp_rank, dp=dims.dp, grads=True)
    else:
        group = dims.get_mesh("dp").get_group() if dims.dp > 1 else None
        run = layout_run(model, steps, TP_SGD, dp_rank=dp_rank, dp=dims.dp, dp_group=group, grads=True)
    return {k: v for k, v in run.items() if v is not None}


def _case(directory: str, output_dir: str, layout: dict) -> dict:
    import hf_dist
    from hf_dist.trainer.laid_out import laid_out_by_hf_dist
    from hf_dist.trainer.pretrained import layout_dtype

    args = _args(output_dir, layout)
    lora = layout.get("lora", False)
    dtype = layout_dtype(args, lora=lora)
    batch = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    dims = args.layout.dims  # its mesh built by the layout (the streamed model's: its mark's)
    reference = _reference(directory, args, dims, dtype, lora)
    streamed = hf_dist.from_pretrained(directory, args, peft_config=_lora() if lora else None)
    ref_state, got_state = _local_state(reference), _local_state(streamed)
    assert sorted(ref_state) == sorted(got_state), (set(ref_state) - set(got_state), set(got_state) - set(ref_state))
    for name in ref_state:  # the adapters too: both paths draw them from args.seed
        torch.testing.assert_close(got_state[name], ref_state[name], rtol=0, atol=0, msg=name)
        assert got_state[name].dtype == dtype or "norm" in name or "lora_" in name, (name, got_state[name].dtype)
    lora_b = [n for n in got_state if "lora_B" in n]
    assert all(got_state[n].abs().sum() == 0 for n in lora_b)
    if set(layout) == {"fsdp"}:
        _check_holds_its_shard_only(streamed)
    result = {"logits": (_logits(reference, batch), _logits(streamed, batch)),
              "step": (_step(reference, batch, dims), _step(streamed, batch, laid_out_by_hf_dist(streamed, dims).dims))}
    if not layout.get("pp") and not lora:
        _check_streaming_save(reference, streamed, f"{output_dir}/saved")
    return result


def _held_bytes(model) -> int:
    """Bytes of the distinct storages behind a model's parameters and buffers on this rank (a view of a whole
    tensor, e.g. a memory-mapped checkpoint tensor, counts whole)."""
    seen, total = set(), 0
    for tensor in (*model.parameters(), *model.buffers()):
        local = tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _check_holds_its_shard_only(streamed) -> None:
    """Under FSDP2 a rank's streamed model holds its shard of every tensor and nothing more: no whole tensor, no
    second copy (the bound leaves 10% for FSDP2's padding of uneven shards; the buffers are whole on every rank)."""
    import torch.distributed as dist

    buffers = sum(b.numel() * b.element_size() for b in streamed.buffers())
    whole = sum(p.numel() * p.element_size() for p in streamed.parameters())
    held = _held_bytes(streamed)
    assert held <= 1.1 * whole / dist.get_world_size() + buffers, (held, whole, buffers)


def _check_streaming_save(reference, streamed, directory: str) -> None:
    """``save_streaming`` (several files) writes what the full-state-dict gatherer returns; it loads as HF."""
    from hf_dist.state_dict import save_streaming

    save_streaming(streamed, directory, max_shard_bytes=30_000)
    _check_saved(reference, directory, several_files=True)


def _check_saved(model, directory: str, several_files: bool = False) -> None:
    import os

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hf_dist.state_dict import full_state_dict

    want = full_state_dict(model)
    if dist.get_rank() == 0:
        files = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
        assert len(files) > 1 if several_files else files, files
        got = AutoModelForCausalLM.from_pretrained(directory).state_dict()
        assert sorted(got) == sorted(want), set(got) ^ set(want)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value.float(), rtol=1e-6, atol=1e-6, msg=key)


def _trainer_case(directory: str, output_dir: str) -> dict:
    """DistTrainer on the streamed model (no second layout) equals DistTrainer on a plain from_pretrained model."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    import hf_dist

    ids = torch.randint(3, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(5)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    out = {}
    for name in ("plain", "streamed"):
        args = _args(f"{output_dir}/{name}", {"fsdp": True}, max_steps=2, learning_rate=1e-2, save_strategy="no",
                     logging_steps=1, disable_tqdm=True, seed=3)
        if name == "plain":
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        else:
            model = hf_dist.from_pretrained(directory, args)
        before = [id(p) for p in model.parameters()]
        trainer = hf_dist.DistTrainer(model=model, args=args, train_dataset=data)
        if name == "streamed":  # used as it is: no second layout
            assert trainer.model is model and [id(p) for p in trainer.model.parameters()] == before
        trainer.train()
        out[name] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    trainer.save_model(f"{output_dir}/final")  # the streaming save, through the Trainer
    _check_saved(trainer.model, f"{output_dir}/final")
    with pytest.raises(ValueError, match="laid out for"):  # laid out for FSDP2, asked for TP=2
        hf_dist.DistTrainer(model=model, args=_args(f"{output_dir}/tp", {"tp": 2}), train_dataset=data)
    return {"losses": (torch.tensor(out["plain"]), torch.tensor(out["streamed"]))}


def _run(rank: int, world_size: int, checkpoints: dict, output_dir: str, cases: dict) -> dict:
    results = {name: _case(checkpoints[model], f"{output_dir}/{name}", layout) for name, (model, layout) in cases.items()}
    if world_size == 2:
        results["trainer_fsdp2"] = _trainer_case(checkpoints["llama"], f"{output_dir}/trainer")
    return results


CASES_2 = {
    "llama_fsdp2": ("llama", {"fsdp": True}),
    "llama_tp2": ("llama", {"tp": 2}),
    "llama_pp2": ("llama", {"pp": 2}),
    "tied_fsdp2": ("tied", {"fsdp": True}),
    "tied_tp2": ("tied", {"tp": 2}),
    "tied_pp2": ("tied", {"pp": 2}),
    "phi3_tp2": ("phi3", {"tp": 2}),
    "phi3_fsdp2": ("phi3", {"fsdp": True}),
    "llama_lora_bf16_tp2": ("llama", {"tp": 2, "lora": True, "bf16": True}),
}
CASES_4 = {
    "phi3_fsdp2_x_tp2": ("phi3", {"fsdp": True, "tp": 2}),
    "llama_pp2_x_fsdp2": ("llama", {"fsdp": True, "pp": 2}),
}


def _check(per_rank: list[dict]) -> None:
    from parity import TP_SGD, assert_parity

    for rank, cases in enumerate(per_rank):
        for name, result in cases.items():
            for what, (want, got) in result.items():
                if what == "step":  # the same numbers: losses, norms, first-step gradients and state exactly
                    assert min(want["norms"]) > TP_SGD.max_norm, (rank, name, want["norms"])  # clipping bites
                    assert got["norms"] == want["norms"], (rank, name, got["norms"], want["norms"])
                    assert_parity(got, want, atol=0, what=f"rank {rank} {name} step")
                    continue
                if want is None:
                    assert got is None, (rank, name, what)
                    continue
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"rank {rank} {name} {what}")
    last = per_rank[-1]  # the last pipeline stage's rank holds logits in every case
    assert all(r["logits"][1] is not None for r in last.values() if "logits" in r)


def test_streaming_load_matches_from_pretrained_on_2_ranks(checkpoints, tmp_path):
    _check(run_distributed(_run, 2, checkpoints, str(tmp_path), CASES_2, timeout_s=600))


def test_streaming_load_matches_from_pretrained_on_4_ranks(checkpoints, tmp_path):
    _check(run_distributed(_run, 4, checkpoints, str(tmp_path), CASES_4, timeout_s=600))


def test_checkpoint_key_strips_wrappers():
    from hf_dist.loading.slices import checkpoint_key

    assert checkpoint_key("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert checkpoint_key("model.layers.1._checkpoint_wrapped_module.mlp.down_proj.weight") == (
        "model.layers.1.mlp.down_proj.weight"
    )


def test_bad_inputs_are_refused_before_any_process_group(tmp_path):
    import hf_dist
    from hf_dist.loading.checkpoint_files import CheckpointFiles

    with pytest.raises(ValueError, match="device_map"):
        hf_dist.from_pretrained(str(tmp_path), args=None, device_map="auto")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="safetensors only"):
        CheckpointFiles(tmp_path)


def test_a_model_laid_out_for_other_arguments_is_refused():
    from torch import nn

    from hf_dist import ParallelDims
    from hf_dist.trainer.laid_out import LaidOut, laid_out_by_hf_dist, stamp

    model = stamp(nn.Linear(2, 2), LaidOut(dims=ParallelDims(world_size=2, tp=2), fsdp=False, flops=None))
    assert laid_out_by_hf_dist(model, ParallelDims(world_size=2, tp=2)).dims.tp == 2
    with pytest.raises(ValueError, match="laid out for"):
        laid_out_by_hf_dist(model, ParallelDims(world_size=2, dp_shard=2))
    assert laid_out_by_hf_dist(nn.Linear(2, 2), ParallelDims(world_size=2, dp_shard=2)) is None


def test_a_head_laid_out_for_another_trainers_loss_is_refused():
    """Loaded for DistTrainer (head a unit) but trained by a TRL trainer (fused LM head: head in the root), or back."""
    from torch import nn

    from hf_dist import ParallelDims
    from hf_dist.trainer.laid_out import LaidOut, laid_out_by_hf_dist, stamp

    dims = ParallelDims(world_size=2, dp_shard=2)
    model = stamp(nn.Linear(2, 2), LaidOut(dims=dims, fsdp=True, flops=None, head_unit=True))
    assert laid_out_by_hf_dist(model, dims, head_unit=True) is not None
    with pytest.raises(ValueError, match="lm_head an FSDP2 unit of its own, but .* keeps it in the FSDP2 root .*"
                                         "reads_lm_head_weight=True"):
        laid_out_by_hf_dist(model, dims, head_unit=False)
    tied = stamp(nn.Linear(2, 2), LaidOut(dims=dims, fsdp=True, flops=None, head_unit=None))
    assert laid_out_by_hf_dist(tied, dims, head_unit=False) is not None
