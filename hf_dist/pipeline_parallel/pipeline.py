"""Train and evaluate an HF causal LM split into pipeline stages: ``PipelinedCausalLM``.

Order of application, in ``PipelinedCausalLM.__init__``: split into this rank's stage(s) (``plan_stages``),
then each stage through ``hf_dist.parallelize`` (tensor parallel inside it, expert parallel over the stage's
data-parallel ranks when ``ep > 1``, then FSDP2 on the data-parallel axis when ``dp_shard > 1``), then the torch
``PipelineStage`` objects and the schedule.

Loss and gradients follow one process with the whole global batch: the last stage sums token losses and
divides by the loss tokens of the global batch (counted on every rank, summed over the dp axis), and
gradients are *summed* over data-parallel ranks (FSDP2 with divide factor 1, or, when ``dp_replicate > 1``,
an all-reduce per gradient bucket of ``hf_dist.data_parallel`` once per step). ``train_step`` returns the
global-batch mean loss on every rank.

Evaluation (``eval_step``) does not use the schedule: it runs the stages forward in order with blocking
sends of the hidden states, so any batch size works (the last eval batch is often short).

Not for: checkpoints (``checkpoint``) or the Trainer glue (``hf_dist.trainer``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from hf_dist.data_parallel import DEFAULT_BUCKET_MB, all_reduce_in_buckets, plan_buckets
from hf_dist.expert_parallel import expert_params
from hf_dist.loss.causal_lm import IGNORE_INDEX
from hf_dist.loss.policy import dims_refusal
from hf_dist.models.router import aux_from_stats, aux_loss_coef
from hf_dist.parallel_dims import ParallelDims
from hf_dist.pipeline_parallel.rng import pipeline_random_stream
from hf_dist.pipeline_parallel.schedules import PipelineConfig, build_schedule, check_microbatches
from hf_dist.pipeline_parallel.splitter import StagePlan, plan_stages
from hf_dist.pipeline_parallel.tied import TiedEmbeddingSync, is_tied
from hf_dist.pipeline_parallel.stage_module import CausalLMStage, causal_lm_of, stage_fqns, stage_units
from hf_dist.pipeline_parallel.token_loss import TokenWeightedLoss, count_loss_tokens


def _release_unowned(model: nn.Module, plan: StagePlan, owned: set[str]) -> None:
    """Drop the modules no local stage owns, so a rank holds only its stages' weights."""
    lm = causal_lm_of(model)
    for name in {n for stage in plan.stages for n in stage} - owned:
        lm.set_submodule(name, nn.Module())


