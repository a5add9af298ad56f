"""Context parallelism (``cp_size=2``) on 2 gloo ranks against one process, 3 steps at 2,048 tokens.

Each ``parallelize``-level case trains through the parity harness (``parity.layout_run`` against
``parity.reference_run``: plain SGD, clipping active on every step) and compares losses, gradient norms, the first
step's gradients and the parameters after the last step (``parity.assert_parity``). One spawn runs every case:

- llama, mistral (sliding_window=64, sdpa), gemma2 (eager, attention and final soft-capping, alternating windows of
  64) and qwen3 (q/k norms), each with CP alone (gradients averaged over ``dp_cp``) and CP x FSDP2 (sharded over
  ``dp_shard_cp``); labels ignore a block of tokens on rank 0's slice only, so the ranks count different tokens and
  a wrong loss weighting shows;
- packed rows (several documents per row, ``position_ids`` restarting, first label of each document -100) under
  CP against the same documents trained unpacked, one by one, in one process.

Also, through the harness too: dp=2 x cp=2 x FSDP2, tp=2 x cp=2 and tp=2 x cp=2 x FSDP2 in one 4-rank spawn;
``DistTrainer`` with ``--cp_size 2`` (alone and x FSDP2, with an evaluation) against the one-process Trainer, and the
pure rules: ``Layout`` refusals, the model support decision, the accelerate request mapping, the planner.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from parity import CP_CASES, TP_SGD, assert_parity, layout_run, reference_run

SEQ, ROWS, STEPS, VOCAB = 2048, 2, 3, 128
MODELS = CP_CASES
PACKED_DOCS = ((700, 500, 848), (1000, 1048))
"""Document lengths of the two packed rows (each sums to SEQ)."""


def tiny_model(model_type: str, seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=2 * SEQ, attention_dropout=0.0,
                  use_cache=False, tie_word_embeddings=False) | overrides
    extra = {"mistral": dict(sliding_window=64),
             "gemma2": dict(sliding_window=64, attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
                            query_pre_attn_scalar=12)}.get(model_type, {})
    config = AutoConfig.for_model(model_type, **common, **extra)
    torch.manual_seed(seed)
    attn = "eager" if model_type == "gemma2" else "sdpa"
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


def batches() -> list[dict]:
    out = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
        labels = ids.clone()
        labels[0, 100:400 + 50 * step] = -100  # inside cp rank 0's slice: the ranks count different tokens
        out.append({"input_ids": ids, "labels": labels})
    return out


def packed_batches() -> tuple[list[dict], list[list[dict]]]:
    """Per step: the packed batch, and the same documents one by one (unpacked)."""
    packed, unpacked = [], []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(200 + step)
        rows, docs = {"input_ids": [], "labels": [], "position_ids": []}, []
        for lengths in PACKED_DOCS:
            ids, labels, positions = [], [], []
            for length in lengths:
                doc = torch.randint(0, VOCAB, (length,), generator=gen)
                docs.append({"input_ids": doc[None], "labels": doc[None].clone()})
                ids.append(doc)
                labels.append(torch.cat([torch.tensor([-100]), doc[1:]]))  # as pack_rows marks a document start
                positions.append(torch.arange(length))
            for key, parts in (("input_ids", ids), ("labels", labels), ("position_ids", positions)):
                rows[key].append(torch.cat(parts))
        packed.append({k: torch.stack(v) for k, v in rows.items()})
        unpacked.append(docs)
    return packed, unpacked


RECIPE = TP_SGD
"""Plain SGD with clipping active on every step (the references' norms are about 0.13, ``max_norm`` 0.1)."""


def _train_reference(model, step_batches: list[list[dict]]) -> dict:
    """One process (the parity harness's reference): each step's token-mean loss over all of its sequences
    (unpacked documents included), the first step's gradients kept."""
    return reference_run(model, step_batches, RECIPE, grads=True)


def _train_cp(model_type: str, fsdp: bool, step_batches: list[dict], state: dict, world: int = 2, tp: int = 1,
              **overrides) -> dict:
    """The harness's ``layout_run`` on this rank of ``parallelize``'s CP layout (``token_weighted_loss`` inside the
    cp split, the losses summed over the dp x cp ranks; the tp ranks hold the same share)."""
    from hf_dist import FsdpRequest, parallelize
    from hf_dist.strategy import Layout

    layout = Layout(strategy="fsdp_full_shard" if fsdp else "ddp", num_gpus=world, cp=2, tp=tp)
    dims = layout.dims
    dims.build_mesh("cpu")
    model = tiny_model(model_type, **overrides)
    model.load_state_dict(state)
    model = parallelize(model, dims, fsdp=FsdpRequest() if fsdp else None)
    return layout_run(model, step_batches, RECIPE, dp_rank=dims.dp_rank(dist.get_rank()), dp=dims.dp,
                      dp_group=dims.get_mesh("dp_cp").get_group(), grads=True)


def _assert_cp_parity(got: dict, ref: dict, what: str) -> None:
    assert min(ref["norms"]) > RECIPE.max_norm, (what, ref["norms"])  # clipping was active on every step
    assert_parity(got, ref, rtol=1e-5, state_rtol=1e-5, what=what)


def _cp_ranks(rank, world_size, states):
    packed, _ = packed_batches()
    results = {}
    for model_type in MODELS:
        for fsdp in (False, True):
            results[(model_type, fsdp)] = _train_cp(model_type, fsdp, batches(), states[model_type])
    results[("packed", False)] = _train_cp("llama", False, packed, states["llama"])
    return results


@pytest.fixture(scope="module")
def runs():
    states = {m: {k: v.clone() for k, v in tiny_model(m).state_dict().items()} for m in MODELS}
    reference = {m: _train_reference(tiny_model(m), [[b] for b in batches()]) for m in MODELS}
    _, unpacked = packed_batches()
    reference["packed"] = _train_reference(tiny_model("llama"), unpacked)
    results = run_distributed(_cp_ranks, 2, states)
    return reference, results


EIGHT_HEADS = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=4)
"""TP x CP: heads / (tp x cp) = 2 query and 1 KV head per rank."""
FOUR_RANK_CASES = {"dp2_cp2_fsdp2": dict(fsdp=True), "tp2_cp2": dict(fsdp=False, tp=2, **EIGHT_HEADS),
                   "tp2_cp2_fsdp2": dict(fsdp=True, tp=2, **EIGHT_HEADS)}
