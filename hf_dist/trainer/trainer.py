"""``DistTrainer``: a drop-in ``transformers.Trainer`` that applies hf_dist's layouts and batch contract.

A script using ``Trainer``/``TrainingArguments`` works unchanged with ``DistTrainer``/``DistTrainingArguments``.
What changes:

- the global-batch contract decides accumulation and the learning rate (``DistTrainingArguments``), and its
  table is printed once at start by the main process;
- layouts hf_dist owns (FSDP2, and TP/PP) are applied to the model here, in ``apply_layout``'s order, and the
  Trainer is told not to wrap the model again; DDP and DeepSpeed stay with accelerate;
- a launch that would silently run as something else stops with an error (``launch_env``);
- each training log carries tokens/s, MFU (when the device peak is known) and per-rank peak memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
from transformers import Trainer, TrainingArguments

from hf_dist.pipeline_parallel import trainer_glue as pipeline_trainer
from hf_dist.pipeline_parallel.support import check_pipeline_support
from hf_dist.report.log_history import LogHistoryCallback
from hf_dist.tensor_parallel import trainer_glue as tensor_parallel_trainer
from hf_dist.trainer import launch_env, preemption, resume, teardown
from hf_dist.trainer.args import DistTrainingArguments
from hf_dist.trainer.layout import apply_layout, layout_dims, mark_distribution_owned
from hf_dist.planner.flops import module_flop_counts
from hf_dist.trainer.throughput import ThroughputMeter, default_peak_flops

logger = logging.getLogger(__name__)


def as_dist_args(args: TrainingArguments | None) -> DistTrainingArguments:
    """``args`` as ``DistTrainingArguments`` (a plain ``TrainingArguments`` is converted field by field)."""
    if args is None:
        return DistTrainingArguments(output_dir="trainer_output")
    if isinstance(args, DistTrainingArguments):
        return args
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return DistTrainingArguments(**values)


class DistTrainer(Trainer):
    """``transformers.Trainer`` with hf_dist's parallel layouts, batch contract and throughput logging."""

    def __init__(self, model=None, args: TrainingArguments | None = None, *positional, **kwargs):
        args = as_dist_args(args)
        if model is None:
            raise ValueError("DistTrainer needs a model (model_init is not supported: the layout is applied once)")
        if args.pp_size > 1:
            check_pipeline_support(model.config)  # before any process group: stages must reproduce the model
        args.device  # initialises the process group with the backend launch_env chose
        teardown.register()  # destroyed at exit, before interpreter finalisation (else exit -6 under load)
        contract = args.batch_contract
        flops = module_flop_counts(model)  # before sharding; ds_numel under ZeRO-3 zero.Init
        fsdp = args.hf_dist_fsdp
        self.dims = layout_dims(
            world_size=contract.world_size, tp=args.tp_size, pp=args.pp_size, fsdp=fsdp is not None,
            dp_replicate=fsdp.dp_replicate if fsdp is not None else 1,
        )
        self.owns_layout = args.hf_dist_fsdp is not None or self.dims.tp_enabled or self.dims.pp_enabled
        if self.owns_layout:
            model = self._apply_owned_layout(model, args)
        peak = args.peak_tflops * 1e12 if args.peak_tflops else default_peak_flops()
        recompute = bool(args.gradient_checkpointing or (fsdp is not None and fsdp.activation_checkpointing))
        self.throughput = ThroughputMeter(
            flops=flops, model_parallel=self.dims.tp * self.dims.pp, peak_flops=peak, recompute=recompute
        )
        from hf_dist.checkpoint import trainer_hooks

        with trainer_hooks.sharded_checkpoints_accepted(args, self.owns_layout):
            super().__init__(model, args, *positional, **kwargs)
        launch_env.verify_backend(self)
        self.add_callback(LogHistoryCallback())  # OUTPUT_DIR/log_history.jsonl, for `hf-dist report`
        signals = preemption.parse_signals(args.preemption_signals)
        self.preemption = preemption.PreemptionCallback(signals) if signals else None
        if self.preemption is not None:  # SIGTERM/SIGUSR1: finish the step, save, exit 75
            self.add_callback(self.preemption)
        self._check_packing()
        if self.dims.pp_enabled:
            pipeline_trainer.finish_init(self)  # dp-only data sharding; logits to every rank for metrics
        elif self.dims.tp_enabled:
            tensor_parallel_trainer.prepare_trainer(self)  # a TP group reads one batch; metrics gathered over dp
        if self.args.should_log:
            print(self.describe(), flush=True)

    def create_accelerator_and_postprocess(self) -> None:
        with launch_env.accelerate_view(self.args):  # accelerate must not build FSDP over hf_dist's FSDP2
            super().create_accelerator_and_postprocess()

    def _apply_owned_layout(self, model, args: DistTrainingArguments):
        device = args.device
        self.dims.build_mesh(device.type)
        model = model.to(device)
        if self.dims.pp_enabled:  # split into this rank's stages (TP/FSDP inside the stages)
            return pipeline_trainer.apply_pipeline(self, model, args)
        param_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        model = apply_layout(
            model,
            self.dims,
            fsdp=args.hf_dist_fsdp,
            activation_checkpointing=args.gradient_checkpointing,
            param_dtype=param_dtype,
            sequence_parallel=args.tp_sequence_parallel,
            vocab_parallel=args.tp_vocab_parallel,
        )
        mark_distribution_owned(model)
        return model

    def _check_packing(self) -> None:
        """Packed batches must not let conversations attend to each other (KV cache off, varlen kwargs on flash)."""
        from hf_dist.data.packing import PackedCollator, check_model_for_packing

        if isinstance(self.data_collator, PackedCollator):
            check_model_for_packing(self.accelerator.unwrap_model(self.model), self.data_collator)

    def _mean_sequence_length(self) -> int | None:
        """Mean ``input_ids`` length over the first rows of the train set (for the tokens/step figure)."""
        dataset = self.train_dataset
        try:
            rows = [dataset[i]["input_ids"] for i in range(min(256, len(dataset)))]
        except (TypeError, KeyError, IndexError):
            return None
        return round(sum(len(r) for r in rows) / len(rows)) if rows else None

    def describe(self) -> str:
        """The resolved table: layout, batch contract and LR."""
        contract = dataclasses.replace(self.args.batch_contract, seq_len=self._mean_sequence_length())
        if self.args.hf_dist_fsdp is not None:
            kind = "FSDP2 FULL_SHARD" if self.args.hf_dist_fsdp.reshard_after_forward else "FSDP2 SHARD_GRAD_OP"
            if self.dims.dp_replicate > 1:
                kind += f" HYBRID ({self.dims.dp_replicate} replicas x {self.dims.dp_shard} shards)"
            kind += " (hf_dist fully_shard)"
        elif self.is_deepspeed_enabled:
            stage = self.accelerator.state.deepspeed_plugin.zero_stage
            kind = f"DeepSpeed ZeRO-{stage}"
        elif self.dims.tp_enabled or self.dims.pp_enabled:  # never DDP-wrapped: hf_dist averages over dp itself
            kind = f"DP{self.dims.dp} (hf_dist gradient averaging)" if self.dims.dp_enabled else "no data parallelism"
        elif contract.world_size > 1:
            kind = f"DDP ({self.accelerator.distributed_type.value})"
        else:
            kind = "single process"
        if self.dims.tp_enabled:
            options = [n for n, on in (("sequence", self.args.tp_sequence_parallel),
                                       ("vocab", self.args.tp_vocab_parallel)) if on]
            kind += f" x TP{self.dims.tp}" + (f" ({' + '.join(options)} parallel)" if options else "")
        if self.dims.pp_enabled:
            kind += f" x PP{self.dims.pp}"
        note = ""
        if self.dims.pp_enabled:
            note = f"{'':<22}  (under PP the accumulation steps run as the pipeline's micro-batches)\n"
        return f"{contract.table()}\n{'layout':<22}  {kind}\n{note}"

    # -- training -------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self.throughput.reset()  # time set-up (data loader, optimizer) is not throughput
        wrapped_elsewhere = self.owns_layout or self.is_deepspeed_enabled or self.is_fsdp_enabled
        if self.model is self.model_wrapped and not wrapped_elsewhere:
            # evaluate() before train() marks the bare model prepared (inference only): accelerate would then
            # skip the DDP wrap and every rank would train alone, gradients never reduced. Let train() wrap it.
            self.model.__dict__.pop("_is_accelerate_prepared", None)
        if self.owns_layout:  # an evaluate() forward leaves FSDP2's root unsharded: the optimizer must see shards
            from torch.distributed.fsdp import FSDPModule

            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        resume_from_checkpoint = resume.prepare_resume(self, resume_from_checkpoint)  # also args' flag
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        preemption.exit_if_preempted(self, self.preemption)  # saved at a signal: SystemExit(75)
        return output

    def evaluate(self, *args, **kwargs):
        zero_stage = self.accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else None
        if zero_stage is not None and zero_stage < 3 and self.deepspeed is None:
            # Before train() there is no engine, and DeepSpeed refuses inference below ZeRO-3; every rank holds
            # the full weights under ZeRO-1/2, so evaluate the plain model (batches still sharded over ranks).
            self.is_deepspeed_enabled = False
            try:
                return super().evaluate(*args, **kwargs)
            finally:
                self.is_deepspeed_enabled = True
        return super().evaluate(*args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        with self.throughput.step(model, inputs):  # tokens, busy time, DDP all-reduce wait
            if self.dims.pp_enabled:
                return pipeline_trainer.training_step(self, model, inputs)
            return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        return loss, tensor_parallel_trainer.whole_logits(model, logits), labels  # vocab-sharded under TP

    def get_tp_size(self) -> int:
        return self.dims.tp  # the Trainer divides num_items_in_batch and the global batch by it

    def _sync_replicated_trainable_parameters(self, model) -> None:
        if self.dims.pp_enabled:  # stages differ per rank: no broadcast from rank 0; the pipeline reduces grads
            return
        super()._sync_replicated_trainable_parameters(model)

    def _clip_grad_norm(self, model):
        if self.dims.pp_enabled:  # the norm over every stage, not just this rank's
            return pipeline_trainer.clip_grad_norm(self)
        return super()._clip_grad_norm(model)

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """Accumulate gradients locally until the last micro step (the model is ours, not transformers')."""
        if self.dims.dp_replicate > 1:
            self.model.set_requires_all_reduce(False)
        else:
            self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: every rank is here (the Trainer just gathered the loss)
            logs.update(self.throughput.report())
        super().log(logs, start_time)

    # -- saving ---------------------------------------------------------------------------------
    # Layouts hf_dist owns checkpoint through hf_dist.checkpoint (sharded, atomic); the rest as the Trainer does.
    def _save_checkpoint(self, model, trial) -> None:
        from hf_dist.checkpoint import trainer_hooks

        if not self.owns_layout:  # the Trainer's own format, into a folder holding nothing else
            return resume.save_native_checkpoint(self, model, trial, super()._save_checkpoint)
        trainer_hooks.save_trainer_checkpoint(self, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        from hf_dist.checkpoint import trainer_hooks

        if not trainer_hooks.loads_with_hf_dist(self, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # else: loaded with the optimizer

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        from hf_dist.checkpoint import trainer_hooks

        if not trainer_hooks.loads_with_hf_dist(self, checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        trainer_hooks.load_trainer_checkpoint(self, checkpoint)

    def _load_rng_state(self, checkpoint) -> None:
        from hf_dist.checkpoint import trainer_hooks

        if not trainer_hooks.loads_with_hf_dist(self, checkpoint):
            return super()._load_rng_state(checkpoint)
        trainer_hooks.restore_trainer_rng(self, checkpoint)

    def _load_best_model(self) -> None:
        from hf_dist.checkpoint import trainer_hooks

        if not trainer_hooks.loads_with_hf_dist(self, self.state.best_model_checkpoint):
            return super()._load_best_model()
        trainer_hooks.load_best_model(self)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """For layouts hf_dist owns, gather the full state dict (collective) and write a normal HF directory."""
        if self.dims.pp_enabled:
            return pipeline_trainer.save(self, output_dir)
        if self.dims.tp_enabled and state_dict is None:  # fused projections back in HF row order
            state_dict = tensor_parallel_trainer.gathered_state_dict(self.model)
        if self.owns_layout and state_dict is None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state_dict = get_model_state_dict(self.model, options=options)
            state_dict = {k: v.clone() for k, v in state_dict.items()}  # cpu_offload may alias live tensors
        super()._save(output_dir, state_dict=state_dict)
