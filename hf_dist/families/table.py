"""The registry's data: one ``Family`` record per model type hf_dist knows something about.

Adding a model type, or proving a parallelism for one, is one row here plus its parity case in the test the row
names (``tests/test_families.py`` checks that every proven cell has its case). Types absent from this table are
``unknown``: every parallelism beyond data parallelism is refused for them by name.
"""

from __future__ import annotations

from hf_dist.families.fields import auto_adjusted_ff_width
from hf_dist.families.records import PARITY_FIELDS, Family, PlannerShape
from hf_dist.families.tp_plans import (
    BLOOM_TP,
    FALCON_TP,
    GATED_DELTANET_TP,
    GPT2_TP,
    GPT_BIGCODE_TP,
    GPT_OSS_BASE_TP,
    GPTJ_TP,
    MAMBA2_MUP_TP,
    MAMBA2_TP,
    MPT_TP,
    OPT_TP,
    PER_HEAD_QK_NORM,
    PERSIMMON_TP,
    SHARED_QK_LAYERNORM,
    SHORT_CONV_TP,
    STABLELM_TP,
)

TP_SWEEP = "tests/test_tp_sweep.py"
TP_MOE = "tests/test_moe_tp.py"
PP_SWEEP = "tests/test_pp_sweep.py"
PP_MOE = "tests/test_pp_moe.py"
EP_TESTS = "tests/test_expert_parallel.py"
CP_TESTS = "tests/test_context_parallel.py"
EP_PP_TESTS = "tests/test_ep_pp.py"
MOE_CP_TESTS = "tests/test_moe_cp.py"
EP_TP_TESTS = "tests/test_ep_tp.py"
_MOE_CP_NOTE = ("all-to-all; router aux loss from statistics pooled over the cp ranks; with ep_size too (experts over "
                "the data-parallel ranks, FSDP2 FULL_SHARD or DDP)")


def _row(kind: str, tp_plan: str = "model"):
    def make(model_type: str, *, tp=None, pp=None, ep=None, cp=None, ep_pp=None, ep_cp=None, ep_tp=None,
             refused=None, notes=None, tp_plan: str = tp_plan, **facts) -> Family:
        cells = (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp), ("ep_pp", ep_pp), ("ep_cp", ep_cp), ("ep_tp", ep_tp))
        proven = {name: test for name, test in cells if test}
        return Family(model_type=model_type, kind=kind, proven=proven, refused=refused or {}, notes=notes or {},
                      tp_plan=tp_plan, **facts)
    return make


# pipeline plans for types transformers ships none for: (base model modules, the layer list among them; head)
_HEAD = ("lm_head",)
_GPT2_PP = (("wte", "wpe", "drop", "h", "ln_f"), _HEAD)
_GPTJ_PP = (("wte", "drop", "h", "ln_f"), _HEAD)
_LAYERS_PP = (("embed_tokens", "layers", "norm"), _HEAD)
_FINAL_LAYERNORM_PP = (("embed_tokens", "layers", "final_layernorm"), _HEAD)
_OPT_PP = (("decoder.embed_tokens", "decoder.embed_positions", "decoder.project_in", "decoder.layers",
            "decoder.final_layer_norm", "decoder.project_out"), _HEAD)  # project_in/out: only when the config has them
# sizes the hybrid overlays split that the model's own plan does not name (label: config field or config -> int)
_MAMBA2_SIZES = {name: name for name in ("mamba_n_groups", "mamba_n_heads", "num_attention_heads",
                                         "num_key_value_heads")}
# a type whose code fixes the experts per token: its parity cases cannot move it (phimoe's sparsemixer picks two;
# zaya's config accepts one only)
_FIXED_TOP_K = {group: names for group, names in PARITY_FIELDS.items() if group != "router"}
# a config field its modeling code never reads (nemotron_h's sliding_window): nothing for a case to move
_NO_WINDOW = {group: names for group, names in PARITY_FIELDS.items() if group != "window"}
_GQA = dict(tp_replicated_kv=True, tp_sequence_parallel=True)  # separate q/k/v Linears, Llama's module names


