"""Shared pieces of the pipeline-parallel tests: the tiny model, padded batches, and the single-process reference.

Imported by ``test_pp_*.py`` and by the spawned ranks (so everything here is importable at module level).
"""

from __future__ import annotations

import torch

VOCAB, HIDDEN, LAYERS, SEQ = 256, 64, 4, 32
LR, MAX_NORM, STEPS = 1e-3, 0.5, 5


def tiny_model(seed: int = 0, **overrides):
    from hf_dist.models.tiny import build_tiny_model

    config = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS)
    config.update(overrides)
    return build_tiny_model(seed=seed, **config)


def tiny_phi3(seed: int = 0):
    """A tiny Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``) with non-default values: grouped KV heads, a
    sliding window shorter than ``SEQ``, an MLP width that is not 4 x hidden, untied head."""
    from transformers import Phi3Config

    from hf_dist.models.tiny import build_tiny_model

    config = Phi3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return build_tiny_model(config, seed=seed)


def padded_batch(batch: int, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded sequences of different lengths; labels are -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    lengths = torch.randint(SEQ // 4, SEQ + 1, (batch,), generator=g)
    mask = (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class PaddedDataset(torch.utils.data.Dataset):
    """``padded_batch`` rows as a dataset, the same on every rank: token counts differ per micro-batch."""

    def __init__(self, n: int, seed: int) -> None:
        self.rows = padded_batch(n, seed)

    def __len__(self) -> int:
        return self.rows["input_ids"].shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.rows.items()}


def batches(global_batch: int, steps: int = STEPS, seed: int = 100) -> list[dict[str, torch.Tensor]]:
    return [padded_batch(global_batch, seed + i) for i in range(steps)]


def dp_slice(batch: dict[str, torch.Tensor], dp_rank: int, dp: int) -> dict[str, torch.Tensor]:
    size = batch["input_ids"].shape[0] // dp
    return {k: v[dp_rank * size : (dp_rank + 1) * size] for k, v in batch.items()}


def portable(state: dict[str, torch.Tensor] | None) -> dict | None:
    """Tensors as numpy arrays: torch tensors returned from a spawned rank arrive through shared memory that
    is gone once the rank exits."""
    return None if state is None else {k: v.numpy() for k, v in state.items()}


def reference_run(model, steps: list[dict[str, torch.Tensor]], max_norm: float = MAX_NORM):
    """One process, whole global batch per step: (losses, grad norms, final state dict)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    losses, norms = [], []
    for batch in steps:
        loss = model(**batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def pipelined_run(pipe, steps: list[dict[str, torch.Tensor]], dp_rank: int, dp: int, max_norm: float = MAX_NORM):
    """The same training with a ``PipelinedCausalLM``: (losses, grad norms) as every rank sees them."""
    params = [p for p in pipe.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    losses, norms = [], []
    for batch in steps:
        loss = pipe.train_step(dp_slice(batch, dp_rank, dp))
        norms.append(float(pipe.clip_grad_norm_(max_norm)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms
