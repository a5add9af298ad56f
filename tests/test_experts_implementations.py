"""transformers' experts implementations (``eager``, ``batched_mm``, ``grouped_mm``) under EP=2 x FSDP2 and TP=2.

A user picks one with ``from_pretrained(..., experts_implementation=...)`` (``config._experts_implementation``;
``grouped_mm`` when none is named). hf_dist's EP and TP keep the experts module's own forward, so the one the user
picked is the one that runs: every call of an experts forward is recorded through transformers'
``ALL_EXPERTS_FUNCTIONS.get_interface`` (the function it returned), and each run must have called only the chosen
one. All three run on CPU in torch 2.13 (``grouped_mm`` through torch's own ``_grouped_mm`` CPU kernel, not
transformers' fallback loop: also counted).

One 2-rank spawn: tiny qwen3_moe (top-k 2, router aux loss on with coefficient ``ep_cases.AUX``) saved and loaded
from disk with each implementation; EP=2 x FSDP2 against one process running both ranks' micro-batches, TP=2
against one process on the whole batch, the same implementation in both. 3 AdamW steps with clipping active (the
parity harness's ``layout_run``); losses, gradient norms, the first step's gradients and every parameter (router and
expert weights included) within 1e-5.

hf_dist's EP names transformers' ``all_to_all`` dispatch: each rank's experts run on the pairs sent to them, top-1
with unit weights, and the router's weights are applied on the sender after the return exchange -- no sentinel ids
(the ``_is_expert_parallel`` masking belongs to the ``allreduce`` dispatch, which needs ``ep_size == tp_size`` on one
shared batch and which hf_dist never selects). The router weights after 3 steps check its gradient either way.
"""

from __future__ import annotations

import pytest

from dist_utils import run_distributed
from ep_cases import moe_config, moe_model, token_batches
from parity import MOE_ADAMW, MOE_GLOBAL_BATCH, MOE_STEPS, assert_parity, layout_run, reference_run, split_rows
from trainer_harness import as_loaded

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
LAYOUTS = ("ep_fsdp", "tp")


class _Calls:
    """Which experts forward transformers' interface handed out, by function name, and torch grouped-mm calls."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def __enter__(self):
        from transformers.integrations import moe

        self._interface, self._get = moe.ALL_EXPERTS_FUNCTIONS, moe.ALL_EXPERTS_FUNCTIONS.get_interface

        def get_interface(implementation, default):
            chosen = self._get(implementation, default)
            name = "eager" if chosen is default else chosen.__name__
            self.counts[name] = self.counts.get(name, 0) + 1
            return chosen

        self._interface.get_interface = get_interface
        return self

    def __exit__(self, *exc):
        del self._interface.get_interface  # the class's method again
        return False


def _count_grouped_mm(counts: dict[str, int]):
    """``aten._grouped_mm`` (torch's kernel) vs transformers' fallback op, counted at dispatch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if "grouped_mm" in name:
                counts[name] = counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    return Mode()


def _loaded(implementation: str):
    return as_loaded(moe_model("qwen3_moe"), experts_implementation=implementation)


def _counted(run) -> dict:
    """``run()``'s result with the experts forwards transformers handed out and the grouped-mm ops it called."""
    ops = {}
    with _Calls() as calls, _count_grouped_mm(ops):
        out = run()
    return {**out, "calls": calls.counts, "ops": ops}


def _one_process(implementation: str, batches: list[dict], micro: int) -> dict:
    """The parity harness's reference, each step as ``micro`` micro-batches, its expert calls counted."""
    return _counted(lambda: reference_run(_loaded(implementation), [split_rows(batch, micro) for batch in batches],
                                          MOE_ADAMW, grads=True))


def _parallel(implementation: str, layout: str, batches: list[dict], rank: int, world: int) -> dict:
    """The harness's ``layout_run`` on this rank of EP=2 x FSDP2 or TP=2, its expert calls counted."""
    from hf_dist import FsdpRequest, ParallelDims, parallelize

    if layout == "ep_fsdp":
        dims = ParallelDims(world_size=world, dp_shard=world, ep=world)
    else:
        dims = ParallelDims(world_size=world, tp=world)
    dims.build_mesh("cpu")
    model = parallelize(_loaded(implementation), dims, fsdp=FsdpRequest() if layout == "ep_fsdp" else None)
    group = dims.get_mesh("dp").get_group() if dims.dp > 1 else None
    return _counted(lambda: layout_run(model, batches, MOE_ADAMW, dp_rank=dims.dp_rank(rank), dp=dims.dp,
                                       dp_group=group, grads=True))


def _two_ranks(rank, world):
    batches = token_batches(MOE_STEPS, MOE_GLOBAL_BATCH)
    return {impl: {"ref_ep_fsdp": _one_process(impl, batches, world), "ref_tp": _one_process(impl, batches, 1),
                   **{layout: _parallel(impl, layout, batches, rank, world) for layout in LAYOUTS}}
            for impl in IMPLEMENTATIONS}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_two_ranks, 2)


