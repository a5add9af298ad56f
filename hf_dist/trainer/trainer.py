"""``DistTrainer``: a drop-in ``transformers.Trainer`` that applies hf_dist's layouts and batch contract.

A script using ``Trainer``/``TrainingArguments`` works unchanged with ``DistTrainer``/``DistTrainingArguments``.
What changes:

- the global-batch contract decides accumulation and the learning rate (``DistTrainingArguments``), and its
  table is printed once at start by the main process;
- layouts hf_dist owns (FSDP2, and TP/PP) are applied to the model here, by ``hf_dist.parallelize``, and the
  Trainer is told not to wrap the model again; DDP and DeepSpeed stay with accelerate;
- a launch that would silently run as something else stops with an error (``launch_env``);
- ``model_init`` works as with the Trainer: each new model gets the layout (so ``hyperparameter_search`` runs).

Nothing else a Trainer user observes changes: the callbacks, the files in ``output_dir`` and in checkpoints
(for the layouts the Trainer checkpoints itself) and ``state.log_history`` are the Trainer's.
``dist_logging=True`` adds tokens/s, MFU (when the device peak is known), per-rank peak memory and step times to each training log and
appends every log to ``OUTPUT_DIR/log_history.jsonl`` (what ``hf-dist report`` draws).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
from transformers import Trainer, TrainingArguments

from hf_dist.file_modes import give_user_mode
from hf_dist.models.peft_utils import peft_rank
from hf_dist.loss.policy import loss_option_refusal
from hf_dist.parallel_dims import ParallelDims
from hf_dist.compile import compile_blocks
from hf_dist.parallelism import find_blocks, parallelize
from hf_dist.planner.flops import module_flop_counts
from hf_dist.report.log_history import LogHistoryCallback
from hf_dist.state_dict import save_gathered
from hf_dist.pipeline_parallel.apply import apply_pipeline
from hf_dist.pipeline_parallel.save import save_pretrained as save_pipeline
from hf_dist.tensor_parallel.apply import whole_logits
from hf_dist.tensor_parallel.grads import reduce_partial_grads
from hf_dist.trainer import (
    checkpoint_glue, compile_glue, context, data, launch_env, preemption, resume, router_loss, step, teardown,
)
from hf_dist.trainer.loss import chunked_loss_for, count_shifted_labels, local_token_count
from hf_dist.trainer.args import DistTrainingArguments
from hf_dist.internals import check_internals
from hf_dist.trainer.laid_out import laid_out_by_hf_dist
from hf_dist.trainer.model_support import check_model_support
from hf_dist.trainer.layout import apply_owned_layout
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
        check_internals()  # a private Trainer method overridden below that transformers removed: stop now
        args = as_dist_args(args)
        if kwargs.get("compute_loss_func") is not None and (why := loss_option_refusal(args.layout,
                                                                                          "compute_loss_func")):
            raise ValueError(why)  # before any process group
        if model is not None:  # before any process group (model_init's models are checked when made)
            check_model_support(getattr(model, "config", None), args, peft_rank(model))
        args.device  # initialises the process group with the backend launch_env chose
        teardown.register()  # destroyed at exit, before interpreter finalisation (else exit -6 under load)
        self.pending_save = None  # the last asynchronous checkpoint, until committed (checkpoint_glue)
        self.async_checkpointer = None  # reused across --async_save checkpoints (checkpoint_glue)
        self.expert_load = router_loss.ExpertLoad()  # MoE routing counts for --dist_logging
        self.dims = args.layout.dims  # the run's one Layout (DistTrainingArguments), its mesh built when applied
        self.owns_layout = args.layout.owned_by_hf_dist
        if model is not None:  # with model_init, the Trainer calls call_model_init (below) instead
            model = self._prepare_model(model, args)
        with checkpoint_glue.sharded_checkpoints_accepted(args, self.owns_layout):
            super().__init__(model, args, *positional, **kwargs)
        launch_env.verify_backend(self)
        count_shifted_labels(self)  # GPT-2 and other loss_type=None causal LMs: the count their loss uses
        if compile_glue.compile_request(args) is not None:
            self.add_callback(compile_glue.CompileReport())
        if args.dist_logging:
            self.add_callback(LogHistoryCallback())  # OUTPUT_DIR/log_history.jsonl, for `hf-dist report`
        signals = preemption.parse_signals(args.preemption_signals)
        # SIGTERM/SIGUSR1: finish the step, save, exit 75. A callback only while train() runs, where its signal
        # handlers live: outside it the callback list is the Trainer's.
        self.preemption = preemption.PreemptionCallback(signals) if signals else None
        self._check_packing()
        if self.dims.pp_enabled or self.dims.tp_enabled or self.dims.cp_enabled:  # ranks sharing a batch: by dp rank
            data.use_dp_group(self)
        if self.dims.pp_enabled:  # logits to every stage's rank only when metrics need them
            self.model.logits_everywhere = self.compute_metrics is not None or \
                self.preprocess_logits_for_metrics is not None
        if self.args.should_log:
            print(self.describe(), flush=True)

    def _prepare_model(self, model, args: DistTrainingArguments):
        """Every model this Trainer trains (the one passed in, or each ``model_init`` call): the layout applied."""
        fsdp = args.hf_dist_fsdp  # hf_dist.from_pretrained: the layout is applied already
        laid_out = laid_out_by_hf_dist(model, self.dims, head_unit=None if fsdp is None else fsdp.head_unit)
        if laid_out is not None:
            self.dims, flops = laid_out.dims, laid_out.flops
        else:
            flops = module_flop_counts(model)  # before sharding; ds_numel under ZeRO-3 zero.Init
            if self.owns_layout:
                model = apply_owned_layout(model, args, self.dims)
            elif compile_glue.compile_request(args) is not None:  # accelerate wraps it (DDP) or nothing does
                compile_blocks(find_blocks(model), compile_glue.compile_request(args))
        peak = args.peak_tflops * 1e12 if args.peak_tflops else default_peak_flops()
        fsdp = args.hf_dist_fsdp
        recompute = bool(args.activation_checkpointing or (fsdp is not None and fsdp.activation_checkpointing))
        self.throughput = ThroughputMeter(
            flops=flops, model_parallel=self.dims.tp * self.dims.pp, peak_flops=peak, recompute=recompute
        )
        return model

    def call_model_init(self, trial=None):
        """``model_init``'s new model with the layout applied (at start, and again per train() / search trial)."""
        model = super().call_model_init(trial)
        check_model_support(getattr(model, "config", None), self.args, peft_rank(model))
        model = self._prepare_model(model, self.args)
        previous = getattr(self, "model", None)  # None during __init__; the replaced model in train()
        if self.dims.pp_enabled and previous is not None:
            model.logits_everywhere = previous.logits_everywhere
        return model

    def create_accelerator_and_postprocess(self) -> None:
        with launch_env.accelerate_view(self.args):  # accelerate must not build FSDP over hf_dist's FSDP2
            with compile_glue.accelerate_compiles_nothing(self.args):  # nor compile what hf_dist compiled
                super().create_accelerator_and_postprocess()

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
        note = ""
        if self.dims.pp_enabled:
            note = f"{'':<22}  (under PP the accumulation steps run as the pipeline's micro-batches)\n"
        layout = self.args.layout
        backend = None  # what runs the data-parallel part, as the accelerator really is (no silent fallback)
        if layout.is_fsdp:
            backend = "hf_dist fully_shard"
        elif not layout.owned_by_hf_dist and not layout.is_deepspeed and layout.world_size > 1:
            backend = self.accelerator.distributed_type.value
        return f"{contract.table()}\n{'layout':<22}  {layout.describe(backend)}\n{note}"

    # -- training -------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self.throughput.reset()  # time set-up (data loader, optimizer) is not throughput
        wrapped_elsewhere = self.owns_layout or self.is_deepspeed_enabled or self.is_fsdp_enabled
        if self.model is self.model_wrapped and not wrapped_elsewhere:
            # evaluate() before train() marks the bare model prepared (inference only): accelerate would then
            # skip the DDP wrap and every rank would train alone, gradients never reduced. Let train() wrap it.
            self.model.__dict__.pop("_is_accelerate_prepared", None)
        resume_from_checkpoint = resume.prepare_resume(self, resume_from_checkpoint)  # also args' flag
        if self.preemption is not None:
            self.add_callback(self.preemption)
        try:
            output = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if self.preemption is not None:
                self.remove_callback(self.preemption)
        checkpoint_glue.wait_for_saves(self)  # --async_save: the last checkpoint is committed when train() returns
        preemption.exit_if_preempted(self, self.preemption)  # saved at a signal: SystemExit(75)
        return output

    def get_train_dataloader(self):
        """The resumable, dp-sharded order (``data.train_dataloader``); the Trainer's own for other datasets."""
        loader = data.train_dataloader(self)
        return loader if loader is not None else super().get_train_dataloader()

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
        metering = self.throughput.step(model, inputs) if self.args.dist_logging else contextlib.nullcontext()
        with metering, context.training_step(self):  # tokens, busy time, DDP all-reduce wait; CP: split batch
            if self.dims.pp_enabled:
                return step.pipeline_training_step(self, model, inputs)
            return super().training_step(model, inputs, num_items_in_batch)

    def pipeline_step(self, pipeline, inputs) -> torch.Tensor:
        """Under PP, one optimizer step's forward and backward through ``pipeline``; the global-batch mean loss on
        every rank. The causal-LM token loss here; a trainer with another objective (DPO) replaces it."""
        return step.token_loss_step(self, pipeline, inputs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The Trainer's own, with the model's loss made chunk by chunk where exact (``hf_dist.trainer.loss``) and,
        in a training step, a MoE router aux term weighted the same for any batch split
        (``hf_dist.trainer.router_loss``). Called on its own, outside ``train()``, it returns the Trainer's loss.
        A caller asking for the outputs (a subclass reading the logits) gets the model's own forward, whole logits."""
        num_items_in_batch = context.loss_count(self, num_items_in_batch)  # evaluation: the batch's own loss
        chunked = None if return_outputs else chunked_loss_for(self, model, inputs)
        loss, outputs = super().compute_loss(chunked or model, inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        if context.in_training_step(self):
            loss = router_loss.reweigh_router_loss(self, model, loss, outputs, inputs, num_items_in_batch)
            if self.args.dist_logging:
                self.expert_load.add(self.accelerator.unwrap_model(model), outputs)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        with context.prediction_step(self):  # compute_loss: this batch's own loss, as one process's
            loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        return loss, whole_logits(model, logits), labels  # vocab-sharded under TP

    def _prepare_context_parallel_inputs(self, model, inputs):
        if self.dims.cp_enabled:  # hf_dist's context parallelism (accelerate's parallelism_config is kept off)
            return context.prepare_inputs(self, model, inputs)
        return super()._prepare_context_parallel_inputs(model, inputs)

    def _get_num_items_in_batch(self, batch_samples, device):
        return local_token_count(self, super()._get_num_items_in_batch(batch_samples, device))

    def get_cp_size(self) -> int:
        return self.dims.cp  # the Trainer divides num_items_in_batch and the dp world by it

    def get_tp_size(self) -> int:
        return self.dims.tp  # the Trainer divides num_items_in_batch and the global batch by it

    def _sync_replicated_trainable_parameters(self, model) -> None:
        if self.dims.pp_enabled:  # stages differ per rank: no broadcast from rank 0; the pipeline reduces grads
            return
        # Keep the Trainer's broadcast of plain parameters, not its per-parameter gradient all-reduce hooks: hf_dist
        # reduces every gradient itself, once per step (FSDP2, or buckets over dp x cp), and TP ranks' replicated
        # gradients are equal already. With the hooks, CP issued 21 extra all-reduces and twice the gradient bytes
        # per step, TP 6 (the step ledger, tests/test_ledger.py). The Trainer skips parameters marked as hooked.
        for param in model.parameters():
            param._replicated_grad_hook_registered = True
        super()._sync_replicated_trainable_parameters(model)

    def _run_epoch(self, model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch, trial,
                   ignore_keys_for_eval, start_time, resume_from_checkpoint, epochs_trained,
                   steps_trained_in_current_epoch):
        if 0 < self.state.max_steps <= self.state.global_step:
            # Resumed at (or past) max_steps in the middle of an epoch: the Trainer checks the step count only
            # after a step, so it would train one step more than asked (and a restarted run would differ).
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch, trial,
                                  ignore_keys_for_eval, start_time, resume_from_checkpoint, epochs_trained,
                                  steps_trained_in_current_epoch)

    def _clip_grad_norm(self, model):
        if self.dims.pp_enabled:  # the norm over every stage, not just this rank's
            return step.pipeline_clip_grad_norm(self)
        self._reduce_partial_grads(model)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # no clipping: the first look at this step's gradients
            self._reduce_partial_grads(model)
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _reduce_partial_grads(self, model) -> None:
        """TP ranks' partial gradients of whole weights (the norms under sequence parallelism) summed in one
        all-reduce before the norm and the optimizer step read them, not one per tensor in each."""
        if self.dims.tp > 1:
            reduce_partial_grads(model.parameters())

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
        if self.args.dist_logging and "loss" in logs:  # a training log: every rank is here (loss just gathered)
            logs.update(self.throughput.report())
            # MoE: tokens per expert, max / mean, over every rank holding different tokens
            logs.update(self.expert_load.report(router_loss.dp_group(self, with_cp=True)))
        super().log(logs, start_time)

    # -- saving ---------------------------------------------------------------------------------
    # Every private method overridden in this class is listed, with why, in hf_dist.internals.
    # Layouts hf_dist owns checkpoint through hf_dist.checkpoint (sharded, atomic); the rest as the Trainer does.
    def _save_checkpoint(self, model, trial) -> None:
        if not self.owns_layout:  # the Trainer's own format, into a folder holding nothing else
            return resume.save_native_checkpoint(self, model, trial, super()._save_checkpoint)
        checkpoint_glue.save_trainer_checkpoint(self, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        if not checkpoint_glue.loads_with_hf_dist(self, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # else: loaded with the optimizer

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if not checkpoint_glue.loads_with_hf_dist(self, checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        checkpoint_glue.load_trainer_checkpoint(self, checkpoint)

    def _load_rng_state(self, checkpoint) -> None:
        if not checkpoint_glue.loads_with_hf_dist(self, checkpoint):
            return super()._load_rng_state(checkpoint)
        checkpoint_glue.restore_trainer_rng(self, checkpoint)

    def _load_best_model(self) -> None:
        if not checkpoint_glue.loads_with_hf_dist(self, self.state.best_model_checkpoint):
            return super()._load_best_model()
        checkpoint_glue.load_best_model(self)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's save, after the model files an earlier save left in the folder are moved into its
        ``previous_run-<time>/`` (``resume.keep_earlier_model``): a full model saved over an adapter would otherwise
        reload as the old adapter on its base, and an adapter over a full model's files beside them."""
        resume.keep_earlier_model(self, output_dir or self.args.output_dir)
        super().save_model(output_dir, _internal_call)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """For layouts hf_dist owns, a normal HF directory (or PEFT adapter) without gathering the whole model;
        under PP the stage that owns a tensor sends it to rank 0. Tokenizer and arguments as the Trainer writes them."""
        if not self.owns_layout or (state_dict is not None and not self.dims.pp_enabled):
            super()._save(output_dir, state_dict=state_dict)
            give_user_mode(output_dir or self.args.output_dir)  # save_pretrained leaves its safetensors 0600
            return
        import os

        from transformers.trainer import TRAINING_ARGS_NAME

        output_dir = output_dir or self.args.output_dir
        if self.dims.pp_enabled:
            save_pipeline(self.model.pipeline, output_dir)  # every rank joins; rank 0 writes
        else:
            save_gathered(self.model, output_dir)  # streamed weights, or only the adapter's tensors (collective)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
