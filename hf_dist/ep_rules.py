"""The expert-parallel rules of ``hf_dist.strategy.Layout``: which products with EP run, each refused with its fix.

``Layout.__post_init__`` calls ``check_expert_parallel`` with itself (its fields: ``ep``, ``tp``, ``pp``, ``cp``,
``strategy``, ``offload``, ``replicas``, ``dp``, ...), so every caller of ``Layout`` -- the training arguments, the
planner, ``hf-dist config`` -- gets the same answer. Which *model types* run EP and its products is the registry's
(``hf_dist.expert_parallel.support``). Pure: no torch, no process group.
"""

from __future__ import annotations

from hf_dist.parallel_dims import valid_ep_sizes


def check_expert_parallel(layout) -> None:
    """EP runs with FSDP2 FULL_SHARD / SHARD_GRAD_OP or DDP on a stage's data-parallel ranks
    (tests/test_expert_parallel.py), and inside pipeline stages with FULL_SHARD or DDP, each stage's experts over its
    own data-parallel ranks (tests/test_ep_pp.py), and with CP (FULL_SHARD or DDP, experts over the data-parallel
    ranks while each sequence is split, tests/test_moe_cp.py), beside TP (``_check_ep_tp``, tests/test_ep_tp.py),
    and under HSDP with each replica group holding every expert (tests/test_ep_hsdp.py): the layouts a parity test
    holds against one process. Everything else is refused here; which model types run EP and its products is the
    registry's (``hf_dist.expert_parallel.support``)."""
    if layout.ep == 1:
        return
    if layout.is_deepspeed:
        raise ValueError(f"ep_size={layout.ep} with DeepSpeed {layout.strategy}: ZeRO partitions every parameter "
                         f"itself, experts included, and has no expert-parallel token dispatch in hf_dist; use "
                         f"FSDP2 (accelerate_configs/fsdp.yaml) or DDP with ep_size, or drop ep_size")
    if layout.pp > 1 and layout.strategy not in ("fsdp_full_shard", "ddp"):
        raise ValueError(f"ep_size={layout.ep} with pp_size={layout.pp} and strategy={layout.strategy!r}: a parity "
                         f"test covers EP x PP with FSDP2 FULL_SHARD or DDP on each stage's data-parallel ranks only; "
                         f"use fsdp_full_shard (reshard_after_forward) or DDP, or ep_size=1")
    if layout.cp > 1 and layout.strategy not in ("fsdp_full_shard", "ddp"):
        raise ValueError(f"ep_size={layout.ep} with cp_size={layout.cp} and strategy={layout.strategy!r}: a parity "
                         f"test covers EP x CP with FSDP2 FULL_SHARD or DDP only; use fsdp_full_shard "
                         f"(reshard_after_forward) or DDP, or ep_size=1")
    if layout.tp > 1:
        _check_ep_tp(layout)
    if layout.strategy == "fsdp_hybrid_shard" and (layout.dp // layout.replicas) % layout.ep:
        raise ValueError(f"ep_size={layout.ep} with HYBRID_SHARD (dp_replicate={layout.replicas}): each replica group "
                         f"holds every expert, so ep_size must divide its {layout.dp // layout.replicas} ranks; use "
                         f"ep_size in {valid_ep_sizes(layout.dp // layout.replicas, 1)}, or FULL_SHARD")
    if layout.offload != "none":
        raise ValueError(f"ep_size={layout.ep} with offload={layout.offload!r}: no parity test covers offloaded expert "
                         f"shards (FSDP2's CPU offload needs a GPU to run at all, so a CPU test cannot prove it); "
                         f"drop the offload or set ep_size=1")
    if layout.ep not in valid_ep_sizes(layout.dp, layout.tp):
        valid = valid_ep_sizes(layout.dp, layout.tp)
        raise ValueError(f"ep_size={layout.ep} does not divide the {layout.dp * layout.tp} ranks (dp {layout.dp} x "
                         f"tp_size {layout.tp}; world {layout.world_size} / pp_size {layout.pp}) that experts spread "
                         f"over; use ep_size in {valid}")

def _check_ep_tp(layout) -> None:
    """EP x TP runs as tests/test_ep_tp.py proves it: attention split by TP, each TP rank's experts whole and split
    by EP, FSDP2 FULL_SHARD or DDP over the data-parallel ranks; no PP, CP, sequence or vocabulary parallelism, no
    LoRA."""
    refused = {"pp_size": layout.pp > 1, "cp_size": layout.cp > 1, "tp_sequence_parallel": layout.sequence_parallel,
               "tp_vocab_parallel": layout.vocab_parallel, "lora_rank": layout.lora_rank > 0,
               "strategy": layout.strategy not in ("fsdp_full_shard", "ddp")}
    for name, on in refused.items():
        if on:
            value = {"pp_size": layout.pp, "cp_size": layout.cp, "lora_rank": layout.lora_rank,
                     "strategy": repr(layout.strategy)}.get(name, True)
            raise ValueError(f"ep_size={layout.ep} with tp_size={layout.tp} and {name}={value}: a parity test covers "
                             f"EP x TP with FSDP2 FULL_SHARD or DDP only, without pp_size, cp_size, "
                             f"tp_sequence_parallel, tp_vocab_parallel or LoRA; drop {name} (or use "
                             f"fsdp_full_shard), or set ep_size=1")
