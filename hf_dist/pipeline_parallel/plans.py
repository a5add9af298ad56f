"""Pipeline plans for the model types transformers ships no ``base_model_pp_plan`` for.

transformers declares, per architecture, which modules of the base model come before the decoder-layer list,
the list itself and what comes after (``base_model_pp_plan``), and which head modules the ``*ForCausalLM`` adds
(``_pp_plan``). The classic dense types predate these plans; their registry records (``hf_dist.families``,
``Family.pp_modules``) write the same facts for them, with the model's own module names. A name may be dotted (OPT
keeps its layers in ``model.decoder.layers``); a name whose module the config switches off (OPT's ``project_in``
when no projection is needed) is skipped.

Which types are proven to run this way is ``support.py``'s decision. Not for: building stages.
"""

from __future__ import annotations

from hf_dist.families import family_of


def _registry_plan(config) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return family_of(config).pp_modules or ((), ())


def base_plan_names(config) -> list[str]:
    """The base model's pipeline plan names: the config's own ``base_model_pp_plan``, else its registry record's
    (a type's own plan wins where transformers ships one: 5.24 ships gptj's and codegen's)."""
    own = getattr(config, "base_model_pp_plan", None)
    if own:
        return list(own)
    return list(_registry_plan(config)[0])


def head_plan_names(lm_class: type, config) -> list[str]:
    """The head modules of the ``*ForCausalLM``: its class's ``_pp_plan``, else its registry record's."""
    own = getattr(lm_class, "_pp_plan", None)
    if own:
        return list(own)
    return list(_registry_plan(config)[1])
