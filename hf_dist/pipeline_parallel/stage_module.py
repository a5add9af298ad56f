"""One pipeline stage of an HF decoder-only causal LM, and the token-weighted causal-LM loss.

``CausalLMStage`` holds the modules a ``StagePlan`` stage owns, taken by reference from the HF model, under
the same names (``model.embed_tokens``, ``model.layers.<i>``, ``model.norm``, ``lm_head``), so its
``state_dict()`` keys are the HF checkpoint keys. Its forward runs the HF decoder layers the way the HF
base model does: every stage recomputes the rotary embeddings from the positions and builds the
padding-aware causal mask from the attention mask (both are passed to every stage as keyword
arguments, so nothing but the hidden states travels between stages). The first stage embeds token ids,
the last returns logits.

Supported: the model types ``support.check_pipeline_support`` accepts (Llama, full attention, no logit or
embedding scaling); everything else is refused by name before the stages are built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_dist.pipeline_parallel.splitter import EMBED_FQNS, HEAD_FQNS
from hf_dist.pipeline_parallel.support import check_pipeline_support

IGNORE_INDEX = -100
_LAYER_PREFIX = "model.layers."


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The HF ``*ForCausalLM`` inside ``model`` (a PEFT model is unwrapped to its LoRA-injected base)."""
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        model = model.get_base_model()
    base = getattr(model, "model", None)
    missing = [
        name
        for name, owner in (
            ("model.embed_tokens", base),
            ("model.layers", base),
            ("model.norm", base),
            ("model.rotary_emb", base),
        )
        if owner is None or getattr(owner, name.split(".")[-1], None) is None
    ]
    if getattr(model, "lm_head", None) is None:
        missing.append("lm_head")
    if missing:
        raise ValueError(
            f"{type(model).__name__} lacks {missing}: pipeline stages need the Llama layout "
            f"(model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head); "
            f"use a Llama-style causal LM"
        )
    check_pipeline_support(model.config)
    return model


def stage_units(model: nn.Module) -> tuple[list[tuple[str, int]], int, int]:
    """``(decoder layers as (fqn, params), embedding params, norm + lm_head params)`` for ``plan_stages``."""
    lm = causal_lm_of(model)

    def count(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    layers = [(f"{_LAYER_PREFIX}{i}", count(layer)) for i, layer in enumerate(lm.model.layers)]
    return layers, count(lm.model.embed_tokens), count(lm.model.norm) + count(lm.lm_head)


class _Body(nn.Module):
    """The ``model.*`` part of a stage: optional embeddings, some decoder layers, optional final norm."""

    def __init__(self, lm: nn.Module, layer_ids: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.embed_tokens = lm.model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): lm.model.layers[i] for i in layer_ids})
        self.norm = lm.model.norm if last else None
        self.rotary_emb = lm.model.rotary_emb  # buffers only; every stage needs the position embeddings


class CausalLMStage(nn.Module):
    """The modules of one pipeline stage, with HF names, and a forward over them."""

    def __init__(self, model: nn.Module, fqns: tuple[str, ...]) -> None:
        super().__init__()
        lm = causal_lm_of(model)
        known = {*EMBED_FQNS, *HEAD_FQNS}
        bad = [n for n in fqns if n not in known and not n.startswith(_LAYER_PREFIX)]
        if bad:
            raise ValueError(f"stage names {bad} are not embeddings, decoder layers or head of {type(lm).__name__}")
        layer_ids = [int(n[len(_LAYER_PREFIX) :]) for n in fqns if n.startswith(_LAYER_PREFIX)]
        self.is_first = "model.embed_tokens" in fqns
        self.is_last = "lm_head" in fqns
        self.config = lm.config
        self.model = _Body(lm, layer_ids, self.is_first, self.is_last)
        self.lm_head = lm.lm_head if self.is_last else None
        layer_types = getattr(lm.config, "layer_types", None)
        self._layer_types = {i: (layer_types[i] if layer_types else "full_attention") for i in layer_ids}

    def _masks(self, hidden: torch.Tensor, attention_mask, position_ids) -> dict[str, object]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        builders = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        masks = {}
        for kind in set(self._layer_types.values()):
            if kind not in builders:
                raise ValueError(f"attention type {kind!r} is not supported by pipeline stages; use {list(builders)}")
            masks[kind] = builders[kind](
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=attention_mask,
                past_key_values=None,
                position_ids=position_ids,
            )
        return masks

    def forward(
        self,
        inputs: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (first stage) or hidden states (others) in; hidden states or logits (last stage) out."""
        hidden = self.model.embed_tokens(inputs) if self.is_first else inputs
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        position_embeddings = self.model.rotary_emb(hidden, position_ids=position_ids)
        masks = self._masks(hidden, attention_mask, position_ids)
        for key, layer in self.model.layers.items():
            hidden = layer(
                hidden,
                attention_mask=masks[self._layer_types[int(key)]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                use_cache=False,
            )
        if not self.is_last:
            return hidden
        return self.lm_head(self.model.norm(hidden))


def count_loss_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that contribute to the causal-LM loss: labels shifted left by one, ignoring ``-100``."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


class TokenWeightedLoss:
    """Causal-LM cross entropy summed over a micro-batch and divided by the step's total token count.

    Summing these over micro-batches (and data-parallel ranks) gives exactly the mean over every loss token of
    the global batch, as one process would compute it: micro-batches with more padding weigh less.
    ``denominator`` must be set before each step (``count_loss_tokens`` over the whole global batch).
    """

    def __init__(self) -> None:
        self.denominator: float | torch.Tensor = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        vocab = logits.shape[-1]
        total = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, vocab),
            labels[:, 1:].reshape(-1).to(logits.device),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return total / self.denominator
