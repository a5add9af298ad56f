"""Save a pipelined model as one normal HF directory (or one PEFT adapter) that loads without hf_dist.

Every rank turns its stages' parameters into full tensors (``hf_dist.state_dict``: FSDP/TP shards gathered over
their mesh, a collective), the ranks of the pipeline group that holds global rank 0 send theirs to it, and rank 0 writes
with ``save_pretrained``. The keys are HF keys already (``CausalLMStage`` keeps HF names), so the result
loads with ``AutoModelForCausalLM.from_pretrained`` or ``PeftModel.from_pretrained`` on a non-PP model.

Rank 0 holds the whole state dict in CPU memory while writing; for models too large for that, save with
DCP (``torch.distributed.checkpoint``) and consolidate offline. Not for: resuming optimizer state.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hf_dist.pipeline_parallel.pipeline import PipelinedCausalLM
from hf_dist.pipeline_parallel.stage_module import causal_lm_of
from hf_dist.state_dict import full_state_dict


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def local_state_dict(pipe: PipelinedCausalLM, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """This rank's stages as full CPU tensors under HF keys (``hf_dist.state_dict.full_state_dict`` per stage:
    FSDP/TP shards gathered, fused projections in HF row order). Collective over dp/tp when sharded."""
    out: dict[str, torch.Tensor] = {}
    for module in pipe.modules:
        out.update(full_state_dict(module, trainable_only=trainable_only))
    return out


def _gather_to_rank0(pipe: PipelinedCausalLM, local: dict) -> list[dict] | None:
    """The pp ranks' dicts, in pp-rank order, on global rank 0 (None elsewhere)."""
    coords = pipe.dims.coordinates(dist.get_rank())
    if coords["dp"] != 0 or coords["tp"] != 0:
        return None  # another pipeline group holds global rank 0; its copy is identical
    parts: list | None = [None] * pipe.dims.pp if pipe.pp_rank == 0 else None
    dist.gather_object(local, parts, group=pipe.pp_group, group_dst=0)
    return parts


def gather_state_dict(pipe: PipelinedCausalLM, *, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict (HF keys) on global rank 0, None on every other rank. Every rank calls it."""
    parts = _gather_to_rank0(pipe, local_state_dict(pipe, trainable_only=trainable_only))
    return None if parts is None else {k: v for part in parts for k, v in part.items()}


def gather_adapter_state_dicts(pipe: PipelinedCausalLM) -> dict[str, dict[str, torch.Tensor]] | None:
    """``{adapter name: PEFT-format adapter state dict}`` of all stages on global rank 0 (None elsewhere).

    Each rank selects its own adapter tensors with PEFT (which walks the LoRA layers it still holds), so the
    keys are exactly what ``PeftModel.save_pretrained`` writes.
    """
    from peft import get_peft_model_state_dict

    model = pipe.source_model
    prefixed = {f"base_model.model.{k}": v for k, v in local_state_dict(pipe, trainable_only=True).items()}
    local = {
        name: get_peft_model_state_dict(model, state_dict=prefixed, adapter_name=name, save_embedding_layers=False)
        for name in model.peft_config
    }
    parts = _gather_to_rank0(pipe, local)
    if parts is None:
        return None
    return {name: {k: v for part in parts for k, v in part[name].items()} for name in local}


def save_pretrained(pipe: PipelinedCausalLM, output_dir: str) -> None:
    """Write ``output_dir`` as ``save_pretrained`` on the unsplit model would (adapter only for PEFT models).

    Every rank must call it; only global rank 0 writes. Ends with a barrier, so the files exist on return.
    """
    model = pipe.source_model
    if _is_peft(model):
        adapters = gather_adapter_state_dicts(pipe)
        if adapters is not None:
            _write_adapters(model, adapters, output_dir)
    else:
        state = gather_state_dict(pipe)
        if state is not None:
            _write_full(model, state, output_dir)
    dist.barrier()


def _write_full(model, state: dict[str, torch.Tensor], output_dir: str) -> None:
    os.makedirs(output_dir, exist_ok=True)
    lm = causal_lm_of(model)
    lm.config.save_pretrained(output_dir)
    if getattr(lm, "generation_config", None) is not None:
        lm.generation_config.save_pretrained(output_dir)
    from transformers.modeling_utils import PreTrainedModel

    # Write through a meta-device twin: the live model lost its non-local modules when it was split.
    with torch.device("meta"):
        twin = type(lm)(lm.config)
    # Tied weights arrive as two copies (one per stage); the checkpoint holds the tensor once, under the name
    # the unsplit model's save_pretrained would use.
    kept = {name for name, _ in twin.named_parameters()}
    aliases = {name for name, _ in twin.named_parameters(remove_duplicate=False)} - kept
    state = {key: value for key, value in state.items() if key not in aliases}
    PreTrainedModel.save_pretrained(twin, output_dir, state_dict=state)


def _write_adapters(model, adapters: dict[str, dict[str, torch.Tensor]], output_dir: str) -> None:
    from safetensors.torch import save_file

    for name, adapter in adapters.items():
        target = output_dir if name == "default" else os.path.join(output_dir, name)
        os.makedirs(target, exist_ok=True)
        save_file({k: v.contiguous() for k, v in adapter.items()}, os.path.join(target, "adapter_model.safetensors"))
        model.peft_config[name].save_pretrained(target)
