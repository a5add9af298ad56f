"""A manual training loop on a tiny Llama for the checkpoint tests: DDP, FSDP2, TP, PP, FSDP2 x TP or one
process, save/resume.

Imported by the other ``test_checkpoint_*`` modules (and by spawned ranks, by module name). The loop draws one
random number per step after the optimizer step, so a resumed run matches the uninterrupted one only if the
per-rank RNG was restored too.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from hf_dist import BatchContract, ParallelDims
from hf_dist.checkpoint import ResumableSampler, load_checkpoint, resume_batch_contract, save_checkpoint
from hf_dist.checkpoint.sampler import global_slice
from hf_dist.models import build_tiny_model

MODEL_KWARGS = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64)
NUM_SAMPLES, SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH, DATA_SEED = 40, 8, 4, 1, 7
ADAM_EPS = 1e-5


def dataset() -> torch.Tensor:
    return torch.randint(0, MODEL_KWARGS["vocab_size"], (NUM_SAMPLES, SEQ_LEN), generator=torch.Generator().manual_seed(3))


def layout_for(kind: str, world: int) -> ParallelDims:
    if kind == "fsdp":
        return ParallelDims(world_size=world, dp_shard=world)
    if kind == "tp":
        return ParallelDims(world_size=world, tp=world, dp_shard=1)
    if kind == "pp":
        return ParallelDims(world_size=world, pp=world, dp_shard=1)
    if kind == "fsdp_tp":  # FSDP2 over half the ranks x TP over pairs (2 x 2 on 4 ranks)
        return ParallelDims(world_size=world, tp=2, dp_shard=world // 2)
    return ParallelDims(world_size=world, dp_replicate=world, dp_shard=1)


def build(kind: str, world: int):
    """Model (wrapped for ``kind``), optimizer, scheduler, layout and batch contract."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = build_tiny_model(seed=0, **MODEL_KWARGS)
    layout = layout_for(kind, world)
    if world > 1:
        layout.build_mesh("cpu")
    if kind == "fsdp_tp":
        from hf_dist import parallelize

        model = parallelize(model, layout, fsdp=True)
    elif kind == "tp":
        from hf_dist.tensor_parallel import apply_tensor_parallel

        model = apply_tensor_parallel(model, layout.get_mesh("tp"))
    elif kind == "pp":  # this rank's stage, under HF parameter names, as DistTrainer holds it
        from hf_dist.pipeline_parallel import PipelineConfig, PipelinedCausalLM, PipelineModel

        pipe = PipelinedCausalLM(model, dims=layout, config=PipelineConfig(schedule="gpipe", microbatches=GLOBAL_BATCH))
        model = PipelineModel(pipe)
    elif kind == "fsdp":
        mesh = layout.get_mesh("dp_shard")
        for block in model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "ddp" and world > 1:
        model = DistributedDataParallel(model)
    # eps=1e-5, not 1e-8: Adam's first step moves an element by lr * g / (|g| + eps), so with eps=1e-8 a gradient
    # of ~1e-8 that another layout's reduction order shifts by 4e-10 (rounding) moves its parameter by ~1e-5 and
    # cross-layout comparisons test rounding, not resharding. eps=1e-5 bounds that at lr * 4e-10 / 1e-5.
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, eps=ADAM_EPS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    contract = BatchContract(world_size=world, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
                             tp=layout.tp, pp=layout.pp)
    return model, optimizer, scheduler, layout, contract


