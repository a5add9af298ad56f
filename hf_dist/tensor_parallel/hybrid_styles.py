"""The parallel style hybrid (linear-attention / short-convolution) layers need beyond torch's and ``styles.py``.

- ``LocalParams``: parameters that a mixer's forward reads directly (``self.conv1d.weight.squeeze(1)`` handed to a
  causal-conv function, ``self.A_log``, a gated norm's ``self.weight``) instead of through a child module's
  forward, so no Linear-style hook can hand them over. They are stored as DTensors -- split on dimension 0 by
  head or channel, or whole -- and, for the duration of the module's forward only, the attribute the forward
  reads is the local tensor (``DTensor.to_local``, differentiable). A split whose rows are several parts
  (Gated DeltaNet's conv over ``[q | k | v]``) is interleaved part by part like the fused projection feeding
  it (``FusedColwiseParallel``), and recorded with ``FUSED_PARTS_ATTR`` so a gathered save restores HF order.
  A whole parameter read by every rank's heads gets a partial gradient per rank, summed over the TP ranks.
  Integer attributes the forward splits by (``key_dim``, ``value_dim``) are divided by ``tp``.

Not for: choosing which module gets which style (``hybrid.py``), or sizes (``checks.py``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DeviceMesh, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from hf_dist.tensor_parallel.styles import FUSED_PARTS_ATTR, _reduce_partial_grad, interleave_parts


class LocalParams(ParallelStyle):
    """Parameters read directly by a module's forward, as local shards (or whole) during that forward.

    Args:
        shards: ``{dotted parameter name: parts}`` split on dimension 0 across the TP ranks; ``parts`` is ``()``
            for an even split, or the row count of each fused part, each split on its own.
        whole: parameter names kept whole on every rank; their gradient is summed over the TP ranks.
        attrs: integer attributes (dotted for a child's) divided by ``tp``.
        buffers: ``{buffer name: parts}`` of non-persistent buffers the forward multiplies the output of a fused
            projection by (Falcon-H1's ``mup_vector``): replaced by this rank's slice of their last dimension.
    """

    def __init__(
        self,
        *,
        shards: dict[str, tuple[int, ...]] | None = None,
        whole: tuple[str, ...] = (),
        attrs: tuple[str, ...] = (),
        buffers: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        super().__init__()
        self.shards = dict(shards or {})
        self.whole = tuple(whole)
        self.attrs = tuple(attrs)
        self.buffers = dict(buffers or {})

    @staticmethod
    def _owner(module: nn.Module, dotted: str) -> tuple[nn.Module, str]:
        path, _, name = dotted.rpartition(".")
        return (module.get_submodule(path) if path else module), name

    def _distribute(self, module: nn.Module, mesh: DeviceMesh) -> list[tuple[nn.Module, str, bool]]:
        tp = mesh.size()
        entries = []
        for dotted in (*self.shards, *self.whole):
            owner, name = self._owner(module, dotted)
            param = owner._parameters.get(name)
            if param is None:
                continue  # switched off by the config (a conv without bias)
            whole = dotted in self.whole
            value = param.detach()
            if not whole:
                parts = self.shards[dotted]
                if value.shape[0] % tp or any(p % tp for p in parts):
                    raise ValueError(
                        f"{type(module).__name__}.{dotted} has {value.shape[0]} rows (parts {parts}) that tp={tp} "
                        f"does not split evenly; use a tp that divides them"
                    )
                if parts:
                    value = interleave_parts(value, parts, tp)
                    setattr(owner, FUSED_PARTS_ATTR, (parts, tp))
            placement = Replicate() if whole else Shard(0)
            dist_param = nn.Parameter(
                distribute_tensor(value, mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            )
            if whole:
                dist_param.register_post_accumulate_grad_hook(_reduce_partial_grad)
            owner.register_parameter(name, dist_param)
            entries.append((owner, name, whole))
        return entries

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        for dotted in self.attrs:
            owner, attr = self._owner(module, dotted)
            value = getattr(owner, attr)
            if not isinstance(value, int) or value % tp:
                raise ValueError(f"{type(module).__name__}.{dotted}={value!r} does not divide by tp={tp}")
            setattr(owner, attr, value // tp)
        for name, parts in self.buffers.items():
            whole = module._buffers[name]
            rows = interleave_parts(whole.movedim(-1, 0), parts, tp).chunk(tp, dim=0)[rank]
            module.register_buffer(name, rows.movedim(0, -1).contiguous(), persistent=False)
        entries = self._distribute(module, device_mesh)

        def swap_in(mod, args):
            # an instance attribute shadows the registered parameter for attribute reads only: state_dict(),
            # parameters() and optimizers keep seeing the DTensor
            for owner, name, whole in entries:
                param = owner._parameters[name]
                local = param.to_local(grad_placements=[Partial()]) if whole else param.to_local()
                owner.__dict__[name] = local

        def swap_out(mod, args, output):
            for owner, name, _ in entries:
                owner.__dict__.pop(name, None)

        module.register_forward_pre_hook(swap_in)
        module.register_forward_hook(swap_out, always_call=True)
        return module

    def __repr__(self) -> str:
        return f"LocalParams(shards={self.shards}, whole={self.whole}, attrs={self.attrs}, buffers={self.buffers})"