"""One 4-rank spawn: dp=2 x cp=2 (each dp rank reads one row, the cp ranks the same row; FSDP2 over all 4), and
tp=2 x cp=2 (the all-to-all over each TP rank's heads), replicated and x FSDP2 (over the 2 cp ranks)."""


def _four_ranks(rank, world_size, states):
    return {name: _train_cp("llama", case["fsdp"], batches(), states[name], world=world_size,
                            **{k: v for k, v in case.items() if k != "fsdp"})
            for name, case in FOUR_RANK_CASES.items()}


@pytest.fixture(scope="module")
def four_rank_runs():
    overrides = {name: {k: v for k, v in case.items() if k not in ("fsdp", "tp")}
                 for name, case in FOUR_RANK_CASES.items()}
    states = {name: {k: v.clone() for k, v in tiny_model("llama", **o).state_dict().items()}
              for name, o in overrides.items()}
    reference = {name: _train_reference(tiny_model("llama", **o), [[b] for b in batches()])
                 for name, o in overrides.items()}
    return reference, run_distributed(_four_ranks, 4, states)


@pytest.mark.parametrize("case", list(FOUR_RANK_CASES))
def test_four_rank_cp_products_equal_one_process(four_rank_runs, case):
    reference, results = four_rank_runs
    for got in (r[case] for r in results):
        _assert_cp_parity(got, reference[case], case)


@pytest.mark.parametrize("model_type", MODELS)
@pytest.mark.parametrize("fsdp", [False, True], ids=["cp2", "cp2_fsdp2"])
def test_cp_equals_one_process(runs, model_type, fsdp):
    reference, results = runs
    for rank in (0, 1):
        got = results[rank][(model_type, fsdp)]
        _assert_cp_parity(got, reference[model_type], f"rank {rank} {model_type}")


def test_packed_with_cp_equals_documents_unpacked(runs):
    reference, results = runs
    for rank in (0, 1):
        _assert_cp_parity(results[rank][("packed", False)], reference["packed"], f"rank {rank} packed")