# classic types: hf_dist's own TP plans (tp_plans.py, applied by tensor_parallel/classic.py), proven by the sweep,
# even where transformers ships one later (5.24 ships gptj's and codegen's)
_dense, _moe, _hybrid, _classic = _row("dense"), _row("moe"), _row("hybrid"), _row("classic", tp_plan="hf_dist")
_CODEGEN_TP = ("its qkv_proj packs q, v and k in blocks of a hard-coded mp_num=4 that its forward reshapes; a rank's "
               "share of a plain column split (transformers' plan from 5.24) is not whole heads, and no parity test "
               "proves another split")

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    _moe("afmoe", ep=EP_TESTS),
    _dense("apertus", tp=TP_SWEEP, pp=PP_SWEEP),
    _dense("arcee", tp=TP_SWEEP, pp=PP_SWEEP),
    _moe("aria_text", ep=EP_TESTS),
    _moe("axk1", ep=EP_TESTS),
    _moe("axk2", ep=EP_TESTS),
    _moe("bailing_hybrid", ep=EP_TESTS),
    _hybrid("bamba", tp=TP_SWEEP, pp=PP_SWEEP, tp_overlay=MAMBA2_TP, tp_overlay_sizes=_MAMBA2_SIZES,
            pp_modules=_FINAL_LAYERNORM_PP),
    _moe("beam", ep=EP_TESTS),
    _classic("bloom", tp=TP_SWEEP, pp=PP_SWEEP, tp_classic=BLOOM_TP,
             pp_modules=(("word_embeddings", "word_embeddings_layernorm", "h", "ln_f"), _HEAD)),
    _classic("codegen", pp=PP_SWEEP, refused=dict(tp=_CODEGEN_TP), pp_modules=_GPTJ_PP),
    _dense("cohere", tp=TP_SWEEP, pp=PP_SWEEP, tp_head_norm=PER_HEAD_QK_NORM),
    _dense("cohere2", tp=TP_SWEEP, pp=PP_SWEEP),
    _moe("cohere2_moe", ep=EP_TESTS),
    _dense("cohere_compass_text", tp=TP_SWEEP),
    _dense("cwm", tp=TP_SWEEP, pp=PP_SWEEP),
    _moe("deepseek_v2", ep=EP_TESTS),
    _moe("deepseek_v3", tp=TP_MOE, pp=PP_MOE, ep=EP_TESTS, ep_pp=EP_PP_TESTS, ep_tp=EP_TP_TESTS, cp=MOE_CP_TESTS,
         ep_cp=MOE_CP_TESTS,
         notes=dict(cp="all-to-all (MLA's per-head keys and values exchanged as they are, values wider than keys); no "
                       "router aux loss in its code (routing per token); with ep_size too (experts over the "
                       "data-parallel ranks, FSDP2 FULL_SHARD or DDP)")),
    _moe("deepseek_v32", ep=EP_TESTS),
    _moe("deepseek_v4", ep=EP_TESTS),
    _dense("doge", pp=PP_SWEEP),
    _moe("dots1", ep=EP_TESTS),
    _moe("dots3_note", ep=EP_TESTS),
    _moe("dots3_note_text", ep=EP_TESTS),
    _dense("ernie4_5", tp=TP_SWEEP, pp=PP_SWEEP),
    _moe("ernie4_5_moe", ep=EP_TESTS),
    _dense("exaone4", tp=TP_SWEEP, pp=PP_SWEEP),
    _moe("exaone_moe", ep=EP_TESTS),
    _classic("falcon", tp=TP_SWEEP, pp=PP_SWEEP, tp_classic=FALCON_TP,
             pp_modules=(("word_embeddings", "h", "ln_f"), _HEAD)),
    _hybrid("falcon_h1", tp=TP_SWEEP, pp=PP_SWEEP, tp_overlay=MAMBA2_MUP_TP, tp_overlay_sizes=_MAMBA2_SIZES,
            pp_modules=_FINAL_LAYERNORM_PP),
    _moe("flex_olmo", ep=EP_TESTS),
    _moe("flint", ep=EP_TESTS),
    _dense("gemma", tp=TP_SWEEP, pp=PP_SWEEP),
    _dense("gemma2", tp=TP_SWEEP, pp=PP_SWEEP, cp=CP_TESTS,
           notes=dict(cp="all-to-all (soft-capping and alternating windows stay the model's eager code)")),
    _dense("gemma3_text", tp=TP_SWEEP, pp=PP_SWEEP),
    _dense("gemma3n_text", tp=TP_SWEEP),
    _dense("glm", tp=TP_SWEEP, pp=PP_SWEEP),
    _dense("glm4", tp=TP_SWEEP, pp=PP_SWEEP),
    _moe("glm4_moe", ep=EP_TESTS),
    _moe("glm4_moe_lite", ep=EP_TESTS),
    _moe("glm_moe_dsa", ep=EP_TESTS),
    _classic("gpt2", tp=TP_SWEEP, pp=PP_SWEEP, tp_classic=GPT2_TP, pp_modules=_GPT2_PP),
    _classic("gpt_bigcode", tp=TP_SWEEP, pp=PP_SWEEP, tp_classic=GPT_BIGCODE_TP, pp_modules=_GPT2_PP),
    _dense("gpt_neox", tp=TP_SWEEP, pp=PP_SWEEP),
    _moe("gpt_oss", tp=TP_MOE, pp=PP_MOE, ep=EP_TESTS, ep_pp=EP_PP_TESTS, cp=MOE_CP_TESTS, ep_cp=MOE_CP_TESTS,
         ep_tp=EP_TP_TESTS, tp_plan="hf_dist", tp_base_plan=GPT_OSS_BASE_TP, attention_head_params=("sinks",),
         planner=PlannerShape(output_bias=True, sinks=True, router_bias=True, expert_bias=True),
         notes=dict(tp="hf_dist's plan (moe.py): attention sinks split by head, experts by intermediate dimension",
                    cp=f"{_MOE_CP_NOTE}; attention sinks cut to each rank's heads (eager attention)")),
    _classic("gptj", tp=TP_SWEEP, pp=PP_SWEEP, tp_classic=GPTJ_TP, pp_modules=_GPTJ_PP),
    _dense("granite", tp=TP_SWEEP, pp=PP_SWEEP),
    _dense("granite_swa", pp=PP_SWEEP),
    _moe("granitemoe", ep=EP_TESTS),
    _moe("granitemoe_swa", ep=EP_TESTS),
    _hybrid("granitemoehybrid", ep=EP_TESTS, refused=dict(tp='Mamba2 mixers (head groups, the B/C state projections and the grouped gated norm) have no TP overlay yet')),
    _moe("granitemoeshared", ep=EP_TESTS),
    _dense("helium", tp=TP_SWEEP, pp=PP_SWEEP),
    _dense("hrm_text", tp=TP_SWEEP),
    _moe("hunyuan_v1_moe", ep=EP_TESTS),
    _moe("hy_v3", ep=EP_TESTS),
    _moe("hy_v4", ep=EP_TESTS),
    _dense("hyperclovax", tp=TP_SWEEP, pp=PP_SWEEP),
    _moe("inkling2_text", ep=EP_TESTS),
    _moe("inkling_text", ep=EP_TESTS),
    _dense("internlm3", tp=TP_SWEEP, pp=PP_SWEEP),
    _dense("iquestcoder", tp=TP_SWEEP, pp=PP_SWEEP),
    _dense("jais2", tp=TP_SWEEP, pp=PP_SWEEP),
    _moe("jamba", ep=EP_TESTS),
    _moe("kimi_linear", ep=EP_TESTS),
    _moe("kolibri1", ep=EP_TESTS),
    _moe("laguna", ep=EP_TESTS),
    _hybrid("lfm2", tp=TP_SWEEP, pp=PP_SWEEP, tp_overlay=SHORT_CONV_TP,
            tp_overlay_sizes={"hidden_size (short-conv channels)": "hidden_size",
                              "num_attention_heads": "num_attention_heads",
                              "num_key_value_heads": "num_key_value_heads",
                              "feed-forward width (from intermediate_size)": auto_adjusted_ff_width},
            pp_modules=(("embed_tokens", "layers", "embedding_norm"), _HEAD)),  # its final norm: "embedding_norm"
    _moe("lfm2_moe", ep=EP_TESTS),
    _dense("llama", tp=TP_SWEEP, pp=PP_SWEEP, cp=CP_TESTS, **_GQA, planner=PlannerShape(output_bias=True),
           notes=dict(cp='all-to-all')),
    _moe("mellum", ep=EP_TESTS),
    _moe("mimo_v2_flash", ep=EP_TESTS),
    _dense("minicpm3", pp=PP_SWEEP),
    _moe("minimax", ep=EP_TESTS),
    _moe("minimax_m2", ep=EP_TESTS),
    _moe("minimax_m3_vl_text", ep=EP_TESTS),
    _dense("ministral", tp=TP_SWEEP, pp=PP_SWEEP),
    _dense("ministral3", tp=TP_SWEEP, pp=PP_SWEEP),
    _dense("mistral", tp=TP_SWEEP, pp=PP_SWEEP, cp=CP_TESTS, **_GQA, planner=PlannerShape(),
           notes=dict(cp="all-to-all (sliding window from the model's mask)")),
    _moe("mixtral", tp=TP_MOE, pp=PP_MOE, ep=EP_TESTS, ep_pp=EP_PP_TESTS, cp=MOE_CP_TESTS, ep_cp=MOE_CP_TESTS,
         ep_tp=EP_TP_TESTS, planner=PlannerShape(), notes=dict(cp=_MOE_CP_NOTE)),
    _classic("mpt", tp=TP_SWEEP, pp=PP_SWEEP, tp_classic=MPT_TP, pp_modules=(("wte", "blocks", "norm_f"), _HEAD)),
    _dense("nanochat", tp=TP_SWEEP),
    _classic("nemotron", tp=TP_SWEEP, pp=PP_SWEEP, tp_plan="model",  # transformers ships its TP plan
             pp_modules=_LAYERS_PP),
    _hybrid("nemotron_h", ep=EP_TESTS, parity_fields=_NO_WINDOW, refused=dict(tp='Mamba2 mixers (head groups, the B/C state projections and the grouped gated norm) have no TP overlay yet')),
    _dense("olmo", tp=TP_SWEEP, pp=PP_SWEEP),
    _dense("olmo2", tp=TP_SWEEP, pp=PP_SWEEP),
    _dense("olmo3", tp=TP_SWEEP, pp=PP_SWEEP),
    _hybrid("olmo_hybrid", pp=PP_SWEEP, refused=dict(tp="Gated DeltaNet has no TP overlay yet for OLMo-hybrid's layer (only for qwen3_5_text)")),
    _moe("olmoe", ep=EP_TESTS),
    _classic("opt", tp=TP_SWEEP, pp=PP_SWEEP, tp_classic=OPT_TP, pp_modules=_OPT_PP),
    _classic("persimmon", tp=TP_SWEEP, pp=PP_SWEEP, tp_classic=PERSIMMON_TP, pp_modules=_FINAL_LAYERNORM_PP),
    _dense("phi", tp=TP_SWEEP, pp=PP_SWEEP, tp_head_norm=SHARED_QK_LAYERNORM),
    _dense("phi3", tp=TP_SWEEP, pp=PP_SWEEP, tp_sequence_parallel=True),
    _dense("phi4_multimodal", tp=TP_SWEEP),
    _moe("phimoe", ep=EP_TESTS, parity_fields=_FIXED_TOP_K),
    _dense("qwen2", tp=TP_SWEEP, pp=PP_SWEEP, **_GQA, planner=PlannerShape(qkv_bias=True)),
    _moe("qwen2_moe", ep=EP_TESTS),
    _dense("qwen3", tp=TP_SWEEP, pp=PP_SWEEP, cp=CP_TESTS, **_GQA, planner=PlannerShape(qk_norm=True, output_bias=True),
           notes=dict(cp='all-to-all (q/k norms before the exchange)')),
    _moe("qwen3_5_moe", ep=EP_TESTS),
    _moe("qwen3_5_moe_text", ep=EP_TESTS),
    _hybrid("qwen3_5_text", tp=TP_SWEEP, pp=PP_SWEEP, tp_overlay=GATED_DELTANET_TP,
            tp_overlay_sizes={n: n for n in ("linear_num_key_heads", "linear_num_value_heads")}),
    _moe("qwen3_moe", tp=TP_MOE, pp=PP_MOE, ep=EP_TESTS, ep_pp=EP_PP_TESTS, cp=MOE_CP_TESTS, ep_cp=MOE_CP_TESTS,
         ep_tp=EP_TP_TESTS,
         planner=PlannerShape(qk_norm=True, output_bias=True),
         notes=dict(cp=_MOE_CP_NOTE)),
    _hybrid("qwen3_next", ep=EP_TESTS, pp=PP_SWEEP, refused=dict(tp='Gated DeltaNet with q/k/v/z fused per key head (in_proj_qkvz) has no TP overlay yet')),
    _moe("qwen4_exp", ep=EP_TESTS),
    _moe("qwen4_exp_text", ep=EP_TESTS),
    _dense("seed_oss", tp=TP_SWEEP, pp=PP_SWEEP),
    _dense("smollm3", tp=TP_SWEEP, pp=PP_SWEEP),
    _moe("solar_open", ep=EP_TESTS),
    _classic("stablelm", tp=TP_SWEEP, pp=PP_SWEEP, tp_classic=STABLELM_TP, pp_modules=_LAYERS_PP),
    _dense("starcoder2", tp=TP_SWEEP, pp=PP_SWEEP),
    _dense("vaultgemma", tp=TP_SWEEP, pp=PP_SWEEP),
    _dense("youtu", tp=TP_SWEEP, pp=PP_SWEEP),
    _hybrid("zamba", refused=dict(pp='its decoder layers call one shared attention block whose weights would be copied onto every stage')),
    _hybrid("zamba2", refused=dict(tp='shared attention blocks called from several decoder layers and Mamba2 mixers have no TP overlay yet', pp='its decoder layers call shared attention blocks whose weights would be copied onto every stage')),
    _moe("zaya", ep=EP_TESTS, parity_fields=_FIXED_TOP_K),
)}
