"""The same work on hf_dist and on the stack it extends (importable by spawned ranks): ``bench/native.py`` times it,
``tests/test_native_ledger.py`` compares what each side's step communicates and computes.

Sides: ``native`` is ``AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=...
[, ep_size=2]))`` (transformers shards it while loading) trained by ``transformers.Trainer``; ``hf_dist`` is
``hf_dist.from_pretrained(dir, args)`` trained by ``DistTrainer`` (FSDP2 ``full_shard``, ``ep_size=2`` for the MoE;
one process: the model as the Trainer loads it); ``plain`` is ``Trainer`` on one process. Models (written with
``save_pretrained``, loaded as users load them): a tiny Llama (hidden 256, 4 layers, vocab 2,048), a tiny
Qwen3-MoE (hidden 256, 4 layers, 8 experts top-2, router aux loss on) and a 254 M-parameter Llama for loading.
Micro batch 4 x 128 tokens per rank, AdamW, constant lr, no accumulation, the same rows on every side.
"""

from __future__ import annotations

import os

import torch

VOCAB, SEQ, MICRO = 2048, 128, 4
LLAMA = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
MOE = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           head_dim=64, intermediate_size=512, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
           tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.01)
BIG = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
           num_key_value_heads=8)
"""The loading pair's Llama: 254 M parameters (1.0 GB in fp32), vocabulary 32,000."""


def write_models(folder: str, router_aux_loss_coef: float = MOE["router_aux_loss_coef"],
                 names: tuple[str, ...] = ("llama", "moe")) -> dict[str, str]:
    """The tiny Llama and Qwen3-MoE (and the ``big`` Llama) written as checkpoints; ``{name: directory}``."""
    from transformers import Qwen3MoeConfig

    from hf_dist.models.tiny import build_tiny_model, tiny_llama_config

    dirs = {}
    moe = Qwen3MoeConfig(**{**MOE, "router_aux_loss_coef": router_aux_loss_coef})
    configs = {"llama": tiny_llama_config(vocab_size=VOCAB, **LLAMA), "moe": moe,
               "big": tiny_llama_config(vocab_size=32000, **BIG)}
    for name in names:
        dirs[name] = os.path.join(folder, name)
        build_tiny_model(configs[name], seed=0).save_pretrained(dirs[name])
    return dirs


def dataset(rows: int, seq: int = SEQ):
    from datasets import Dataset

    ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(0)).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def common_args(out: str, steps: int) -> dict:
    # use_cpu=True on every side: without it the plain Trainer on gloo ranks does not shard the data (each rank
    # trained on the same batch, measured with transformers 5.24 under DistributedConfig(fsdp_size=2))
    return dict(output_dir=out, max_steps=steps, per_device_train_batch_size=MICRO, learning_rate=1e-4,
                lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], seed=0,
                data_seed=0, disable_tqdm=True, dataloader_num_workers=0, use_cpu=True,
                dataloader_pin_memory=False)


def build_trainer(side: str, model_dir: str, out: str, steps: int, world: int, callbacks: list, *, ep: bool = False,
                  args: dict | None = None):
    """The trainer of ``side`` (``native``, ``hf_dist`` or ``plain``) with its model loaded and laid out; ``ep``:
    experts over 2 ranks; ``args``: more of hf_dist's arguments (``{"chunked_loss": False}``)."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hf_dist
    from hf_dist import DistTrainer, DistTrainingArguments

    common = common_args(out, steps)
    if side == "hf_dist":
        layout = {} if world == 1 else {"fsdp": "full_shard", "fsdp_config": {"version": 2}}
        if ep:
            layout["ep_size"] = 2
        layout.update(args or {})
        targs = DistTrainingArguments(**common, global_batch_size=MICRO * world, **layout)
        model = hf_dist.from_pretrained(model_dir, targs) if world > 1 else AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32)
        return DistTrainer(model=model, args=targs, train_dataset=dataset(64), callbacks=callbacks)
    kwargs = {"dtype": torch.float32}
    if side == "native":
        from transformers import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(fsdp_size=world, **({"ep_size": 2} if ep else {}))
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    return Trainer(model=model, args=TrainingArguments(**common), train_dataset=dataset(64), callbacks=callbacks)


def ledger_rows(ledger) -> dict:
    """``{(kind, dtype): (count, bytes, small count)}`` of one rank's step ledger, and ``"flops"``; calls under 1 KiB
    (control: token counts, stop flags) counted apart (``ledger_minimum.measured_rows``, as ``bench/ledger.py``).
    Groups are not told apart: the two sides name them differently, and on 2 ranks every group here is both ranks."""
    from hf_dist.metrics.ledger_minimum import measured_rows

    rows: dict[tuple[str, str], tuple[int, int, int]] = {}
    for row in measured_rows([ledger.plain()]):
        count, nbytes, small = rows.get((row.kind, row.dtype), (0, 0, 0))
        if row.small:
            rows[(row.kind, row.dtype)] = (count, nbytes, small + int(row.count))
        else:
            rows[(row.kind, row.dtype)] = (count + int(row.count), nbytes + int(row.bytes), small)
    return {"comms": rows, "flops": ledger.flops}


def counted_step(rank: int, world: int, side: str, model_dir: str, ep: bool = False, step: int = 2) -> dict:
    """Train ``side`` for ``step`` optimizer steps and return optimizer step ``step``'s ``ledger_rows`` (this rank)."""
    import tempfile

    from transformers import logging as hf_logging

    from hf_dist.metrics.ledger import attach_ledger

    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(side, model_dir, out, step, world, [], ep=ep)
        counted = attach_ledger(trainer, step=step)
        trainer.train()
    return ledger_rows(counted.ledger)


def counted_steps(rank: int, world: int, runs: list[tuple[str, str, str, bool]]) -> dict[str, dict]:
    """``counted_step`` for each ``(name, side, model_dir, ep)`` in turn on these ranks; ``{name: ledger_rows}``."""
    return {name: counted_step(rank, world, side, model_dir, ep) for name, side, model_dir, ep in runs}
