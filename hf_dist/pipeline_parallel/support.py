"""Which models pipeline parallelism supports: ``pipeline_refusal``, asked by DistTrainer, ``hf_dist.from_pretrained``,
``hf-dist pp`` and the planner (through ``hf_dist.support.model_refusals``), so the CLI never offers what training
refuses.

``CausalLMStage`` runs each stage through the model's own forward, so a model type is supported when

- its registry record (``hf_dist.families``) proves PP, and its config declares a ``base_model_pp_plan`` hf_dist can split (one decoder-layer list, a top-level head), or
  hf_dist writes one for it (the registry's ``Family.pp_modules``, the classic types transformers ships none for);
- it is dense, or a mixture-of-experts type proven by ``tests/test_pp_moe.py`` (``PIPELINE_PROVEN_MOE_TYPES``:
  the stages pass the router statistics of the model's aux loss on with the hidden states); linear-attention /
  short-conv / state-space layers are fine once proven (``PIPELINE_PROVEN_HYBRID_TYPES``): the model's own forward
  builds their per-layer-type masks on every stage, and without a cache their recurrent state lives inside one
  layer's forward, never across a stage boundary;
- it adds nothing to the loss outside the logits and the router aux loss (Bamba's ``z_loss_coefficient`` is refused
  while non-zero), and skips no layers at random (OPT's ``layerdrop`` is refused while non-zero; dropout is fine,
  each pipeline rank drawing its own masks, ``rng``);
- and PP=2 training of a tiny config with non-default values of every field read outside the decoder layers
  is proven equal to one process by ``tests/test_pp_sweep.py`` (``PIPELINE_PROVEN_MODEL_TYPES``).

The config actually trained is checked once more at launch by the layout canary (``canary``).
Pure: a config in, ``None`` or a ``ValueError`` out; ``pipeline_coverage`` for docs/coverage.md.
Not for: splitting layers (``splitter``) or running stages (``stage_module``).
"""

from __future__ import annotations

import functools

from hf_dist.families import expert_count_field, family, proven_types
from hf_dist.pipeline_parallel.plans import base_plan_names

# Views of the registry (``hf_dist.families``): the types whose records prove PP, by kind.
PIPELINE_PROVEN_MODEL_TYPES = proven_types("pp", kinds=("dense", "classic", "hybrid"))
"""Dense, classic and hybrid types whose PP=2 training equals one process in tests/test_pp_sweep.py (fp32, 1e-5,
non-default configs; hybrids on the written-out configs of tests/pp_sweep_cases.py HYBRID)."""
PIPELINE_PROVEN_HYBRID_TYPES = proven_types("pp", kinds=("hybrid",))
PIPELINE_PROVEN_MOE_TYPES = proven_types("pp", kinds=("moe",))
"""MoE types whose PP=2 training (router aux loss of every stage included) equals one process in
tests/test_pp_moe.py (fp32, 1e-5, non-default router values; cases in tests/pp_sweep_cases.MOE)."""
# Config fields that add a loss term the pipeline's token-weighted cross entropy does not compute.
_EXTRA_LOSS_FIELDS = ("z_loss_coefficient",)
# Config fields that, while non-zero, make the base model's own forward do what stages cannot reproduce.
_RANDOM_LAYER_FIELDS = {
    "layerdrop": "the base model's own layer loop draws which layers LayerDrop skips on every stage, the other "
                 "stages' stand-ins included, so a stage can skip the hidden states it received (zeros, with "
                 "OPT's project_in) or run past its last layer",
}
_ATTENTION_KINDS = {"full_attention", "sliding_attention", "chunked_attention"}


def _other_layer_kinds(config) -> list[str]:
    kinds = set(getattr(config, "layer_types", None) or ()) | set(getattr(config, "layers_block_type", None) or ())
    return sorted(k for k in kinds if isinstance(k, str) and k not in _ATTENTION_KINDS)


def pipeline_refusal(config) -> str | None:
    """Why pipeline stages would not reproduce ``config``'s model, or ``None`` when they do."""
    model_type = getattr(config, "model_type", None)
    record = family(model_type)
    if "pp" in record.refused:
        return f"model_type={model_type!r}: {record.refused['pp']}"
    if not base_plan_names(config):
        return f"model_type={model_type!r} declares no base_model_pp_plan"
    moe = expert_count_field(config)
    if moe is not None and not (record.proves("pp") and record.kind == "moe"):
        dense = " (its dense configs, without experts, are pipeline-proven)" if record.proves("pp") else ""
        return (f"model_type={model_type!r} is a mixture-of-experts model ({moe}); no MoE PP parity case in "
                f"tests/test_pp_moe.py{dense}")
    extra = [f"{f}={getattr(config, f)}" for f in _EXTRA_LOSS_FIELDS if getattr(config, f, None)]
    if extra:
        return (f"model_type={model_type!r} adds a loss term ({', '.join(extra)}) the pipeline stages do not "
                f"compute; set it to 0")
    for field, reason in _RANDOM_LAYER_FIELDS.items():
        if getattr(config, field, None):
            return f"model_type={model_type!r} has {field}={getattr(config, field)}: {reason}; set {field}=0"
    other = _other_layer_kinds(config)
    if other and not (record.proves("pp") and record.kind == "hybrid"):
        return (f"model_type={model_type!r} has non-attention layers {other} with no PP parity case in "
                f"tests/test_pp_sweep.py")
    if not record.proves("pp"):
        return f"model_type={model_type!r} has no PP parity case in tests/test_pp_sweep.py"
    return None


@functools.lru_cache(maxsize=None)
def model_type_refusal(model_type: str) -> str | None:
    """``pipeline_refusal`` for the default config of ``model_type`` (what the planner knows of a model)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(model_type)
    except Exception as error:  # an unknown type cannot be proven either
        return f"model_type={model_type!r} has no config in installed transformers ({type(error).__name__})"
    return pipeline_refusal(config)


def check_pipeline_support(config) -> None:
    """Raise ``ValueError`` naming the model type and the reason when ``pp_size > 1`` cannot train ``config``."""
    reason = pipeline_refusal(config)
    if reason is not None:
        raise ValueError(
            f"pp_size > 1 is not supported: {reason}. Train this model with pp_size=1 (FSDP2, DDP or DeepSpeed); "
            f"pipeline-proven model types: {', '.join(sorted(PIPELINE_PROVEN_MODEL_TYPES))}"
        )


def pipeline_coverage() -> dict[str, str]:
    """``{model_type: "yes" or the refusal reason}`` for every causal-LM model type of installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    table = {}
    for name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        table[name] = model_type_refusal(name) or "yes"
    return table
