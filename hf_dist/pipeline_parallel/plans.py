"""Pipeline plans, as data, for the model types transformers ships no ``base_model_pp_plan`` for.

transformers declares, per architecture, which modules of the base model come before the decoder-layer list,
the list itself and what comes after (``base_model_pp_plan``), and which head modules the ``*ForCausalLM`` adds
(``_pp_plan``). The classic dense types predate these plans; ``PP_PLANS`` writes the same facts for them, with
the model's own module names. A name may be dotted (OPT keeps its layers in ``model.decoder.layers``); a name
whose module the config switches off (OPT's ``project_in`` when no projection is needed) is skipped.

Pure data; which types are proven to run this way is ``support.py``'s decision. Not for: building stages.
"""

from __future__ import annotations

PP_PLANS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # model_type: (base model modules in forward order, the layer list among them; head modules)
    "gpt2": (("wte", "wpe", "drop", "h", "ln_f"), ("lm_head",)),
    "falcon": (("word_embeddings", "h", "ln_f"), ("lm_head",)),
    "opt": (
        ("decoder.embed_tokens", "decoder.embed_positions", "decoder.project_in", "decoder.layers",
         "decoder.final_layer_norm", "decoder.project_out"),
        ("lm_head",),
    ),
    "bloom": (("word_embeddings", "word_embeddings_layernorm", "h", "ln_f"), ("lm_head",)),
    "nemotron": (("embed_tokens", "layers", "norm"), ("lm_head",)),
    "gpt_bigcode": (("wte", "wpe", "drop", "h", "ln_f"), ("lm_head",)),
    "gptj": (("wte", "drop", "h", "ln_f"), ("lm_head",)),
    "codegen": (("wte", "drop", "h", "ln_f"), ("lm_head",)),
    "stablelm": (("embed_tokens", "layers", "norm"), ("lm_head",)),
    "persimmon": (("embed_tokens", "layers", "final_layernorm"), ("lm_head",)),
    "mpt": (("wte", "blocks", "norm_f"), ("lm_head",)),
    # hybrids: the model's forward builds the per-layer-type masks (attention, conv / mamba) on every stage
    "lfm2": (("embed_tokens", "layers", "embedding_norm"), ("lm_head",)),  # its final norm is "embedding_norm"
    "falcon_h1": (("embed_tokens", "layers", "final_layernorm"), ("lm_head",)),
    "bamba": (("embed_tokens", "layers", "final_layernorm"), ("lm_head",)),
}
"""Model type -> (base-model plan names, head plan names), as transformers' plans would list them (a type's own
``base_model_pp_plan`` wins where transformers ships one: 5.24 ships gptj's and codegen's)."""


def base_plan_names(config) -> list[str]:
    """The base model's pipeline plan names: the config's own ``base_model_pp_plan``, else ``PP_PLANS``."""
    own = getattr(config, "base_model_pp_plan", None)
    if own:
        return list(own)
    return list(PP_PLANS.get(getattr(config, "model_type", None), ((), ()))[0])


def head_plan_names(lm_class: type, config) -> list[str]:
    """The head modules of the ``*ForCausalLM``: its class's ``_pp_plan``, else ``PP_PLANS``."""
    own = getattr(lm_class, "_pp_plan", None)
    if own:
        return list(own)
    return list(PP_PLANS.get(getattr(config, "model_type", None), ((), ()))[1])
