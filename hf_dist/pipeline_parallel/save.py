"""Save a pipelined model as one normal HF directory (or one PEFT adapter) that loads without hf_dist.

The keys are HF keys already (``CausalLMStage`` keeps HF names), so the result loads with
``AutoModelForCausalLM.from_pretrained`` or ``PeftModel.from_pretrained`` on a non-PP model.

A whole model is streamed (``save_pretrained``): the ranks agree on every stage's tensor names and shapes, then
take the tensors one at a time in the unsplit model's order. The stage that owns a tensor makes it whole over its
own mesh (``hf_dist.state_dict.hf_layout``: FSDP/TP shards gathered, fused rows in HF order), its rank in global
rank 0's pipeline sends it to rank 0, and rank 0 adds it to the output file it is writing
(``hf_dist.state_dict.write_streaming``). Rank 0 never holds more than one output file plus one tensor; a tied
weight is written once, under the name the unsplit model's ``save_pretrained`` keeps. A PEFT adapter (small) is
gathered whole to rank 0 and written as PEFT writes it. ``gather_state_dict`` gathers a whole model to rank 0, for
tests and small models only.

Not for: resuming optimizer state (``hf_dist.checkpoint``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hf_dist.hub_writer import ADAPTER_FILES, write_weights
from hf_dist.models.peft_utils import is_peft_model
from hf_dist.pipeline_parallel.pipeline import PipelinedCausalLM
from hf_dist.pipeline_parallel.stage_module import causal_lm_of
from hf_dist.state_dict import full_state_dict, fused_keys, held, hf_layout, write_streaming


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


def save_pretrained(pipe: PipelinedCausalLM, output_dir: str, *, max_shard_bytes: int | None = None) -> None:
    """Write ``output_dir`` as ``save_pretrained`` on the unsplit model would (adapter only for PEFT models).

    Every rank must call it; only global rank 0 writes. Ends with a barrier, so the files exist on return.
    ``max_shard_bytes``: the largest output file (default ``hf_dist.state_dict.DEFAULT_SHARD_BYTES``).
    """
    model = pipe.source_model
    if is_peft_model(model):
        adapters = gather_adapter_state_dicts(pipe)
        if adapters is not None:
            _write_adapters(model, adapters, output_dir)
        dist.barrier()
        return
    local = _local_tensors(pipe)
    entries, owners = _plan(pipe, local)
    fetch = _fetcher(pipe, local, owners, entries)
    kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    write_streaming(causal_lm_of(model), output_dir, entries, fetch, **kwargs)


def _local_tensors(pipe: PipelinedCausalLM) -> dict[str, tuple[torch.Tensor, dict]]:
    """``{HF key: (this rank's state-dict value, its stage's fused_keys)}`` over this rank's stages."""
    out: dict[str, tuple[torch.Tensor, dict]] = {}
    for module in pipe.modules:
        fused = fused_keys(module)
        for key, value in module.state_dict().items():
            out.setdefault(key, (value, fused))
    return out


def _plan(pipe: PipelinedCausalLM, local: dict) -> tuple[dict, dict[str, int]]:
    """Every stage's ``{key: (global shape, dtype)}`` in the unsplit model's order, tied copies dropped, and the
    pp rank that sends each key (the first that holds it). Collective over the pipeline group."""
    mine = {key: (tuple(value.shape), value.dtype) for key, (value, _) in local.items()}
    every: list = [None] * pipe.dims.pp
    dist.all_gather_object(every, mine, group=pipe.pp_group)
    owners: dict[str, int] = {}
    shapes: dict = {}
    for pp_rank, entries in enumerate(every):
        for key, entry in entries.items():
            owners.setdefault(key, pp_rank)
            shapes.setdefault(key, entry)
    order, aliases = _unsplit_order(pipe.source_model)
    keys = [k for k in order if k in shapes] + [k for k in shapes if k not in order and k not in aliases]
    return {k: shapes[k] for k in keys}, owners


def _unsplit_order(model) -> tuple[list[str], set[str]]:
    """The unsplit model's state-dict keys in order without tied copies, and the tied copies' names
    (from a meta-device twin: the live model lost its other stages' modules when it was split)."""
    lm = causal_lm_of(model)
    with torch.device("meta"):
        twin = type(lm)(lm.config)
    kept = {name for name, _ in twin.named_parameters()}
    aliases = {name for name, _ in twin.named_parameters(remove_duplicate=False)} - kept
    return [k for k in twin.state_dict() if k not in aliases], aliases


def _fetcher(pipe: PipelinedCausalLM, local: dict, owners: dict[str, int], entries: dict):
    """``fetch(key)`` for ``write_streaming``: the owning stage gathers, its rank in rank 0's pipeline sends."""
    rank = dist.get_rank()
    coords = pipe.dims.coordinates(rank)
    in_first_pipeline = coords["dp"] == 0 and coords["tp"] == 0
    ranks = pipe.dims.mesh.mesh  # (pp, dp_replicate, dp_shard, tp) global ranks

    def fetch(key: str) -> torch.Tensor | None:
        owner = owners[key]
        sender = int(ranks[owner].reshape(-1)[0])
        if pipe.pp_rank == owner:
            value, fused = local[key]
            value = hf_layout(key, value, fused)  # collective over this stage's mesh (all its dp/tp ranks)
            if rank == 0:
                return value
            if in_first_pipeline and rank == sender:
                dist.send(_as_bytes(value, pipe.device), dst=0, group=pipe.pp_group)
            return None
        if rank == 0:
            shape, dtype = entries[key]
            received = torch.empty(_nbytes(shape, dtype), dtype=torch.uint8, device=pipe.device)
            dist.recv(received, src=sender, group=pipe.pp_group)
            return held(received.to("cpu").view(dtype).reshape(shape))
        return None

    return fetch


def _as_bytes(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor's bytes on the pipeline's device (its p2p backend sends every dtype this way)."""
    return value.detach().contiguous().reshape(-1).view(torch.uint8).to(device)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _write_adapters(model, adapters: dict[str, dict[str, torch.Tensor]], output_dir: str) -> None:
    for name, adapter in adapters.items():
        target = output_dir if name == "default" else os.path.join(output_dir, name)
        os.makedirs(target, exist_ok=True)
        entries = {key: (tuple(value.shape), value.dtype) for key, value in adapter.items()}
        write_weights(target, entries, lambda keys, part=adapter: {k: part[k] for k in keys}, max_shard_size=None,
                      filename_pattern=ADAPTER_FILES)
        model.peft_config[name].save_pretrained(target)
