"""LoRA adapters on stacked expert weights (PEFT ``target_parameters``, its ``ParamWrapper``) under expert parallelism.

PEFT wraps an experts module once per targeted parameter (``mlp.experts`` -> ``ParamWrapper(down_proj)`` ->
``ParamWrapper(gate_up_proj)`` -> the model's experts) and keeps, per wrapper, ``lora_A [E * r, in]`` (expert-major
rows: expert ``e`` owns rows ``e*r .. e*r + r``) and ``lora_B [out, r * E]`` (expert-minor columns: expert ``e`` owns
columns ``k*E + e``), reshaped with the wrapper's ``num_experts`` on every forward. Under EP each rank keeps the
adapters of its own experts, placed as the experts are (``Shard(0)`` on the ``ep`` mesh): ``lora_A`` ``Shard(0)``,
``lora_B`` ``_StridedShard(1, split_factor=r)`` (torch's private placement FSDP2 x TP uses) -- whose local block is
exactly PEFT's ``[out, r * E / ep]`` layout for the local experts -- and ``num_experts`` becomes ``E / ep``.
Gathered (``full_tensor``, state dicts, checkpoints) they are PEFT's tensors again, so saving and
``AutoPeftModelForCausalLM`` see the usual adapter.

The dispatch goes on the outermost wrapper (the plan's ``mlp.experts``), so the received tokens run PEFT's forward
(the adapted weights) on local expert ids; that forward reads nested parameters, so they are made local tensors around
it, as transformers' dispatch does for the experts module's own parameters.

Not here: which models run EP (``support``), the plan (``apply``).
"""

from __future__ import annotations

import contextlib

from torch import nn


def _param_wrappers(module: nn.Module) -> list[nn.Module]:
    """PEFT's ``ParamWrapper`` chain starting at ``module`` (empty when it is the experts module itself)."""
    chain = []
    while hasattr(module, "parameter_name") and hasattr(module, "lora_A") and hasattr(module, "base_layer"):
        chain.append(module)
        module = module.base_layer
    return chain


def shard_expert_adapters(experts: nn.Module, mesh) -> None:
    """Place the LoRA adapters of ``experts``' ``ParamWrapper`` chain on ``mesh`` as its experts are placed."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    ep, rank = mesh.size(), mesh.get_local_rank()
    for wrapper in _param_wrappers(experts):
        total = wrapper.num_experts
        local = total // ep  # the experts' own count was checked to divide (``ep_refusal``)
        for adapter, linear in wrapper.lora_A.items():
            weight = linear.weight
            rows = weight.shape[0] // total
            shard = weight.detach()[rank * local * rows:(rank + 1) * local * rows].clone()
            linear.weight = nn.Parameter(DTensor.from_local(shard, mesh, [Shard(0)], shape=weight.shape,
                                                            stride=weight.stride(), run_check=False),
                                         requires_grad=weight.requires_grad)
        for adapter, linear in wrapper.lora_B.items():
            weight = linear.weight
            r = weight.shape[1] // total
            shard = weight.detach().reshape(weight.shape[0], r, total)[:, :, rank * local:(rank + 1) * local]
            shard = shard.reshape(weight.shape[0], r * local).clone()
            linear.weight = nn.Parameter(DTensor.from_local(shard, mesh, [_StridedShard(1, split_factor=r)],
                                                            shape=weight.shape, stride=weight.stride(),
                                                            run_check=False),
                                         requires_grad=weight.requires_grad)
        wrapper.num_experts = local
    if _param_wrappers(experts):
        forward = experts.forward

        def local_forward(*args, **kwargs):
            with _local_parameters(experts):
                return forward(*args, **kwargs)

        experts.forward = local_forward  # what transformers' dispatch calls on the received tokens


@contextlib.contextmanager
def _local_parameters(module: nn.Module):
    """Every ``DTensor`` parameter under ``module`` as its local tensor for the duration (differentiable)."""
    from torch.distributed.tensor import DTensor

    originals = [(owner, name, param) for owner in module.modules()
                 for name, param in owner._parameters.items() if isinstance(param, DTensor)]
    for owner, name, param in originals:
        owner._parameters[name] = param.to_local()
    try:
        yield
    finally:
        for owner, name, param in originals:
            owner._buffers.pop(name, None)  # PEFT's parametrization hands a non-Parameter back as a buffer
            owner._parameters[name] = param


