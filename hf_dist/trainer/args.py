"""``DistTrainingArguments``: ``transformers.TrainingArguments`` plus the global-batch contract and layout sizes.

Everything here is parseable by ``HfArgumentParser``. The contract is resolved in ``__post_init__``, before the
process group exists, from the launcher's ``WORLD_SIZE``: ``gradient_accumulation_steps`` and ``learning_rate``
are derived, so the rest of the Trainer sees ordinary arguments.

Not here: applying the layout to a model (``hf_dist.parallelize``) or deciding which backend runs it
(``hf_dist.trainer.launch_env``).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

from transformers import TrainingArguments

from hf_dist.batch import LR_SCALINGS, BatchContract
from hf_dist.pipeline_parallel.microbatches import fold_accumulation_into_pipeline
from hf_dist.loss.policy import loss_option_refusal
from hf_dist.strategy import Layout
from hf_dist.trainer import launch_env, preemption, router_loss
from hf_dist.trainer.layout import resolve_layout


logger = logging.getLogger(__name__)
DEFAULT_LEARNING_RATE = 5e-5  # transformers.TrainingArguments' default


def check_values(args) -> None:
    """Values no layout can use, refused by name before any process group (pure)."""
    given = args.learning_rate
    if given is not None and not math.isnan(given) and not (math.isfinite(given) and given >= 0):
        raise ValueError(f"learning_rate={given!r} must be a finite non-negative number")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        raise ValueError(f"peak_tflops={args.peak_tflops!r} must be a positive number of TFLOP/s (one device's "
                         f"dense peak, e.g. 312 for an A100 in bf16); leave it unset to look it up")
    if args.pp_microbatches is not None and args.pp_microbatches < 1:
        raise ValueError(f"pp_microbatches={args.pp_microbatches} must be a positive integer (micro-batches per "
                         f"pipeline step); leave it unset to use the accumulation the global batch gives")
    preemption.parse_signals(args.preemption_signals)
    router_loss.check_scope(args.router_aux_loss_scope)
    if args.router_aux_loss_scope == "global_batch" and args.pp_size > 1:
        raise ValueError(f"router_aux_loss_scope='global_batch' with pp_size={args.pp_size}: pipeline stages compute "
                         f"the aux loss per micro-batch (statistics passed between stages, not over dp ranks); use "
                         f"router_aux_loss_scope='micro_batch' or pp_size=1")
    if args.router_aux_loss_scope == "global_batch" and args.cp_size > 1:
        raise ValueError(f"router_aux_loss_scope='global_batch' with cp_size={args.cp_size}: under context "
                         f"parallelism the router statistics are pooled over the cp ranks of each micro-batch, not "
                         f"gathered over the dp ranks; use router_aux_loss_scope='micro_batch' or cp_size=1")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "tp_size", "pp_size", "ep_size", "cp_size"):
        value = getattr(args, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer (sequences per forward on one rank for "
                             f"the batch sizes; 1 disables tp_size/pp_size/ep_size/cp_size)")


def fp16_without_gpu(args) -> str | None:
    """Why ``fp16=True`` does nothing here: accelerate trains fp16 only on an accelerator and silently runs fp32 on
    CPU (the Trainer accepts it, so DistTrainingArguments warns; the recipe refuses). None when it applies."""
    if args.fp16 and not launch_env.has_gpu() and not launch_env.deepspeed_requested(args):
        return ("fp16=True on a machine without a GPU: accelerate runs fp16 only on an accelerator, so this would "
                "train in fp32; drop --fp16, or use --bf16 true (bf16 autocast runs on CPU)")
    return None


def check_learning_rate(args) -> None:
    """``learning_rate`` and ``base_learning_rate`` together must agree (after the layout is resolved)."""
    given = args.learning_rate
    if args.base_learning_rate is not None and given is not None and not math.isnan(given):
        derived = resolve_contract_lr(args)
        if derived is not None and not math.isclose(given, derived, rel_tol=1e-12):  # else the contract refuses
            raise ValueError(
                f"learning_rate={given:g} and base_learning_rate={args.base_learning_rate:g} were both given; the "
                f"learning rate is derived from base_learning_rate x the global batch ({args.lr_scaling} scaling), "
                f"so pass only one of them (a preset's base_learning_rate stays: to fix the rate, pass "
                f"--base_learning_rate {given:g} --lr_scaling none instead)"
            )


def resolve_contract_lr(args) -> float | None:
    """The learning rate ``base_learning_rate`` gives at this run's global batch (None when it cannot resolve)."""
    try:
        return args._resolve_contract().learning_rate
    except ValueError:
        return None