def pad_to_bucket(batch: Mapping[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """``batch`` right-padded to a multiple of ``multiple`` tokens without changing its loss or gradients.

    Padded positions get label -100 and are masked: ``attention_mask`` is extended with zeros (created when
    the batch has neither a mask nor ``position_ids``); a packed batch (``position_ids``, no mask) gets its
    padding as one more sequence with positions 0, 1, ..., which attends only to itself. Causal attention keeps
    every real token's output unchanged.
    """
    ids = batch["input_ids"]
    out = dict(batch)
    out["labels"] = batch["labels"] if batch.get("labels") is not None else ids
    rows, length = ids.shape
    extra = -length % multiple
    if extra == 0:
        return out
    pad = torch.nn.functional.pad
    out["input_ids"] = pad(ids, (0, extra), value=0)
    out["labels"] = pad(out["labels"], (0, extra), value=IGNORE_INDEX)
    mask, positions = batch.get("attention_mask"), batch.get("position_ids")
    if mask is None and positions is None:
        mask = torch.ones_like(ids)
    if mask is not None:
        out["attention_mask"] = pad(mask, (0, extra), value=0)
    if positions is not None:
        tail = torch.arange(extra, device=positions.device, dtype=positions.dtype).expand(rows, extra)
        out["position_ids"] = torch.cat([positions, tail], dim=1)
    return out


class PipelinedCausalLM:
    """This rank's stages of a causal LM, its pipeline schedule, and the data-parallel gradient reduction."""

    def __init__(
        self,
        model: nn.Module,
        *,
        dims: ParallelDims,
        config: PipelineConfig,
        device: torch.device | str = "cpu",
        release_unowned: bool = True,
        reshard_after_forward: bool = False,
        compile_request=None,
        chunked_loss: bool = True,
    ) -> None:
        """Split ``model`` for this rank of ``dims`` (mesh built) and build the schedule.

        ``compile_request`` (``hf_dist.compile.CompileRequest``) compiles each stage's own decoder layers.
        ``chunked_loss``: in training the last stage computes the loss chunk by chunk, never the whole logits
        (``hf_dist.loss``), where ``hf_dist.loss.policy`` finds it exact (not under TP); evaluation keeps logits.

        ``release_unowned`` drops the modules of other ranks' stages from ``model``. ``reshard_after_forward``
        (FSDP only): free gathered parameters after each micro-batch's forward (less memory, one all-gather per
        micro-batch and layer) instead of keeping them for the whole step.
        """
        if not dims.pp_enabled:
            raise ValueError(f"PipelinedCausalLM needs pp > 1, got {dims}; train without it when pp=1")
        tied = is_tied(model)
        self.dims, self.config, self.device = dims, config, torch.device(device)
        self.source_model = model  # kept for its config (and PEFT config) when saving
        self.pp_group = dims.get_mesh("pp").get_group()
        self.pp_rank = dist.get_rank(self.pp_group)
        layers, embed_size, head_size = stage_units(model)
        embed_fqns, head_fqns = stage_fqns(model)
        self.plan = plan_stages(
            layers,
            pp_size=dims.pp,
            virtual_stages=config.virtual_stages,
            embed_size=embed_size,
            head_size=head_size,
            split_points=config.split_points,
            placement=config.spec.placement,
            embed_fqns=embed_fqns,
            head_fqns=head_fqns,
        )
        self.stage_ids = self.plan.local_stages(self.pp_rank)
        self.tied_sync = TiedEmbeddingSync(dims, self.plan, self.pp_rank) if tied else None
        self.chunked_loss = chunked_loss and dims_refusal(dims) is None
        self.modules = [CausalLMStage(model, self.plan.stages[i], chunked_loss=self.chunked_loss) for i in self.stage_ids]
        if not any(p.is_meta for p in model.parameters()):  # a meta model is filled after the split
            self.modules = [m.to(self.device) for m in self.modules]
        if release_unowned:
            _release_unowned(model, self.plan, {n for i in self.stage_ids for n in self.plan.stages[i]})
        self.hidden_dtype = next(causal_lm_of(model).parameters()).dtype
        self.hidden_size = causal_lm_of(model).config.hidden_size
        self.compile_request = compile_request
        self._parallelize_stages(reshard_after_forward)
        router = self.modules[0].router_stats
        self.loss_fn = TokenWeightedLoss(experts=router.experts if router is not None else 0)
        self.router_aux_coef = (aux_loss_coef(causal_lm_of(model)) or 0.0) if router is not None else 0.0
        self._build_schedule()

    # -- construction ------------------------------------------------------------------------------
    def _parallelize_stages(self, reshard_after_forward: bool) -> None:
        """Each stage through ``hf_dist.parallelize``: TP inside it, then FSDP2 over dp_shard (gradients summed:
        the loss is already divided by the global batch's tokens). Replicated dp is all-reduced once per step
        in ``train_step`` instead of per-parameter hooks, which zero-bubble schedules bypass."""
        from hf_dist.parallelism import FsdpRequest, parallelize

        self.dp_group = self.dims.get_mesh("dp").get_group() if self.dims.dp_enabled else None
        self.allreduce_group = None
        fsdp = None
        if self.dims.dp_shard > 1:
            fsdp = FsdpRequest(reshard_after_forward=reshard_after_forward)
        elif self.dims.dp_replicate > 1:
            self.allreduce_group = self.dims.get_mesh("dp_replicate").get_group()
        self.modules = [
            parallelize(
                m, self.dims, fsdp=fsdp, fsdp_units=m.owned_layers(), grad_reduction="sum",
                replicate_gradients=False, compile_request=self.compile_request,
            )
            for m in self.modules
        ]

    def _build_schedule(self) -> None:
        self._schedules: dict[tuple[int, int], tuple[list, object]] = {}
        self.stages: list = []  # the torch PipelineStage objects of the latest training step's schedule
        self.schedule = None

    def _schedule_for(self, microbatches: int, length: int = 0, loss_fn=None) -> tuple[list, object]:
        """Stages and schedule for ``microbatches`` of ``length`` tokens and ``loss_fn`` (default: the token loss),
        built once per key: a short last batch needs fewer micro-batches, and stages fix their shapes at first use."""
        from torch.distributed.pipelining import PipelineStage

        loss_fn = self.loss_fn if loss_fn is None else loss_fn
        key = (microbatches, length, id(loss_fn))
        if key not in self._schedules:
            stages = [
                PipelineStage(module, i, self.plan.num_stages, self.device, group=self.pp_group)
                for i, module in zip(self.stage_ids, self.modules)
            ]
            config = dataclasses.replace(self.config, microbatches=microbatches)
            self._schedules[key] = (stages, build_schedule(config, stages, loss_fn))
        return self._schedules[key]

    # -- queries -----------------------------------------------------------------------------------
    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.plan.num_stages - 1 in self.stage_ids

    def parameters(self):
        """This rank's parameters, each once (stages on one rank may share the tied embedding)."""
        for _, param in self.named_parameters():
            yield param

    def named_parameters(self):
        seen: set[int] = set()
        for module in self.modules:
            for name, param in module.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def train(self, mode: bool = True) -> None:
        for module in self.modules:
            module.train(mode)

    # -- steps -------------------------------------------------------------------------------------
    def _dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.dp_group is not None:
            dist.all_reduce(value, group=self.dp_group)
        return value

    @staticmethod
    def _model_kwargs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: batch[k] for k in ("attention_mask", "position_ids") if batch.get(k) is not None}

    def train_step(self, batch: Mapping[str, torch.Tensor], *, microbatches: int | None = None) -> torch.Tensor:
        """Forward and backward over the whole per-rank batch; returns the global-batch mean loss (all ranks).

        ``microbatches`` overrides the configured count for this step (the Trainer's short last batch of an
        epoch keeps the micro-batch size and runs fewer micro-batches). Gradients are accumulated into
        ``.grad`` (call ``optimizer.zero_grad()`` between steps).
        """
        batch = pad_to_bucket(batch, self.config.pad_to_multiple_of)
        input_ids = batch["input_ids"].to(self.device)
        labels = batch["labels"].to(self.device)
        microbatches = microbatches or self.config.microbatches
        check_microbatches(input_ids.shape[0], microbatches, self.plan.num_stages)
        self.stages, schedule = self._schedule_for(microbatches, input_ids.shape[1])
        self.schedule = schedule
        tokens = self._dp_sum(count_loss_tokens(labels).to(torch.float32))
        self.loss_fn.denominator = tokens.clamp(min=1.0)
        self.loss_fn.aux_weight = self.router_aux_coef / (microbatches * self.dims.dp)  # coef x mean over micro-batches
        kwargs = {k: v.to(self.device) for k, v in self._model_kwargs(batch).items()}
        if self.chunked_loss:
            kwargs["labels"] = labels  # every stage gets them; a chunked last stage returns its loss sum
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.has_first else ()
        with pipeline_random_stream(self.pp_rank, self.device):  # dropout: stages must not draw the same masks
            schedule.step(*args, target=labels, losses=losses, return_outputs=False, **kwargs)
        if self.tied_sync is not None:
            self.tied_sync.sync_grads(self.modules)
        self._allreduce_grads()
        local = torch.stack([l.detach() for l in losses]).sum() if self.has_last else torch.zeros(())
        return self._broadcast_loss(local.to(torch.float32))

    def _allreduce_grads(self) -> None:
        """Sum the gradients over the dp replicas, in buckets (``hf_dist.data_parallel``), once per step. TP grads
        are DTensors: their local shards are summed over the replicas of the same tp coordinate. Expert shards (EP)
        already hold every ``ep`` peer's tokens (the exchange's backward): they are summed over ``efsdp`` only."""
        if self.allreduce_group is None:
            return
        experts = {id(p) for module in self.modules for p in expert_params(module)}
        trainable = [p for p in self.parameters() if p.requires_grad]
        cap = int(DEFAULT_BUCKET_MB * 2**20)
        dense = [p for p in trainable if id(p) not in experts]
        all_reduce_in_buckets(plan_buckets(dense[::-1], cap), self.allreduce_group)
        if experts and self.dims.efsdp > 1:  # expert shards: summed over the ranks holding the same experts only
            local = [p for p in trainable if id(p) in experts]
            all_reduce_in_buckets(plan_buckets(local[::-1], cap), self.dims.get_mesh("efsdp").get_group())

    def _broadcast_loss(self, local: torch.Tensor) -> torch.Tensor:
        """The last stage's loss on every rank: sum over pp (zeros elsewhere), then over dp."""
        local = local.to(self.device)
        dist.all_reduce(local, group=self.pp_group)
        return self._dp_sum(local)

    @torch.no_grad()
    def forward_only(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """Run every stage forward in pipeline order; the logits on the last stage's rank, None elsewhere."""
        return self._forward_stages(batch)[0]

    def _forward_stages(self, batch: Mapping[str, torch.Tensor], labels: torch.Tensor | None = None):
        """``(logits, router statistics)`` on the last stage's rank (None elsewhere); the statistics (a MoE whose
        loss adds a router aux term, else None) travel with the hidden states as in training. ``labels`` go to every
        stage (a last stage's ``head`` returns its figures instead of the logits)."""
        input_ids = batch["input_ids"].to(self.device)
        kwargs = {k: v.to(self.device) for k, v in self._model_kwargs(batch).items()}
        if labels is not None:
            kwargs["labels"] = labels.to(self.device)
        shape = (*input_ids.shape, self.hidden_size)
        with_stats = self.router_aux_coef > 0
        out = stats = None
        for index in range(self.plan.num_stages):
            owner = self.plan.rank_of(index)
            if owner != self.pp_rank:
                continue
            if index == 0:
                x = input_ids
            elif self.plan.rank_of(index - 1) == self.pp_rank:
                x = out
            else:
                x = torch.empty(shape, dtype=self.hidden_dtype, device=self.device)
                dist.recv(x, group=self.pp_group, group_src=self.plan.rank_of(index - 1))
                if with_stats:
                    stats = torch.empty(2 * self.loss_fn.experts + 1, device=self.device)
                    dist.recv(stats, group=self.pp_group, group_src=self.plan.rank_of(index - 1))
            stage = self.modules[self.stage_ids.index(index)]
            stage.eval_router_stats = with_stats
            try:
                out = stage(x, router_stats=stats, **kwargs) if with_stats else stage(x, **kwargs)
            finally:
                stage.eval_router_stats = False
            if with_stats:
                out, stats = out
            if index + 1 < self.plan.num_stages and self.plan.rank_of(index + 1) != self.pp_rank:
                dist.send(out.contiguous(), group=self.pp_group, group_dst=self.plan.rank_of(index + 1))
                if with_stats:
                    dist.send(stats.contiguous(), group=self.pp_group, group_dst=self.plan.rank_of(index + 1))
        return (out, stats) if self.has_last else (None, None)

    @torch.no_grad()
    def eval_step(
        self, batch: Mapping[str, torch.Tensor], *, logits_everywhere: bool = False, reduce_dp: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(mean loss on every rank, logits)``: over the global batch, or this dp rank's batch (``reduce_dp=False``,
        what the Trainer gathers itself).

        Logits are on the last stage's rank only (None elsewhere) unless ``logits_everywhere``: then they are
        broadcast over the pp group (for metrics computed from logits on every rank; costs B x S x V).
        """
        labels = batch.get("labels", batch["input_ids"]).to(self.device)
        logits, stats = self._forward_stages(batch)
        if logits_everywhere:
            logits = self._broadcast_logits(logits, labels.shape)
        summed = torch.zeros((), dtype=torch.float32, device=self.device)
        if logits is not None and self.has_last:
            vocab = logits.shape[-1]
            summed = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().reshape(-1, vocab),
                labels[:, 1:].reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
        tokens = count_loss_tokens(labels).to(torch.float32)
        # the model's own loss adds router_aux_loss_coef x its load-balancing loss of the batch (a MoE returning
        # router logits), in evaluation too: so does this one (one process's eval loss)
        aux = torch.zeros((), dtype=torch.float32, device=self.device)
        if stats is not None:
            aux = self.router_aux_coef * aux_from_stats(stats, self.loss_fn.experts).float().to(self.device)
        summed, aux = summed.to(self.device), aux.reshape(1)
        both = torch.cat([summed.reshape(1), aux])
        dist.all_reduce(both, group=self.pp_group)  # the last stage's values reach every pp rank
        summed, aux = both[0], both[1]
        if reduce_dp:  # the global batch: token-weighted cross-entropy, the aux term averaged over dp batches
            summed, tokens, aux = self._dp_sum(summed), self._dp_sum(tokens), self._dp_sum(aux) / self.dims.dp
        return summed / tokens.clamp(min=1.0) + aux, logits

    def _broadcast_logits(self, logits: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
        if logits is None:
            vocab = self.modules[0].config.vocab_size
            logits = torch.empty((*shape, vocab), dtype=self.hidden_dtype, device=self.device)
        dist.broadcast(logits, group=self.pp_group, group_src=self.plan.rank_of(self.plan.num_stages - 1))
        return logits

    # -- gradients ---------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over *all* stages' gradients (all pp ranks, dp/tp shards included); returns it."""
        params = [p for p in self.parameters() if p.grad is not None]
        skip = self.tied_sync.skip_in_norm(self.modules) if self.tied_sync is not None else set()
        total = _local_norm_power([p.grad for p in params if id(p) not in skip], norm_type, self.device)
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=self.pp_group)
        total = total if math.isinf(norm_type) else total ** (1.0 / norm_type)
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)
        return total


def _local_norm_power(grads: list[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """``sum |g|^p`` (max |g| for p = inf) over this rank's gradients, reduced over their DTensor meshes.

    FSDP/TP gradients are DTensors; those with the same mesh and placements are normed together, and the
    norm of a DTensor is made whole with ``full_tensor()`` (a scalar collective over its mesh). Replicated
    plain tensors (norm weights under TP) count once.
    """
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=norm_type, foreach=False)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norm = norm.to(torch.float32)
        total = torch.maximum(total, norm) if inf else total + norm**norm_type
    return total
