"""The memory planner: say before launch what fits on which GPUs, why, and how long it will take.

Pure functions, no process group: ``model_spec``/``gpu_spec`` (catalogues), ``estimate_memory`` (per-rank
allocated, reserved and in-use memory with every term named), ``host_memory`` (host RAM per node for loading
and offload), ``estimate_throughput`` (step time from the one FLOP formula, ``flops.py``, and a stated or
calibrated efficiency) and ``choose_layout`` (the case study's decision table over ``hf_dist.strategy.Layout``,
each layout in the precision it runs). ``calibrate.py`` measures an efficiency on the machine at hand.
``hf-dist plan`` is the command line over them.

Not here: writing DeepSpeed/accelerate configs (``hf_dist.configs``) or running anything.
"""

from hf_dist.planner.catalogue import GPU_CATALOGUE, MODEL_CATALOGUE, GpuSpec, ModelSpec, gpu_spec, model_spec
from hf_dist.planner.chooser import Candidate, Plan, PlanRequest, choose_layout
from hf_dist.planner.host import HostMemory, host_memory
from hf_dist.planner.workload import Layout, Workload, make_layout
from hf_dist.planner.memory import MemoryAssumptions, MemoryBreakdown, estimate_memory
from hf_dist.planner.throughput import Throughput, estimate_throughput

__all__ = [
    "GPU_CATALOGUE", "MODEL_CATALOGUE", "Candidate", "GpuSpec", "HostMemory", "Layout", "MemoryAssumptions",
    "MemoryBreakdown", "ModelSpec", "Plan", "PlanRequest", "Throughput", "Workload", "choose_layout", "estimate_memory",
    "estimate_throughput", "gpu_spec", "host_memory", "make_layout", "model_spec",
]