def test_sliding_window_bites_at_this_length():
    """The window cases can fail: mistral's logits with window 64 differ from the same weights' without a window by
    far more than the tolerance (a CP run that lost the window would train other weights)."""
    batch = batches()[0]
    windowed = tiny_model("mistral")
    full = tiny_model("mistral")
    full.config.sliding_window = None
    with torch.no_grad():
        assert float((windowed(**batch).logits - full(**batch).logits).abs().max()) > 1e-2


# -- DistTrainer: --cp_size 2 (alone and x FSDP2) against the one-process Trainer run --------------------------------
TRAINER_CASES = {"trainer_cp2": {}, "trainer_cp2_fsdp2_ac": {"fsdp2": True, "fsdp2_activation_checkpointing": True}}
"""name -> extra arguments; activation checkpointing recomputes the split forward inside backward"""


def _eval_loss(trainer) -> float:
    from trainer_harness import token_dataset

    return trainer.evaluate(eval_dataset=token_dataset(8, seed=1))["eval_loss"]


def _trainer_ranks(rank, world_size, output_dir):
    from trainer_harness import trainer_run

    out = {}
    for name, extra in TRAINER_CASES.items():
        run, trainer = trainer_run(f"{output_dir}/{name}", max_steps=STEPS, cp_size=2, **extra)
        out[name] = {**run, "layout": trainer.args.layout.name, "dp": trainer.args.batch_contract.dp,
                     "eval_loss": _eval_loss(trainer)}
    return out


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    from trainer_harness import trainer_run

    out = tmp_path_factory.mktemp("cp_trainer")
    reference, trainer = trainer_run(str(out / "reference"), max_steps=STEPS)
    return {**reference, "eval_loss": _eval_loss(trainer)}, run_distributed(_trainer_ranks, 2, str(out))


@pytest.mark.parametrize("case", list(TRAINER_CASES))
def test_dist_trainer_cp_equals_one_process(trainer_runs, case):
    """Losses, the first step's gradients (the first micro-batch of a ``train()`` call split like every other) and
    the final parameters, through the harness."""
    reference, results = trainer_runs
    for rank in (0, 1):
        got = results[rank][case]
        assert "cp2" in got["layout"] and got["dp"] == 1  # the cp ranks share one batch
        assert_parity(got, reference, rtol=1e-5, state_rtol=1e-5, what=f"rank {rank} {case}")
        assert got["eval_loss"] == pytest.approx(reference["eval_loss"], abs=1e-5)  # whole sequences, loss / cp


# -- pure: the rules, before any process group ------------------------------------------------------------------------
@pytest.mark.parametrize("fields, match", [
    (dict(strategy="zero3"), "cp_size=2 with DeepSpeed zero3"),
    (dict(strategy="fsdp_full_shard", pp=2, num_gpus=4), "cp_size=2 with pp_size=2"),
    (dict(strategy="fsdp_full_shard", tp=2, num_gpus=4, sequence_parallel=True),
     "cp_size=2 with tp_sequence_parallel=True"),
    (dict(strategy="fsdp_hybrid_shard", num_gpus=2, num_nodes=2), "cp_size=2 with fsdp_hybrid_shard"),
    (dict(strategy="ddp", num_gpus=3), "cp_size=2 does not divide the world size 3"),
])
def test_layout_refuses_cp_products_it_does_not_run(fields, match):
    from hf_dist.strategy import Layout

    with pytest.raises(ValueError, match=match):
        Layout(**{"num_gpus": 2, **fields, "cp": 2})


def test_fsdp_shards_over_dp_times_cp():
    from hf_dist.strategy import Layout

    layout = Layout(strategy="fsdp_full_shard", num_gpus=8, cp=2)
    dims = layout.dims
    assert (layout.dp, layout.shard_degree, dims.dp_shard, dims.cp, dims.dp_cp) == (4, 8, 4, 2, 8)
    assert layout.name == "fsdp_full_shard+cp2" and layout.owned_by_hf_dist


def test_support_refuses_by_name_and_by_heads():
    from transformers import AutoConfig

    from hf_dist.context_parallel import check_cp_support, cp_refusal

    llama = AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2)
    assert cp_refusal(llama, 2) is None
    with pytest.raises(ValueError, match=r"cp_size=4 does not divide .*num_key_value_heads=2.*Ring attention"):
        check_cp_support(llama, 4)
    with pytest.raises(ValueError, match="model_type='olmoe' has no context-parallel parity test"):
        check_cp_support(AutoConfig.for_model("olmoe"), 2)


