"""May this model run this layout? ``model_refusals(config, layout)`` asks every parallelism's rule at once.

It asks each parallelism's own rule for the sizes of ``layout`` (a ``hf_dist.strategy.Layout``, or anything with
``tp``, ``pp``, ``ep``, ``cp`` and ``vocab_parallel``), from the model's config alone, and each rule reads the
model-family registry (``hf_dist.families``) for what is proven:

- pp: ``pipeline_parallel.support.check_pipeline_support`` (and no more stages than layers);
- tp: ``tensor_parallel.checks.check_tp_sizes`` (support, then the sizes its plan shards);
- ep: ``expert_parallel.support.check_ep_support`` (inside pipeline stages, with CP and with TP too: the ``ep_pp``,
  ``ep_cp`` and ``ep_tp`` records);
- cp: ``context_parallel.support.check_cp_support`` (heads divide tp x cp);
- tp or ep with MoE experts: the experts implementation the config names (``PROVEN_EXPERTS_IMPLEMENTATIONS``).

``DistTrainer`` (its model, and each ``model_init`` model), ``hf_dist.from_pretrained`` (the config, before any
weight) and the Harbor recipe (before it writes data) ask it through ``hf_dist.trainer.model_support``; the planner
asks it directly (``planner.chooser``), so it never proposes a cell the run refuses; ``hf-dist config --model``
asks it before writing a file, and ``bench/coverage.py`` for what the run says of each type's default config.
``tests/test_families.py`` checks over every causal-LM type that a cell it accepts is one the registry proves. Pure: no process group, no weights (``AutoConfig.from_pretrained`` is enough).
"""

from __future__ import annotations

PROVEN_EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
"""transformers' experts implementations (``from_pretrained(..., experts_implementation=...)``) proven equal to one
process under EP x FSDP2 and TP (``tests/test_experts_implementations.py``). The others (``deepgemm``, ``sonicmoe``:
CUDA kernels from the Hub) have never run under hf_dist's EP or TP."""


def model_refusals(config, layout) -> list[str]:
    """Why ``config``'s model cannot run ``layout``: one message per refusing parallelism (each the ``ValueError``
    its own check raises, naming the value, the rule and the fix); empty when it can."""
    from hf_dist.context_parallel.support import check_cp_support
    from hf_dist.expert_parallel.support import check_ep_support
    from hf_dist.pipeline_parallel.support import check_pipeline_support
    from hf_dist.tensor_parallel.checks import check_tp_sizes

    checks = []
    if layout.pp > 1:
        checks += [lambda: check_pipeline_support(config), lambda: _check_stage_count(config, layout.pp)]
    if layout.tp > 1:
        checks.append(lambda: check_tp_sizes(config, layout.tp, vocab_parallel=getattr(layout, "vocab_parallel", False)))
    if layout.ep > 1:
        checks.append(lambda: check_ep_support(config, layout.ep, layout.pp, layout.cp, layout.tp))
    if layout.cp > 1:
        checks.append(lambda: check_cp_support(config, layout.cp, layout.tp))
    if layout.tp > 1 or layout.ep > 1:
        checks.append(lambda: _check_experts_implementation(config, layout))
    reasons = []
    for check in checks:
        try:
            check()
        except ValueError as err:
            reasons.append(str(err))
    return reasons


def _check_stage_count(config, pp: int) -> None:
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and pp > layers:
        raise ValueError(f"pp_size={pp} exceeds num_hidden_layers={layers}: each stage needs a layer; use "
                         f"pp_size <= {layers}")


def _check_experts_implementation(config, layout) -> None:
    chosen = getattr(config, "_experts_implementation", None)  # None: transformers picks grouped_mm (or eager)
    if chosen is not None and chosen not in PROVEN_EXPERTS_IMPLEMENTATIONS:
        proven = ", ".join(PROVEN_EXPERTS_IMPLEMENTATIONS)
        raise ValueError(
            f"experts_implementation={chosen!r} has no parity proof under tp_size={layout.tp} / ep_size={layout.ep} in "
            f"hf_dist (proven equal to one process: {proven}); load with experts_implementation='grouped_mm' (or "
            f"another proven one), or run with tp_size=1 and ep_size=1")


def check_model_layout(config, layout) -> None:
    """``ValueError`` with every reason ``model_refusals`` gives (nothing when the model can run ``layout``)."""
    reasons = model_refusals(config, layout)
    if reasons:
        raise ValueError("; ".join(reasons))
