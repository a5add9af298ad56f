"""One pipeline stage of an HF causal LM that runs the model's own forward, and the token-weighted loss.

A stage is a *view* of the HF ``*ForCausalLM``: a shallow copy of the model object and of its base model
whose decoder-layer list holds the real layers the stage owns and stand-ins for the others. The stage calls
the model's own ``forward``, so everything outside the decoder layers -- embedding scale and multipliers,
rotary embeddings (per layer type too), causal and sliding-window masks, the final norm, logit scaling and
soft-capping -- is the model's code, not a re-implementation. The stand-ins steer that forward:

- every stand-in *before* the stage's first layer returns the hidden states received from the previous
  stage (a non-first stage calls the model with ``inputs_embeds=received`` so masks and rotary see the right
  shape and dtype; whatever the model did to them before the layers is replaced by the received tensor);
- the first stand-in *after* the stage's last layer stops the forward and returns its input (a non-last
  stage's output): nothing after it runs.

Which modules are "embeddings", "layers" and "head" comes from the model's own ``base_model_pp_plan`` (on its
config) and ``_pp_plan`` (on the CausalLM class), or from their registry records (``Family.pp_modules``) for types that ship none.
The stage's children are the model's children under the
same names, so ``state_dict()`` keys are the HF checkpoint keys. Which model types are proven to run this way
is ``support.check_pipeline_support``'s decision, not this module's.

Not for: splitting (``splitter``), schedules (``schedules``), process groups (``pipeline``).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from torch import nn

from hf_dist.loss.causal_lm import ChunkedCausalLMLoss
from hf_dist.models.peft_utils import unwrap_peft
from hf_dist.models.router import RouterStats, adds_router_aux_loss, num_experts, router_recorder
from hf_dist.pipeline_parallel.layer_output import layer_output_width
from hf_dist.pipeline_parallel.plans import base_plan_names, head_plan_names

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelParts:
    """Where a causal LM keeps what its pp plans name: FQNs relative to the ``*ForCausalLM``."""

    base: str
    """The base model attribute (``model``, ``transformer``, ...)."""
    layers: str
    """The decoder-layer ``ModuleList`` inside the base model (``layers``; dotted when nested, ``decoder.layers``)."""
    embeds: tuple[str, ...]
    """FQNs of the first stage's modules outside the layers (``model.embed_tokens``)."""
    heads: tuple[str, ...]
    """FQNs of the last stage's modules outside the layers (``model.norm``, ``lm_head``)."""

    @property
    def layer_list(self) -> str:
        """FQN of the decoder-layer ``ModuleList``."""
        return f"{self.base}.{self.layers}"

    def layer_fqn(self, index: int) -> str:
        return f"{self.base}.{self.layers}.{index}"

    def layer_index(self, fqn: str) -> int | None:
        prefix = f"{self.base}.{self.layers}."
        return int(fqn[len(prefix) :]) if fqn.startswith(prefix) else None


def _child(base: nn.Module, name: str) -> nn.Module | None:
    """The module at dotted ``name`` under ``base``, or ``None`` when the config switched it off."""
    try:
        return base.get_submodule(name)
    except AttributeError:
        return None


def model_parts(model: nn.Module) -> ModelParts:
    """The pp-plan parts of ``model``; ``ValueError`` when the model declares no usable pp plan."""
    lm = unwrap_peft(model)
    config = getattr(lm, "config", None)
    prefix = getattr(lm, "base_model_prefix", "")
    base = getattr(lm, prefix, None) if prefix else None
    planned = base_plan_names(config)
    head_plan = head_plan_names(type(lm), config)  # the instance merges in the base plan
    names = [k for k in planned if base is not None and _child(base, k) is not None]
    lists = [k for k in names if isinstance(_child(base, k), nn.ModuleList)]
    if base is None or len(lists) != 1 or not head_plan or any("." in k for k in head_plan):
        raise ValueError(
            f"{type(lm).__name__} declares no pipeline plan hf_dist can split (base_model_pp_plan="
            f"{planned}, _pp_plan={head_plan}): pipeline stages need a base model with one "
            f"decoder-layer list and a top-level head; train this model with pp_size=1"
        )
    cut = names.index(lists[0])
    return ModelParts(
        base=prefix,
        layers=lists[0],
        embeds=tuple(f"{prefix}.{k}" for k in names[:cut]),
        heads=(*(f"{prefix}.{k}" for k in names[cut + 1 :]), *head_plan),
    )


