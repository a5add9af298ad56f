"""Losses that never build whole ``[batch, seq, vocab]`` logits: ``chunked`` (cross-entropy through the head chunk
by chunk), ``causal_lm`` (a causal LM's loss through its own forward with it), ``policy`` (where DistTrainer and the
planner use it; torch-free). The vocab-parallel TP loss stays in ``hf_dist.tensor_parallel.loss``.

Nothing is imported here, so that the planner can read ``policy`` without torch.
"""
