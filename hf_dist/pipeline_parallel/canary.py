"""The before-launch layout canary: the requested pipeline layout, on a tiny twin of the user's config, must
give the unsplit twin's loss and gradients on the real ranks, or training does not start.

``check_pipeline_layout`` builds ``tiny_twin(config)`` (same class, every behaviour field kept, sizes shrunk),
runs one fp32 pipeline step of it with the requested ``ParallelDims`` and schedule (TP, FSDP and EP included) on
a padded batch, and compares the loss and every gradient with the same twin's one-process step on the same
micro-batches (``hf_dist.models.reference``: a MoE router aux loss per micro-batch, as the run has it). On a
difference it raises ``ValueError`` on every rank, naming the architecture, the layout and the size of the
difference. It takes about a second; ``DistTrainingArguments(layout_canary=False)`` skips it.

It proves the *code path* for this architecture and these settings; precision (bf16) is not its concern.
Not for: the support decision itself (``support``), which refuses by model type before any process starts.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.distributed as dist

from hf_dist.pipeline_parallel.schedules import PipelineConfig

SEQ = 32
LOSS_ATOL = 1e-5
GRAD_RTOL = 1e-4  # max |g_pp - g_ref| over max |g_ref|, per parameter

logger = logging.getLogger(__name__)


def _twin_batch(rows: int, vocab: int) -> dict[str, torch.Tensor]:
    """Right-padded rows of different lengths, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (rows, SEQ), generator=g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (rows,), generator=g)
    lengths[0] = SEQ // 2  # at least one padded row: the mask path is exercised
    mask = (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _build_twin(config, dims, num_stages: int):
    from transformers import AutoModelForCausalLM

    from hf_dist.models.twin import tiny_twin

    twin_config = tiny_twin(config, layers=max(4, num_stages), width=dims.tp)
    with torch.random.fork_rng(devices=[]):  # the same twin on every rank; the caller's generator left as it was
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(twin_config).float()


def _worst_gradient(pipe, ref_grads: dict[str, torch.Tensor]) -> tuple[float, str]:
    """``(max |g_pp - g_ref| / max |g_ref|, its parameter)`` over this rank's parameters. Collective over tp/dp.

    Each gradient is compared whole and in HF row order: the TP shards of a fused projection (Phi-3 ``qkv_proj``,
    GLM ``gate_up_proj``) hold their rows rank-major (``FusedColwiseParallel``), not in the model's order.
    """
    from hf_dist.state_dict import fused_keys, hf_layout

    fused = {key: parts for stage in pipe.modules for key, parts in fused_keys(stage).items()}
    worst, where = 0.0, ""
    for name, param in pipe.named_parameters():
        if param.grad is None:
            grad = torch.zeros_like(hf_layout(name, param, fused))
        else:
            grad = hf_layout(name, param.grad, fused)
        ref = ref_grads.get(name, torch.zeros_like(grad))
        diff = float((grad - ref).abs().max() / ref.abs().max().clamp(min=1e-6))
        if diff > worst:
            worst, where = diff, name
    return worst, where


def _differences(config, dims, pipeline_config: PipelineConfig, device) -> tuple[float, float, str]:
    """``(loss difference, worst relative grad difference, worst parameter)`` on this rank."""
    from hf_dist.models.reference import reference_step, split_rows
    from hf_dist.pipeline_parallel.pipeline import PipelinedCausalLM

    # Split points name the user's layers; the twin has fewer, so it is balanced instead.
    twin_pipeline = dataclasses.replace(pipeline_config, split_points=None)
    num_stages = dims.pp * twin_pipeline.virtual_stages
    reference = _build_twin(config, dims, num_stages).to(device)
    rows = twin_pipeline.microbatches * max(dims.dp, 1)  # one row per micro-batch on every dp rank
    batch = {k: v.to(device) for k, v in _twin_batch(rows, reference.config.vocab_size).items()}
    # the step as the run defines it: the router aux loss per micro-batch (hf_dist.models.reference)
    ref_loss = reference_step(reference, split_rows(batch, rows))
    # every name of a tied weight (lm_head.weight too) maps to the one gradient
    ref_grads = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False) if p.grad is not None}
    pipe = PipelinedCausalLM(_build_twin(config, dims, num_stages), dims=dims, config=twin_pipeline, device=device)
    dp_rank = dims.dp_rank(dist.get_rank())
    share = rows // max(dims.dp, 1)
    loss = pipe.train_step({k: v[dp_rank * share : (dp_rank + 1) * share] for k, v in batch.items()})
    worst, where = _worst_gradient(pipe, ref_grads)
    return abs(float(loss) - ref_loss), worst, where


def check_pipeline_layout(config, dims, pipeline_config: PipelineConfig, device="cpu") -> None:
    """Raise ``ValueError`` on every rank when the layout does not reproduce the unsplit twin. Collective."""
    start = time.perf_counter()
    loss_diff, grad_diff, where = _differences(config, dims, pipeline_config, torch.device(device))
    mine = torch.tensor([loss_diff, grad_diff], dtype=torch.float64)
    worst = mine.clone()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if worst[0] <= LOSS_ATOL and worst[1] <= GRAD_RTOL:
        if dist.get_rank() == 0:
            logger.info(
                "layout canary: %s %s reproduces the unsplit %s twin (loss %.2g, gradients %.2g relative) in %.1f s",
                _describe(dims), pipeline_config.schedule, config.model_type, float(worst[0]), float(worst[1]),
                time.perf_counter() - start,
            )
        return
    named = where if float(mine[1]) == float(worst[1]) else "another rank's parameter"
    raise ValueError(
        f"layout canary: {_describe(dims)} (schedule={pipeline_config.schedule}) does not reproduce "
        f"{type(config).__name__} "
        f"(model_type={config.model_type!r}) on a tiny twin of its config: loss differs by {float(worst[0]):.3g} "
        f"(limit {LOSS_ATOL}), gradients by {float(worst[1]):.3g} relative (limit {GRAD_RTOL}, worst here: {named}). "
        f"Training would be silently wrong; use pp_size=1, or report it. layout_canary=False skips this check"
    )


def _describe(dims) -> str:
    """``pp=2 (tp=1, dp_replicate=1, dp_shard=2, ep=2)``: the sizes the canary ran."""
    return (f"pp={dims.pp} (tp={dims.tp}, dp_replicate={dims.dp_replicate}, dp_shard={dims.dp_shard}, "
            f"ep={dims.ep})")
