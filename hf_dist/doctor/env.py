"""The environment report of ``hf-dist doctor``: versions, backends, devices and DeepSpeed ops.

Collecting is read-only and compiles nothing: DeepSpeed ops are listed with their builders' own compatibility
probes (``deepspeed.ops.op_builder``), whether they were installed pre-built, and whether a JIT build is already
in the torch-extensions cache.

Not here: anything that needs a process group (``hf_dist.doctor.probe``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import os
import platform
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_LIBRARIES = ("torch", "transformers", "accelerate", "deepspeed", "peft", "datasets", "safetensors")


@dataclass(kw_only=True, frozen=True)
class Device:
    """One accelerator (or the host, when there is none)."""

    index: int
    """CUDA device index (-1: the host CPU)."""
    name: str
    """Device name."""
    total_bytes: int
    """Total memory."""
    free_bytes: int | None
    """Free memory now (None where it cannot be asked)."""
    capability: str | None = None
    """CUDA compute capability, e.g. ``8.0``."""


@dataclass(kw_only=True, frozen=True)
class DeepSpeedOp:
    """One DeepSpeed C++/CUDA op as DeepSpeed's builders see it."""

    name: str
    """Op name (``fused_adam``, ``cpu_adam``, ...)."""
    installed: bool
    """Pre-built into the installed wheel."""
    compatible: bool
    """The builder's own probe says it can be built here."""
    jit_cached: bool
    """A JIT build is already in the torch-extensions cache (no compile on first use)."""


@dataclass(kw_only=True, frozen=True)
class EnvReport:
    """What ``hf-dist doctor`` prints before any probe."""

    python: str
    """Python version."""
    platform: str
    """OS and machine."""
    libraries: dict[str, str]
    """Installed versions of the libraries hf_dist builds on ("-" where missing)."""
    cuda_available: bool
    """``torch.cuda.is_available()``."""
    cuda_version: str | None
    """CUDA version torch was built with."""
    nccl_version: str | None
    """NCCL version torch ships (None without CUDA)."""
    backends: dict[str, bool]
    """Which torch.distributed backends are built in (nccl, gloo, mpi)."""
    devices: list[Device]
    """GPUs, or the host when there is none."""
    cpu_count: int
    """Logical CPUs visible to this process."""
    deepspeed_checked: bool = True
    """Whether the DeepSpeed op report was asked for."""
    deepspeed_accelerator: str | None = None
    """The accelerator DeepSpeed picked (cuda, cpu, ...), None without DeepSpeed."""
    deepspeed_ops: list[DeepSpeedOp] = field(default_factory=list)
    """DeepSpeed ops (empty without DeepSpeed)."""

    @property
    def default_backend(self) -> str:
        return "nccl" if self.cuda_available and self.backends.get("nccl") else "gloo"


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _devices() -> list[Device]:
    if not torch.cuda.is_available():
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total, free = 0, None
        return [Device(index=-1, name=f"host CPU ({platform.processor() or platform.machine()})",
                       total_bytes=total, free_bytes=free)]
    out = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        try:
            free, _ = torch.cuda.mem_get_info(index)
        except RuntimeError:
            free = None
        out.append(Device(index=index, name=props.name, total_bytes=props.total_memory, free_bytes=free,
                          capability=f"{props.major}.{props.minor}"))
    return out


def _jit_cache_names() -> set[str]:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    names: set[str] = set()
    if os.path.isdir(root):
        for sub in os.listdir(root):  # one folder per python/torch/cuda combination
            path = os.path.join(root, sub)
            if os.path.isdir(path):
                names.update(os.listdir(path))
    return names


def deepspeed_ops() -> tuple[str | None, list[DeepSpeedOp]]:
    """DeepSpeed's accelerator name and its ops, probed without compiling; (None, []) without DeepSpeed."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the builders print warnings while probing
            from deepspeed.accelerator import get_accelerator
            from deepspeed.git_version_info import installed_ops
            from deepspeed.ops.op_builder.all_ops import ALL_OPS
            from deepspeed.ops.op_builder.builder import probe_is_compatible

            cached = _jit_cache_names()
            ops = [DeepSpeedOp(name=name, installed=bool(installed_ops.get(name, False)),
                               compatible=bool(probe_is_compatible(builder, False)), jit_cached=name in cached)
                   for name, builder in sorted(ALL_OPS.items())]
            return get_accelerator().device_name(), ops
    except ImportError:
        return None, []


def collect_env(*, with_deepspeed: bool = True) -> EnvReport:
    """Collect the environment report of this process."""
    cuda = torch.cuda.is_available()
    nccl = None
    if cuda:
        with contextlib.suppress(AttributeError, RuntimeError):
            version = torch.cuda.nccl.version()
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    accelerator, ops = deepspeed_ops() if with_deepspeed else (None, [])
    return EnvReport(
        python=platform.python_version(),
        platform=f"{platform.system()} {platform.release()} {platform.machine()}",
        libraries={name: _version(name) for name in _LIBRARIES},
        cuda_available=cuda,
        cuda_version=torch.version.cuda,
        nccl_version=nccl,
        backends={"nccl": dist.is_nccl_available(), "gloo": dist.is_gloo_available(), "mpi": dist.is_mpi_available()},
        devices=_devices(),
        cpu_count=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
        deepspeed_checked=with_deepspeed,
        deepspeed_accelerator=accelerator,
        deepspeed_ops=ops,
    )


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def format_env(report: EnvReport) -> str:
    """The report as text."""
    yes = {True: "yes", False: "no"}
    lines = [
        f"python {report.python} on {report.platform}, {report.cpu_count} CPUs",
        "libraries: " + ", ".join(f"{k} {v}" for k, v in report.libraries.items()),
        f"CUDA: {yes[report.cuda_available]}" + (f" (built with {report.cuda_version})" if report.cuda_version else ""),
        f"NCCL: {report.nccl_version or 'n/a'}; backends built in: "
        + ", ".join(f"{k} {yes[v]}" for k, v in report.backends.items())
        + f"; default backend: {report.default_backend}",
        "devices:",
    ]
    for d in report.devices:
        cap = f", sm {d.capability}" if d.capability else ""
        label = "host" if d.index < 0 else f"cuda:{d.index}"
        lines.append(f"  {label}: {d.name}, {_gib(d.total_bytes)} total, {_gib(d.free_bytes)} free{cap}")
    if not report.deepspeed_checked:
        lines.append("DeepSpeed ops: not checked (--no-deepspeed)")
    elif report.deepspeed_accelerator is None:
        lines.append("DeepSpeed: not installed")
    else:
        lines.append(f"DeepSpeed ops (accelerator {report.deepspeed_accelerator}; nothing compiled by this report):")
        lines.append(f"  {'op':<28} {'installed':>9} {'compatible':>10} {'JIT cached':>10}")
        for op in report.deepspeed_ops:
            lines.append(f"  {op.name:<28} {yes[op.installed]:>9} {yes[op.compatible]:>10} {yes[op.jit_cached]:>10}")
    return "\n".join(lines)
