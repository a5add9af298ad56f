"""The router aux loss of a mixture-of-experts model under context parallelism: the micro-batch's, as one process.

A MoE model's load-balancing loss is a product of two means over the tokens of one forward (the top-k assignments
and the router probabilities per expert, ``hf_dist.models.router``). Under CP each rank routes only its slice of
every sequence, so its own ``load_balancing_loss_func`` would see a slice -- and the whole-sequence
``attention_mask`` it is handed does not even match the slice's router logits. Instead, while the split is active,
the model is asked for no router logits (so it computes no aux of its own), the routers' logits are recorded by
hooks, summed into ``RouterStats`` with this rank's slice of the mask (the one definition the pipeline stages use;
positions the training step padded on to make the sequence divide are masked out too),
all-reduced over the cp group with autograd, and turned into the model's aux by ``aux_from_stats``. The forward then
returns what one process returns for the micro-batch: ``aux_loss`` the micro-batch's value and ``loss`` with
``router_aux_loss_coef x aux_loss`` added (when labels were given).

Gradients: every cp rank adds the same aux; the all-reduce's backward sums the cp ranks' gradients into each rank's
own statistics, and the gradient average over the ``dp x cp`` ranks divides that sum by ``cp`` again, so the step
weighs the aux as one process does (``inputs.token_weighted_loss`` and ``hf_dist.trainer.router_loss`` weigh it
once per micro-batch). The hooks only keep references: the statistics are computed after the forward, outside any
activation-checkpointed layer, so recomputation in backward replays the layer exactly.

Not for: the weighting of the aux over accumulation and dp (``hf_dist.trainer.router_loss``), pipeline stages.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_dist.models.router import RouterStats, aux_from_stats, aux_loss_coef, num_experts, router_recorder


class PooledRouterLoss:
    """Hooks on one model that make its forward under the CP split return the micro-batch's router aux loss."""

    def __init__(self, lm: nn.Module, state) -> None:
        self.state = state
        self.lm = lm
        self.experts = num_experts(lm.config)
        self.top_k = lm.config.num_experts_per_tok
        self.recorded: list[torch.Tensor] | None = None
        self.mask: torch.Tensor | None = None
        router_class, index = router_recorder(lm)
        for module in lm.modules():
            if isinstance(module, router_class):
                module.register_forward_hook(self._record(index))
        lm.register_forward_pre_hook(self._begin, with_kwargs=True)
        lm.register_forward_hook(self._end, with_kwargs=True)

    def _record(self, index: int):
        def record(module, args, output):
            if self.recorded is not None:
                self.recorded.append(output[index] if isinstance(output, (tuple, list)) else output)
        return record

    def _begin(self, module, args, kwargs):
        wanted = kwargs.get("output_router_logits")
        if wanted is None:
            wanted = getattr(self.lm.config, "output_router_logits", False)
        if not (self.state.active and wanted):
            return None
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise ValueError(f"attention_mask of shape {tuple(mask.shape)} under context parallelism with a router "
                             f"aux loss: the aux loss masks tokens by a (batch, sequence) mask; pass a 2-D "
                             f"attention_mask (or none) or set output_router_logits=False")
        if mask is None and self.state.padding:  # the positions ``inputs.pad_to_slices`` added count for nothing
            mask = _unpadded(kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None)),
                             self.state.padding)
        self.mask = None if mask is None else self.state.local(mask)
        self.recorded = []
        kwargs["output_router_logits"] = False  # the model's own aux would see this rank's slice only
        return args, kwargs

    def _end(self, module, args, kwargs, output):
        if self.recorded is None:
            return None
        recorded, mask = self.recorded, self.mask
        self.recorded, self.mask = None, None
        if not isinstance(output, dict):
            raise ValueError(f"{type(self.lm).__name__} returned a {type(output).__name__} under context parallelism "
                             f"with a router aux loss; call it with return_dict=True (the aux is set on its output)")
        aux = self.aux(recorded, mask)
        output["aux_loss"] = aux
        output["router_logits"] = tuple(recorded)  # this rank's slice's, as asked for (``--dist_logging`` counts them)
        if output.get("loss") is not None:
            output["loss"] = output["loss"] + aux_loss_coef(self.lm) * aux.to(output["loss"].device)
        return output

    def aux(self, recorded: list[torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
        """The aux loss of the whole micro-batch from this rank's routers' logits, pooled over the cp group."""
        from torch.distributed.nn.functional import all_reduce

        if not recorded:
            raise RuntimeError(f"{type(self.lm).__name__}: no router ran in a forward under context parallelism")
        stats = RouterStats(self.experts, self.top_k)
        stats.begin(None, mask, recorded[0].shape[0], recorded[0].device)
        for logits in recorded:
            stats.add(logits)
        return aux_from_stats(all_reduce(stats.end(), group=self.state.group), self.experts)


def _unpadded(ids: torch.Tensor, padding: int) -> torch.Tensor:
    """A (batch, sequence) mask of ``ids``'s positions: 1, but 0 on the last ``padding``."""
    mask = torch.ones(ids.shape[:2], dtype=torch.long, device=ids.device)
    mask[:, ids.shape[1] - padding:] = 0
    return mask
