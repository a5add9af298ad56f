"""May this model run this layout? One answer, from the model's config alone, asked before anything costly.

``check_model_support(config, args)`` asks each parallelism's own rule for the sizes of ``args.layout``:
``check_pipeline_support`` (pp), ``check_tp_sizes`` (tp), ``check_ep_support`` (ep) and ``check_cp_support`` (cp).
It adds no rule of its own. ``DistTrainer`` asks it for a model it is handed (or that ``model_init`` makes),
``hf_dist.from_pretrained`` for the config it reads before any weight, and the Harbor recipe before it prepares data
-- so a refusal (EP on a dense model, CP on a model type or head count it does not run) comes before any weights
load, any file is written and any process group starts.

Not here: the layout's own rules (``hf_dist.strategy.Layout``), applying it (``hf_dist.parallelize``).
"""

from __future__ import annotations

from hf_dist.context_parallel.support import check_cp_support
from hf_dist.expert_parallel.support import check_ep_support
from hf_dist.pipeline_parallel.support import check_pipeline_support
from hf_dist.tensor_parallel.checks import check_tp_sizes


def check_model_support(config, args) -> None:
    """``ValueError`` naming the model, the rule and the fix when ``config``'s model cannot run ``args.layout``.

    ``config`` is a transformers ``PretrainedConfig`` (``AutoConfig.from_pretrained`` is enough: no weights);
    ``args`` a ``DistTrainingArguments`` (its resolved ``layout`` is read). Pure: no process group.
    """
    layout = args.layout
    if max(layout.pp, layout.tp, layout.ep, layout.cp) == 1:
        return
    if config is None:
        raise ValueError(f"the model has no config: tp_size={layout.tp}, pp_size={layout.pp}, ep_size={layout.ep} "
                         f"and cp_size={layout.cp} need a transformers model (its config says how to split it); "
                         f"use a transformers model or set them to 1")
    if layout.pp > 1:  # stages must reproduce the model
        check_pipeline_support(config)
    if layout.tp > 1:  # the model's own plan must be supported and fit
        check_tp_sizes(config, layout.tp, vocab_parallel=layout.vocab_parallel)
    if layout.ep > 1:  # a MoE model whose experts transformers' EP plan shards
        check_ep_support(config, layout.ep)
    if layout.cp > 1:  # supported model type, heads divisible by tp x cp
        check_cp_support(config, layout.cp, layout.tp)
