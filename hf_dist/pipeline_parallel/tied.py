"""Tied input embeddings and lm_head across pipeline stages: one weight, two copies, gradients summed.

With tied embeddings (Llama 3.2 1B/3B, Qwen2.5 small models, ...) the first stage uses the weight as the
embedding and the last stage as the lm_head. When those stages are on different pp ranks each rank keeps a
copy; after every backward the two gradient halves are summed over a two-rank group, so both copies receive
the single-process gradient, and identical optimizer steps keep them identical. When both stages are on one
rank (the V placement of zbv) the two modules share the Parameter and
autograd sums by itself. The gradient norm counts the weight once (on the first stage's rank).

Refused (``ValueError``): tied weights with tensor parallelism (the TP plan shards the lm_head, not the
embedding), and with FSDP when both stages share a rank (one Parameter would be sharded by two FSDP units).
Not for: anything but the embedding / lm_head pair.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hf_dist.pipeline_parallel.stage_module import causal_lm_of, model_parts


def is_tied(model: nn.Module) -> bool:
    """Whether the model's output embedding uses its input embedding's weight."""
    lm = causal_lm_of(model)
    parts = model_parts(lm)
    inp, out = lm.get_submodule(parts.embeds[0]), lm.get_submodule(parts.heads[-1])
    return getattr(out, "weight", None) is getattr(inp, "weight", 0)


class TiedEmbeddingSync:
    """Sums the tied weight's gradient between the first-stage and last-stage ranks of every pipeline."""

    def __init__(self, dims, plan, pp_rank: int) -> None:
        first, last = plan.rank_of(0), plan.rank_of(plan.num_stages - 1)
        if dims.tp_enabled:
            raise ValueError(
                f"tied embeddings with tp={dims.tp} and pp={dims.pp} are not supported (TP shards the lm_head but "
                f"not the embedding); untie them (tie_word_embeddings=False) or use tp=1"
            )
        if first == last and dims.dp_shard > 1:
            raise ValueError(
                f"tied embeddings with the first and last stage on one rank (placement {plan.placement!r}) and "
                f"FSDP (dp_shard={dims.dp_shard}) would shard one weight in two FSDP units; use a loop schedule "
                f"(1f1b, interleaved_1f1b) or untie the embeddings"
            )
        self.local = first == last
        self.holds = pp_rank in (first, last)
        self.counts_in_norm = pp_rank == first  # one rank counts the weight in the global gradient norm
        self.group = None if self.local else self._pair_group(dims, first, last)

    @staticmethod
    def _pair_group(dims, first: int, last: int):
        """The 2-rank group {first-stage rank, last-stage rank} of this rank's pipeline (all ranks create all)."""
        ranks = dims.mesh.mesh  # (pp, dp_replicate, dp_shard, tp) global ranks
        pairs = torch.stack([ranks[first].reshape(-1), ranks[last].reshape(-1)], dim=1).tolist()
        mine = None
        for pair in pairs:  # every rank must call new_group for every pair, in the same order
            group = dist.new_group(pair)
            if dist.get_rank() in pair:
                mine = group
        return mine

    @staticmethod
    def weight(modules: list[nn.Module]) -> nn.Parameter | None:
        """This rank's copy of the tied weight (the embedding's on the first stage, else the lm_head's)."""
        for module in modules:
            if module.is_first:
                return module.input_embeddings().weight
        for module in modules:
            if module.is_last:
                return module.output_embeddings().weight
        return None

    def sync_grads(self, modules: list[nn.Module]) -> None:
        """Sum the two gradient halves (after backward, before clipping and the optimizer step)."""
        if self.local or not self.holds:
            return
        grad = self.weight(modules).grad
        if grad is not None:
            dist.all_reduce(getattr(grad, "_local_tensor", grad), group=self.group)

    def skip_in_norm(self, modules: list[nn.Module]) -> set[int]:
        """``id`` of the parameter this rank must leave out of the global gradient norm (counted elsewhere)."""
        if self.local or self.counts_in_norm or not self.holds:
            return set()
        return {id(self.weight(modules))}