@dataclass
class DistTrainingArguments(TrainingArguments):
    """``TrainingArguments`` with hf_dist's batch contract, LR scaling and parallel layout."""

    reads_lm_head_weight = False  # a class attribute, not a field: the trainer's loss, not a user's choice
    """Whether the trainer's loss reads ``lm_head.weight`` outside the head's forward (TRL's fused LM head): FSDP2 then
    keeps an untied head in its root (``hf_dist.parallelism.FsdpRequest.head_unit``), gathered in the root's forward."""

    global_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Sequences per optimizer step across all data-parallel ranks. When set, gradient accumulation "
            "is derived as global / (per_device_train_batch_size x data-parallel size)."
        },
    )
    base_learning_rate: float | None = field(
        default=None,
        metadata={"help": "Reference learning rate tuned at base_batch_size; learning_rate is derived from it."},
    )
    base_batch_size: int | None = field(
        default=None, metadata={"help": "Global batch at which base_learning_rate was tuned."}
    )
    lr_scaling: str = field(
        default="linear",
        metadata={"help": "How the LR follows the global batch when base_learning_rate is set.", "choices": LR_SCALINGS},
    )
    learning_rate: float | None = field(
        default=None,
        metadata={"help": f"The initial learning rate for the optimizer (default {DEFAULT_LEARNING_RATE:g}). Not "
                  "together with base_learning_rate, from which it is derived."},
    )
    tp_size: int = field(default=1, metadata={"help": "Tensor-parallel degree (ranks that share a batch)."})
    tp_sequence_parallel: bool = field(
        default=False,
        metadata={"help": "With tp_size > 1: norms and residuals on sequence shards (less activation memory)."},
    )
    tp_vocab_parallel: bool = field(
        default=False,
        metadata={"help": "With tp_size > 1: embedding and lm_head sharded on the vocabulary; the loss never "
                  "builds whole logits (predictions still gather them)."},
    )
    pp_size: int = field(default=1, metadata={"help": "Pipeline-parallel degree (number of stages)."})
    ep_size: int = field(
        default=1,
        metadata={"help": "Expert-parallel degree for MoE models: experts split over this many data-parallel ranks, "
                  "tokens exchanged all-to-all; the experts are sharded (FSDP2) or replicated (DDP) over the "
                  "dp / ep_size ranks that hold the same ones."},
    )
    cp_size: int = field(
        default=1,
        metadata={"help": "Context-parallel degree: ranks that split each sequence (all-to-all attention around the "
                  "model's own attention, hf_dist/context_parallel). They read the same batch; FSDP2 shards over dp x "
                  "cp. Filled from an accelerate parallelism_config_cp_size."},
    )
    pp_schedule: str = field(
        default="1f1b",
        metadata={
            "help": "Pipeline schedule when pp_size > 1.",
            "choices": ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"],
        },
    )
    pp_microbatches: int | None = field(
        default=None,
        metadata={
            "help": "Pipeline micro-batches per step when pp_size > 1 (they replace gradient accumulation). "
            "Default: the accumulation derived from global_batch_size."
        },
    )
    fsdp2: bool = field(
        default=False,
        metadata={
            "help": "Shard the model with FSDP2 (torch fully_shard), applied by hf_dist on CPU and GPU. Filled from an "
            "accelerate FSDP version-2 launch config or from fsdp=/fsdp_config={'version': 2}; may be set directly."
        },
    )
    fsdp2_reshard_after_forward: bool = field(
        default=True,
        metadata={"help": "With fsdp2: True is FULL_SHARD (ZeRO-3); False is SHARD_GRAD_OP (gathered after forward)."},
    )
    fsdp2_activation_checkpointing: bool = field(
        default=False, metadata={"help": "With fsdp2: recompute each sharded block in backward."}
    )
    fsdp2_wrap_classes: list[str] | None = field(
        default=None,
        metadata={"help": "With fsdp2: module class names sharded as units. Default: the model's _no_split_modules."},
    )
    fsdp2_cpu_offload: bool = field(
        default=False, metadata={"help": "With fsdp2: keep the sharded parameters in CPU memory."}
    )
    fsdp2_explicit_prefetch: bool = field(
        default=True,
        metadata={"help": "With fsdp2: each block all-gathers the next in forward and the previous in backward, and "
                  "the last block stays gathered after forward. False: FSDP2's implicit prefetch only."},
    )
    fsdp2_dp_replicate: int = field(
        default=1,
        metadata={"help": "With fsdp2: replica groups (HYBRID_SHARD): shard inside world/dp_replicate ranks, "
                  "all-reduce across groups."},
    )
    fsdp2_dp_shard: int | None = field(
        default=None,
        metadata={"help": "With fsdp2: ranks each replica shards over, when a launch config states it (accelerate's "
                  "parallelism_config_dp_shard_size); must fill the world. Default: the ranks left over."},
    )
    preemption_signals: str = field(
        default="SIGTERM,SIGUSR1",
        metadata={"help": "Signals that mean 'preempted': every rank finishes its step, a checkpoint is saved and "
                  "the process exits with 75 (hf_dist/trainer/preemption.py). Comma-separated, or 'none'."},
    )
    async_save: bool = field(
        default=False,
        metadata={"help": "Checkpoints of the layouts hf_dist owns (FSDP2, TP, PP) are copied into reused CPU buffers "
                  "during the next forward/backward and written and committed by a background thread; the next "
                  "optimizer step waits for the copy, train() for the last commit (hf_dist/checkpoint/async_save.py). "
                  "Refused for DDP and DeepSpeed, whose checkpoints the Trainer writes."},
    )
    layout_canary: bool = field(
        default=True,
        metadata={"help": "With pp_size > 1: before training, run the requested pipeline layout on a tiny twin of "
                  "the model's config on the real ranks and refuse to start unless loss and gradients equal the "
                  "unsplit twin's (about a second). --layout_canary false skips it."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "A fresh start deletes the checkpoint-N folders an earlier run left in output_dir (without "
                  "it they are moved into output_dir/previous_run-<UTC time>/, where they still resume by path)."},
    )
    chunked_loss: bool = field(
        default=True,
        metadata={
            "help": "Training loss through the head chunk by chunk (hf_dist.loss): never the whole [batch, seq, "
            "vocab] logits nor their gradient; equal to the model's own loss. Used where exact (one process, DDP, "
            "FSDP2, PP's last stage; not under TP/DeepSpeed, a label smoother or compute_loss_func). Evaluation "
            "is unchanged."
        },
    )
    dist_logging: bool = field(
        default=False,
        metadata={
            "help": "Add tokens/s, MFU, per-rank peak memory and step times to each training log and append every "
            "log to OUTPUT_DIR/log_history.jsonl (what `hf-dist report` draws). Off: logs and files are the Trainer's."
        },
    )
    router_aux_loss_scope: str = field(
        default="micro_batch",
        metadata={
            "help": "MoE router load-balancing loss: micro_batch (each forward's own tokens, as the models define it) "
            "or global_batch (router statistics pooled over the data-parallel ranks before the loss). Either way its "
            "weight is router_aux_loss_coef whatever the micro batch, accumulation and dp (hf_dist.trainer.router_loss).",
            "choices": ("micro_batch", "global_batch"),
        },
    )
    peak_tflops: float | None = field(
        default=None,
        metadata={
            "help": "Peak dense FLOP/s of one device in TFLOP/s, for the MFU estimate. Default: looked up for known "
            "GPUs; none on CPU (MFU is then not logged)."
        },
    )

    def _check_async_save(self) -> None:
        if self.async_save and not self.layout.owned_by_hf_dist:
            raise ValueError(
                "async_save=True applies to the checkpoints hf_dist writes (FSDP2, TP or PP layouts), but this run is "
                "DDP or DeepSpeed, whose checkpoints the Trainer writes synchronously; drop --async_save, or launch "
                "with accelerate_configs/fsdp.yaml (FSDP2), --tp_size or --pp_size"
            )

    def __post_init__(self):
        check_values(self)  # before anything reads them: no process group exists yet
        if (why := fp16_without_gpu(self)) and int(os.environ.get("RANK", "0")) == 0:
            logger.warning(why)  # the Trainer accepts it; say so once instead of training in fp32 silently
        launch_env.prepare_environment(self)
        # the one layout of this run, from every source; re-resolved on every construction (dataclasses.replace)
        self.layout: Layout = resolve_layout(self)
        if self.label_smoothing_factor and (why := loss_option_refusal(
                self.layout, f"label_smoothing_factor={self.label_smoothing_factor}")):
            raise ValueError(why)
        check_learning_rate(self)
        if self.learning_rate is None:  # None: not given (kept apart from an explicit 5e-5, the Trainer's default)
            self.learning_rate = DEFAULT_LEARNING_RATE if self.base_learning_rate is None else float("nan")
        super().__post_init__()
        self._check_async_save()
        # derived from the fields above and WORLD_SIZE on every construction (so dataclasses.replace re-derives it)
        self.batch_contract: BatchContract = self._resolve_contract()
        self.gradient_accumulation_steps = self.batch_contract.gradient_accumulation_steps
        if self.batch_contract.learning_rate is not None:
            self.learning_rate = self.batch_contract.learning_rate
        fold_accumulation_into_pipeline(self)  # pp_size > 1: accumulation -> micro-batches

    @property
    def hf_dist_fsdp(self) -> launch_env.FsdpRequest | None:
        """The FSDP2 request hf_dist applies, read from the ``fsdp2*`` fields; None without ``fsdp2``."""
        return launch_env.FsdpRequest.from_fields(self)

    def _resolve_contract(self) -> BatchContract:
        return resolve_contract(
            world_size=self.layout.world_size,
            micro_batch_size=self.per_device_train_batch_size,
            global_batch_size=self.global_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            tp_size=self.layout.tp,
            pp_size=self.layout.pp,
            cp_size=self.layout.cp,
            base_learning_rate=self.base_learning_rate,
            base_batch_size=self.base_batch_size,
            lr_scaling=self.lr_scaling,
        )


