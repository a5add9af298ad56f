"""The router load-balancing (aux) loss of mixture-of-experts models, weighted the same whatever the batch split.

A MoE model with ``output_router_logits=True`` adds ``router_aux_loss_coef * aux_loss`` to its loss on every
forward (``load_balancing_loss_func`` in its modeling file). The Trainer normalises the language-model part by
``num_items_in_batch`` (the tokens of the whole optimizer step), so it does not divide the loss by the gradient
accumulation; the aux term, a per-forward mean, was therefore summed over the accumulation steps: its weight was
``coef x accumulation`` and the same global batch trained differently at micro 8 x 1 than at micro 2 x 4.

``reweigh_router_loss`` rewrites the aux term of one micro step's training loss so that, after the Trainer's own
scaling, the DDP/FSDP gradient average over dp ranks and the sum over accumulation steps, the step's gradient is
``coef x mean(aux)`` over every micro-batch of the global batch, for any micro batch, accumulation and dp.
Two scopes (``DistTrainingArguments.router_aux_loss_scope``):

- ``micro_batch`` (default, what the models define): each forward's aux from its own micro-batch's router
  statistics. The weight is split-independent; the value still depends on the micro-batch size (the aux is a
  product of two means over the tokens it sees), so runs with the same micro batch agree whatever the
  accumulation and dp.
- ``global_batch``: the router logits (and attention masks) of every dp rank are gathered, with gradients,
  before the model's own ``load_balancing_loss_func`` runs, so the statistics span ``micro x dp`` sequences:
  with accumulation 1 that is the whole global batch, equal to one process computing the aux on it. With
  accumulation the step's aux is the mean over accumulation steps of these dp-pooled values (pooling across
  accumulation steps would need every micro step's routing before the first backward).

``ExpertLoad`` counts the tokens routed to each expert per layer for ``--dist_logging`` (max / mean per layer).
Under context parallelism the model's forward already returns the micro-batch's aux (statistics pooled over the cp
ranks, ``hf_dist.context_parallel.router``), which is reweighed here like any other; ``global_batch`` is refused
with CP (``DistTrainingArguments``). Under CP the forward returns each rank's slice's router logits, and
``ExpertLoad`` sums its counts over the dp x cp ranks: every token of the global batch once. Not for: the loss's language-model part (the model's, normalised by the Trainer), pipeline stages
(``hf_dist.pipeline_parallel``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_dist.families import num_experts as expert_count
from hf_dist.models.router import aux_loss_coef, load_balancing_fn

SCOPES = ("micro_batch", "global_batch")


def check_scope(scope: str) -> None:
    if scope not in SCOPES:
        raise ValueError(f"router_aux_loss_scope={scope!r} is not a scope; use one of {', '.join(SCOPES)} "
                         f"(micro_batch: each forward's own tokens, as the models define it; global_batch: router "
                         f"statistics pooled over the data-parallel ranks)")


def router_aux_parts(model, outputs) -> tuple[float, torch.Tensor] | None:
    """``(router_aux_loss_coef, aux_loss)`` of a MoE forward whose loss includes the aux term, else None."""
    aux = outputs.get("aux_loss") if isinstance(outputs, dict) else None
    coef = aux_loss_coef(model)
    if aux is None or not torch.is_tensor(aux) or not coef:
        return None
    return coef, aux


def _gather_rows(per_layer: tuple[torch.Tensor, ...], mask: torch.Tensor, group) -> tuple[tuple, torch.Tensor]:
    """Every dp rank's router logits ``(batch x seq, experts)`` per layer and masks ``(batch, seq)``, padded to the
    largest batch and length with masked rows, concatenated over ranks; gradients flow back to each rank's own."""
    from torch.distributed.nn.functional import all_gather

    size = torch.tensor(mask.shape, device=mask.device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    rows, cols = (max(int(s[i]) for s in sizes) for i in (0, 1))
    pad = (0, cols - mask.shape[1], 0, rows - mask.shape[0])
    masks = [torch.zeros_like(mask) for _ in sizes]
    dist.all_gather(masks, torch.nn.functional.pad(mask, pad), group=group)
    gathered = []
    for logits in per_layer:
        local = logits.reshape(*mask.shape, -1)
        local = torch.nn.functional.pad(local, (0, 0) + pad)
        gathered.append(torch.cat(all_gather(local, group=group)).reshape(-1, local.shape[-1]))
    return tuple(gathered), torch.cat(masks)


def global_batch_aux(model, outputs, inputs, group) -> torch.Tensor:
    """The model's aux loss on the router statistics of every rank in ``group`` (this micro step)."""
    model = getattr(model, "module", model)  # DDP
    while not hasattr(model, "num_experts_per_tok") and hasattr(model, "base_model") and model.base_model is not model:
        model = model.base_model  # PEFT wrappers
    mask = inputs.get("attention_mask")
    if mask is None:
        mask = torch.ones(inputs["input_ids"].shape, dtype=torch.long, device=inputs["input_ids"].device)
    per_layer = tuple(outputs["router_logits"])
    if group is not None and dist.get_world_size(group) > 1:
        per_layer, mask = _gather_rows(per_layer, mask, group)
    num_experts = getattr(model, "num_experts", None) or expert_count(model.config)
    fn = load_balancing_fn(model)
    if fn is None:
        raise ValueError(f"router_aux_loss_scope='global_batch': {type(model).__name__} has no "
                         f"load_balancing_loss_func in its modeling module; use router_aux_loss_scope='micro_batch'")
    return fn(per_layer, num_experts, model.num_experts_per_tok, mask)


def reweigh_router_loss(trainer, model, loss, outputs, inputs, num_items_in_batch) -> torch.Tensor:
    """One training micro step's loss with its aux term weighted ``coef / accumulation`` (see the module doc).

    ``loss`` is what ``Trainer.compute_loss`` returned: ``(lm + coef x aux) x s``, with ``s`` the number of dp
    processes when the Trainer normalised by ``num_items_in_batch`` (it then skips dividing by the accumulation),
    else 1 (and the Trainer divides by the accumulation afterwards). A loss the Trainer did not take from the model
    (a label smoother, ``compute_loss_func``, no labels given to the model) holds no aux term: it is left as is.
    """
    if trainer.label_smoother is not None or trainer.compute_loss_func is not None or "labels" not in inputs:
        return loss
    parts = router_aux_parts(trainer.accelerator.unwrap_model(model), outputs)
    if parts is None:
        return loss
    coef, aux = parts
    scaled_for_ga = trainer.model_accepts_loss_kwargs and num_items_in_batch is not None
    applied = 1.0
    if scaled_for_ga and trainer.args.average_tokens_across_devices:
        applied = trainer.accelerator.num_processes // trainer.get_tp_size()
    wanted = aux
    if trainer.args.router_aux_loss_scope == "global_batch":
        wanted = global_batch_aux(trainer.accelerator.unwrap_model(model), outputs, inputs, dp_group(trainer))
    steps = trainer.current_gradient_accumulation_steps if scaled_for_ga else 1
    return loss + coef * (wanted.to(loss.device) / steps - aux.to(loss.device) * applied)


def dp_group(trainer, *, with_cp: bool = False):
    """The process group of the ranks holding different data: the mesh's dp axis under hf_dist's own layouts (with
    ``with_cp``, dp x cp: the ranks holding different tokens), every rank under accelerate's DDP and DeepSpeed; None
    on one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    dims = trainer.dims
    if getattr(dims, "_mesh", None) is not None:
        axis = "dp_cp" if with_cp and dims.cp > 1 else "dp"
        return dims.get_mesh(axis).get_group() if (dims.dp_cp if axis == "dp_cp" else dims.dp) > 1 else None
    return dist.group.WORLD


class ExpertLoad:
    """Tokens routed to each expert per layer, summed between logs; ``report()`` (every rank, at a log) sums them
    over the dp ranks and returns ``expert_load_max_over_mean/layer{i}``: 1.0 is a perfectly balanced router."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None  # (layers, experts)

    def add(self, model, outputs) -> None:
        logits = outputs.get("router_logits") if isinstance(outputs, dict) else None
        top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
        if not logits or not top_k:
            return
        with torch.no_grad():
            counts = torch.stack([
                torch.bincount(layer.topk(top_k, dim=-1).indices.reshape(-1), minlength=layer.shape[-1]).double()
                for layer in logits
            ])
        self.counts = counts if self.counts is None else self.counts + counts

    def report(self, group) -> dict[str, float]:
        if self.counts is None:
            return {}
        counts, self.counts = self.counts, None
        if group is not None:
            dist.all_reduce(counts, group=group)
        ratio = counts.max(dim=-1).values / counts.mean(dim=-1).clamp_min(1e-12)
        return {f"expert_load_max_over_mean/layer{i}": round(float(r), 4) for i, r in enumerate(ratio)}
