"""Cross-entropy through a linear head, chunk by chunk: the ``[tokens, vocab]`` logits exist one chunk at a time.

``linear_cross_entropy(hidden, weight, bias, targets, ...)`` equals ``F.cross_entropy(transform(F.linear(hidden,
weight, bias)).float(), targets, reduction="sum")`` -- what ``transformers.loss.loss_utils.ForCausalLMLoss`` computes
before it divides -- and has the same gradients, without holding the whole logits or their gradient: each chunk's
logits are made, differentiated (in closed form, softmax minus the one-hot targets; a model's logit transform by
autograd, its backward torch's own) and dropped in the forward pass; the gradients for ``hidden``, ``weight`` and ``bias`` are kept (the size of those
tensors, not of the logits) and scaled by the incoming gradient in backward. The memory held is one chunk's
logits in the compute dtype (``chunk_tokens x vocab``, at least ``hidden_size`` tokens: about the head's size; they
are overwritten with their gradient), one piece's fp32 cross-entropy (about 16M logits) and a gradient the size of
the head's weight.

``head_cross_entropy(head, hidden, targets, ...)`` runs it through a head module. Where the head is an FSDP2 unit of
its own (``hf_dist.parallelism``), ``gather_head_for_loss`` has made the loss a forward method of that unit
(torch's ``register_fsdp_forward_method``): its weight is all-gathered before, and its gradient reduce-scattered after
the loss's backward, as around the head's own ``forward``; read directly, the weight would be this rank's shard.

Not for: deciding whether a model's loss may be computed this way, or finding its hidden states
(``hf_dist.loss.causal_lm``); the vocab-parallel TP loss (``hf_dist.tensor_parallel.loss``).
"""

from __future__ import annotations

from dataclasses import dataclass

import types

import torch
import torch.nn.functional as F
from torch import nn

from hf_dist.loss.policy import chunk_tokens_for, piece_tokens_for

HEAD_LOSS_METHOD = "hf_dist_linear_cross_entropy"
"""The head's forward method that ``gather_head_for_loss`` registers with FSDP2."""


