"""All-to-all (Ulysses-style) context parallelism around the model's own attention function.

Each context-parallel rank holds a contiguous slice of every sequence. Around attention, one all-to-all trades the
sequence split for a head split (``(B, H, S/cp, D) -> (B, H/cp, S, D)``), the model's configured attention
implementation (eager, sdpa, flash) runs over the *whole* sequence for ``H/cp`` heads, and a second all-to-all trades
back. So sliding windows, soft-capping, scaling and GQA stay the model's own code, and the mask it receives is the
one the model built for the whole sequence (packed documents, windows, padding included).

How the model sees the sequence: the model is called with the whole ``input_ids`` / ``position_ids`` /
``attention_mask``; it embeds the whole sequence, builds its masks and rotary tables for it, and a pre-hook on the
first decoder layer keeps this rank's slice of the hidden states (every layer's ``position_embeddings`` are sliced
the same way, so rotary is right on every slice). From there on every activation -- decoder layers, final norm,
logits, loss -- is this rank's slice only: the embedding output (``S x hidden``) and the mask are the only
whole-sequence tensors. The split is active only inside ``ContextParallelState.split()`` (training steps); outside
it (evaluation, generation) the model runs the whole sequence as usual.

The attention function is registered under ``hf_dist_cp_<inner>`` in transformers' ``AttentionInterface``, with the
inner implementation's mask function under the same name in ``AttentionMaskInterface``; ``apply_context_parallel``
switches the model's config to it; for a MoE model with a router aux loss it also installs ``router``'s pooling.
Not here: which models may run it (``support``), the labels and the loss weighting (``inputs``), Trainer glue
(``hf_dist.trainer``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

CP_PREFIX = "hf_dist_cp_"
STATE_ATTR = "_hf_dist_cp"


class _AllToAll(torch.autograd.Function):
    """Split ``x`` along ``scatter_dim`` into ``cp`` chunks, send chunk ``j`` to rank ``j``, concatenate what arrives
    along ``gather_dim`` in rank order. The backward is the same exchange with the two dims swapped."""

    @staticmethod
    def forward(ctx, x, scatter_dim: int, gather_dim: int, group):
        ctx.scatter_dim, ctx.gather_dim, ctx.group = scatter_dim, gather_dim, group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.gather_dim, ctx.scatter_dim, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    sent = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """The autograd-aware exchange (``scatter_dim`` split across ranks, ``gather_dim`` joined)."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