def _check_no_stray_parameters(lm: nn.Module, parts: ModelParts) -> None:
    """Every parameter must belong to a plan module: one outside would be copied onto every stage."""
    owned = (*parts.embeds, *parts.heads, parts.layer_list)
    stray = [n for n, _ in lm.named_parameters() if not any(n.startswith(o + ".") for o in owned)]
    if stray:
        raise ValueError(
            f"{type(lm).__name__} has parameters outside its pp plan's modules ({stray[:3]}): every stage would "
            f"hold a copy; train this model with pp_size=1"
        )


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The HF ``*ForCausalLM`` inside ``model`` (a PEFT model is unwrapped to its LoRA-injected base)."""
    lm = unwrap_peft(model)
    _check_no_stray_parameters(lm, model_parts(lm))
    return lm


def stage_units(model: nn.Module) -> tuple[list[tuple[str, int]], int, int]:
    """``(decoder layers as (fqn, params), embedding params, head params)`` for ``plan_stages``."""
    lm = causal_lm_of(model)
    parts = model_parts(lm)

    def count(fqns) -> int:
        return sum(p.numel() for f in fqns for p in lm.get_submodule(f).parameters())

    layers = lm.get_submodule(parts.layer_list)
    units = [(parts.layer_fqn(i), count([parts.layer_fqn(i)])) for i in range(len(layers))]
    return units, count(parts.embeds), count(parts.heads)


def stage_fqns(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(embedding FQNs, head FQNs)``: what ``plan_stages`` adds to the first and last stage."""
    parts = model_parts(model)
    return parts.embeds, parts.heads


class _StageExit(Exception):
    """Raised by the stand-in after a non-last stage's last layer, carrying that layer's output."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("pipeline stage done")
        self.hidden = hidden


class _Inbox:
    """The hidden states a non-first stage received, read by its stand-ins during one forward."""

    received: torch.Tensor | None = None


class _StandIn(nn.Module):
    """Takes the place of a decoder layer another stage owns; holds no parameters.

    Plain attributes of the real layer (``attention_type``, ``layer_idx``, ...) are copied, because base
    models read them in their layer loop to pick masks and rotary embeddings. ``tuple_width``: the base model
    reads ``outputs[0]`` of its layers (Falcon, BLOOM, ...) or unpacks them (Bamba), so the received states are
    handed back in a tuple of that length, padded with ``None`` (read from the loop: ``layer_output``).
    """

    def __init__(self, layer: nn.Module, role: str, inbox: _Inbox, tuple_width: int = 0) -> None:
        super().__init__()
        for key, value in vars(layer).items():
            if not key.startswith("_") and key != "training" and isinstance(value, (str, int, float, bool)):
                setattr(self, key, value)
        self.role = role
        self.inbox = inbox
        self.tuple_width = tuple_width

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.role == "after":
            raise _StageExit(hidden_states)
        if self.inbox.received is None:
            raise RuntimeError("a pipeline stage stand-in ran outside its stage's forward")
        if self.tuple_width:
            return (self.inbox.received, *[None] * (self.tuple_width - 1))
        return self.inbox.received


class _Unowned(nn.Module):
    """Takes the place of an embedding or head module another stage owns.

    A head module must never run. An embedding module may, on a non-first stage, when the model calls it on
    its own before the layers (GPT-2's position embedding ``wpe(position_ids)``, OPT's ``project_in``): it returns
    zeros shaped like the received hidden states, which the first stand-in replaces by the received tensor.
    """

    def __init__(self, inbox: _Inbox | None = None) -> None:
        super().__init__()
        self.inbox = inbox

    def forward(self, *args, **kwargs):
        if self.inbox is None or self.inbox.received is None:
            raise RuntimeError("a pipeline stage reached a module another stage owns")
        return torch.zeros_like(self.inbox.received)


def _view(module: nn.Module, replace: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of ``module`` whose descendants at the (dotted) paths of ``replace`` are swapped, with
    shallow copies along each path (parameters and buffers stay shared)."""
    direct = {k: v for k, v in replace.items() if "." not in k}
    nested: dict[str, dict[str, nn.Module]] = {}
    for path, child in replace.items():
        if "." in path:
            head, rest = path.split(".", 1)
            nested.setdefault(head, {})[rest] = child
    for head, inner in nested.items():
        direct[head] = _view(module._modules[head], inner)
    clone = copy.copy(module)
    clone._modules = {**module._modules, **direct}
    return clone


