"""What is left of the pipeline tests' old helpers: a tiny Llama and padded rows, still imported by Trainer-level and
data-parallel tests that are not yet on the parity harness (``tests/parity.py``: its ``tiny_config`` /
``masked_batches`` / ``reference_run`` replace these; the PP parity tests use it). To be deleted when its last
importer moves.
"""

from __future__ import annotations

import torch

VOCAB, HIDDEN, LAYERS, SEQ = 256, 64, 4, 32
LR = 1e-3


def tiny_model(seed: int = 0, **overrides):
    from hf_dist.models.tiny import build_tiny_model

    config = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS)
    config.update(overrides)
    return build_tiny_model(seed=seed, **config)


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


def dp_slice(batch: dict[str, torch.Tensor], dp_rank: int, dp: int) -> dict[str, torch.Tensor]:
    size = batch["input_ids"].shape[0] // dp
    return {k: v[dp_rank * size : (dp_rank + 1) * size] for k, v in batch.items()}