def max_param_diff(runs, implementation: str, layout: str) -> float:
    """The largest difference of any parameter from one process's, over both ranks (docs/benchmarks.md's table)."""
    return max(float((value - results[implementation][f"ref_{layout}"]["state"][key]).abs().max())
               for results in runs for key, value in results[implementation][layout]["state"].items())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_each_experts_implementation_trains_like_one_process(runs, implementation, layout):
    for rank, results in enumerate(runs):
        ref, run = results[implementation][f"ref_{layout}"], results[implementation][layout]
        assert min(ref["norms"]) > MOE_ADAMW.max_norm  # clipping active: the norm over every mesh decides the update
        assert any(".mlp.gate." in key for key in ref["state"])  # the router is among the compared weights
        assert_parity(run, ref, config=moe_config("qwen3_moe"), what=f"rank {rank} {implementation} {layout}")
    print(f"{implementation} {layout}: max parameter difference {max_param_diff(runs, implementation, layout):.2e}")


@pytest.mark.parametrize("layout", (*LAYOUTS, "ref_ep_fsdp", "ref_tp"))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_chosen_implementation_is_the_one_that_runs(runs, implementation, layout):
    expected = {"eager": "eager", "batched_mm": "batched_mm_experts_forward",
                "grouped_mm": "grouped_mm_experts_forward"}[implementation]
    for results in runs:
        run = results[implementation][layout]
        assert set(run["calls"]) == {expected} and run["calls"][expected] > 0, run["calls"]
        # grouped_mm: torch's CPU kernel in forward and backward, never transformers' fallback loop
        assert ("aten._grouped_mm" in run["ops"]) == (implementation == "grouped_mm"), run["ops"]
        assert not any("fallback" in op for op in run["ops"]), run["ops"]


def test_the_proven_list_is_what_this_file_runs():
    from hf_dist.support import PROVEN_EXPERTS_IMPLEMENTATIONS

    assert PROVEN_EXPERTS_IMPLEMENTATIONS == IMPLEMENTATIONS


@pytest.mark.parametrize("implementation", ("sonicmoe", "deepgemm"))
@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (1, 2)])
def test_an_unproven_experts_implementation_is_refused_under_tp_and_ep(tmp_path, implementation, tp, ep):
    """From the config a user loads with ``experts_implementation=...`` (as ``hf_dist.from_pretrained`` reads it),
    before any weight or process group; the proven ones and layouts without TP/EP pass."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from ep_cases import moe_config
    from hf_dist.support import model_refusals

    moe_config("qwen3_moe").save_pretrained(tmp_path)
    layout = SimpleNamespace(tp=tp, ep=ep, pp=1, cp=1, vocab_parallel=False)
    config = AutoConfig.from_pretrained(tmp_path, experts_implementation=implementation)
    assert model_refusals(config, layout) == [
        f"experts_implementation={implementation!r} has no parity proof under tp_size={tp} / ep_size={ep} in hf_dist "
        f"(proven equal to one process: eager, batched_mm, grouped_mm); load with experts_implementation='grouped_mm' "
        f"(or another proven one), or run with tp_size=1 and ep_size=1"]
    assert model_refusals(config, SimpleNamespace(tp=1, ep=1, pp=1, cp=1)) == []
    for proven in IMPLEMENTATIONS + (None,):
        config = AutoConfig.from_pretrained(tmp_path, **({} if proven is None else {"experts_implementation": proven}))
        assert model_refusals(config, layout) == []