class ContextParallelState:
    """What the hooks and the attention function of one model need: the cp group, rank and size, the model's own
    attention implementation, and whether a training step's split is active."""

    def __init__(self, group, inner: str, head_params: tuple[str, ...] = ()) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.inner = inner
        self.head_params = head_params
        self.active = False
        self.padding = 0
        """Positions at the end of each sequence that ``inputs.pad_to_slices`` added in this split (the router aux
        loss leaves them out)."""

    @contextlib.contextmanager
    def split(self, padding: int = 0) -> Iterator[None]:
        """Run forward (and backward, with its recomputations) on this rank's slice of each sequence; ``padding``:
        the positions ``inputs.pad_to_slices`` appended to make the sequence divide."""
        previous = self.active, self.padding
        self.active, self.padding = True, padding
        try:
            yield
        finally:
            self.active, self.padding = previous

    def local(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous slice of ``tensor`` along the sequence dim."""
        length = tensor.shape[dim]
        if length % self.size:
            raise ValueError(f"sequence length {length} is not divisible by cp_size={self.size}: every rank holds an "
                             f"equal slice; pad the batch to a multiple of {self.size} (pad_to_multiple_of in the "
                             f"collator) or choose cp_size among the divisors of {length}")
        return tensor.chunk(self.size, dim=dim)[self.rank]


def _inner_function(module: nn.Module, inner: str):
    """The model's own attention function for ``inner``: its module's ``eager_attention_forward`` for eager (where a
    model's eager code lives, e.g. soft-capping), else transformers' registered function."""
    if inner == "eager":
        found = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if found is None:
            raise ValueError(f"{type(module).__name__} has no eager_attention_forward in {type(module).__module__}; "
                             f"context parallelism wraps the model's own attention function: use attn_implementation"
                             f"='sdpa'")
        return found
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[inner]


def context_parallel_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """The registered attention function: heads <-> sequence all-to-all around the model's implementation."""
    state: ContextParallelState = getattr(module, STATE_ATTR)
    inner = _inner_function(module, state.inner)
    if not state.active:
        return inner(module, query, key, value, attention_mask, **kwargs)
    group = state.group
    # (B, H, S/cp, D) -> (B, H/cp, S, D): heads scattered, sequence gathered
    query, key, value = (all_to_all(_compute_dtype(t), 1, 2, group) for t in (query, key, value))
    if state.head_params:
        module, kwargs = _rank_heads(module, kwargs, state)
    output, _ = inner(module, query, key, value, attention_mask, **kwargs)
    # (B, S, H/cp, D) -> (B, S/cp, H, D); per-head weights of a subset of heads are not returned
    return all_to_all(output, 1, 2, group), None


class _HeadSlice:
    """An attention module as its attention function sees it on one cp rank: the per-head parameters cut to the heads
    the all-to-all handed this rank, every other attribute the module's own."""

    def __init__(self, module: nn.Module, params: dict[str, torch.Tensor]) -> None:
        self.__dict__.update(params, _module=module)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_module"], name)


def _rank_heads(module: nn.Module, kwargs: dict, state: ContextParallelState) -> tuple[_HeadSlice, dict]:
    """The module and keyword arguments with each per-head parameter (the registry's ``attention_head_params``,
    gpt-oss's sinks, also passed as ``s_aux``) cut to this rank's heads: rank ``r`` receives the ``r``-th chunk of the
    heads (``_all_to_all`` sends chunk ``j`` to rank ``j``). The slice is differentiable: each rank's gradient fills its
    heads' rows, and the gradient sum over the cp ranks fills them all, as for the projections' gradients."""
    params = {}
    for name in state.head_params:
        full = getattr(module, name)
        params[name] = part = full.chunk(state.size, dim=0)[state.rank]
        kwargs = {key: part if value is full else value for key, value in kwargs.items()}
    return _HeadSlice(module, params), kwargs


def _compute_dtype(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the dtype the attention computes in: under autocast (the Trainer's ``bf16=True`` on fp32 weights)
    rotary leaves q and k in fp32 while the attention's matmuls cast them to the autocast dtype; casting before the
    exchange instead of after moves half the bytes and changes no value (an all-to-all only permutes elements; in
    backward the gradients arrive in that dtype and are exchanged before the cast's backward widens them)."""
    device = t.device.type
    if torch.is_autocast_enabled(device) and t.is_floating_point():
        wanted = torch.get_autocast_dtype(device)
        if t.element_size() > torch.empty((), dtype=wanted).element_size():
            return t.to(wanted)
    return t


def register(inner: str) -> str:
    """Register the context-parallel attention (and the inner implementation's mask builder) around ``inner``."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    if inner.startswith(CP_PREFIX):
        raise ValueError(f"attn_implementation={inner!r} is context-parallel already; apply context parallelism once")
    masks = AttentionMaskInterface._global_mapping
    if inner not in masks:
        raise ValueError(f"attn_implementation={inner!r} has no mask builder in transformers' AttentionMaskInterface; "
                         f"context parallelism runs with eager, sdpa or flash attention: load the model with "
                         f"attn_implementation='sdpa'")
    name = CP_PREFIX + inner
    AttentionInterface.register(name, context_parallel_attention)
    AttentionMaskInterface.register(name, masks[inner])
    return name


def _split_first_layer_input(state: ContextParallelState):
    def hook(module, args, kwargs):
        if not state.active:
            return None
        if args:
            args = (state.local(args[0]), *args[1:])
        else:
            kwargs["hidden_states"] = state.local(kwargs["hidden_states"])
        return args, kwargs
    return hook


def _split_position_embeddings(state: ContextParallelState):
    def hook(module, args, kwargs):
        if not state.active or kwargs.get("position_embeddings") is None:
            return None
        kwargs["position_embeddings"] = tuple(state.local(t) for t in kwargs["position_embeddings"])
        return args, kwargs
    return hook


def apply_context_parallel(model: nn.Module, group, layers: list[nn.Module]) -> ContextParallelState:
    """Make ``model`` (an HF causal LM, checked by ``support.check_cp_support``) split sequences over ``group``.

    ``layers`` are its decoder layers in order. Returns the state whose ``split()`` turns the split on; it is also
    stored on the model (``context_parallel_state``).
    """
    from hf_dist.context_parallel.router import PooledRouterLoss
    from hf_dist.families import family_of
    from hf_dist.models.peft_utils import unwrap_peft
    from hf_dist.models.router import load_balancing_fn

    if context_parallel_state(model) is not None:
        raise ValueError(f"{type(model).__name__} splits sequences already; apply context parallelism once")
    config = unwrap_peft(model).config
    # a model loaded with a context-parallel attention name (TRL builds a DPO reference with its policy's) has the
    # name only, not the split: wrap the implementation the name wraps
    state = ContextParallelState(group, (config._attn_implementation or "eager").removeprefix(CP_PREFIX),
                                 family_of(config).attention_head_params)
    config._attn_implementation = register(state.inner)
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            object.__setattr__(module, STATE_ATTR, state)
    layers[0].register_forward_pre_hook(_split_first_layer_input(state), with_kwargs=True)
    for layer in layers:
        layer.register_forward_pre_hook(_split_position_embeddings(state), with_kwargs=True)
    if load_balancing_fn(unwrap_peft(model)) is not None:  # a MoE router aux loss: pooled over the cp ranks
        PooledRouterLoss(unwrap_peft(model), state)
    object.__setattr__(model, STATE_ATTR, state)
    return state


def context_parallel_state(model: nn.Module) -> ContextParallelState | None:
    """The state ``apply_context_parallel`` stored on ``model`` (None: no context parallelism)."""
    return model.__dict__.get(STATE_ATTR)
