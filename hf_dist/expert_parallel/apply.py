"""Shard a MoE model's experts over the ``ep`` ranks, driving transformers' own expert-parallel plan and dispatch.

What runs: the model's ``base_model_ep_plan`` (its patterns expanded to the model's module names), applied with
``transformers.distributed.expert_parallel.apply_expert_parallelism`` on hf_dist's ``ep`` mesh:

- ``grouped_gemm`` parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, gpt-oss' biases) become
  ``DTensor``s ``Shard(0)`` on the ``ep`` mesh: each rank keeps its ``E / ep`` experts (taken from its own full
  copy, no communication), and the experts module counts ``E / ep`` local experts;
- the ``ep_dispatch_experts`` module gets transformers' ``AllToAllEP``: every (token, chosen expert) pair is sent to
  the expert's rank with a differentiable all-to-all, run there by the experts' own forward on local ids, and sent
  back and weighted by the router's weights on the token's rank. Every pair is computed -- dropless, as the
  models' own forward is: no capacity factor, no token dropped.

Why transformers' dispatch and not a second one on torch collectives: the dispatch is the contract between the
router and the experts' forward (local expert ids, the weights applied on the sender, the ``_is_expert_parallel``
masking), which transformers keeps in step with its experts implementations; its collectives take whatever
``DeviceMesh`` they are given, so hf_dist passes its own ``ep`` mesh (from ``ParallelDims``' expert mesh) and a
size-1 ``tp`` mesh. What does not fit hf_dist -- transformers' mesh manager, its FSDP plan, its loader -- is not
used: FSDP2 of the experts over ``efsdp`` with the right gradient divisor is ``hf_dist.parallelism``, replicated
data parallelism ``hf_dist.data_parallel``. ``all_to_all`` is named (not ``auto``): hf_dist's ``ep`` ranks hold
different batches, where ``auto`` picks it anyway.

Not here: which models run (``support``), the layout rules (``hf_dist.strategy``).
"""

from __future__ import annotations

import re

from torch import nn

from hf_dist.expert_parallel.adapters import shard_expert_adapters
from hf_dist.expert_parallel.support import check_ep_support, ep_plan
from hf_dist.models.peft_utils import unwrap_peft, without_base_layers
from hf_dist.parallel_dims import ParallelDims


def _expand(plan: dict[str, str], modules: list[str], params: list[str]) -> dict[str, str]:
    """The plan's patterns (``layers.*.mlp.experts``) matched against the model's module and parameter names (any
    prefix: ``model.``, PEFT's; a parameter inside PEFT's ``ParamWrapper``s as if unwrapped)."""
    names = {name: name for name in modules} | {without_base_layers(name): name for name in params}
    expanded: dict[str, str] = {}
    for pattern, style in plan.items():
        regex = re.compile(r"(?:.*\.)?" + re.escape(pattern).replace(r"\*", r"\d+"))
        expanded |= {real: style for name, real in names.items() if regex.fullmatch(name)}
    return expanded


def apply_expert_parallel(model: nn.Module, dims: ParallelDims) -> list[nn.Module]:
    """Shard ``model``'s experts over ``dims``' ``ep`` mesh in place; return the experts modules (FSDP units)."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    target = unwrap_peft(model)
    check_ep_support(target.config, dims.ep, dims.pp, dims.cp, dims.tp)
    plan = _expand(ep_plan(target.config), [n for n, _ in target.named_modules()],
                   [n for n, _ in target.named_parameters()])
    modules = [name for name, style in plan.items() if style == "ep_dispatch_experts"]
    if not modules and getattr(target, "partial_model", False):
        return []  # a pipeline stage of dense layers only: its peers' stages hold the experts
    if not modules:
        raise ValueError(f"the expert-parallel plan of {type(target).__name__} matched no module (plan: "
                         f"{ep_plan(target.config)}); this model cannot run with ep_size={dims.ep}")
    for name in modules:  # before the dispatch reads the experts' (local) count
        shard_expert_adapters(target.get_submodule(name), dims.get_mesh("ep"))
    apply_expert_parallelism(target, dims.get_mesh("ep"), dims.get_mesh("tp"), plan, ep_implementation="all_to_all")
    experts = [target.get_submodule(name) for name in modules]
    for module in experts:
        module._hf_dist_experts = True
    return experts


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules ``apply_expert_parallel`` sharded (empty without EP)."""
    return [m for m in model.modules() if getattr(m, "_hf_dist_experts", False)]



def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter of the experts modules, frozen ones included (sharded over ``ep``: each rank's differ, so
    none may be broadcast or reduced over the data-parallel ranks; the trainable ones are reduced over ``efsdp``)."""
    return [p for m in expert_modules(model) for p in m.parameters()]