@dataclass(frozen=True, kw_only=True)
class LogitTransform:
    """What a model's forward does to ``lm_head``'s output before its loss, in the model's order and dtype."""

    multiply: float | None = None
    """``logits * multiply`` (cohere's ``logit_scale``)."""
    divide: float | None = None
    """``logits / divide`` (granite's ``logits_scaling``)."""
    softcap: float | None = None
    """``tanh(logits / softcap) * softcap`` (gemma2/gemma3's ``final_logit_softcapping``)."""

    @property
    def identity(self) -> bool:
        return self.multiply is None and self.divide is None and self.softcap is None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiply is not None:
            logits = logits * self.multiply
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _piece_loss_into_grad(piece: torch.Tensor, targets: torch.Tensor, transform: LogitTransform) -> torch.Tensor:
    """The summed fp32 cross-entropy of ``transform(piece)``; ``piece`` (logits) is overwritten with its gradient.

    Without a transform the gradient is written in closed form, ``softmax - one_hot``, from one fp32 copy of the
    piece (none for fp32 logits: they are worked on in place): fewer passes over the logits than autograd's
    log-softmax and its backward, and closer to a float64 reference (``tests/test_chunked_loss.py``). A model's
    transform (scaling, soft-capping) is differentiated by autograd, its backward torch's own."""
    if not transform.identity:
        with torch.enable_grad():
            leaf = piece.detach().requires_grad_()
            loss = F.cross_entropy(transform(leaf).float(), targets, reduction="sum")
            (grad,) = torch.autograd.grad(loss, leaf)
        piece.copy_(grad)
        return loss.detach()
    work = piece.float()  # the piece itself when fp32
    lse = torch.logsumexp(work, dim=-1)
    loss = (lse - work.gather(1, targets[:, None]).squeeze(1)).double().sum()  # rows summed in float64
    work.sub_(lse[:, None]).exp_()
    work[torch.arange(work.shape[0], device=work.device), targets] -= 1
    if work.data_ptr() != piece.data_ptr():
        piece.copy_(work)
    return loss


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``transform(linear(hidden))`` with its gradients made chunk by chunk in forward.

    Two levels: a chunk of ``chunk_tokens`` rows goes through the head's matmuls at once (its logits held in the
    compute dtype, then overwritten piece by piece with their gradient), and each piece of ``piece_tokens`` rows
    through the fp32 cross-entropy."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, transform, chunk_tokens, piece_tokens):
        total = torch.zeros((), dtype=torch.float64, device=hidden.device)  # piece sums, rounded once
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = hidden[start : start + chunk_tokens]
            logits = F.linear(rows, weight, bias).detach()  # becomes the logits' gradient, piece by piece
            for at in range(0, rows.shape[0], piece_tokens):
                end = min(at + piece_tokens, rows.shape[0])  # the chunk's last piece may be short
                total += _piece_loss_into_grad(logits[at:end], targets[start + at : start + end], transform)
            grad_logits = logits
            if grad_hidden is not None:
                grad_hidden[start : start + chunk_tokens] = grad_logits @ weight
            if grad_weight is not None:  # promoted into the fp32 sum in place: no fp32 copy of the product
                grad_weight.add_(grad_logits.t() @ rows)
            if grad_bias is not None:
                grad_bias.add_(grad_logits.sum(0))
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total.to(torch.float32)

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        scale = grad_output
        return (
            None if grad_hidden is None else grad_hidden * scale.to(grad_hidden.dtype),
            None if grad_weight is None else (grad_weight * scale).to(weight_dtype),
            None if grad_bias is None else (grad_bias * scale).to(bias_dtype),
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    transform: LogitTransform | None = None,
    chunk_tokens: int | None = None,
    piece_tokens: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Summed cross-entropy of ``transform(hidden @ weight.T + bias)`` against ``targets``, chunk by chunk.

    Args:
        hidden: ``[..., hidden_size]`` states entering the head (any leading shape; flattened).
        weight, bias: the head's parameters (``nn.Linear`` layout: ``[vocab, hidden_size]``).
        targets: token ids with ``hidden``'s leading shape; ``ignore_index`` positions add nothing.
        transform: the model's scaling/soft-capping of its logits (identity when None).
        chunk_tokens: tokens per chunk through the head's matmuls (default: ``policy.chunk_tokens_for``, at least
            ``hidden_size``).
        piece_tokens: tokens per piece through the fp32 cross-entropy (default: ``policy.piece_tokens_for``, about
            16M logits; at most ``chunk_tokens``).
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} and targets {tuple(targets.shape)} must share their "
                         f"leading shape (one target per position)")
    for name, value in (("chunk_tokens", chunk_tokens), ("piece_tokens", piece_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{name}={value} must be a positive number of tokens per {name.split('_')[0]}")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    kept = (targets != ignore_index).nonzero().squeeze(1)  # ignored positions never reach the head
    chunk = chunk_tokens or chunk_tokens_for(*weight.shape)
    piece = min(chunk, piece_tokens or piece_tokens_for(weight.shape[0]))
    return _LinearCrossEntropy.apply(hidden[kept], weight, bias, targets[kept], transform or LogitTransform(), chunk,
                                     piece)


def _head_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, **kwargs) -> torch.Tensor:
    return linear_cross_entropy(hidden, head.weight, head.bias, targets, **kwargs)


def gather_head_for_loss(head: nn.Module) -> None:
    """Make ``head_cross_entropy`` on ``head`` (an FSDP2 unit) a forward of that unit: FSDP2 gathers its parameters
    before the loss and reduce-scatters their gradients after the loss's backward (the hidden states, an input that
    requires grad, carry its post-backward hook)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    setattr(head, HEAD_LOSS_METHOD, types.MethodType(_head_loss, head))
    register_fsdp_forward_method(head, HEAD_LOSS_METHOD)


def head_cross_entropy(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, **kwargs) -> torch.Tensor:
    """``linear_cross_entropy`` with ``head``'s weight and bias (``kwargs`` as there), through the FSDP2 forward
    method where ``gather_head_for_loss`` registered one."""
    method = getattr(head, HEAD_LOSS_METHOD, None)
    return method(hidden, targets, **kwargs) if method is not None else _head_loss(head, hidden, targets, **kwargs)
