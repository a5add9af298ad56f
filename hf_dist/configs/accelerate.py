"""Accelerate YAML generation: a typed ``AccelerateSpec`` in, a dict (and its YAML text) out.

Covers multi-GPU DDP, FSDP v1 and v2, DeepSpeed (pointing at a JSON file) and multi-node jobs. Key names are the
ones ``accelerate launch`` reads (``accelerate/commands/launch.py``); every emitted file is checked against
accelerate's own loader by the tests.

Things a YAML cannot carry are not here: hf_dist's tensor/pipeline-parallel degrees are training arguments
(``--tp_size``/``--pp_size``) and go in the launch command and the ``hf_dist.yaml`` layout file
(``hf_dist.configs.launch``).

On a machine without a GPU, ``distributed_type: MULTI_GPU`` is what starts N processes (accelerate then runs
MULTI_CPU over gloo); ``MULTI_CPU`` or ``use_cpu`` would start one. So DDP is always written as MULTI_GPU and
``use_cpu`` is never written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import yaml

FsdpSharding = Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"]
MixedPrecision = Literal["no", "bf16", "fp16"]


@dataclass(kw_only=True, frozen=True)
class FsdpSpec:
    """The FSDP part of an accelerate config."""

    version: Literal[1, 2] = 2
    """FSDP1 (``FullyShardedDataParallel`` wrapper) or FSDP2 (``fully_shard``, DTensor parameters)."""
    sharding: FsdpSharding = "FULL_SHARD"
    """FULL_SHARD: params+grads+states sharded, re-gathered per layer in backward. SHARD_GRAD_OP: params kept
    gathered between forward and backward. HYBRID_SHARD: shard inside a node, replicate across nodes."""
    wrap_classes: tuple[str, ...] | None = ()
    """Decoder-layer class names to wrap (the model's ``_no_split_modules``); empty: size-based wrapping; None:
    layer-based wrapping with no class named, so each model's own ``_no_split_modules`` applies (hf_dist's FSDP2
    and accelerate's FSDP1 both default to it): one file serves Llama, Qwen2, GPT-NeoX, ..."""
    state_dict_type: Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"] = "SHARDED_STATE_DICT"
    """SHARDED: each rank writes its shard (fast, DCP format); FULL: rank 0 gathers a full state dict."""
    activation_checkpointing: bool = True
    """FSDP's own activation checkpointing of the wrapped layers (then the Trainer's must be off)."""
    offload_params: bool = False
    """Keep parameters, gradients and optimizer states in CPU RAM."""
    cpu_ram_efficient_loading: bool = True
    """Rank 0 loads the checkpoint, the others get empty weights and receive a broadcast (fails on CPU-only)."""
    replicate_size: int = 1
    """HYBRID_SHARD on FSDP2: number of replicas (usually the node count); the shard size is the rest."""

    def __post_init__(self) -> None:
        if self.version not in (1, 2):
            raise ValueError(f"FSDP version={self.version!r} is not known; use 1 or 2")
        if self.sharding not in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"):
            raise ValueError(
                f"FSDP sharding={self.sharding!r} is not known; use FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD"
            )
        if self.sharding == "HYBRID_SHARD" and self.version == 2 and self.replicate_size < 2:
            raise ValueError(
                f"HYBRID_SHARD on FSDP2 needs replicate_size >= 2 (got {self.replicate_size}); set it to the node "
                f"count, or use FULL_SHARD on one node"
            )


@dataclass(kw_only=True, frozen=True)
class DeepSpeedLaunchSpec:
    """The DeepSpeed part of an accelerate config: where the JSON is and how ZeRO-3 builds the model."""

    config_file: str
    """Path of the DeepSpeed JSON, as the launched processes will see it (relative to their working dir)."""
    zero3_init: bool = False
    """Build the model already partitioned (``deepspeed.zero.Init``); set for ZeRO-3."""
    multinode_launcher: Literal["standard", "pdsh", "openmpi", "mvapich", "slurm"] = "standard"
    """How a multi-node job is started; ``standard`` is torchrun on each node (no ssh between nodes)."""


@dataclass(kw_only=True, frozen=True)
class AccelerateSpec:
    """Everything that decides an accelerate config file."""

    num_processes: int
    """Processes across all machines (accelerate's ``num_processes`` is the total)."""
    num_machines: int = 1
    """Nodes."""
    mixed_precision: MixedPrecision = "bf16"
    """Autocast precision; ``no`` for fp32 (and for the CPU twin)."""
    fsdp: FsdpSpec | None = None
    """Set for an FSDP job."""
    deepspeed: DeepSpeedLaunchSpec | None = None
    """Set for a DeepSpeed job."""
    machine_rank: int = 0
    """This node's rank; every node but the first overrides it (``--machine_rank``)."""
    main_process_ip: str | None = None
    """Address of node 0; None: left to the launcher (``--main_process_ip`` or the scheduler's environment)."""
    main_process_port: int | None = None
    """Rendezvous port on node 0; None: left to the launcher."""

    def __post_init__(self) -> None:
        if self.fsdp is not None and self.deepspeed is not None:
            raise ValueError("an accelerate config is FSDP or DeepSpeed, not both; set only one of fsdp/deepspeed")
        if not isinstance(self.num_processes, int) or self.num_processes < 1:
            raise ValueError(f"num_processes={self.num_processes!r} must be a positive integer")
        if not isinstance(self.num_machines, int) or self.num_machines < 1:
            raise ValueError(f"num_machines={self.num_machines!r} must be a positive integer")
        if self.num_processes % self.num_machines != 0:
            raise ValueError(
                f"num_processes={self.num_processes} is not a multiple of num_machines={self.num_machines}; "
                f"accelerate starts num_processes / num_machines per node"
            )
        if not 0 <= self.machine_rank < self.num_machines:
            raise ValueError(f"machine_rank={self.machine_rank} is outside num_machines={self.num_machines}")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision={self.mixed_precision!r} is not known; use no, bf16 or fp16")

    @property
    def distributed_type(self) -> str:
        if self.fsdp is not None:
            return "FSDP"
        if self.deepspeed is not None:
            return "DEEPSPEED"
        return "MULTI_GPU"


def _fsdp_section(fsdp: FsdpSpec) -> dict:
    section: dict = {"fsdp_version": fsdp.version}
    if fsdp.wrap_classes is None:
        section["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"  # the model's _no_split_modules
    elif fsdp.wrap_classes:
        section["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
        section["fsdp_transformer_layer_cls_to_wrap"] = ",".join(fsdp.wrap_classes)
    else:
        section["fsdp_auto_wrap_policy"] = "SIZE_BASED_WRAP"
        section["fsdp_min_num_params"] = 100_000_000
    section["fsdp_state_dict_type"] = fsdp.state_dict_type
    section["fsdp_activation_checkpointing"] = fsdp.activation_checkpointing
    section["fsdp_offload_params"] = fsdp.offload_params
    section["fsdp_cpu_ram_efficient_loading"] = fsdp.cpu_ram_efficient_loading
    if fsdp.version == 2:
        # FSDP2 has no sharding_strategy: SHARD_GRAD_OP is "do not reshard after forward"; HYBRID is a 2-D mesh
        section["fsdp_reshard_after_forward"] = fsdp.sharding != "SHARD_GRAD_OP"
    else:
        # accelerate 1.x reads the FSDP1 strategy from either key depending on the path; write both, equal
        section["fsdp_sharding_strategy"] = fsdp.sharding
        section["fsdp_reshard_after_forward"] = fsdp.sharding
        section["fsdp_backward_prefetch"] = "BACKWARD_PRE"
        section["fsdp_forward_prefetch"] = False
        section["fsdp_use_orig_params"] = True
    # cpu_ram_efficient_loading needs module states broadcast from rank 0 (accelerate refuses otherwise)
    section["fsdp_sync_module_states"] = fsdp.cpu_ram_efficient_loading or fsdp.version == 1
    return section


def accelerate_config(spec: AccelerateSpec) -> dict:
    """The accelerate config dict for ``spec`` (the keys ``accelerate launch --config_file`` reads)."""
    config: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": spec.distributed_type,
        "enable_cpu_affinity": False,
        "gpu_ids": "all",
        "machine_rank": spec.machine_rank,
        "main_training_function": "main",
        "num_machines": spec.num_machines,
        "num_processes": spec.num_processes,
        "rdzv_backend": "static",
        "same_network": True,
    }
    if spec.deepspeed is None:
        # with a DeepSpeed JSON, accelerate refuses mixed_precision in the YAML at start-up of every process
        # (DeepSpeedPlugin._deepspeed_config_checks): precision lives in the JSON's bf16/fp16 blocks
        config["mixed_precision"] = spec.mixed_precision
    if spec.num_machines > 1:
        if spec.main_process_ip is not None:
            config["main_process_ip"] = spec.main_process_ip
        if spec.main_process_port is not None:
            config["main_process_port"] = spec.main_process_port
    if spec.fsdp is not None:
        config["fsdp_config"] = _fsdp_section(spec.fsdp)
        if spec.fsdp.sharding == "HYBRID_SHARD" and spec.fsdp.version == 2:
            replicate = spec.fsdp.replicate_size
            if spec.num_processes % replicate != 0:
                raise ValueError(
                    f"HYBRID_SHARD replicate_size={replicate} does not divide num_processes={spec.num_processes}; "
                    f"use a replicate size that divides it (usually the node count)"
                )
            config["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": replicate,
                "parallelism_config_dp_shard_size": spec.num_processes // replicate,
                "parallelism_config_tp_size": 1,
                "parallelism_config_cp_size": 1,
            }
    if spec.deepspeed is not None:
        ds: dict = {"deepspeed_config_file": spec.deepspeed.config_file, "zero3_init_flag": spec.deepspeed.zero3_init}
        if spec.num_machines > 1:
            ds["deepspeed_multinode_launcher"] = spec.deepspeed.multinode_launcher
        config["deepspeed_config"] = ds
    return config


def to_yaml(config: dict, *, header: str = "") -> str:
    """YAML text of ``config`` with a ``#`` comment header (one line per header line); stable key order."""
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comment + yaml.safe_dump(config, sort_keys=True, default_flow_style=False)
