"""DeepSpeed JSON generation: a typed ``DeepSpeedSpec`` in, a plain dict out.

Two modes:

* **Trainer mode** (``batch=None``): every value the HF Trainer fills from ``TrainingArguments`` is ``"auto"``
  (the keys in ``TRAINER_OWNED_KEYS``, taken from ``HfTrainerDeepSpeedConfig.trainer_config_process`` and
  ``trainer_config_finalize`` in transformers' ``integrations/deepspeed.py``). One file then works for any batch
  size and precision the training arguments name.
* **Resolved mode** (``batch=DeepSpeedBatch(...)``): the batch, clipping and precision are numbers, checked
  here (``train_batch_size == micro x accumulation x dp``); the Trainer cross-checks them against its arguments
  and refuses a mismatch. Optimizer hyper-parameters stay ``"auto"`` unless ``adamw`` is given, and the ZeRO
  bucket sizes unless ``hidden_size`` is (they are the model's, filled by the Trainer).

Not here: which stage to pick (that is the planner's job), writing files (``hf_dist.configs.launch``) or
reading them back (``hf_dist.configs.strict``). Pure: no torch, no DeepSpeed import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Precision = Literal["auto", "bf16", "fp16", "fp32"]
OffloadDevice = Literal["cpu", "nvme"]

# Dotted keys the HF Trainer fills when their value is "auto" (transformers integrations/deepspeed.py).
TRAINER_OWNED_KEYS: tuple[str, ...] = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "gradient_clipping",
    "fp16.enabled",
    "bf16.enabled",
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr",
    "scheduler.params.warmup_max_lr",
    "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)


@dataclass(kw_only=True, frozen=True)
class DeepSpeedBatch:
    """The numbers of a resolved DeepSpeed config (no ``"auto"`` left)."""

    micro_batch_size: int
    """Sequences per forward on one data-parallel rank (``train_micro_batch_size_per_gpu``)."""
    gradient_accumulation_steps: int
    """Micro steps per optimizer step."""
    dp: int
    """Data-parallel degree (world size / (tp x pp)); DeepSpeed calls it the data-parallel world size."""
    gradient_clipping: float = 1.0
    """Max global gradient norm (the Trainer's ``max_grad_norm``)."""
    hidden_size: int | None = None
    """Model hidden size, to size the ZeRO buckets as the Trainer would; None: ``"auto"`` (Trainer fills them)."""

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "gradient_accumulation_steps", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DeepSpeedBatch.{name}={value!r} must be a positive integer")
        if self.gradient_clipping < 0:
            raise ValueError(f"gradient_clipping={self.gradient_clipping} must be >= 0 (0 disables clipping)")

    @property
    def train_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.dp


@dataclass(kw_only=True, frozen=True)
class AdamWSettings:
    """Hyper-parameters of DeepSpeed's own AdamW when a resolved config carries an optimizer block."""

    lr: float
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam beta1, beta2 (the Trainer's defaults)."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""


@dataclass(kw_only=True, frozen=True)
class DeepSpeedSpec:
    """Everything that decides a DeepSpeed JSON."""

    stage: Literal[1, 2, 3]
    """ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters."""
    precision: Precision = "auto"
    """``auto``: both bf16/fp16 blocks with ``enabled: "auto"`` (the Trainer's ``--bf16``/``--fp16`` decide);
    otherwise that precision only (``fp32``: both disabled)."""
    offload_optimizer: OffloadDevice | None = None
    """Where optimizer states (and the fp32 master weights) live: GPU (None), CPU RAM or NVMe."""
    offload_param: OffloadDevice | None = None
    """Where ZeRO-3 parameters live between uses (stage 3 only)."""
    nvme_path: str = "/local_nvme"
    """Folder on a local NVMe drive, for ``nvme`` offload."""
    optimizer: Literal["trainer", "deepspeed"] = "trainer"
    """``trainer``: no optimizer block, the Trainer builds torch AdamW (no DeepSpeed op to compile).
    ``deepspeed``: an AdamW block, DeepSpeed picks FusedAdam on GPU or DeepSpeedCPUAdam with CPU offload."""
    adamw: AdamWSettings | None = None
    """Optimizer numbers for a resolved config with ``optimizer="deepspeed"``; None: ``"auto"``."""
    gather_16bit_weights_on_model_save: bool = True
    """ZeRO-3: gather a full 16-bit state dict on save, so ``save_model`` writes usable weights."""
    batch: DeepSpeedBatch | None = None
    """None: Trainer mode (``"auto"`` for the values the Trainer owns); set: every number resolved."""
    fp16_initial_scale_power: int = 16
    """fp16 dynamic loss scaling starts at 2**this."""
    fp16_loss_scale_window: int = 1000
    """Steps without overflow before the loss scale is raised."""
    fp16_hysteresis: int = 2
    """Overflows tolerated before the loss scale is lowered."""
    fp16_min_loss_scale: float = 1.0
    """Floor of the dynamic loss scale."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward."""
    extra: dict = field(default_factory=dict)
    """Top-level keys merged last (e.g. ``{"steps_per_print": 10}``); keys the spec writes are refused."""

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"stage={self.stage!r} is not a ZeRO stage; use 1, 2 or 3")
        if self.precision not in ("auto", "bf16", "fp16", "fp32"):
            raise ValueError(f"precision={self.precision!r} is not known; use auto, bf16, fp16 or fp32")
        for name in ("offload_optimizer", "offload_param"):
            value = getattr(self, name)
            if value not in (None, "cpu", "nvme"):
                raise ValueError(f"{name}={value!r} is not an offload device; use None, 'cpu' or 'nvme'")
        if self.offload_param is not None and self.stage != 3:
            raise ValueError(
                f"offload_param={self.offload_param!r} needs ZeRO stage 3 (stage={self.stage} keeps whole "
                f"parameters on every GPU); use stage=3 or offload_param=None"
            )
        if self.optimizer not in ("trainer", "deepspeed"):
            raise ValueError(f"optimizer={self.optimizer!r} is not known; use 'trainer' or 'deepspeed'")
        if self.precision == "auto" and self.batch is not None:
            raise ValueError("precision='auto' leaves bf16/fp16 to the Trainer; a resolved config (batch set) "
                             "must name it: use bf16, fp16 or fp32")


def _auto_or(value, spec: DeepSpeedSpec):
    return "auto" if spec.batch is None else value


def _precision_blocks(spec: DeepSpeedSpec) -> dict:
    fp16 = {
        "enabled": "auto" if spec.precision == "auto" else spec.precision == "fp16",
        "loss_scale": 0,  # 0 = dynamic loss scaling
        "initial_scale_power": spec.fp16_initial_scale_power,
        "loss_scale_window": spec.fp16_loss_scale_window,
        "hysteresis": spec.fp16_hysteresis,
        "min_loss_scale": spec.fp16_min_loss_scale,
    }
    bf16 = {"enabled": "auto" if spec.precision == "auto" else spec.precision == "bf16"}
    if spec.precision == "bf16":
        return {"bf16": bf16}
    if spec.precision == "fp16":
        return {"fp16": fp16}
    if spec.precision == "fp32":
        return {"bf16": {"enabled": False}, "fp16": {"enabled": False}}
    return {"bf16": bf16, "fp16": fp16}


def _offload_block(device: str, spec: DeepSpeedSpec, *, param: bool) -> dict:
    block: dict = {"device": device, "pin_memory": True}
    if device == "nvme":
        block["nvme_path"] = spec.nvme_path
        block["buffer_count"] = 5 if param else 4
        if param:
            block["buffer_size"] = 100_000_000
            block["max_in_cpu"] = 1_000_000_000
    return block


def _bucket_sizes(spec: DeepSpeedSpec) -> dict:
    """The hidden-size-derived buckets: "auto" for the Trainer, or the Trainer's own formulas when resolved."""
    keys = ["reduce_bucket_size"]
    if spec.stage == 3:
        keys += ["stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"]
    if spec.batch is None:
        return dict.fromkeys(keys, "auto")
    hidden = spec.batch.hidden_size
    if hidden is None:
        return dict.fromkeys(keys, "auto")  # the Trainer sizes them from the model's hidden size
    formulas = {
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }
    return {key: formulas[key] for key in keys}


def _zero_block(spec: DeepSpeedSpec) -> dict:
    zero: dict = {"stage": spec.stage, "overlap_comm": spec.overlap_comm, "contiguous_gradients": True}
    if spec.stage < 3:
        zero.update(allgather_partitions=True, allgather_bucket_size=500_000_000, reduce_scatter=True)
    zero.update(_bucket_sizes(spec))
    if spec.stage == 3:
        zero.update(
            stage3_max_live_parameters=1_000_000_000,
            stage3_max_reuse_distance=1_000_000_000,
            sub_group_size=1_000_000_000,
            stage3_gather_16bit_weights_on_model_save=spec.gather_16bit_weights_on_model_save,
        )
    if spec.offload_optimizer is not None:
        zero["offload_optimizer"] = _offload_block(spec.offload_optimizer, spec, param=False)
    if spec.offload_param is not None:
        zero["offload_param"] = _offload_block(spec.offload_param, spec, param=True)
    return zero


def _optimizer_block(spec: DeepSpeedSpec) -> dict:
    if spec.adamw is None:
        params = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
    else:
        params = {
            "lr": spec.adamw.lr,
            "betas": list(spec.adamw.betas),
            "eps": spec.adamw.eps,
            "weight_decay": spec.adamw.weight_decay,
        }
    return {"type": "AdamW", "params": params}


def deepspeed_config(spec: DeepSpeedSpec) -> dict:
    """The DeepSpeed config dict for ``spec`` (JSON-serialisable, key order stable)."""
    batch = spec.batch
    config: dict = {
        "train_batch_size": _auto_or(batch and batch.train_batch_size, spec),
        "train_micro_batch_size_per_gpu": _auto_or(batch and batch.micro_batch_size, spec),
        "gradient_accumulation_steps": _auto_or(batch and batch.gradient_accumulation_steps, spec),
        "gradient_clipping": _auto_or(batch and batch.gradient_clipping, spec),
    }
    config.update(_precision_blocks(spec))
    config["zero_optimization"] = _zero_block(spec)
    if spec.offload_optimizer == "nvme" or spec.offload_param == "nvme":
        config["aio"] = {
            "block_size": 1_048_576,
            "queue_depth": 8,
            "thread_count": 1,
            "single_submit": False,
            "overlap_events": True,
        }
    if spec.optimizer == "deepspeed":
        config["optimizer"] = _optimizer_block(spec)
    config["steps_per_print"] = 1_000_000_000  # the Trainer logs; keep DeepSpeed's own step log quiet
    config["wall_clock_breakdown"] = False
    clash = sorted(set(spec.extra) & set(config))
    if clash:
        raise ValueError(f"extra keys {clash} are written by the spec itself; set them through DeepSpeedSpec fields")
    config.update(spec.extra)
    check_batch_arithmetic(config, dp=batch.dp if batch else None)
    return config


def check_batch_arithmetic(config: dict, *, dp: int | None, source: str = "DeepSpeed config") -> None:
    """Refuse a resolved config whose ``train_batch_size != micro x accumulation x dp`` (naming all four)."""
    values = [config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                      "gradient_accumulation_steps")]
    if dp is None or any(v is None or v == "auto" for v in values):
        return
    total, micro, accum = values
    if total != micro * accum * dp:
        raise ValueError(
            f"{source}: train_batch_size={total} != train_micro_batch_size_per_gpu={micro} x "
            f"gradient_accumulation_steps={accum} x dp={dp} (= {micro * accum * dp}); DeepSpeed requires equality. "
            f"Fix one of the four, or set the three batch keys to \"auto\" and let the Trainer fill them"
        )
