"""Losses that never build whole ``[batch, seq, vocab]`` logits (``chunked``), driven through the model's own
forward (``causal_lm``). The vocab-parallel TP loss stays in ``hf_dist.tensor_parallel.loss``."""

from hf_dist.loss.causal_lm import ChunkedCausalLMLoss, chunked_loss_refusal
from hf_dist.loss.chunked import LogitTransform, linear_cross_entropy

__all__ = ["ChunkedCausalLMLoss", "LogitTransform", "chunked_loss_refusal", "linear_cross_entropy"]
