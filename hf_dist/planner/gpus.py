"""The GPU kinds the planner knows: memory, peak dense bf16 FLOP/s, a typical node's host RAM per GPU and its links.

``gpu_spec(name)`` looks one up and ``gpu_from_device_name`` maps ``torch.cuda.get_device_name()`` to a kind (the
one GPU catalogue, used by the planner and by the trainer's runtime MFU). Figures are NVIDIA's datasheets (dense, no
sparsity). The two link classes a collective runs over (``hf_dist.planner.communication``): inside a node, the GPU's
NVLink (or PCIe where the node has no NVLink switch); between nodes, the network bandwidth per GPU of the typical
node. Both are per direction, as the bus bandwidth nccl-tests (and ``hf-dist doctor``) report is: half a datasheet's
bidirectional NVLink or PCIe figure. They are peaks; ``hf-dist plan --intra-node-gbs/--inter-node-gbs`` take
measured ones. Not here: models (``catalogue.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class GpuSpec:
    """A GPU kind."""

    name: str
    """Catalogue key, e.g. ``a100-80gb``."""
    memory_bytes: int
    """Device memory as ``nvidia-smi`` reports its total (MiB x 2**20)."""
    peak_bf16_flops: float
    """Peak dense bf16 tensor-core FLOP/s (datasheet, no sparsity)."""
    host_ram_per_gpu_bytes: int
    """Host RAM per GPU of a typical node (the default of ``--host-ram-gb``; see ``GPU_CATALOGUE``)."""
    intra_node_bytes_per_s: float = 0.0
    """Per-direction bandwidth per GPU inside a node (NVLink, or PCIe without an NVLink switch)."""
    inter_node_bytes_per_s: float = 0.0
    """Per-direction network bandwidth per GPU between nodes (the typical node's NICs / its GPUs)."""
    device_names: tuple[str, ...] = ()
    """Substrings of ``torch.cuda.get_device_name()`` that identify this kind (most specific kinds first)."""


_MIB, _GIB, _GB = 2**20, 2**30, 1e9
# Links, per direction. Inside a node: NVIDIA datasheets' NVLink (H100/H200 SXM 900 GB/s, B200 1.8 TB/s, A100 SXM
# 600 GB/s, bidirectional) or PCIe (Gen5 x16 128 GB/s: H100 PCIe, and H100 NVL, whose NVLink bridges join pairs only;
# Gen4 x16 64 GB/s: L40S, L4, A10G, A10), halved. Between nodes: the 8-GPU node's network over its GPUs: DGX
# H100/H200/B200 and AWS p5/p5e/p6 8 x 400 Gb/s (50 GB/s per GPU), DGX A100 and AWS p4d/p4de 8 x 200 Gb/s (25 GB/s),
# AWS g6e.48xlarge 400 Gb/s (6.25 GB/s), g6/g5.48xlarge 100 Gb/s (1.56 GB/s); PCIe H100 servers 400 Gb/s per 2 GPUs.
GPU_CATALOGUE: dict[str, GpuSpec] = {g.name: g for g in (
    # peak: NVIDIA datasheets, dense bf16. Host RAM per GPU: the 8-GPU cloud node of that kind (AWS p4d/p4de
    # 1,152 GiB, p5/p5e/p6-b200 2,048 GiB, g6e 1,536 GiB, g6/g5 768 GiB); PCIe/NVL H100 and A10: 128 / 96 GiB.
    GpuSpec(name="h100-pcie", memory_bytes=81559 * _MIB, peak_bf16_flops=756e12, host_ram_per_gpu_bytes=128 * _GIB,
            intra_node_bytes_per_s=64 * _GB,
            inter_node_bytes_per_s=25 * _GB, device_names=("H100 PCIe",)),
    GpuSpec(name="h100-nvl", memory_bytes=95830 * _MIB, peak_bf16_flops=835e12, host_ram_per_gpu_bytes=128 * _GIB,
            intra_node_bytes_per_s=64 * _GB,
            inter_node_bytes_per_s=25 * _GB, device_names=("H100 NVL",)),
    GpuSpec(name="h100", memory_bytes=81559 * _MIB, peak_bf16_flops=989e12, host_ram_per_gpu_bytes=256 * _GIB,
            intra_node_bytes_per_s=450 * _GB,
            inter_node_bytes_per_s=50 * _GB, device_names=("H100",)),
    GpuSpec(name="h200", memory_bytes=143771 * _MIB, peak_bf16_flops=989e12, host_ram_per_gpu_bytes=256 * _GIB,
            intra_node_bytes_per_s=450 * _GB,
            inter_node_bytes_per_s=50 * _GB, device_names=("H200",)),
    GpuSpec(name="b200", memory_bytes=183359 * _MIB, peak_bf16_flops=2250e12, host_ram_per_gpu_bytes=256 * _GIB,
            intra_node_bytes_per_s=900 * _GB,
            inter_node_bytes_per_s=50 * _GB, device_names=("B200",)),
    GpuSpec(name="a100-40gb", memory_bytes=40960 * _MIB, peak_bf16_flops=312e12, host_ram_per_gpu_bytes=144 * _GIB,
            intra_node_bytes_per_s=300 * _GB,
            inter_node_bytes_per_s=25 * _GB, device_names=("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB")),
    GpuSpec(name="a100-80gb", memory_bytes=81920 * _MIB, peak_bf16_flops=312e12, host_ram_per_gpu_bytes=144 * _GIB,
            intra_node_bytes_per_s=300 * _GB,
            inter_node_bytes_per_s=25 * _GB, device_names=("A100",)),
    GpuSpec(name="l40s", memory_bytes=46068 * _MIB, peak_bf16_flops=362e12, host_ram_per_gpu_bytes=192 * _GIB,
            intra_node_bytes_per_s=32 * _GB,
            inter_node_bytes_per_s=6.25 * _GB, device_names=("L40S",)),
    GpuSpec(name="l4", memory_bytes=23034 * _MIB, peak_bf16_flops=121e12, host_ram_per_gpu_bytes=96 * _GIB,
            intra_node_bytes_per_s=32 * _GB,
            inter_node_bytes_per_s=1.5625 * _GB, device_names=("L4",)),
    GpuSpec(name="a10g", memory_bytes=23028 * _MIB, peak_bf16_flops=70e12, host_ram_per_gpu_bytes=96 * _GIB,
            intra_node_bytes_per_s=32 * _GB,
            inter_node_bytes_per_s=1.5625 * _GB, device_names=("A10G",)),
    GpuSpec(name="a10", memory_bytes=23028 * _MIB, peak_bf16_flops=125e12, host_ram_per_gpu_bytes=96 * _GIB,
            intra_node_bytes_per_s=32 * _GB,
            inter_node_bytes_per_s=1.5625 * _GB, device_names=("A10",)),
)}
"""Listed most specific first: ``gpu_from_device_name`` takes the first kind whose name matches."""
GPU_ALIASES = {"h100-sxm": "h100", "h100-80gb": "h100", "h200-141gb": "h200"}


def gpu_spec(name: str | GpuSpec) -> GpuSpec:
    """Look up a GPU kind by name (case-insensitive)."""
    if isinstance(name, GpuSpec):
        return name
    key = GPU_ALIASES.get(name.lower(), name.lower())
    if key not in GPU_CATALOGUE:
        raise ValueError(f"gpu={name!r} is not in the GPU catalogue; use one of {', '.join(GPU_CATALOGUE)}")
    return GPU_CATALOGUE[key]


def gpu_from_device_name(device_name: str) -> GpuSpec | None:
    """The catalogue kind of a ``torch.cuda.get_device_name()`` string, e.g. ``NVIDIA H100 PCIe``; None if unknown.

    Words are matched whole, so ``L4`` does not match ``L40S`` and ``A10`` does not match ``A100``.
    """
    padded = f" {device_name.upper().replace('_', ' ')} "
    for spec in GPU_CATALOGUE.values():
        for pattern in spec.device_names:
            p = pattern.upper()
            i = padded.find(p)
            while i >= 0:
                before, after = padded[i - 1], padded[i + len(p)]
                if not before.isalnum() and not after.isalnum():
                    return spec
                i = padded.find(p, i + 1)
    return None