def test_a_row_of_odd_length_is_padded_to_equal_slices_that_change_nothing():
    """TRL's padding-free batch of 5 positions (documents of 3 and 2) for cp=2: one position is added; the last
    document grows by it (``position_ids`` / ``seq_idx`` / ``cu_seq_lens`` continue), its label is ignored. That the
    router aux leaves it out and the run equals one process: ``tests/test_sft_moe.py``."""
    from hf_dist.context_parallel.inputs import pad_to_slices

    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "labels": torch.tensor([[-100, 6, 7, -100, 9]]),
             "position_ids": torch.tensor([[0, 1, 2, 0, 1]]), "cu_seq_lens_q": torch.tensor([0, 3, 5]),
             "max_length_q": 3, "seq_idx": torch.tensor([[0, 0, 0, 1, 1]])}
    out, extra = pad_to_slices(batch, 2)
    assert extra == 1 and out["input_ids"].shape == (1, 6)
    assert out["labels"].tolist() == [[-100, 6, 7, -100, 9, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2]] and out["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 1]]
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 6] and out["max_length_q"] == 3
    assert pad_to_slices(batch, 5) == (batch, 0)  # divisible: untouched
    masked = {"input_ids": batch["input_ids"], "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    assert pad_to_slices(masked, 4)[0]["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match=r"input 'pixel_mask' of shape \(1, 5\) .* cp_size=2: .*pad_to_multiple_of"):
        pad_to_slices({**batch, "pixel_mask": torch.ones(1, 5)}, 2)


def _launch_args(**fields):
    from types import SimpleNamespace

    return SimpleNamespace(**{"tp_size": 1, "pp_size": 1, "cp_size": 1, "tp_sequence_parallel": False,
                              "tp_vocab_parallel": False, "deepspeed": None, "fsdp": None, "fsdp2": False,
                              "hf_dist_fsdp": None, **fields})


def test_accelerate_cp_request_is_honoured_and_sp_refused(monkeypatch):
    """accelerate's parallelism_config_cp_size becomes cp_size (read, the environment unchanged); sp_size refused."""
    from hf_dist.trainer.launch_env import prepare_environment
    from hf_dist.trainer.layout import resolve_layout

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    args = _launch_args()
    prepare_environment(args)
    layout = resolve_layout(args)
    assert (args.cp_size, layout.cp, layout.dp) == (2, 2, 1)
    assert os.environ["PARALLELISM_CONFIG_CP_SIZE"] == "2"
    with pytest.raises(ValueError, match="parallelism_config_cp_size=2 but cp_size=4"):
        prepare_environment(_launch_args(cp_size=4))
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    with pytest.raises(ValueError, match="parallelism_config_sp_size=2"):
        prepare_environment(_launch_args())


def test_planner_chooses_cp_at_131k_and_divides_activations():
    """llama-2-13b on 8 x A100-80GB at 131,072 tokens: nothing without CP fits; a CP layout is chosen. Per-rank
    activations and logits at cp=2 are those of cp=1 over 2 (the mask-free sdpa path)."""
    from hf_dist.planner.activations import activation_model
    from hf_dist.planner.catalogue import GPU_CATALOGUE, MODEL_CATALOGUE
    from hf_dist.planner.chooser import PlanRequest, choose_layout
    from hf_dist.planner.workload import Workload, make_layout

    model = MODEL_CATALOGUE["llama-2-13b"]
    plan = choose_layout(PlanRequest(model=model, gpu=GPU_CATALOGUE["a100-80gb"], num_gpus=8, seq_len=131072,
                                     global_batch=8))
    assert plan.chosen is not None and plan.chosen.layout.cp > 1
    assert all(not c.fits for c in plan.candidates if c.layout.cp == 1)
    workload = Workload(seq_len=8192, precision="bf16_mixed")
    one, two = (activation_model(model, workload, make_layout("fsdp_full_shard", 8, cp=cp)) for cp in (1, 2))
    assert two.checkpoint_input * 2 == one.checkpoint_input and two.loss * 2 == one.loss
    assert two.layer.total * 2 == one.layer.total