class CausalLMStage(nn.Module):
    """The modules of one pipeline stage, with HF names, and a forward through the model's own code."""

    partial_model = True
    """A stage holds some of the model's layers: a plan may match none of them (DeepSeek-V3's dense first layers hold
    no experts: ``hf_dist.expert_parallel.apply_expert_parallel`` shards nothing on such a stage)."""
    eval_router_stats = False
    """Set by ``PipelinedCausalLM.forward_only``: collect router statistics outside training too (eval loss)."""
    head = None
    """On a last stage, a callable ``head(view, model_kwargs, labels)`` run instead of the logits whenever labels are
    given: per-sequence figures for a pairwise loss (``hf_dist.pipeline_parallel.pair_loss``)."""

    def __init__(self, model: nn.Module, fqns: tuple[str, ...], *, chunked_loss: bool = False) -> None:
        super().__init__()
        lm = causal_lm_of(model)
        parts = model_parts(lm)
        known = {*parts.embeds, *parts.heads}
        bad = [n for n in fqns if n not in known and parts.layer_index(n) is None]
        if bad:
            raise ValueError(f"stage names {bad} are not embeddings, decoder layers or head of {type(lm).__name__}")
        owned = sorted(parts.layer_index(n) for n in fqns if parts.layer_index(n) is not None)
        if not owned or owned != list(range(owned[0], owned[-1] + 1)):
            raise ValueError(f"stage {fqns} must own a contiguous, non-empty run of decoder layers")
        self.is_first = all(n in fqns for n in parts.embeds)
        self.is_last = all(n in fqns for n in parts.heads)
        self.config = lm.config
        self.parts = parts
        self._inbox = _Inbox()
        view = self._build_view(lm, parts, owned)
        for name, child in view._modules.items():
            self.add_module(name, child)
        object.__setattr__(self, "_lm", view)  # not a submodule: its children are registered above
        self.chunked_loss = self._chunked_loss(view) if chunked_loss and self.is_last else None
        self.router_stats = self._record_routers(lm) if adds_router_aux_loss(lm) else None

    @staticmethod
    def _chunked_loss(view: nn.Module) -> ChunkedCausalLMLoss | None:
        """The last stage's training loss through the model's own forward, chunk by chunk (None: whole logits)."""
        loss = ChunkedCausalLMLoss(view)
        if loss.refusal is not None:
            logger.warning("pipeline last stage: chunked loss off, whole logits: %s", loss.refusal)
            return None
        return loss

    def _record_routers(self, lm: nn.Module) -> RouterStats:
        """Hooks on this stage's routers (the class the model's ``_can_record_outputs`` names) that add each
        layer's load-balancing statistics to the ones received from the previous stage (``hf_dist.models.router``).
        """
        router_class, index = router_recorder(lm)
        stats = RouterStats(num_experts(lm.config), lm.config.num_experts_per_tok)
        for layer in self.owned_layers():
            for module in layer.modules():
                if isinstance(module, router_class):
                    module.register_forward_hook(stats.hook(index))
        return stats

    def _build_view(self, lm: nn.Module, parts: ModelParts, owned: list[int]) -> nn.Module:
        real = lm.get_submodule(parts.layer_list)
        owner, _, attr = parts.layer_list.rpartition(".")
        width = layer_output_width(type(lm.get_submodule(owner)), attr, getattr(lm.config, "model_type", None))
        layers = nn.ModuleList(
            real[i] if i in owned else _StandIn(real[i], "before" if i < owned[0] else "after", self._inbox, width)
            for i in range(len(real))
        )
        replace: dict[str, nn.Module] = {parts.layer_list: layers}
        unowned = [] if self.is_first else [(fqn, self._inbox) for fqn in parts.embeds]
        unowned += [] if self.is_last else [(fqn, None) for fqn in parts.heads]
        for fqn, inbox in unowned:
            if not any(True for _ in lm.get_submodule(fqn).parameters()):
                continue  # no weights (dropout): it runs on every stage, on tensors the stand-ins replace
            replace[fqn] = _Unowned(inbox)
        return _view(lm, replace)

    def owned_layers(self) -> list[nn.Module]:
        """This stage's decoder layers, in order (the units FSDP wraps one by one)."""
        layers = self.get_submodule(self.parts.layer_list)
        return [layer for layer in layers if not isinstance(layer, _StandIn)]

    def input_embeddings(self) -> nn.Module:
        """The token embedding (first stage only)."""
        return self.get_submodule(self.parts.embeds[0])

    def output_embeddings(self) -> nn.Module:
        """The output projection to the vocabulary (last stage only)."""
        return self.get_submodule(self.parts.heads[-1])

    def owned_modules(self) -> dict[str, nn.Module]:
        """``{HF FQN: module}`` of everything this stage owns: embeddings, decoder layers, head."""
        layers = self.get_submodule(self.parts.layer_list)
        owned = {self.parts.layer_fqn(i): m for i, m in enumerate(layers) if not isinstance(m, _StandIn)}
        first = {f: self.get_submodule(f) for f in self.parts.embeds} if self.is_first else {}
        last = {f: self.get_submodule(f) for f in self.parts.heads} if self.is_last else {}
        return {**first, **owned, **last}

    def train(self, mode: bool = True) -> CausalLMStage:
        super().train(mode)
        self._lm.training = mode  # the view is not a registered child
        return self

    def forward(
        self,
        inputs: torch.Tensor,
        router_stats: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Token ids (first stage) or hidden states (others) in; hidden states or logits (last stage) out.

        A last stage built with ``chunked_loss`` that gets ``labels`` in training returns the micro-batch's summed
        cross-entropy instead of logits (``hf_dist.loss.causal_lm``: the head's logits exist one chunk at a time).

        In training (and in evaluation with ``eval_router_stats``), a model whose loss adds a router aux term also
        passes its router statistics on: the stage takes the previous stage's (``router_stats``) and returns
        ``(hidden states or logits, statistics)``.
        """
        kwargs = {"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": False}
        if hasattr(self.config, "output_router_logits"):
            kwargs["output_router_logits"] = False  # the stage's hooks collect what the model's aux loss needs
        if self.is_first:
            kwargs["input_ids"] = inputs
        else:
            kwargs["inputs_embeds"] = inputs
            self._inbox.received = inputs
        collect = self.router_stats is not None and (self.training or self.eval_router_stats)
        if collect:
            self.router_stats.begin(router_stats, attention_mask, inputs.shape[0] * inputs.shape[1], inputs.device)
        loss = self.chunked_loss if labels is not None and self.training else None
        head = self.head if labels is not None and self.is_last else None
        try:
            if head is not None:
                out = head(self._lm, kwargs, labels)
            else:
                out = self._lm(**kwargs) if loss is None else loss(**kwargs, labels=labels, num_items_in_batch=1)
        except _StageExit as done:
            out = done.hidden
        else:
            if not self.is_last:
                raise RuntimeError(f"stage of {type(self._lm).__name__} ran past its last layer without stopping")
            if head is None:
                out = out.logits if loss is None else out.loss  # the summed loss: num_items_in_batch=1
        finally:
            self._inbox.received = None
            stats = self.router_stats.end() if collect else None
        return (out, stats) if collect else out