def full_params(model) -> dict[str, torch.Tensor] | None:
    """Every parameter, whole (on rank 0 only for a pipelined model)."""
    if hasattr(model, "pipeline"):
        from hf_dist.pipeline_parallel import gather_state_dict

        return gather_state_dict(model.pipeline)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def train(kind: str, *, steps: int, save_at=(), root: str | None = None, resume: str | None = None,
          on_step=None, async_save: bool = False, tokenizer=None) -> dict:
    """Train ``steps`` optimizer steps (from the checkpoint ``resume`` when given); return what was seen."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    torch.manual_seed(100 + rank)
    model, optimizer, scheduler, layout, contract = build(kind, world)
    start, consumed = 0, 0
    if resume is not None:
        info = load_checkpoint(resume, model=model, optimizer=optimizer, lr_scheduler=scheduler)
        start, consumed = info.step, info.samples_consumed
        contract = resume_batch_contract(info.saved_batch_contract, layout)
    sampler = ResumableSampler(NUM_SAMPLES, seed=DATA_SEED, dp_rank=layout.dp_rank(rank), dp_size=layout.dp,
                               micro_batch_size=contract.micro_batch_size, samples_consumed=consumed)
    data, accum = dataset(), contract.gradient_accumulation_steps
    losses, ids_seen, draws, pending = [], [], [], None
    for step in range(start, steps):
        total = torch.zeros(())
        if kind == "pp":  # the pipeline runs the step's micro-batches itself
            ids = [i for _ in range(accum) for i in sampler.next_micro_batch()]
            ids_seen.append((step, ids))
            total += model.pipeline.train_step({"input_ids": data[ids], "labels": data[ids]}).detach()
        for _ in range(accum if kind != "pp" else 0):
            ids = sampler.next_micro_batch()
            ids_seen.append((step, ids))
            loss = model(input_ids=data[ids], labels=data[ids]).loss / accum
            loss.backward()
            total += loss.detach()
        if layout.dp > 1:  # tensor-parallel ranks already hold the same loss
            dist.all_reduce(total, group=layout.get_mesh("dp").get_group())
            total /= layout.dp
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        draws.append(torch.rand(1).item())
        losses.append(total.item())
        if on_step is not None:
            on_step(step + 1)
        if pending is not None:
            pending.result()
            pending = None
        if step + 1 in save_at:
            pending = save_checkpoint(
                Path(root) / f"step_{step + 1}", model=model, optimizer=optimizer, lr_scheduler=scheduler,
                step=step + 1, samples_consumed=(step + 1) * contract.global_batch_size, layout=layout,
                batch_contract=contract, async_save=async_save, tokenizer=tokenizer,
            )
            if not async_save:
                pending = None
    if pending is not None:
        pending.result()
    return {"losses": losses, "ids": ids_seen, "draws": draws, "params": full_params(model), "rank": rank,
            "dp_rank": layout.dp_rank(rank)}


def picklable(result: dict) -> dict:
    """``result`` with tensors as numpy arrays: tensors sent back from a spawned rank share memory that dies with it."""
    params = result["params"]
    return {**result, "params": None if params is None else {k: v.numpy() for k, v in params.items()}}


def as_tensors(params: dict) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v) for k, v in params.items()}


def merged_ids(per_rank: list[dict]) -> dict[int, list[int]]:
    """Sample ids each optimizer step consumed, over all data-parallel ranks (one rank per dp rank)."""
    out: dict[int, list[int]] = {}
    seen_dp: set[int] = set()
    for result in per_rank:
        if result["dp_rank"] in seen_dp:
            continue
        seen_dp.add(result["dp_rank"])
        for step, ids in result["ids"]:
            out.setdefault(step, []).extend(ids)
    return out


def test_global_slice_wraps_epochs_without_gaps():
    ids = global_slice(NUM_SAMPLES, DATA_SEED, 0, 2 * NUM_SAMPLES)
    assert sorted(ids[:NUM_SAMPLES]) == list(range(NUM_SAMPLES))
    assert sorted(ids[NUM_SAMPLES:]) == list(range(NUM_SAMPLES))
    assert ids[:NUM_SAMPLES] != ids[NUM_SAMPLES:]
    assert global_slice(NUM_SAMPLES, DATA_SEED, 37, 6) == ids[37:43]


def tiny_tokenizer():
    """A word-level tokenizer over the model's vocabulary, built locally (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, MODEL_KWARGS["vocab_size"])}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
