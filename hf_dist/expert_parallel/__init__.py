"""Expert parallelism (EP) for mixture-of-experts models: each rank of an ``ep`` group holds ``1/ep`` of every MoE
layer's experts and tokens travel to their experts' ranks and back (all-to-all).

``apply_expert_parallel`` shards the experts (``hf_dist.parallelize`` calls it after TP, before activation
checkpointing and FSDP2); ``check_ep_support`` / ``ep_refusal`` say which models run it (before any process group).
Not here: the layout rules (``hf_dist.strategy.Layout``), the expert mesh (``hf_dist.parallel_dims``), FSDP2 of the
expert parameters over the ``efsdp`` ranks (``hf_dist.parallelism.apply_fsdp``).
"""

from hf_dist.expert_parallel.apply import apply_expert_parallel, expert_modules, expert_params
from hf_dist.expert_parallel.support import check_ep_support, ep_plan, ep_refusal

__all__ = ["apply_expert_parallel", "check_ep_support", "ep_plan", "ep_refusal", "expert_modules",
           "expert_params"]
