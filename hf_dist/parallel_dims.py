"""The rank arithmetic of a parallel layout: degrees, groups and the named ``DeviceMesh``.

``ParallelDims`` says how the world is factored into data-parallel replicas
(``dp_replicate``), data-parallel shards (``dp_shard``, what FSDP/ZeRO shards
over), context-parallel ranks (``cp``, which split one sequence), tensor-parallel
ranks (``tp``) and pipeline stages (``pp``). It builds a named ``DeviceMesh`` and
answers "which group do I talk to for X" questions.

It is not a process-group manager: nothing here is global, two layouts can live
in one process (tests do that), and building the mesh is explicit.

Mesh axis order, outermost first: ``pp, dp_replicate, dp_shard, cp, tp``. Tensor
parallelism is innermost so that its ranks are neighbours (one node, fast
links); pipeline stages are outermost so that they cross nodes. Context
parallelism sits next to TP: its all-to-all runs twice per layer. The ranks of
one ``cp`` group read the same batch (``dp`` excludes ``cp``), but hold different
tokens, so parameters are sharded -- and gradients reduced -- over ``dp_shard x
cp`` together (the flattened ``dp_shard_cp`` axis, as torchtitan does): CP ranks
are data-parallel ranks for the parameters and one rank for the data.

Experts (``ep > 1``) are laid out over the same ranks a second way, as transformers' ``DistributedConfig`` does:
inside one pipeline stage the ``dp x tp`` ranks are factored into ``dp x tp / ep`` x ``ep``. The ``ep`` ranks of a
group (neighbours among the ``dp x tp`` ranks, innermost) hold different experts and exchange tokens; the others
hold the same experts and shard them with FSDP (or average their gradients without FSDP): ``efsdp = dp x cp x tp /
ep`` ranks, the context-parallel ranks included -- a cp group's ranks hold different tokens of the same sequences
and the same experts, each sending its own tokens to its ``ep`` peers, which hold the same slice of other batches.
The expert mesh is a second root mesh ``(pp, efsdp, ep)`` built next to the dense one (with ``cp = 1``, the ranks
in order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_FACTORS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
_FLATTENED = ("dp", "dp_shard_cp", "dp_cp")
_EXPERT_FACTORS = ("pp", "efsdp", "ep")


def valid_ep_sizes(dp: int, tp: int) -> list[int]:
    """The expert-parallel degrees that factor the ``dp x tp`` ranks of a stage into ``efsdp x ep``: the one EP
    divisibility rule, asked by ``hf_dist.strategy.Layout`` (in the training arguments' words, for the planner and
    the run alike) and by ``ParallelDims`` (for a mesh built directly)."""
    spread = dp * tp
    return [d for d in range(1, spread + 1) if spread % d == 0]


@dataclass(kw_only=True)
class ParallelDims:
    """A factorisation of ``world_size`` into ``pp x dp_replicate x dp_shard x cp x tp``."""

    world_size: int
    """Number of processes in the job."""
    dp_replicate: int = 1
    """Data-parallel replicas that hold full copies (DDP, or HSDP's outer axis)."""
    dp_shard: int = -1
    """Data-parallel ranks that shard parameters/states (FSDP/ZeRO). -1: the ranks left over."""
    cp: int = 1
    """Context-parallel degree: ranks that split each sequence (and read the same batch)."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (number of physical stages)."""
    ep: int = 1
    """Expert-parallel degree: ranks of one stage that hold different experts (not a factor of the world: the
    experts' own factorisation of the ``dp x tp`` ranks, see the module docstring)."""
    _mesh: object | None = field(default=None, init=False, repr=False, compare=False)
    _flat_meshes: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _expert_mesh: object | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} must be a positive integer")
        values = {name: getattr(self, name) for name in _FACTORS}
        for name, value in values.items():
            if not isinstance(value, int) or (value < 1 and value != -1):
                raise ValueError(f"{name}={value!r} must be a positive integer or -1 (the ranks left over)")
        left_over = [name for name, value in values.items() if value == -1]
        if len(left_over) > 1:
            raise ValueError(
                f"only one factor may be -1, got {', '.join(f'{n}=-1' for n in left_over)}; "
                f"set all but one explicitly"
            )
        if left_over:
            known = 1
            for name, value in values.items():
                if value != -1:
                    known *= value
            if self.world_size % known != 0:
                raise ValueError(
                    f"{self._describe()} cannot fill world_size={self.world_size}: the fixed factors multiply to "
                    f"{known}, which does not divide {self.world_size}; use a world size that is a multiple of {known}"
                )
            setattr(self, left_over[0], self.world_size // known)
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ValueError(
                f"{self._describe()} multiply to {product}, but world_size={self.world_size}; "
                f"the five factors must multiply to the world size (set one of them to -1 to take the ranks left over)"
            )
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 1:
            raise ValueError(f"ep={self.ep!r} must be a positive integer (1: no expert parallelism)")
        if self.ep > 1 and self.expert_replicas > 1 and (self.dp_shard * self.tp) % self.ep:
            raise ValueError(f"ep={self.ep} does not divide dp_shard={self.dp_shard}: under HSDP each replica group "
                             f"holds every expert, so its ep ranks lie inside one group of {self.dp_shard} shards; use "
                             f"ep in {valid_ep_sizes(self.dp_shard, self.tp)}")
        if self.ep not in valid_ep_sizes(self.dp, self.tp):
            spread, valid = self.dp * self.tp, valid_ep_sizes(self.dp, self.tp)
            raise ValueError(f"ep={self.ep} does not divide the {spread} ranks of a stage that experts spread over "
                             f"(dp_replicate x dp_shard x tp = {self.dp_replicate} x {self.dp_shard} x {self.tp}); "
                             f"use ep in {valid}")

    def _describe(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)}" for name in _FACTORS)

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel degree: the number of different batches seen per micro step."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """Ranks that hold the same experts (transformers' ``efsdp_size``): ``dp x cp x tp / ep``."""
        return self.dp * self.cp * self.tp // self.ep

    @property
    def expert_replicas(self) -> int:
        """Replica groups the experts are replicated over: ``dp_replicate`` under HSDP (``dp_shard > 1`` too: each
        replica group holds every expert, split over its ``ep`` ranks and sharded over the rest), else 1."""
        return self.dp_replicate if self.dp_replicate > 1 and self.dp_shard > 1 else 1

    def expert_fsdp_mesh(self):
        """The mesh FSDP2 shards the experts over: ``efsdp``, or ``(efsdp_replicate, efsdp_shard)`` under HSDP."""
        if self.expert_replicas > 1:
            return self._expert_mesh["efsdp_replicate", "efsdp_shard"]
        return self.get_mesh("efsdp")

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_cp(self) -> int:
        """Ranks that hold different tokens of one step (data-parallel x context-parallel): gradients average
        over them."""
        return self.dp * self.cp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    # -- coordinates (pure: no process group needed) ---------------------------------------------
    def coordinates(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of ``rank``: ``{"pp", "dp_replicate", "dp_shard", "cp", "tp", "dp"}``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside world_size={self.world_size}")
        coords: dict[str, int] = {}
        remainder = rank
        for name in reversed(_FACTORS):  # innermost axis varies fastest
            size = getattr(self, name)
            coords[name] = remainder % size
            remainder //= size
        coords["dp"] = coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]
        return coords

    def axis_span(self, name: str) -> tuple[int, int]:
        """``(size, stride)`` of the groups of mesh axis ``name`` (the ranks of one group are ``stride`` apart):
        the five factors, the flattened ``dp``, ``dp_shard_cp``, ``dp_cp``, ``world``, and ``ep``, ``efsdp`` of the
        expert mesh. Whether a group stays inside a node follows (``size x stride <= GPUs per node``)."""
        expert = {"ep": (self.ep, 1), "efsdp": (self.efsdp, self.ep)}
        if name in expert:
            return expert[name]
        groups = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
                  "dp_cp": ("dp_replicate", "dp_shard", "cp"), "world": _FACTORS}.get(name, (name,))
        if not set(groups) <= set(_FACTORS):
            raise ValueError(f"unknown mesh axis {name!r}; axes are {', '.join((*_FACTORS, *_FLATTENED))}, world, "
                             f"ep, efsdp")
        inner = _FACTORS[_FACTORS.index(groups[-1]) + 1:]
        size = stride = 1
        for factor in groups:
            size *= getattr(self, factor)
        for factor in inner:
            stride *= getattr(self, factor)
        return size, stride

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel shard of the batch ``rank`` reads."""
        return self.coordinates(rank)["dp"]

    # -- the mesh --------------------------------------------------------------------------------
    def build_mesh(self, device_type: str | None = None):
        """Build (once) and return the named ``DeviceMesh``; needs an initialised process group.

        Axis names: ``pp, dp_replicate, dp_shard, cp, tp`` plus the flattened ``dp`` (replicate x shard: the data
        sampler's axis), ``dp_shard_cp`` (what FSDP2 shards over) and ``dp_cp`` (what gradients average over).
        """
        if self._mesh is not None:
            return self._mesh
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(
            device_type,
            tuple(getattr(self, name) for name in _FACTORS),
            mesh_dim_names=_FACTORS,
        )
        # keep the flattened axes themselves: slicing a flattened dim from the root mesh is deprecated
        self._flat_meshes = {"dp": mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")}
        if self.cp_enabled:
            self._flat_meshes["dp_shard_cp"] = mesh["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp")
            self._flat_meshes["dp_cp"] = mesh["dp_replicate", "dp_shard", "cp"]._flatten(mesh_dim_name="dp_cp")
        else:  # without CP the same ranks: one group each
            self._flat_meshes["dp_shard_cp"] = mesh["dp_shard"]
            self._flat_meshes["dp_cp"] = self._flat_meshes["dp"]
        if self.ep > 1 and self.expert_replicas > 1:  # HSDP: the efsdp axis split into replicas x shards
            ranks = self.expert_ranks().reshape(self.pp, self.expert_replicas, -1, self.ep)
            expert = DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "efsdp_replicate", "efsdp_shard", "ep"))
            self._flat_meshes["efsdp"] = expert["efsdp_replicate", "efsdp_shard"]._flatten(mesh_dim_name="efsdp")
            self._expert_mesh = expert
        elif self.ep > 1:
            self._expert_mesh = DeviceMesh(device_type, self.expert_ranks(), mesh_dim_names=_EXPERT_FACTORS)
        self._mesh = mesh
        return mesh

    def expert_ranks(self) -> torch.Tensor:
        """The expert mesh's ranks ``(pp, efsdp, ep)``: the ``ep`` axis over the ``dp x tp`` ranks of one cp coordinate
        (rank order: ``pp, dp, cp, tp``), the ``efsdp`` axis over the rest. Pure: no process group."""
        ranks = torch.arange(self.world_size).reshape(self.pp, self.dp, self.cp, self.tp)
        return ranks.transpose(1, 2).reshape(self.pp, self.efsdp, self.ep)

    def get_mesh(self, name: str):
        """The sub-mesh for axis ``name`` (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, or the flattened
        ``dp``, ``dp_shard_cp``, ``dp_cp``; with ``ep > 1`` also ``ep`` and ``efsdp``, from the expert mesh)."""
        if self._mesh is None:
            raise RuntimeError("call build_mesh() before get_mesh()")
        if name in ("ep", "efsdp", "efsdp_replicate", "efsdp_shard"):
            if self._expert_mesh is None:
                raise ValueError(f"mesh axis {name!r} exists only with ep > 1 (this layout has ep={self.ep})")
            return self._flat_meshes["efsdp"] if name == "efsdp" and self.expert_replicas > 1 else self._expert_mesh[name]
        if name not in (*_FACTORS, *_FLATTENED):
            raise ValueError(f"unknown mesh axis {name!r}; axes are {', '.join((*_FACTORS, *_FLATTENED))}")
        if name in _FLATTENED:
            return self._flat_meshes[name]
        return self._mesh[name]

    @property
    def mesh(self):
        if self._mesh is None:
            raise RuntimeError("call build_mesh() before using the mesh")
        return self._mesh

    @classmethod
    def from_sizes(cls, world_size: int, *, tp: int = 1, pp: int = 1, dp_replicate: int = 1,
                   cp: int = 1) -> "ParallelDims":
        """The common case: TP, PP and CP fixed, every rank left over shards data."""
        return cls(world_size=world_size, tp=tp, pp=pp, cp=cp, dp_replicate=dp_replicate, dp_shard=-1)
