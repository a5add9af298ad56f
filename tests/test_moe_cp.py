"""Mixture-of-experts models under context parallelism through ``DistTrainer``, against one process.

Tiny qwen3_moe (top-3 of 4 experts, ``norm_topk_prob=True``), mixtral (top-1) and gpt_oss (top-2, attention sinks,
eager attention), router aux loss on at 0.1, a sliding window of 64 tokens, and deepseek_v3 (MLA with values wider
than queries and keys, grouped routing with a score-correction bias, a shared expert, a dense first layer; no aux loss
in its code), loaded from disk as users load theirs, train 3 AdamW steps (accumulation 2) on rows of 2,048 tokens
whose halves draw on different tokens, with right padding (``attention_mask`` zeros, labels -100) and a block of
ignored labels in the first cp rank's slice:

- ``cp_size=2`` on 2 gloo ranks (qwen3_moe with the cp ranks averaging gradients and the model's own loss, mixtral
  and gpt_oss x FSDP2, mixtral with activation checkpointing, which recomputes the split forward in backward, and the
  chunked loss);
- ``ep_size=2 x cp_size=2`` on 4 gloo ranks: the 2 data-parallel ranks hold 2 of the 4 experts each, the 2 cp ranks
  of each split its sequences; the rest FSDP2 FULL_SHARD or DDP-style replication over dp x cp (``EP_CP_RUNS``).

Each equals a one-process ``DistTrainer`` on the same micro-batches within 1e-5 on the losses, the first optimizer
step's gradients and every parameter (routers, norms, experts: ``trainer_harness.trainer_run``,
``parity.assert_parity``). The API without the Trainer (``parallelize`` + ``token_weighted_loss``, cp=2) gives the
gradients of ``hf_dist.models.reference.reference_step`` (one SGD step at learning rate 1; weighing the aux by
``dp x cp`` as the language-model part would be 1e-3 off on the routers). The aux loss is the model's own per micro-batch (``hf_dist.models.reference``): each rank
routes only its slice, so the router statistics are pooled over the cp ranks (``hf_dist.context_parallel.router``).
Two checks that the comparison can fail: the aux gradient of the sequence halves (what the ranks would train from
their slices alone) is not the micro-batch's, and a one-process run without the aux term ends with routers farther
from the EP x CP runs' than the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from parity import MOE_CP_CASES, Recipe, assert_parity, layout_run, reference_run, tiny_config
from trainer_harness import VOCAB, as_loaded, train_tiny, trainer_run

CASES = MOE_CP_CASES
"""The model types whose records prove ``cp`` and ``ep_cp`` (the harness's list; ``tests/test_families.py`` keeps it
equal to the registry)."""
SEQ, WINDOW, ROWS, AUX = 2048, 64, 24, 0.1
SPAN = 8
"""Distinct tokens per half sequence: the halves route differently, so a slice's own router statistics are not the
micro-batch's (with tokens drawn from the whole vocabulary the halves' aux gradients differ by only ~1%)."""
STEPS = 3
FSDP2 = dict(fsdp="full_shard", fsdp_config={"version": 2})
CP_RUNS = {"qwen3_moe": dict(chunked_loss=False, dist_logging=True),
           "mixtral": dict(fsdp2=True, fsdp2_activation_checkpointing=True),
           "gpt_oss": dict(fsdp2=True), "deepseek_v3": {}}
"""2 ranks, ``cp_size=2``: the extra arguments per model type (the model's own loss, which the pooled aux is added
to, and the chunked loss, which adds the returned aux itself, are both run; ``--dist_logging``'s expert load)."""
SGD_1 = Recipe(lr=1.0, optimizer="sgd")
"""The API path's one step: plain SGD at learning rate 1 (the parameters then differ by the gradients themselves)."""
EP_CP_FLAVOURS = {"fsdp2": FSDP2, "ddp": {}}
LOCAL_EXPERTS = {"fsdp2": 1, "ddp": 2}
"""Experts of each layer per rank: 4 over ep=2, and FSDP2 shards the 2 over the 2 cp ranks that hold the same ones."""
CP_BATCH = dict(max_steps=STEPS, per_device_train_batch_size=2, global_batch_size=4)
EP_CP_BATCH = dict(max_steps=STEPS, per_device_train_batch_size=2, global_batch_size=8)
"""The same micro-batches of 2 rows: one process accumulates 2 (CP) or 4 (dp=2 x cp=2) of them per step."""
EP_CP_RUNS = {"qwen3_moe": (EP_CP_BATCH, ("fsdp2", "ddp")), "mixtral": (EP_CP_BATCH, ("fsdp2", "ddp")),
              "gpt_oss": (CP_BATCH, ("fsdp2",)), "deepseek_v3": (CP_BATCH, ("ddp",))}
"""4 ranks, ``ep_size=2 x cp_size=2``: the batch and layouts per model type. gpt-oss and deepseek_v3 add their
attention (sinks cut to each rank's heads; MLA's wider values) to what the first two prove in both layouts with
accumulation: one layout each, one micro-batch per rank per step, so one reference serves their CP and EP x CP runs."""


LONG = {"qwen3_moe": dict(sliding_window=WINDOW, use_sliding_window=True, norm_topk_prob=True),
        "mixtral": dict(sliding_window=WINDOW),
        "gpt_oss": dict(sliding_window=WINDOW),  # its sliding layer first, then a full one (ep_cases)
        "deepseek_v3": dict(v_head_dim=16)}  # MLA: values 16 wide, queries and keys 8 (nope 4 + rope 4)
"""The long-sequence config values per model type, beyond ``ep_cases``' tiny config (a window where the type has
one)."""
ATTENTION = {"gpt_oss": "eager"}
"""The attention implementation per type (``sdpa`` otherwise): gpt-oss's sinks have no SDPA path in transformers."""


def _config(name: str, aux: float = AUX):
    """``parity.tiny_config(name, "cp")`` with the long-sequence values, the aux coefficient ``aux`` where the type has
    an aux loss."""
    config = tiny_config(name, "cp")
    config.vocab_size, config.max_position_embeddings = VOCAB, 2 * SEQ
    if getattr(config, "output_router_logits", False):
        config.router_aux_loss_coef = aux
    for key, value in LONG[name].items():
        setattr(config, key, value)
    return config


def _model(name: str, aux: float = AUX):
    from hf_dist.models.tiny import build_tiny_model

    return as_loaded(build_tiny_model(_config(name, aux), seed=0), attn_implementation=ATTENTION.get(name, "sdpa"))


def _kept(run: dict, rank: int) -> dict:
    """What a rank sends back: every rank's losses, rank 0's gradients and parameters too (gathered on every rank)."""
    return run if rank == 0 else {"losses": run["losses"]}


def _dataset():
    from datasets import Dataset

    gen = torch.Generator().manual_seed(3)
    halves = [torch.randint(low, low + SPAN, (ROWS, SEQ // 2), generator=gen) for low in (3, VOCAB // 2)]
    ids = torch.cat(halves, dim=1)  # each half of a sequence (each cp rank's slice) routes its own tokens
    mask = torch.ones_like(ids)
    labels = ids.clone()
    for row in range(ROWS):
        pad = 150 * (row % 3)  # right padding on two rows in three, inside the second cp rank's slice
        if pad:
            ids[row, -pad:], mask[row, -pad:], labels[row, -pad:] = 0, 0, -100
        labels[row, 100:400 + 10 * row] = -100  # inside the first cp rank's slice: the ranks count different tokens
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()})


def _local_experts(trainer) -> set[int]:
    """How many experts of each layer this rank holds (gathered DTensors would say 4)."""
    from torch.distributed.tensor import DTensor

    experts = [p for n, p in trainer.model.named_parameters() if n.endswith("experts.gate_up_proj")]
    return {p.to_local().shape[0] if isinstance(p, DTensor) else 0 for p in experts}


def _micro_batch() -> dict:
    return {k: torch.tensor(v) for k, v in _dataset()[:2].items()}


def _token_weighted(rank, world) -> dict:
    """``hf_dist.parallelize`` + ``token_weighted_loss`` (the API without the Trainer, run by the harness's
    ``layout_run``), cp=2: one step."""
    from hf_dist import parallelize
    from hf_dist.strategy import Layout

    dims = Layout(strategy="ddp", num_gpus=world, cp=2).dims
    dims.build_mesh("cpu")
    return layout_run(parallelize(_model("qwen3_moe"), dims), [_micro_batch()], SGD_1, dp=dims.dp,
                      dp_group=dims.get_mesh("dp_cp").get_group(), grads=True)


def _two_ranks(rank, world, root):
    out = {"token_weighted": _token_weighted(rank, world)}
    for name, extra in CP_RUNS.items():
        run, trainer = trainer_run(f"{root}/cp_{name}", model=_model(name), dataset=_dataset(), cp_size=2,
                                   **CP_BATCH, **extra)
        out[name] = (_kept(run, rank), trainer.dims.cp, _expert_load(trainer))
    return out


def _expert_load(trainer) -> list[dict[str, float]]:
    """``--dist_logging``'s tokens-per-expert max / mean per layer, per logged step."""
    return [{k: v for k, v in log.items() if k.startswith("expert_load")} for log in trainer.state.log_history
            if any(k.startswith("expert_load") for k in log)]


def _four_ranks(rank, world, root):
    out = {}
    for name, (batch, flavours) in EP_CP_RUNS.items():
        for flavour in flavours:
            run, trainer = trainer_run(f"{root}/ep_cp_{name}_{flavour}", model=_model(name), dataset=_dataset(),
                                       cp_size=2, ep_size=2, **batch, **EP_CP_FLAVOURS[flavour])
            out[(name, flavour)] = (_kept(run, rank), _local_experts(trainer),
                                    (trainer.dims.dp, trainer.dims.cp, trainer.dims.ep))
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("moe_cp")


@pytest.fixture(scope="module")
def references(root):
    """One process, per model type and accumulation: ``trainer_run``'s losses, first-step gradients and parameters."""
    return {(name, batch["global_batch_size"]): trainer_run(f"{root}/one_{name}_{batch['global_batch_size']}",
                                                            model=_model(name), dataset=_dataset(), **batch)[0]
            for name in CASES for batch in {b["global_batch_size"]: b for b in (CP_BATCH, EP_CP_RUNS[name][0])}.values()}


@pytest.fixture(scope="module")
def cp_runs(root):
    return run_distributed(_two_ranks, 2, str(root), timeout_s=1500)


@pytest.fixture(scope="module")
def ep_cp_runs(root):
    return run_distributed(_four_ranks, 4, str(root), timeout_s=1500)


def _assert_equal(results, key, reference):
    """Rank 0's losses, first-step gradients and final parameters equal one process's (``parity.assert_parity``:
    routers and experts among them); every other rank logged the same losses."""
    assert len(results[0][key][0]["losses"]) == STEPS
    assert_parity(results[0][key][0], reference, config=_config(key if isinstance(key, str) else key[0]),
                  what=f"{key} vs one process")
    for rank, result in enumerate(results[1:], 1):
        torch.testing.assert_close(result[key][0]["losses"], reference["losses"], atol=1e-5, rtol=0,
                                   msg=lambda m, rank=rank: f"{key} rank {rank} losses: {m}")


@pytest.mark.parametrize("name", CASES)
def test_cp_equals_one_process(cp_runs, references, name):
    assert all(result[name][1] == 2 for result in cp_runs)
    _assert_equal(cp_runs, name, references[(name, CP_BATCH["global_batch_size"])])


def test_expert_load_under_cp_counts_every_token_once(cp_runs, root):
    """``--dist_logging``'s expert load under CP: each rank counts its slice's routing, summed over dp x cp, so the
    logged max / mean per layer is one process's on the same batches (it logged nothing before)."""
    _, _, trainer = train_tiny(f"{root}/one_load", model=_model("qwen3_moe"), dataset=_dataset(), **CP_BATCH,
                               **CP_RUNS["qwen3_moe"])
    expected = _expert_load(trainer)
    assert len(expected) == STEPS and all(len(step) == 2 for step in expected)  # 2 layers
    for result in cp_runs:
        assert result["qwen3_moe"][2] == expected


@pytest.mark.parametrize(("name", "flavour"), [(n, f) for n, (_, flavours) in EP_CP_RUNS.items() for f in flavours])
def test_ep_cp_equals_one_process(ep_cp_runs, references, name, flavour):
    for result in ep_cp_runs:
        _, local, sizes = result[(name, flavour)]
        assert sizes == (2, 2, 2) and local == {LOCAL_EXPERTS[flavour]}  # dp, cp, ep
    _assert_equal(ep_cp_runs, (name, flavour), references[(name, EP_CP_RUNS[name][0]["global_batch_size"])])


def test_token_weighted_loss_weighs_the_aux_once(cp_runs):
    """The API path (``parallelize`` + ``token_weighted_loss``): its loss and gradients equal ``reference_step``'s
    (``parity.reference_run``: the one definition of a step the layouts are compared with), router and experts
    included."""
    reference = reference_run(_model("qwen3_moe"), [[_micro_batch()]], SGD_1, grads=True)
    for rank, result in enumerate(cp_runs):
        assert_parity(result["token_weighted"], reference, config=_config("qwen3_moe"), what=f"rank {rank}")


def test_a_slice_alone_has_another_aux_gradient():
    """What the cp ranks would train from their own slices (the mean of the halves' aux losses) moves the routers
    another way than the micro-batch's aux: their gradients differ by more than half the latter's norm. The pooling
    is what the parity above rests on."""
    from hf_dist.models.router import load_balancing_fn

    model = _model("qwen3_moe")
    rows = _dataset()[:2]
    batch = {k: torch.tensor(v) for k, v in rows.items() if k != "labels"}
    fn, experts, top_k = load_balancing_fn(model), model.config.num_experts, model.config.num_experts_per_tok
    grads = []
    for parts in (1, 2):
        model.zero_grad()
        logits = model(**batch, output_router_logits=True).router_logits
        aux = 0
        for part in range(parts):
            cut = slice(part * SEQ // parts, (part + 1) * SEQ // parts)
            local = tuple(layer.reshape(2, SEQ, experts)[:, cut].reshape(-1, experts) for layer in logits)
            aux = aux + fn(local, experts, top_k, batch["attention_mask"][:, cut]) / parts
        aux.backward()
        grads.append(torch.cat([p.grad.flatten() for n, p in model.named_parameters() if n.endswith("gate.weight")]))
    whole, halves = grads
    assert float((whole - halves).norm()) > 0.5 * float(whole.norm())


def test_dropping_the_aux_loss_fails_the_comparison(ep_cp_runs, root):
    """Without the aux term the routers end farther from the EP x CP run's than the parity tolerance."""
    _, no_aux = train_tiny(f"{root}/no_aux", model=_model("qwen3_moe", aux=0.0), dataset=_dataset(),
                           **EP_CP_BATCH)[:2]
    params = ep_cp_runs[0][("qwen3_moe", "fsdp2")][0]["state"]
    routers = [k for k in params if k.endswith("mlp.gate.weight")]
    assert routers and max(float((params[k] - no_aux[k]).abs().max()) for k in routers) > 1e-4


# -- pure: the rules, before any process group ------------------------------------------------------------------------
def test_the_expert_mesh_puts_ep_over_the_data_parallel_ranks():
    """dp=2 x cp=2 (ranks ``dp x 2 + cp``): ep peers share the cp coordinate and differ in dp; a cp group's ranks
    hold the same experts (efsdp). Without CP the expert mesh is the ranks in order, as before."""
    from hf_dist.parallel_dims import ParallelDims

    dims = ParallelDims(world_size=4, dp_shard=2, cp=2, ep=2)
    assert dims.expert_ranks().tolist() == [[[0, 2], [1, 3]]] and dims.efsdp == 2
    plain = ParallelDims(world_size=8, dp_shard=8, ep=4)
    assert plain.expert_ranks().tolist() == torch.arange(8).reshape(1, 2, 4).tolist()


def test_layout_runs_ep_x_cp_only_as_proven():
    from hf_dist.strategy import Layout

    for strategy in ("fsdp_full_shard", "ddp"):
        layout = Layout(strategy=strategy, num_gpus=4, ep=2, cp=2)
        assert (layout.dp, layout.efsdp) == (2, 2)
    with pytest.raises(ValueError, match="ep_size=2 with cp_size=2 and strategy='fsdp_shard_grad_op'"):
        Layout(strategy="fsdp_shard_grad_op", num_gpus=4, ep=2, cp=2)


def test_global_batch_aux_scope_is_refused_with_cp():
    from hf_dist import DistTrainingArguments

    with pytest.raises(ValueError, match="router_aux_loss_scope='global_batch' with cp_size=2"):
        DistTrainingArguments(output_dir="unused", cp_size=2, router_aux_loss_scope="global_batch", report_to=[])
