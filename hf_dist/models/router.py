"""What hf_dist reads of a mixture-of-experts model's router: its own aux-loss function, the router module its
``_can_record_outputs`` names, and the load-balancing loss split into per-layer statistics that add up.

The models' ``load_balancing_loss_func`` (Switch Transformer eq. 4-6, as transformers writes it) pools every MoE
layer of one forward: ``aux = E * sum_e (C_e / R) * (P_e / R)`` with ``C_e`` the top-k assignments to expert ``e``
and ``P_e`` the softmax probabilities summed over every layer's unmasked tokens, ``R`` the rows summed over layers.
It is not a sum of per-layer terms, so a pipeline stage that holds some of the layers cannot compute its share
alone: ``RouterStats`` keeps ``(C, P, R)`` as one tensor that stages add to and pass on with the hidden states
(``P`` carries the gradient back to every stage's routers), and ``aux_from_stats`` gives the model's value at the
last stage. ``tests/test_pp_moe.py`` checks it equals the model's own function.

Not for: weighting the aux term in the loss (``hf_dist.trainer.router_loss``, ``pipeline_parallel.stage_module``).
"""

from __future__ import annotations

import sys

import torch
from torch import nn


def load_balancing_fn(model: nn.Module):
    """The model's own ``load_balancing_loss_func`` (from its modeling module; FSDP2 subclasses the model's
    class, so the class hierarchy is searched), or None."""
    modules = (sys.modules.get(cls.__module__) for cls in type(model).__mro__)
    return next((m.load_balancing_loss_func for m in modules if hasattr(m, "load_balancing_loss_func")), None)


def adds_router_aux_loss(model: nn.Module) -> bool:
    """Whether ``model``'s training loss includes ``router_aux_loss_coef * aux`` (its config asks for router logits,
    the coefficient is non-zero and its modeling module defines the aux loss)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0)
                and load_balancing_fn(model) is not None)


def aux_loss_coef(model: nn.Module) -> float | None:
    """The coefficient ``model``'s forward multiplies its aux loss by: the causal LM's own ``router_aux_loss_coef``
    attribute (set from the config at init, and what its ``forward`` reads), else the config's."""
    coef = getattr(model, "router_aux_loss_coef", None)
    if not isinstance(coef, (int, float)) or isinstance(coef, bool):
        coef = getattr(getattr(model, "config", None), "router_aux_loss_coef", None)
    return None if coef is None else float(coef)


def router_recorder(model: nn.Module):
    """``(router module class, index of the logits in its output)`` from the model's ``_can_record_outputs``."""
    recorder = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None or not hasattr(recorder, "target_class"):
        raise ValueError(f"{type(model).__name__} records no router_logits (_can_record_outputs): its router "
                         f"aux loss cannot be collected per pipeline stage; train it with pp_size=1")
    return recorder.target_class, recorder.index


def num_experts(config) -> int:
    """Routed experts per MoE layer (``hf_dist.families.num_experts``); ``ValueError`` for a config without."""
    from hf_dist.families import num_experts as count

    value = count(config)
    if value is None:
        raise ValueError(f"model_type={config.model_type!r}: no expert count in its config")
    return value


class RouterStats:
    """Per forward: ``[C (E), P (E), R (1)]`` of the router layers run so far, as the model's aux loss counts them."""

    def __init__(self, experts: int, top_k: int) -> None:
        self.experts, self.top_k = experts, top_k
        self.total: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None  # (tokens,) float: 0 on padding
        self.pending: list[torch.Tensor] = []
        """Router logits the hooks kept during the forward, summed by ``end`` (outside any checkpointed layer: an
        op inside one would be missing from its recomputation, which activation checkpointing refuses)."""

    def begin(self, incoming: torch.Tensor | None, mask: torch.Tensor | None, tokens: int, device) -> None:
        self.mask = (mask.reshape(-1).float() if mask is not None else torch.ones(tokens, device=device))
        self.total = incoming if incoming is not None else torch.zeros(2 * self.experts + 1, device=device)

    def add(self, logits: torch.Tensor) -> None:
        """One router layer's logits ``(tokens, experts)``: its masked assignments, probabilities and rows."""
        mask = self.mask.to(logits.device)
        weights = torch.softmax(logits, dim=-1)
        _, selected = torch.topk(weights, self.top_k, dim=-1)
        counts = torch.zeros(self.experts, device=logits.device).scatter_add_(
            0, selected.reshape(-1), mask.repeat_interleave(self.top_k))
        probs = (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
        self.total = self.total + torch.cat([counts, probs, mask.sum().reshape(1)])

    def hook(self, index: int):
        def record(module, args, output):
            if self.total is not None:  # between begin and end; not in a recomputation during backward
                self.pending.append(output[index] if isinstance(output, (tuple, list)) else output)
        return record

    def end(self) -> torch.Tensor:
        for logits in self.pending:
            self.add(logits)
        total, self.total, self.mask, self.pending = self.total, None, None, []
        return total


def aux_from_stats(stats: torch.Tensor, experts: int) -> torch.Tensor:
    """The model's ``load_balancing_loss_func`` value from summed ``RouterStats``; gradients flow through ``P``."""
    counts, probs, rows = stats[:experts].detach(), stats[experts:2 * experts], stats[-1].detach()
    return torch.sum((counts / rows) * (probs / rows)) * experts
