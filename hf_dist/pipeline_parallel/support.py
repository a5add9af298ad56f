"""Which models the pipeline stages reproduce exactly: the one support decision for pipeline parallelism.

``CausalLMStage`` runs the decoder layers of a Llama-layout model and rebuilds everything outside them
(embedding, rotary, a full causal mask, final norm, ``lm_head``) the Llama way. A model that does anything
else outside its layers (scales embeddings or logits, soft-caps, windows its attention) would train with a
silently wrong loss, so ``check_pipeline_support`` refuses it by name before any process group starts.

Pure: a model config in, ``None`` or a ``ValueError`` out. Not for: splitting layers (``splitter``).
"""

from __future__ import annotations

# Model types whose pipeline stages are proven equal to one process by a parity test in tests/.
PIPELINE_TESTED_MODEL_TYPES = frozenset({"llama"})

# Config fields the Llama stage forward ignores, with the value that makes ignoring them exact.
_IDENTITY_FIELDS = {
    "logit_scale": (None, 1.0),
    "logits_scaling": (None, 1.0),
    "embedding_multiplier": (None, 1.0),
    "residual_multiplier": (None, 1.0),
    "attention_multiplier": (None,),
    "final_logit_softcapping": (None, 0.0),
    "attn_logit_softcapping": (None, 0.0),
}


def _sliding_window(config) -> int | None:
    """The attention window the model's own forward would apply, or ``None`` for full attention."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    return window


def check_pipeline_support(config) -> None:
    """Raise ``ValueError`` naming the field when pipeline stages would not reproduce ``config``'s model."""
    model_type = getattr(config, "model_type", None)
    if model_type not in PIPELINE_TESTED_MODEL_TYPES:
        raise ValueError(
            f"pp_size > 1 is not supported for model_type={model_type!r}: pipeline stages are proven equal to one "
            f"process only for {sorted(PIPELINE_TESTED_MODEL_TYPES)}; train this model with pp_size=1 "
            f"(FSDP2, DDP or DeepSpeed)"
        )
    problems = []
    for name, identities in _IDENTITY_FIELDS.items():
        value = getattr(config, name, None)
        if value not in identities:
            problems.append(f"{name}={value!r} (stages apply only {identities[-1]!r})")
    window = _sliding_window(config)
    if window is not None:
        problems.append(f"sliding_window={window} (stages build a full causal mask)")
    if problems:
        raise ValueError(
            f"pp_size > 1 would train {model_type!r} with a wrong loss: {'; '.join(problems)}. Pipeline stages do "
            f"not reproduce these config fields; use pp_size=1, or set them to the identity value if that is "
            f"what the model means"
        )
