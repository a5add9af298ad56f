"""TRL's ``GRPOTrainer`` with hf_dist's layouts: ``DistGRPOTrainer`` and ``DistGRPOConfig``.

Built as ``DistDPOTrainer`` is (``hf_dist.trainer.dpo``): ``DistGRPOConfig`` is TRL's ``GRPOConfig`` with
``DistTrainingArguments``' fields (``GRPOConfig``'s own defaults kept), ``DistGRPOTrainer`` is ``GRPOTrainer`` over
``DistTrainer``. ``GRPOTrainer.__init__`` prepares the policy (PEFT adapter), ``DistTrainer.__init__`` lays it out,
then TRL loads the frozen reference from the policy's path and adds its fused LM head; the reference is then laid out
here like the policy (``lay_out_reference``: FSDP2-sharded by hf_dist, a whole replica per rank under DDP, as TRL has
it; under LoRA the policy with its adapters disabled). Generation, rewards, advantages and the per-token
log-probabilities are TRL's own code, run on the laid-out model.

The batch contract counts completions: ``global_batch_size`` = prompts x ``num_generations`` per optimizer step, so it
must hold whole prompt groups. Unless ``generation_batch_size`` or ``steps_per_generation`` is set, one generation
batch is one global batch (TRL's default: ``steps_per_generation`` = the derived accumulation). ``base_learning_rate``
scales with that completion count.

Generation under FSDP2 (``hf_dist.parallelism``): ``generate`` is a forward of the FSDP root, so the root's own
parameters (embeddings, final norm, lm_head) are gathered for the whole call and each decoder block is gathered by
its own forward, once per generated token. Under FULL_SHARD one block is gathered at a time (with LoRA also the last
block, which FSDP keeps for backward, until ``generate`` ends: a PeftModel root's forward is not called per token);
under SHARD_GRAD_OP every block stays gathered until the end of each forward, the whole model. Every rank keeps
stepping until all are done (``synced_gpus``), because a block's gather is a collective. ``tests/test_grpo.py``
measures the gathered blocks.

What runs is decided in one place, ``grpo_layout_refusal`` (``hf_dist.trl_support``, called from
``DistGRPOConfig.__post_init__`` before any process group): DDP, FSDP2, TP (every rank in one TP group) and, for a
mixture-of-experts policy, EP over all the data-parallel ranks (DDP or FSDP2 for the rest of the model), full
fine-tune and LoRA, with transformers' ``generate`` (``use_vllm=False``), each proven equal to one process in
``tests/test_grpo.py``, ``tests/test_trl_model_parallel.py`` and ``tests/test_grpo_moe.py``.

Under EP the frozen reference gets the policy's expert layout (``lay_out_reference``: ``parallelize`` with the same
dims), and every forward -- each generated token's, the old and reference log-probabilities' -- exchanges tokens
with the ``ep`` peers, so ``generate`` keeps stepping on every rank until all are done (``synced_gpus``, set by
``hf_dist.parallelism`` for EP as for FSDP2). TRL adds the router's load-balancing loss (``router_aux_loss_coef``)
per micro-batch, which is not a sum over completions: it depends on which completions share a micro-batch.

Under TP (every rank in one TP group) the reference is sharded with the policy's plan and ``generate`` runs the
TP-sharded policy, each rank holding its shards throughout. The TP ranks read the same prompts, so what TRL counts
per process is counted per dp rank: the seeds (TRL seeds each process apart; the TP ranks sample and shuffle alike,
as one process does), the generation batch (``generation_batch_over_dp``), the gathered rewards and the token count.

Not here: vLLM or continuous-batching generation under FSDP2, PP/CP, TP beside data parallelism and EP over
fewer ranks than dp (refused); the
layouts (``DistTrainer``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from accelerate.utils import set_seed
from transformers import TrainingArguments
from trl import GRPOConfig, GRPOTrainer

from hf_dist.internals import TRL_MEMBERS, check_internals
from hf_dist.strategy import Layout
from hf_dist.trainer.args import DistTrainingArguments
from hf_dist.trainer.data import dp_gather
from hf_dist.trainer.sft import default_output_dir
from hf_dist.trainer.trainer import DistTrainer
from hf_dist.trainer.trl_layout import as_config, check_trl_layout, default_trl_learning_rate, lay_out_reference, \
    trl_default
from hf_dist.trl_support import grpo_layout_refusal


def generation_batch_from_contract(args, layout: Layout) -> None:
    """With ``global_batch_size`` and neither ``generation_batch_size`` nor ``steps_per_generation``, one generation
    batch is the global batch, which must hold whole prompt groups (pure; refuses before any process group)."""
    if args.global_batch_size is None or args.generation_batch_size is not None or \
            args.steps_per_generation is not None:
        return
    groups, left = divmod(args.global_batch_size, args.num_generations)
    if left:
        nearest = sorted({max(groups, 1) * args.num_generations, (groups + 1) * args.num_generations})
        raise ValueError(
            f"global_batch_size={args.global_batch_size} counts completions (prompts x num_generations="
            f"{args.num_generations}) and must hold whole prompt groups; use global_batch_size in {nearest}, or "
            f"change num_generations")
    if layout.dp == layout.world_size:
        # GRPOConfig derives steps_per_generation = generation_batch_size / (per-device batch x ranks): the
        # accumulation the contract derives afterwards. Set now because GRPOConfig checks it before the contract.
        args.generation_batch_size = args.global_batch_size
    else:  # ranks share a batch (TP): the steps, as the contract will derive them; the size is recounted after
        args.steps_per_generation = max(1, args.global_batch_size // (args.per_device_train_batch_size * layout.dp))


def generation_batch_over_dp(args, size_given: bool) -> None:
    """``GRPOConfig`` counts the generation batch over every process (``per_device_train_batch_size x world_size x
    steps_per_generation``); where ranks share a batch (the TP ranks of one dp rank read the same prompts), it is
    counted over the data-parallel ranks instead, keeping what was given (``size_given``: the size; else the
    steps)."""
    per_step = args.per_device_train_batch_size * args.layout.dp
    if args.layout.dp == args.layout.world_size:
        return
    if not size_given:
        args.generation_batch_size = per_step * args.steps_per_generation
        return
    if args.generation_batch_size % per_step:
        raise ValueError(
            f"generation_batch_size={args.generation_batch_size} must be divisible by per_device_train_batch_size x "
            f"dp = {args.per_device_train_batch_size} x {args.layout.dp} (the ranks of one TP group read one batch); "
            f"use a multiple of {per_step}")
    args.steps_per_generation = args.generation_batch_size // per_step


@dataclass
class DistGRPOConfig(DistTrainingArguments, GRPOConfig):
    """``trl.GRPOConfig`` plus hf_dist's batch contract and layout fields (see ``DistTrainingArguments``).

    ``global_batch_size`` counts completions (prompts x ``num_generations``). ``GRPOConfig``'s defaults stay TRL's
    (learning rate 1e-6, gradient checkpointing, bf16 when available, logging every 10 steps, dataset columns kept for
    the reward functions)."""

    reads_lm_head_weight = True  # TRL's fused LM head (add_fused_lm_head) multiplies by lm_head.weight

    bf16: bool | None = trl_default(GRPOConfig, "bf16")
    gradient_checkpointing: bool = trl_default(GRPOConfig, "gradient_checkpointing")
    logging_steps: float = trl_default(GRPOConfig, "logging_steps")
    remove_unused_columns: bool | None = trl_default(GRPOConfig, "remove_unused_columns")

    def __post_init__(self):
        layout = check_trl_layout(self, grpo_layout_refusal)
        generation_batch_from_contract(self, layout)
        size_given = self.generation_batch_size is not None
        default_trl_learning_rate(self, GRPOConfig)
        super().__post_init__()
        generation_batch_over_dp(self, size_given)


def as_dist_grpo_config(args: TrainingArguments | None) -> DistGRPOConfig | None:
    """``args`` as ``DistGRPOConfig`` (a ``GRPOConfig`` or ``TrainingArguments`` is converted field by field;
    ``generation_batch_size``, which ``GRPOConfig`` derived from ``steps_per_generation``, is derived again)."""
    return as_config(args, DistGRPOConfig, drop=("generation_batch_size",))


class _DataParallelRank:
    """The trainer's accelerator seen as one data-parallel rank: ``process_index`` is the dp rank (which slice of the
    dp-gathered batch is this rank's); everything else is the accelerator's."""

    def __init__(self, accelerator, dp_rank: int) -> None:
        self._accelerator, self.process_index = accelerator, dp_rank

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


class DistGRPOTrainer(GRPOTrainer, DistTrainer):
    """``trl.GRPOTrainer`` with hf_dist's parallel layouts (DDP, FSDP2, TP, EP, LoRA) and batch contract."""

    def __init__(self, model, reward_funcs=None, args: TrainingArguments | None = None, *positional, **kwargs):
        check_internals(TRL_MEMBERS)  # a private TRL member overridden below that trl removed: stop now
        if args is None:  # where GRPOTrainer would write, not the Trainer's "trainer_output"
            args = DistGRPOConfig(output_dir=default_output_dir(model, suffix="GRPO"))
        adapted, ep = getattr(kwargs.get("peft_config"), "target_parameters", None), getattr(args, "ep_size", 1)
        if adapted and ep > 1:  # the config alone cannot say it; before the Trainer starts the process group
            raise ValueError(f"peft_config.target_parameters={list(adapted)} with ep_size={ep} in DistGRPOTrainer: "
                             f"adapters on the expert weights have no GRPO parity test under EP yet (attention adapters "
                             f"do); drop target_parameters, or drop ep_size")
        super().__init__(model, reward_funcs, as_dist_grpo_config(args), *positional, **kwargs)
        if self.ref_model is not None:
            self.ref_model = lay_out_reference(self.ref_model, self.args, self.dims, self.owns_layout)
        if self.dims.tp_enabled:
            # TRL seeds each process apart (seed + process index) so that ranks sample different completions; the TP
            # ranks of one data-parallel rank share its batch and must sample and shuffle it alike, as one process
            set_seed(self.args.seed + self.dims.dp_rank(dist.get_rank()))

    def _generate_and_score_completions(self, *args, **kwargs):
        """TRL's, with the rewards gathered once per data-parallel rank where ranks share a batch (TP): TRL gathers
        them over every process and keeps this process's slice, so the ranks of one TP group would each add a copy
        of their batch, and the batch-wide reward statistics (``scale_rewards="batch"``'s advantages, ``reward_std``,
        ``rewards/<func>/std``) would be those of the copies. (Private TRL members: TRL's module-level ``gather``
        and the accelerator's ``process_index``, replaced for the call only; ``tests/test_trl_model_parallel.py``
        compares every metric with one process.)"""
        if self.dims.world_size == self.dims.dp:
            return super()._generate_and_score_completions(*args, **kwargs)
        import trl.trainer.grpo_trainer as trl_grpo

        accelerator, gather = self.accelerator, trl_grpo.gather
        self.accelerator = _DataParallelRank(accelerator, self.dims.dp_rank(dist.get_rank()))
        trl_grpo.gather = dp_gather(self.dims)
        try:
            return super()._generate_and_score_completions(*args, **kwargs)
        finally:
            self.accelerator, trl_grpo.gather = accelerator, gather

    def _generate(self, *args, **kwargs):
        """TRL's, with the tokens it adds to ``num_input_tokens_seen`` (and logs as ``num_tokens``) counted once per
        data-parallel rank: it gathers each rank's token counts over every process, which counts a batch that the
        ranks of one TP group share once per rank of the group. (A private TRL method: should TRL stop calling it,
        ``tests/test_trl_model_parallel.py`` compares ``num_tokens`` with one process.)"""
        seen = self.state.num_input_tokens_seen
        outputs = super()._generate(*args, **kwargs)
        share = self.dims.world_size // self.dims.dp  # ranks reading one batch
        if share > 1 and self.state.num_input_tokens_seen != seen:
            self.state.num_input_tokens_seen = seen + (self.state.num_input_tokens_seen - seen) // share
            self._metrics["train"]["num_tokens"] = [self.state.num_input_tokens_seen]
        return outputs
