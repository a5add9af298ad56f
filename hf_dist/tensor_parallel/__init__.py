"""Tensor parallelism for HF decoder-only causal LMs on torch DTensor.

Entry points: ``apply_tensor_parallel`` (shard a built model over the ``tp`` mesh axis), the composition
helpers in ``compose`` (TP with FSDP2 or with plain data parallelism), ``full_state_dict`` /
``save_gathered`` (normal HF weights back from a sharded model) and ``check_tp_sizes`` (the size rules,
usable before any process group exists).
"""

from hf_dist.tensor_parallel.apply import TensorParallelInfo, apply_tensor_parallel, tensor_parallel_info
from hf_dist.tensor_parallel.checks import check_tp_sizes, valid_tp_sizes
from hf_dist.tensor_parallel.plans import plan_names, supported_families
from hf_dist.tensor_parallel.state import full_state_dict, save_gathered

__all__ = [
    "TensorParallelInfo",
    "apply_tensor_parallel",
    "check_tp_sizes",
    "full_state_dict",
    "plan_names",
    "save_gathered",
    "supported_families",
    "tensor_parallel_info",
    "valid_tp_sizes",
]
