"""Tensor parallelism for HF decoder-only causal LMs on torch DTensor.

The plan comes from the model itself (its config's ``base_model_tp_plan`` and its head's ``_tp_plan``, turned
into DTensor styles in ``plans.py``) with hf_dist's overlays on top (fused projections split part by part,
sequence/vocab parallelism, replicated KV heads, LoRA; MoE experts split by ``moe.py``, the linear-attention,
short-conv and Mamba2 layers of hybrids by ``hybrid.py``, classic types' plans written by ``classic.py``).
``support.py`` decides, from the config alone, which model types may use it: those whose registry record
(``hf_dist.families``) names a TP=2 parity test -- dense, classic, hybrid and MoE types alike (docs/coverage.md
lists them). The others are refused by name with the reason (e.g. experts or layers no parity test covers, latent
attention, attention sinks, no plan). Any other model: pass ``plan={pattern: ParallelStyle}``.

    dims = ParallelDims(world_size=4, tp=2, dp_shard=2)
    dims.build_mesh("cpu")
    model = AutoModelForCausalLM.from_config(config)          # or from_pretrained
    hf_dist.parallelize(model, dims, fsdp=True)                # TP, then FSDP2 over dp
    ...train as usual (torch.optim.AdamW with its default foreach=None)...
    hf_dist.state_dict.save_gathered(model, "out/")            # a normal HF directory

``apply_tensor_parallel`` shards over the ``tp`` mesh axis only (options: ``sequence_parallel``,
``vocab_parallel``); ``hf_dist.parallelize`` is how a whole layout (TP, then FSDP2 or replicated dp) is applied;
``check_tp_sizes`` / ``valid_tp_sizes`` state the size rules without a process group.
Not for: data parallelism (``hf_dist.parallelism``), gathering (``hf_dist.state_dict``), the Trainer
(``hf_dist.trainer``).
"""

from hf_dist.tensor_parallel.apply import TensorParallelInfo, apply_tensor_parallel, tensor_parallel_info
from hf_dist.tensor_parallel.checks import check_tp_sizes, valid_tp_sizes
from hf_dist.tensor_parallel.plans import plan_names, supported_families

__all__ = [
    "TensorParallelInfo",
    "apply_tensor_parallel",
    "check_tp_sizes",
    "plan_names",
    "supported_families",
    "tensor_parallel_info",
    "valid_tp_sizes",
]
