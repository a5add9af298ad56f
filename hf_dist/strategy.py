"""How a job is laid out (``Layout``), which layouts hf_dist runs, and how each maps to ParallelDims.

``Layout`` names a job's layout: the data-parallel flavour (``STRATEGIES``), GPUs per node and nodes, TP/PP/EP/CP
degrees, offload, the TP options and LoRA. Its ``__post_init__`` holds the rules about which combinations hf_dist
runs (a ``ValueError`` naming the value, the rule and the fix); the rules about what a launch may request before a
``Layout`` exists (DeepSpeed and FSDP together, HYBRID_SHARD without resharding) are its static methods, which the
launch-config readers of ``hf_dist.trainer`` call (they also refuse DeepSpeed stage 0 and accelerate's
``parallelism_config_sp_size``, which name no layout). ``Layout.dims`` maps a layout to ``ParallelDims``. The planner
(``hf_dist.planner``) chooses among ``Layout``s, config generation (``hf_dist.configs``) writes the files that
launch one, and a training run resolves its one ``Layout`` from its arguments and launcher
(``hf_dist.trainer.layout.resolve_layout``, in ``DistTrainingArguments``), which the trainer,
``hf_dist.from_pretrained`` and the checkpoint manifest use; ``hf_dist.precision.precision_that_runs`` says which
tensors are bf16 and which fp32 for a layout.

Not here: what a given model can run (``hf_dist.support.model_refusals``, the registry), batch arithmetic
(``hf_dist.batch``), memory, or files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hf_dist.ep_rules import check_expert_parallel
from hf_dist.parallel_dims import ParallelDims

Strategy = Literal["ddp", "zero1", "zero2", "zero3", "fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard"]
STRATEGIES: tuple[str, ...] = (
    "ddp", "zero1", "zero2", "zero3", "fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard",
)
FSDP_STRATEGIES: tuple[str, ...] = ("fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard")
ZERO_STRATEGIES: tuple[str, ...] = ("zero1", "zero2", "zero3")
Offload = Literal["none", "cpu", "cpu_optimizer", "nvme"]
OFFLOADS: tuple[str, ...] = ("none", "cpu", "cpu_optimizer", "nvme")
"""``cpu``: everything the strategy can move to CPU memory (ZeRO-1/2: optimizer states and gradients; ZeRO-3:
those and the parameters; FSDP FULL_SHARD: parameter, gradient and optimizer shards, the step on CPU).
``cpu_optimizer``: ZeRO-3 with the optimizer offloaded and the parameters left on the GPU. ``nvme``: ZeRO-3
optimizer states and parameters on NVMe (ZeRO-Infinity)."""
_OFFLOADS_BY_STRATEGY: dict[str, tuple[str, ...]] = {
    "ddp": ("none",), "zero1": ("none", "cpu"), "zero2": ("none", "cpu"), "zero3": OFFLOADS,
    "fsdp_full_shard": ("none", "cpu"), "fsdp_shard_grad_op": ("none",), "fsdp_hybrid_shard": ("none",),
}
_OFFLOAD_WHY = {
    "ddp": "DDP replicates everything on every GPU; use zero2/zero3 or fsdp_full_shard to offload",
    "zero1": "DeepSpeed offloads to NVMe and keeps parameters on the GPU only at ZeRO-3; use zero3, or offload='cpu'",
    "zero2": "DeepSpeed offloads to NVMe and keeps parameters on the GPU only at ZeRO-3; use zero3, or offload='cpu'",
    "fsdp_full_shard": "FSDP offloads parameters, gradients and optimizer together, to CPU only; use offload='cpu' "
                       "or a zero3 layout",
    "fsdp_shard_grad_op": "SHARD_GRAD_OP keeps parameters gathered on the GPU between forward and backward; use "
                          "fsdp_full_shard with offload='cpu'",
    "fsdp_hybrid_shard": "hf_dist offloads with fsdp_full_shard only; use fsdp_full_shard with offload='cpu'",
}


def streams_weights(*, fsdp: bool, tp: int, pp: int) -> bool:
    """Whether ``hf_dist.from_pretrained`` streams each rank's slices (meta init, no rank holds the whole model):
    for the layouts hf_dist owns, FSDP2, TP, PP and their products. DDP and DeepSpeed keep transformers' loader
    (whole model on every rank; ZeRO-3 through ``deepspeed.zero.Init``). The planner counts host RAM by it."""
    return fsdp or tp > 1 or pp > 1


def check_tp_options(*, tp: int, pp: int, sequence_parallel: bool, vocab_parallel: bool) -> None:
    """Sequence and vocabulary parallelism shard over the TP ranks, and pipeline stages apply TP without them."""
    for name, value in (("tp_sequence_parallel", sequence_parallel), ("tp_vocab_parallel", vocab_parallel)):
        if value and tp == 1:
            raise ValueError(f"{name}=True needs tp_size > 1 (it shards over the TP ranks); set tp_size or "
                             f"drop {name}")
        if value and pp > 1:
            raise ValueError(f"{name}=True is not available with pp_size={pp} (pipeline stages apply TP without "
                             f"it); set {name}=False")


@dataclass(kw_only=True, frozen=True)
class Layout:
    """A parallel layout hf_dist runs: invalid combinations raise ``ValueError`` here, before anything starts.

    The planner and ``hf-dist config`` build one from their choices; a training run resolves one from its
    arguments and launcher (``hf_dist.trainer.layout.resolve_layout``), so both obey the same rules. Error
    messages name the training arguments (``tp_size``, ``pp_size``, ...); the planner's options have the same
    meaning.
    """

    strategy: Strategy
    """Data-parallel flavour: ddp, zero1/2/3 (DeepSpeed) or fsdp_full_shard/shard_grad_op/hybrid_shard (FSDP2)."""
    num_gpus: int
    """GPUs (processes) per node."""
    num_nodes: int = 1
    """Nodes; the world size is ``num_gpus x num_nodes``."""
    tp: int = 1
    """Tensor-parallel degree, inside a node (``--tp_size``)."""
    pp: int = 1
    """Pipeline-parallel degree (``--pp_size``)."""
    ep: int = 1
    """Expert-parallel degree (``--ep_size``): MoE experts split over this many of a stage's ``dp x tp`` ranks, tokens
    sent to their experts' ranks (a TP group's shared tokens sliced over its ranks first); experts are sharded (FSDP2)
    or replicated (DDP) over the ``efsdp = dp x cp x tp / ep`` ranks that hold the same ones (a cp group's ranks hold
    the same experts)."""
    cp: int = 1
    """Context-parallel degree (``--cp_size``): ranks that split each sequence (all-to-all attention,
    ``hf_dist.context_parallel``). They read the same batch; parameters shard and gradients average over
    ``dp x cp`` together."""
    offload: Offload = "none"
    """What leaves the GPU (see ``OFFLOADS``)."""
    sequence_parallel: bool = False
    """With TP: norms and residual-stream activations split over the TP ranks (``--tp_sequence_parallel``)."""
    vocab_parallel: bool = False
    """With TP: embedding and lm_head split over the vocabulary (``--tp_vocab_parallel``); else replicated."""
    lora_rank: int = 0
    """LoRA rank on all seven linears of every layer over a frozen base; 0: full fine-tune."""
    dp_replicate: int | None = None
    """fsdp_hybrid_shard only: replica groups, each sharding over ``dp / dp_replicate`` ranks. None: one per node."""
    dp_shard: int | None = None
    """Ranks each replica shards over, when a launch config states it (accelerate's
    ``parallelism_config_dp_shard_size``); None: the ranks left over. A stated size must fill the world."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not known; use one of {', '.join(STRATEGIES)}")
        for name in ("num_gpus", "num_nodes", "tp", "pp", "ep", "cp"):
            _check_positive(name, getattr(self, name))
        for name in ("dp_replicate", "dp_shard"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank!r} must be a non-negative integer (0: no LoRA)")
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload={self.offload!r} is not known; use one of {', '.join(OFFLOADS)}")
        if self.offload not in _OFFLOADS_BY_STRATEGY[self.strategy]:
            raise ValueError(f"offload={self.offload!r} with strategy={self.strategy!r}: "
                             f"{_OFFLOAD_WHY[self.strategy]}")
        if self.offload != "none" and self.pp > 1:
            raise ValueError(f"offload={self.offload!r} with pp_size={self.pp}: pipeline stages keep their "
                             f"parameters on the device; drop the offload (fsdp cpu_offload / offload_params) or set "
                             f"pp_size=1")
        self._check_model_parallel()
        self._check_context_parallel()
        check_tp_options(tp=self.tp, pp=self.pp, sequence_parallel=self.sequence_parallel,
                         vocab_parallel=self.vocab_parallel)
        self._check_data_parallel()
        check_expert_parallel(self)

    @staticmethod
    def check_one_engine(*, deepspeed: bool, fsdp: bool) -> None:
        """DeepSpeed and FSDP are two data-parallel engines: a request for both is refused (asked by the launch-config
        readers before a ``Layout`` exists, and by ``resolve_layout``)."""
        if deepspeed and fsdp:
            raise ValueError("both DeepSpeed and FSDP were requested; choose one (drop --deepspeed or the FSDP config)")

    @staticmethod
    def fsdp_strategy(*, dp_replicate: int, reshard_after_forward: bool) -> Strategy:
        """The FSDP2 strategy of a launch's FSDP options: HYBRID_SHARD with ``dp_replicate > 1`` (it reshards after
        forward: the other request is refused), else FULL_SHARD or SHARD_GRAD_OP by ``reshard_after_forward``."""
        if dp_replicate > 1:
            if not reshard_after_forward:
                raise ValueError(f"fsdp2_dp_replicate={dp_replicate} (HYBRID_SHARD) with fsdp2_reshard_after_forward"
                                 f"=False: hf_dist's HSDP reshards after forward; drop one of them")
            return "fsdp_hybrid_shard"
        return "fsdp_full_shard" if reshard_after_forward else "fsdp_shard_grad_op"

    def _check_model_parallel(self) -> None:
        if self.strategy in ZERO_STRATEGIES and (self.tp > 1 or self.pp > 1):
            raise ValueError(f"DeepSpeed {self.strategy} with tp_size={self.tp}, pp_size={self.pp}: DeepSpeed ZeRO "
                             f"shards the whole model itself and does not compose with hf_dist's TP/PP; use FSDP2 "
                             f"(accelerate_configs/fsdp.yaml) or DDP with TP/PP, or drop tp_size/pp_size")
        if self.strategy == "fsdp_hybrid_shard" and (self.tp > 1 or self.pp > 1):
            raise ValueError(f"HYBRID_SHARD (dp_replicate={self.replicas}) with tp_size={self.tp}, pp_size={self.pp}: "
                             f"hf_dist does not run HSDP with TP/PP (no parity test covers it); use FULL_SHARD "
                             f"(dp_replicate=1) with tp/pp, or tp_size=pp_size=1")
        if self.num_gpus % self.tp:
            valid = [d for d in range(1, self.num_gpus + 1) if self.num_gpus % d == 0]
            raise ValueError(f"tp_size={self.tp} does not divide the {self.num_gpus} processes per node; tensor "
                             f"parallelism stays inside a node: use tp_size in {valid}")
        if self.world_size % (self.tp * self.pp):
            raise ValueError(
                f"tp_size={self.tp} x pp_size={self.pp} = {self.tp * self.pp} does not divide the world size "
                f"{self.world_size}; launch a multiple of {self.tp * self.pp} processes or lower tp_size/pp_size")

    def _check_context_parallel(self) -> None:
        """CP runs with DDP-style replication or FSDP2 FULL_SHARD / SHARD_GRAD_OP, and with TP (each tested against one
        process);
        the other products are refused with their reason. Model rules (heads divisible by cp, supported model types)
        are ``hf_dist.context_parallel.support``."""
        if self.cp == 1:
            return
        if self.is_deepspeed:
            raise ValueError(f"cp_size={self.cp} with DeepSpeed {self.strategy}: the DeepSpeed engine reduces gradients "
                             f"over the whole world and reads a different batch on every rank, while context-parallel "
                             f"ranks share one batch; use FSDP2 (accelerate_configs/fsdp.yaml) or DDP with cp_size")
        reasons = {
            "pp_size": (self.pp > 1, "pipeline stages pass whole-sequence activations between ranks and compute the "
                                     "loss on the last stage only, where the sequence split and its shifted labels "
                                     "are not wired; use cp_size without pp_size (CP cuts activations per rank too)"),
            "tp_sequence_parallel": (self.sequence_parallel, "the sequence split takes whole hidden states between "
                                                             "layers, which TP's sequence parallelism shards; drop "
                                                             "tp_sequence_parallel (CP already splits the sequence)"),
            "tp_vocab_parallel": (self.vocab_parallel, "CP x vocabulary-parallel logits has no parity test in hf_dist "
                                                       "yet; drop tp_vocab_parallel"),
            "fsdp_hybrid_shard": (self.strategy == "fsdp_hybrid_shard",
                                  "HSDP x CP has no parity test in hf_dist yet; use fsdp_full_shard (dp_replicate=1)"),
        }
        for name, (refused, why) in reasons.items():
            if refused:
                value = self.strategy if name == "fsdp_hybrid_shard" else getattr(
                    self, {"tp_sequence_parallel": "sequence_parallel", "tp_vocab_parallel": "vocab_parallel"}.get(
                        name, name.removesuffix("_size")))
                raise ValueError(f"cp_size={self.cp} with {name}={value}: {why}")
        if self.world_size % (self.cp * self.tp * self.pp):
            raise ValueError(f"cp_size={self.cp} does not divide the world size {self.world_size}; launch a multiple of "
                             f"{self.cp} processes or choose cp_size among the divisors of {self.world_size}")

    def _check_data_parallel(self) -> None:
        dp = self.dp
        if self.dp_replicate is not None and self.dp_replicate > 1 and self.strategy != "fsdp_hybrid_shard":
            raise ValueError(f"dp_replicate={self.dp_replicate} with strategy={self.strategy}: replica groups are "
                             f"HYBRID_SHARD's (FSDP2); drop dp_replicate or use FSDP2 with it")
        if self.strategy == "fsdp_hybrid_shard" and self.replicas < 2:
            raise ValueError(f"fsdp_hybrid_shard replicates over dp_replicate >= 2 groups (default: one per node), "
                             f"got {self.replicas} on {self.num_nodes} node(s); set dp_replicate "
                             f"(--fsdp2_dp_replicate, parallelism_config_dp_replicate_size), or use FULL_SHARD")
        if dp % self.replicas:
            valid = [d for d in range(1, dp + 1) if dp % d == 0]
            raise ValueError(f"dp_replicate={self.replicas} does not divide the {dp} data-parallel ranks (world "
                             f"{self.world_size} / tp_size {self.tp} / pp_size {self.pp} / cp_size {self.cp}); use "
                             f"dp_replicate in {valid}")
        if self.dp_shard is not None and self.replicas * self.dp_shard != dp:
            raise ValueError(
                f"dp_replicate={self.replicas} x dp_shard={self.dp_shard} = {self.replicas * self.dp_shard} but the "
                f"launch has {dp} data-parallel ranks (world {self.world_size} / tp_size {self.tp} / pp_size "
                f"{self.pp} / cp_size {self.cp}): the request would silently run as {self.replicas} x "
                f"{dp // self.replicas}; launch {self.replicas * self.dp_shard * self.tp * self.pp * self.cp} processes "
                f"or set dp_shard={dp // self.replicas}")

    @property
    def world_size(self) -> int:
        return self.num_gpus * self.num_nodes

    @property
    def replicas(self) -> int:
        """HYBRID_SHARD replica groups (1 for every other strategy)."""
        if self.strategy != "fsdp_hybrid_shard":
            return 1
        return self.dp_replicate if self.dp_replicate is not None else self.num_nodes

    @property
    def dims(self) -> ParallelDims:
        """A new ``ParallelDims`` (mesh not built): DDP replicates over the data-parallel ranks; ZeRO, FULL_SHARD and
        SHARD_GRAD_OP shard over all of them; HYBRID_SHARD replicates over ``replicas`` groups, sharding inside."""
        if self.strategy == "ddp":
            return ParallelDims(world_size=self.world_size, tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp,
                                dp_replicate=-1, dp_shard=1)
        return ParallelDims(world_size=self.world_size, tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp,
                            dp_replicate=self.replicas, dp_shard=-1)

    @property
    def efsdp(self) -> int:
        """Ranks that hold the same experts (``dp x cp x tp / ep``; transformers' ``efsdp_size``)."""
        return self.dp * self.cp * self.tp // self.ep

    @property
    def dp(self) -> int:
        """Data-parallel degree: different batches per micro step (context-parallel ranks share one)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def shard_degree(self) -> int:
        """Ranks that model states are sharded over (1: replicated)."""
        if self.is_deepspeed:
            return self.dp
        return self.dp * self.cp // self.replicas if self.is_fsdp else 1

    @property
    def streaming_load(self) -> bool:
        """Whether ``hf_dist.from_pretrained`` streams this layout's weights (``streams_weights``)."""
        return streams_weights(fsdp=self.is_fsdp, tp=self.tp, pp=self.pp)

    @property
    def owned_by_hf_dist(self) -> bool:
        """Whether hf_dist lays the model out and checkpoints it (FSDP2, TP, PP, EP, CP); else accelerate (DDP,
        DeepSpeed)."""
        return self.is_fsdp or self.tp > 1 or self.pp > 1 or self.ep > 1 or self.cp > 1

    @property
    def is_deepspeed(self) -> bool:
        return self.strategy in ZERO_STRATEGIES

    @property
    def is_fsdp(self) -> bool:
        return self.strategy in FSDP_STRATEGIES

    @property
    def name(self) -> str:
        """Short label, e.g. ``fsdp_full_shard+tp4sp``, ``zero3+offload_cpu``, ``ddp+lora16``."""
        parts = [self.strategy]
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("sp" if self.sequence_parallel else "") + ("vp" if self.vocab_parallel
                                                                                    else ""))
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.offload != "none":
            parts.append(f"offload_{self.offload}")
        if self.lora_rank:
            parts.append(f"lora{self.lora_rank}")
        return "+".join(parts)

    def describe(self, backend: str | None = None) -> str:
        """The layout for people, e.g. ``FSDP2 FULL_SHARD (hf_dist fully_shard) x TP2 (sequence parallel)``: the
        description the trainer's table prints, ``launch.sh`` (``hf-dist config``, ``hf-dist plan --out``) opens with
        and checkpoint manifests record. ``backend`` names what runs the
        data-parallel part, when known (the trainer passes accelerate's distributed type for DDP)."""
        if self.is_fsdp:
            kind = "FSDP2 " + _FSDP_KIND[self.strategy]
            if self.strategy == "fsdp_hybrid_shard":
                kind += f" ({self.replicas} replicas x {self.shard_degree} shards)"
        elif self.is_deepspeed:
            kind = f"DeepSpeed ZeRO-{self.strategy[-1]}"
        elif self.dp > 1 or self.cp > 1:
            model_parallel = self.tp > 1 or self.pp > 1 or self.ep > 1 or self.cp > 1
            kind = f"DP{self.dp} (hf_dist gradient averaging)" if model_parallel else "DDP"
        else:
            kind = "single process" if self.world_size == 1 else "no data parallelism"
        if backend:
            kind += f" ({backend})"
        if self.tp > 1:
            options = [n for n, on in (("sequence", self.sequence_parallel), ("vocab", self.vocab_parallel)) if on]
            kind += f" x TP{self.tp}" + (f" ({' + '.join(options)} parallel)" if options else "")
        if self.pp > 1:
            kind += f" x PP{self.pp}"
        if self.ep > 1:
            kind += f" x EP{self.ep} (experts over {self.efsdp} x {self.ep})"
        if self.cp > 1:
            kind += f" x CP{self.cp} (all-to-all attention)"
        if self.offload != "none":
            kind = f"{kind}, offload {self.offload}"
        if self.lora_rank:
            kind = f"{kind}, LoRA r={self.lora_rank}"
        return kind


_FSDP_KIND = {"fsdp_full_shard": "FULL_SHARD", "fsdp_shard_grad_op": "SHARD_GRAD_OP",
              "fsdp_hybrid_shard": "HYBRID_SHARD"}


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
