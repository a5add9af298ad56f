"""Decide, before any process group exists, which backend really runs the requested layout.

The traps this module closes (each measured on a machine without GPUs, see ENVIRONMENT.md):

- the plain Trainer under ``torchrun``/``accelerate launch`` without ``use_cpu=True`` runs N independent
  trainings (no gradient sync): we set ``use_cpu`` when there is no GPU and more than one process;
- ``use_cpu=True`` silently disables DeepSpeed in accelerate: we never set it for a DeepSpeed launch, and
  name the gloo backend instead (without it accelerate counts 1 process while DeepSpeed's group has N, so every
  rank reads the same batches);
- an accelerate FSDP config on such a machine silently trains as DDP: hf_dist takes an FSDP **v2** request
  over and applies ``fully_shard`` itself (``hf_dist.parallelize``) on CPU and GPU alike; an FSDP **v1**
  request without GPUs is refused with the fix.

The launch environment is read, never changed: ``read_fsdp_request`` parses it (or ``TrainingArguments.fsdp``) once
into the typed ``fsdp2*`` fields of ``DistTrainingArguments`` (``FsdpRequest.as_fields`` writes them and
``from_fields`` reads the request back; this module reads only the on/off ``fsdp2`` flag itself), so a second
arguments object, ``dataclasses.replace`` or a re-parse sees the same request. accelerate decides from its own flags
whether to build an FSDP plugin (and on GPU wrap the model a second time); ``accelerate_view`` masks those flags
only while the Trainer builds its ``Accelerator`` and restores them at once. After the Trainer is built,
``verify_backend`` checks that the accelerator really is what was asked for.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from hf_dist.parallelism import FsdpRequest
from hf_dist.strategy import Layout

_TRUE = ("1", "true", "yes")

# DeepSpeed JSON paths that work from any working directory. The shipped accelerate YAMLs name their DeepSpeed JSON
# relative to the repository root (``deepspeed_config_file: ds_configs/zero3.json``), and accelerate opens it relative
# to each launched process's working directory: from anywhere else it failed (``UnicodeDecodeError``, then a missing
# file). A relative path that is not a file from the working directory is looked up in the checkout holding hf_dist.


def has_gpu() -> bool:
    return torch.cuda.is_available()


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def deepspeed_requested(args) -> bool:
    return bool(getattr(args, "deepspeed", None)) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in _TRUE


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.lower() in _TRUE


def _reshard_from_env() -> bool:
    value = os.environ.get("FSDP_RESHARD_AFTER_FORWARD")
    if value is None:  # v1-style configs give a sharding strategy instead
        strategy = os.environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
        return strategy not in ("SHARD_GRAD_OP", "2")
    return value.lower() in (*_TRUE, "full_shard")


def _stated_size(name: str) -> int | None:
    """A positive size the launch config states; None when absent or left to accelerate (<= 0)."""
    value = int(os.environ.get(name, "0") or 0)
    return value if value > 0 else None


def read_fsdp_request(args) -> tuple[int, FsdpRequest] | None:
    """The FSDP version and settings asked for by the accelerate launcher's env or ``args.fsdp``; None if none."""
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in _TRUE:
        classes = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
        return int(os.environ.get("FSDP_VERSION", "1")), FsdpRequest(
            reshard_after_forward=_reshard_from_env(),
            activation_checkpointing=_env_flag("FSDP_ACTIVATION_CHECKPOINTING", False),
            wrap_classes=tuple(c.strip() for c in classes.split(",") if c.strip()) if classes else None,
            cpu_offload=_env_flag("FSDP_OFFLOAD_PARAMS", False),
            dp_replicate=int(os.environ.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1")),
            dp_shard=_stated_size("PARALLELISM_CONFIG_DP_SHARD_SIZE"),
            source="the accelerate config (ACCELERATE_USE_FSDP)",
        )
    if not getattr(args, "fsdp", None):
        return None
    config = dict(args.fsdp_config or {}) if not isinstance(args.fsdp_config, str) else {}
    config = {k.removeprefix("fsdp_"): v for k, v in config.items()}
    options = args.fsdp.split() if isinstance(args.fsdp, str) else list(args.fsdp) if args.fsdp is not True else []
    classes = config.get("transformer_layer_cls_to_wrap")
    if isinstance(classes, str):
        classes = [classes]
    return int(config.get("version", 2)), FsdpRequest(
        reshard_after_forward=str(config.get("reshard_after_forward", "shard_grad_op" not in options)).lower()
        in (*_TRUE, "full_shard"),
        activation_checkpointing=str(config.get("activation_checkpointing", False)).lower() in _TRUE,
        wrap_classes=tuple(classes) if classes else None,
        cpu_offload="offload" in options or str(config.get("cpu_offload", False)).lower() in _TRUE,
        source="TrainingArguments.fsdp",
    )


# accelerate builds an FSDP plugin (and a device mesh) from these flags when its Accelerator is constructed
_ACCELERATE_LAYOUT_FLAGS = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG")


@contextlib.contextmanager
def accelerate_view(args) -> Iterator[None]:
    """While the Trainer builds its ``Accelerator``: hide accelerate's FSDP/parallelism flags when hf_dist applies
    FSDP2 or context parallelism itself, so that accelerate builds no FSDP plugin and never wraps the model a second time (on GPU it would
    wrap the hf_dist-sharded model again). The flags are restored on exit; nothing else in the process sees a change.
    """
    if not (getattr(args, "fsdp2", False) or getattr(args, "cp_size", 1) > 1):
        yield
        return
    saved = {key: os.environ[key] for key in _ACCELERATE_LAYOUT_FLAGS if key in os.environ}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def _check_parallelism_env(args) -> None:
    """accelerate's parallelism_config TP and CP sizes must agree with hf_dist's (hf_dist applies both itself): a CP
    request becomes ``args.cp_size`` (hf_dist's all-to-all context parallelism, whatever ``cp_backend`` says), a
    DeepSpeed sequence-parallel (Ulysses) request is refused, never dropped."""
    sp = int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1") or 1)
    if sp > 1:
        raise ValueError(
            f"the accelerate config asks for parallelism_config_sp_size={sp} (DeepSpeed's Ulysses sequence parallelism), "
            f"which hf_dist does not run: the request would silently train as data parallelism over those ranks; use "
            f"parallelism_config_cp_size: {sp} (or --cp_size {sp}), hf_dist's all-to-all context parallelism, instead")
    cp = int(os.environ.get("PARALLELISM_CONFIG_CP_SIZE", "1") or 1)
    if cp > 1:
        given = getattr(args, "cp_size", 1)
        if given not in (1, cp):
            raise ValueError(f"the accelerate config asks for parallelism_config_cp_size={cp} but cp_size={given}; "
                             f"pass one of them (or the same value in both)")
        args.cp_size = cp
    tp = int(os.environ.get("PARALLELISM_CONFIG_TP_SIZE", "1"))
    if tp > 1 and tp != getattr(args, "tp_size", 1):
        raise ValueError(
            f"the accelerate config asks for parallelism_config_tp_size={tp} but tp_size={getattr(args, 'tp_size', 1)}; "
            f"hf_dist applies tensor parallelism itself: pass --tp_size {tp} (and drop it from the YAML)"
        )


def prepare_environment(args) -> None:
    """Called first in ``DistTrainingArguments.__post_init__``: take FSDP v2 over, fix the CPU traps.

    An FSDP2 request (launcher environment or ``args.fsdp``) is written into ``args``' ``fsdp2*`` fields unless they
    already carry one (``dataclasses.replace`` of resolved arguments, or fields set by hand); the environment is
    only read.
    """
    _check_parallelism_env(args)
    request = None if getattr(args, "fsdp2", False) else read_fsdp_request(args)
    if request is not None:
        version, settings = request
        if version == 2:
            for name, value in settings.as_fields().items():
                setattr(args, name, value)
            args.fsdp = None  # the Trainer's own FSDP plugin stays off: hf_dist shards
            args.fsdp_config = None
        elif not has_gpu():
            raise ValueError(
                f"FSDP version {version} was requested by {settings.source}, but this machine has no GPU: accelerate "
                f"would silently train it as DDP, and FSDP1 on CPU fails to save and resume. Use FSDP version 2 "
                f"(`fsdp_version: 2` in the accelerate YAML, or fsdp_config={{'version': 2}}); hf_dist applies it with "
                f"fully_shard on CPU and GPU alike"
            )
    if deepspeed_requested(args):
        if getattr(args, "deepspeed", None) and not has_gpu() and world_size_from_env() > 1:
            raise ValueError(
                f"deepspeed={args.deepspeed!r} in TrainingArguments with {world_size_from_env()} processes on a machine "
                f"without GPUs: transformers then builds accelerate's state without a backend, so accelerate counts "
                f"1 process while DeepSpeed's group has {world_size_from_env()} and every rank would read the same "
                f"batches. Launch with `accelerate launch --config_file accelerate_configs/zero2.yaml` (or zero3.yaml) "
                f"and drop deepspeed= from the arguments"
            )
        Layout.check_one_engine(deepspeed=True, fsdp=bool(getattr(args, "fsdp2", False)))
        anchor_deepspeed_paths(args)  # the shipped YAMLs' ds_configs/*.json from any working directory
        # accelerate runs DeepSpeed; use_cpu would silently turn it off. Without a GPU accelerate picks no backend
        # and counts one process while DeepSpeed's own group has N: name gloo so both see the same world.
        if not has_gpu() and world_size_from_env() > 1 and not getattr(args, "ddp_backend", None):
            args.ddp_backend = "gloo"
        return
    if not has_gpu() and world_size_from_env() > 1:
        args.use_cpu = True  # without it every rank trains alone on the same data


def verify_backend(trainer) -> None:
    """Stop if the accelerator is not running what the launch asked for (never train as something else)."""
    from accelerate.utils import DistributedType

    accelerator = trainer.accelerator
    world = world_size_from_env()
    if world > 1 and accelerator.num_processes != world:
        raise RuntimeError(
            f"the launcher started {world} processes but the accelerator sees {accelerator.num_processes}: each rank "
            f"would train alone; check the launch command and that use_cpu matches the machine"
        )
    if deepspeed_requested(trainer.args) and accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise RuntimeError(
            f"DeepSpeed was requested but accelerate chose {accelerator.distributed_type}; remove use_cpu/--cpu from "
            f"the launch (DeepSpeed picks its CPU accelerator by itself)"
        )


DEEPSPEED_FILE_ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
"""Where ``accelerate launch`` puts the YAML's ``deepspeed_config_file`` for each launched process."""
REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout holding this hf_dist: ``ds_configs/`` and ``accelerate_configs/`` sit next to ``hf_dist/``."""


def locate_json(value: str, source: str) -> str:
    """``value`` unchanged when it is a file from the working directory, else the repository's file of that relative
    path (absolute); ``source`` says where the value came from, for the error."""
    path = Path(value).expanduser()
    if path.is_file():
        return value
    shipped = REPO_ROOT / path
    if not path.is_absolute() and shipped.is_file():
        return str(shipped)
    looked = f"{Path.cwd() / path}" + ("" if path.is_absolute() else f" or {shipped}")
    raise ValueError(
        f"{source} names the DeepSpeed config {value!r}, which is not a file ({looked}); use an absolute path, a path "
        f"relative to the folder you launch from, or a shipped one (ds_configs/zero2.json, ds_configs/zero3.json, ...)"
    )


def anchor_deepspeed_paths(args) -> None:
    """Before ``TrainingArguments`` builds its DeepSpeed plugin: the launcher's JSON path (environment) and
    ``args.deepspeed`` point at an existing file. The environment is rewritten only when its value was not found
    from here, with the absolute path of the same file (every later reader, accelerate's included, then finds it)."""
    value = os.environ.get(DEEPSPEED_FILE_ENV)
    if value and value.lower().endswith(".json"):  # accelerate also takes base64 or a dict: those pass untouched
        found = locate_json(value, f"{DEEPSPEED_FILE_ENV}={value} (deepspeed_config_file in the accelerate config)")
        if found != value:
            os.environ[DEEPSPEED_FILE_ENV] = found
    deepspeed = getattr(args, "deepspeed", None)
    if isinstance(deepspeed, str) and deepspeed.lower().endswith(".json"):
        args.deepspeed = locate_json(deepspeed, f"--deepspeed {deepspeed}")
