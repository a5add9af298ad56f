"""Tensor-parallel plans for the classic dense model types transformers ships no plan for.

GPT-2, Falcon, OPT, BLOOM, GPT-J ... predate ``base_model_tp_plan``. For each, its registry record
(``hf_dist.families``, ``Family.tp_classic``; the data is in ``families/tp_plans.py``) holds what the plan of a newer
model would say, written against the model's own module names (relative to its ``*ForCausalLM``), plus the few facts
about its attention that a plan alone cannot carry:

- ``plan``: ``{pattern: style_name}``, style names from ``plans.STYLE_BUILDERS``. Fused q/k/v projections
  whose rows are interleaved per head (BLOOM, Falcon, Persimmon ``query_key_value``) are plainly
  column-parallel: a contiguous slice of rows is whole heads, each with its q, k and v. GPT-2's ``c_attn`` is a
  ``Conv1D`` holding ``[q | k | v]``: it stays whole on every rank, each rank keeping its heads' columns
  (``conv1d_fused_qkv_slice``).
- ``local_attrs``: the attention module's head counts and split sizes that its forward reads and that must
  count this rank's heads only (``local_attrs`` style).
- ``heads`` / ``kv_heads`` / ``mlp_width``: the sizes the plan splits, read from the config (``checks.py``).
- ``refusal``: config values under which the plan would not be exact, as a reason (``support.py``).

Which types use these plans is their registry record's choice (``hf_dist.families``, ``Family.tp_plan``), not
whether transformers ships a plan: transformers 5.24 ships plans for gptj (hf_dist's, proven, stays) and codegen
(refused by name in the registry: its qkv is packed in blocks of ``mp_num=4``).
Pure data and small functions of a config; reads only the registry. Not for: applying (``apply.py``).
"""

from __future__ import annotations

from hf_dist.families import family_of
from hf_dist.families.tp_plans import ClassicPlan


CLASSIC_STYLES: frozenset[str] = frozenset({
    "conv1d_colwise", "conv1d_rowwise", "conv1d_fused_qkv_slice", "local_attrs", "local_alibi",
    "rowwise_writable_output", "local_position_bias", "fused_colwise_qkv",
})
"""hf_dist's style names these plans use besides transformers' own (``plans.STYLE_BUILDERS``)."""


def classic_plan(config) -> ClassicPlan | None:
    """The classic plan of ``config``'s model type, where its registry record chooses hf_dist's plan
    (``Family.tp_plan``), whether or not the installed transformers ships one."""
    record = family_of(config)
    return record.tp_classic if record.tp_plan == "hf_dist" else None
