"""May this model run this layout? One answer, from the model's config alone, asked before anything costly.

``check_model_support(config, args)`` asks ``hf_dist.support.model_refusals`` (each parallelism's own rule, reading
the model-family registry) for the sizes of ``args.layout``; it adds only the rule that a model without a config
cannot be split. ``DistTrainer`` asks it for a model it is handed (or that ``model_init`` makes),
``hf_dist.from_pretrained`` for the config it reads before any weight, and the Harbor recipe before it prepares data
-- so a refusal (EP on a dense model, CP on a model type or head count it does not run) comes before any weights
load, any file is written and any process group starts.

Not here: the layout's own rules (``hf_dist.strategy.Layout``), applying it (``hf_dist.parallelize``).
"""

from __future__ import annotations

import dataclasses

from hf_dist.support import check_model_layout


def check_model_support(config, args, lora_rank: int = 0) -> None:
    """``ValueError`` naming the model, the rule and the fix when ``config``'s model cannot run ``args.layout``.

    ``config`` is a transformers ``PretrainedConfig`` (``AutoConfig.from_pretrained`` is enough: no weights);
    ``args`` a ``DistTrainingArguments`` (its resolved ``layout`` is read); ``lora_rank`` the model's LoRA rank
    (``peft_rank``: 0 for a plain model), for the layout rules about adapters. Pure: no process group.
    """
    layout = args.layout
    if lora_rank and not layout.lora_rank:
        layout = dataclasses.replace(layout, lora_rank=lora_rank)  # the Layout rules run again, adapters known
    if max(layout.pp, layout.tp, layout.ep, layout.cp) == 1:
        return
    if config is None:
        raise ValueError(f"the model has no config: tp_size={layout.tp}, pp_size={layout.pp}, ep_size={layout.ep} "
                         f"and cp_size={layout.cp} need a transformers model (its config says how to split it); "
                         f"use a transformers model or set them to 1")
    check_model_layout(config, layout)  # the one refusal path (hf_dist.support): pp, tp, ep, cp rules
