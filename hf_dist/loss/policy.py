"""Where the chunked loss is used, and its chunk size: shared by DistTrainer (``hf_dist.trainer.loss``), the loss
itself (``hf_dist.loss.chunked``) and the planner (``Workload.chunked_loss``). Pure; no torch."""

from __future__ import annotations

DEFAULT_CHUNK_ELEMENTS = 1 << 24
"""Logit elements per chunk (64 MiB in fp32): ``chunk_tokens = DEFAULT_CHUNK_ELEMENTS // vocab``."""


def chunk_tokens_for(vocab: int, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Tokens per chunk so that one chunk's logits hold about ``chunk_elements`` values (at least one token)."""
    return max(1, chunk_elements // max(1, vocab))


def layout_refusal(layout) -> str | None:
    """Why a run of ``layout`` (``hf_dist.strategy.Layout``) keeps the model's own loss (None: chunked).

    Under PP the last stage computes it (``hf_dist.pipeline_parallel.apply``); its head is whole there, and a tied
    head's copy is an ordinary parameter whose gradient ``TiedEmbeddingSync`` sums as before."""
    refusal = dims_refusal(layout.dims)
    if refusal is not None:
        return refusal
    if layout.is_deepspeed:
        return "DeepSpeed gathers the head only inside its own forward"
    return None


def dims_refusal(dims) -> str | None:
    """Why a mesh of ``dims`` (``hf_dist.parallel_dims.ParallelDims``) keeps the model's own loss (None: chunked)."""
    if dims.tp > 1:
        return "tensor parallelism has its own loss"
    return None
