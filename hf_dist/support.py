"""May this model run this layout? ``model_refusals(config, layout)`` asks every parallelism's rule at once.

It asks each parallelism's own rule for the sizes of ``layout`` (a ``hf_dist.strategy.Layout``, or anything with
``tp``, ``pp``, ``ep``, ``cp`` and ``vocab_parallel``), from the model's config alone, and each rule reads the
model-family registry (``hf_dist.families``) for what is proven:

- pp: ``pipeline_parallel.support.pipeline_refusal`` (and no more stages than layers);
- tp: ``tensor_parallel.checks.check_tp_sizes`` (support, then the sizes its plan shards);
- ep: ``expert_parallel.support.ep_refusal``;
- cp: ``context_parallel.support.cp_refusal`` (heads divide tp x cp).

The planner asks it (``planner.chooser``), so it never proposes a cell these rules refuse. ``DistTrainer`` asks the
same four rules of its model directly (``DistTrainer._check_model``), and ``hf_dist.from_pretrained`` the PP and EP
ones before loading; ``hf-dist config`` checks no model. Pure: no process group, no weights
(``AutoConfig.from_pretrained`` is enough).
"""

from __future__ import annotations


def model_refusals(config, layout) -> list[str]:
    """Why ``config``'s model cannot run ``layout``, one reason per refusing parallelism; empty when it can."""
    from hf_dist.context_parallel.support import cp_refusal
    from hf_dist.expert_parallel.support import ep_refusal
    from hf_dist.pipeline_parallel.support import pipeline_refusal
    from hf_dist.tensor_parallel.checks import check_tp_sizes

    reasons = []
    if layout.pp > 1:
        layers = getattr(config, "num_hidden_layers", None)
        if why := pipeline_refusal(config):
            reasons.append(f"pp_size={layout.pp}: {why}")
        elif isinstance(layers, int) and layout.pp > layers:
            reasons.append(f"pp_size={layout.pp} exceeds num_hidden_layers={layers}: each stage needs a layer; "
                           f"use pp_size <= {layers}")
    if layout.tp > 1:
        try:
            check_tp_sizes(config, layout.tp, vocab_parallel=getattr(layout, "vocab_parallel", False))
        except ValueError as err:
            reasons.append(f"tp_size={layout.tp}: {err}")
    if layout.ep > 1 and (why := ep_refusal(config, layout.ep)):
        reasons.append(f"ep_size={layout.ep}: {why}; set ep_size=1 (FSDP2 or DDP alone train it)")
    if layout.cp > 1 and (why := cp_refusal(config, layout.cp, layout.tp)):
        reasons.append(f"cp_size={layout.cp}: {why}")
    return reasons


def check_model_layout(config, layout) -> None:
    """``ValueError`` with every reason ``model_refusals`` gives (nothing when the model can run ``layout``)."""
    reasons = model_refusals(config, layout)
    if reasons:
        raise ValueError("; ".join(reasons))
