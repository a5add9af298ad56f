"""Where the chunked loss is used, and its chunk size: shared by DistTrainer (``hf_dist.trainer.loss``), the loss
itself (``hf_dist.loss.chunked``) and the planner (``Workload.chunked_loss``). Pure; no torch."""

from __future__ import annotations

DEFAULT_CHUNK_ELEMENTS = 1 << 24
"""Logit elements whose fp32 cross-entropy runs at once (64 MiB in fp32): ``piece_tokens_for``."""


def piece_tokens_for(vocab: int, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Tokens whose logits go through the fp32 cross-entropy at once: about ``chunk_elements`` logits."""
    return max(1, chunk_elements // max(1, vocab))


def chunk_tokens_for(vocab: int, hidden: int, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Tokens per chunk through the head's matmuls: ``piece_tokens_for(vocab)``, and never fewer than ``hidden``.

    Each chunk adds its ``[vocab, hidden]`` product to the head's fp32 gradient, a fixed cost per chunk the size of
    the head; with chunks of at least ``hidden`` tokens it stays below the chunk's own logits work. A chunk's logits
    are held once, in the compute dtype (about the head weight's size), and go through the fp32 cross-entropy piece
    by piece. Measured on an H200 (``docs/benchmarks.md``, a 1B Llama, vocab 128,256, hidden 2,048, 4,096 tokens a
    step, bf16): one level of 130-token chunks took 1.53x the whole loss's step time (1.38x once the gradient's sum
    was made in place); these chunks 1.07x, at 26.4 GiB against the whole loss's 30.0 (with autograd's piece
    gradient, since replaced by the closed form: not yet measured on a GPU)."""
    return max(piece_tokens_for(vocab, chunk_elements), hidden)


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


def loss_option_refusal(layout, option: str) -> str | None:
    """Why ``option`` (``"label_smoothing_factor=0.1"`` or ``"compute_loss_func"``: a Trainer loss made from the
    model's whole logits and whole labels) cannot run on ``layout``; None where it equals one process.

    Under PP the last stage computes plain token-weighted cross-entropy itself; under CP each rank's logits cover
    its slice of the sequence while the Trainer hands the option the whole labels; with vocabulary-parallel TP each
    rank's logits cover its slice of the vocabulary. ``tests/test_loss_options.py`` runs the rest against one
    process (DDP, FSDP2, TP with the head whole)."""
    if layout.pp > 1:
        return (f"{option} with pp_size={layout.pp}: the last pipeline stage computes plain token-weighted "
                f"cross-entropy, so it would be ignored; drop {option.split('=')[0]} or set pp_size=1")
    if layout.cp > 1:
        return (f"{option} with cp_size={layout.cp}: each cp rank's logits cover its slice of the sequence, and the "
                f"Trainer would give it the whole labels; drop {option.split('=')[0]} or set cp_size=1")
    if layout.tp > 1 and layout.vocab_parallel:
        return (f"{option} with tp_size={layout.tp} and tp_vocab_parallel=True: each tp rank's logits cover its slice "
                f"of the vocabulary; set tp_vocab_parallel=False (the head whole on every rank) or drop "
                f"{option.split('=')[0]}")
    return None