def resolve_contract(
    *,
    world_size: int,
    micro_batch_size: int,
    global_batch_size: int | None,
    gradient_accumulation_steps: int = 1,
    tp_size: int = 1,
    pp_size: int = 1,
    cp_size: int = 1,
    base_learning_rate: float | None = None,
    base_batch_size: int | None = None,
    lr_scaling: str = "linear",
) -> BatchContract:
    """The batch contract of a run (pure). Without ``global_batch_size`` it is micro x dp x accumulation; the
    layout's rules (``hf_dist.strategy.Layout``) have already checked ``tp_size``, ``pp_size`` and ``cp_size``."""
    dp = world_size // (tp_size * pp_size * cp_size)
    if global_batch_size is None:
        global_batch_size = micro_batch_size * dp * gradient_accumulation_steps
    else:
        derived, remainder = divmod(global_batch_size, micro_batch_size * dp)
        if remainder == 0 and gradient_accumulation_steps not in (1, derived):
            raise ValueError(
                f"gradient_accumulation_steps={gradient_accumulation_steps} contradicts global_batch_size="
                f"{global_batch_size} = per_device_train_batch_size={micro_batch_size} x data-parallel size={dp} x "
                f"accumulation {derived}; drop gradient_accumulation_steps (it is derived) or change global_batch_size"
            )
    return BatchContract(
        world_size=world_size,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        tp=tp_size,
        pp=pp_size,
        cp=cp_size,
        base_learning_rate=base_learning_rate,
        base_batch_size=base_batch_size,
        lr_scaling=lr_scaling if base_learning_rate is not None else "none",
    )
