"""The memory planner: say before launch what fits on which GPUs, why, and how long it will take.

Pure functions, no process group: ``model_spec``/``gpu_spec`` (catalogues), ``estimate_memory`` (per-rank
allocated, reserved and in-use memory with every term named), ``host_memory`` (host RAM per node for loading
and offload), ``estimate_throughput`` (step time: compute from the one FLOP formula, ``flops.py``, at a stated or
calibrated efficiency, and communication from the ledger minimum's bytes over the links, ``communication.py``) and
``choose_layout`` (the fastest layout that fits, over the case study's decision table of ``hf_dist.strategy.Layout``,
each layout in the precision it runs; ``--trainer dpo|grpo`` adds the reference model and generation buffers).
``calibrate.py`` measures an efficiency on the machine at hand.
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
