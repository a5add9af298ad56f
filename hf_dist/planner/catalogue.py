"""What the planner knows about models and GPUs, without downloading anything.

``ModelSpec`` holds the numbers of a decoder-only causal LM with a gated MLP (Llama, Mistral, Qwen2 families) or
with routed gated-MLP experts (Qwen3-MoE, Mixtral, gpt-oss: total vs active parameters) that memory and FLOPs
depend on, and lists every parameter tensor with its shape, so that parameter counts and shard sizes are exact. The
model types it describes, and how their layers differ (biases, q/k norms, sinks), are their registry records'
``planner`` field (``hf_dist.families``); other types are refused with that reason. ``model_spec(x)`` takes a catalogue name, a local HF config directory or a
``PretrainedConfig``; ``get_model_config(name)`` turns a catalogue entry into a ``PretrainedConfig``.
The GPU kinds (``GpuSpec``, ``gpu_spec``, ``gpu_from_device_name``) live in ``gpus.py`` and are re-exported here.

Catalogue figures are the published HF ``config.json`` values and NVIDIA's datasheets (dense, no sparsity).
Not here: memory arithmetic (``memory.py``, ``activations.py``) or choosing layouts (``chooser.py``).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Iterator

from hf_dist.families import EXPERT_COUNT_FIELDS, PlannerShape, family, num_experts, types_with
from hf_dist.planner.gpus import GPU_ALIASES, GPU_CATALOGUE, GpuSpec, gpu_from_device_name, gpu_spec  # noqa: F401

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """The shape of a gated-MLP decoder-only causal LM."""

    name: str
    """Catalogue name or the source it was read from."""
    model_type: str
    """HF ``model_type`` (one whose registry record has a ``planner`` shape)."""
    hidden_size: int
    """Width of the residual stream (h)."""
    num_hidden_layers: int
    """Decoder layers (L)."""
    num_attention_heads: int
    """Query heads (a)."""
    num_key_value_heads: int
    """Key/value heads (grouped-query attention when < a)."""
    intermediate_size: int
    """Width of the gated MLP (I)."""
    vocab_size: int
    """Vocabulary (V)."""
    head_dim: int | None = None
    """Per-head width; None: hidden_size / num_attention_heads."""
    tie_word_embeddings: bool = False
    """Whether lm_head shares the embedding matrix."""
    attention_bias: bool = False
    """The config's ``attention_bias``: biases on q/k/v (on o_proj too where the type's ``PlannerShape`` says so);
    Qwen2 has q/k/v biases whatever it says."""
    num_experts: int = 0
    """Routed experts per MoE layer (E; HF ``num_local_experts``); 0: a dense model."""
    experts_per_token: int = 0
    """Experts each token is routed to (k; HF ``num_experts_per_tok``)."""
    moe_intermediate_size: int = 0
    """Width of one expert's gated MLP (Qwen3-MoE ``moe_intermediate_size``, Mixtral/gpt-oss ``intermediate_size``)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} does not divide num_attention_heads="
                f"{self.num_attention_heads}; grouped-query attention needs heads to be a multiple of kv heads"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                                 f"{self.num_attention_heads}; give head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts or self.moe_intermediate_size < 1:
                raise ValueError(f"experts_per_token={self.experts_per_token} must be in [1, num_experts="
                                 f"{self.num_experts}] and moe_intermediate_size={self.moe_intermediate_size} positive "
                                 f"for a MoE model")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def shape(self) -> PlannerShape:
        """How the type's layers differ from the plain gated-MLP decoder (its registry record's ``planner``)."""
        return family(self.model_type).planner or PlannerShape()

    def expert_param_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """The routed experts' parameters of one MoE layer (what expert parallelism splits on dim 0)."""
        e, h, i = self.num_experts, self.hidden_size, self.moe_intermediate_size
        yield "mlp.experts.gate_up_proj", (e, 2 * i, h)
        if self.shape.expert_bias:
            yield "mlp.experts.gate_up_proj_bias", (e, 2 * i)
        yield "mlp.experts.down_proj", (e, h, i)
        if self.shape.expert_bias:
            yield "mlp.experts.down_proj_bias", (e, h)

    @property
    def layer_expert_weights(self) -> int:
        """Elements of one layer's expert matmul weights (all E experts)."""
        return 3 * self.num_experts * self.hidden_size * self.moe_intermediate_size

    @property
    def layer_active_linear_weights(self) -> int:
        """Matmul weight elements one token goes through in a layer: attention, router and its k experts."""
        if not self.is_moe:
            return self.layer_linear_weights
        return (self.layer_linear_weights + self.num_experts * self.hidden_size
                + 3 * self.experts_per_token * self.hidden_size * self.moe_intermediate_size)

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses: all but the experts it is not routed to."""
        idle = self.layer_expert_weights * (self.num_experts - self.experts_per_token) // self.num_experts
        return self.num_params - self.num_hidden_layers * idle if self.is_moe else self.num_params

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def decoder_layer_classes(self) -> tuple[str, ...]:
        """The classes FSDP wraps: the causal LM's ``_no_split_modules`` in installed transformers."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        return tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING[type(spec_config(self))]._no_split_modules))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``{name: (in_features, out_features)}`` of the linears of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        attention = {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                     "o_proj": (self.q_dim, h)}
        if self.is_moe:  # the experts are 3-D parameters (``expert_param_shapes``), not linears
            return attention
        return attention | {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_param_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every parameter of one decoder layer as ``(name, shape)``, in HF registration order (attention,
        MLP, then the two norms) and PyTorch layout (a weight is out x in)."""
        shape = self.shape
        qkv_bias, o_bias = self.attention_bias or shape.qkv_bias, self.attention_bias and shape.output_bias
        for name, (fan_in, fan_out) in self.linear_shapes().items():
            yield f"{name}.weight", (fan_out, fan_in)
            if (qkv_bias and name in ("q_proj", "k_proj", "v_proj")) or (o_bias and name == "o_proj"):
                yield f"{name}.bias", (fan_out,)
        if shape.qk_norm:
            yield "q_norm.weight", (self.head_dim,)
            yield "k_norm.weight", (self.head_dim,)
        if shape.sinks:
            yield "sinks", (self.num_attention_heads,)
        if self.is_moe:
            yield "mlp.gate.weight", (self.num_experts, self.hidden_size)
            if shape.router_bias:
                yield "mlp.gate.bias", (self.num_experts,)
            yield from self.expert_param_shapes()
        yield "input_layernorm.weight", (self.hidden_size,)
        yield "post_attention_layernorm.weight", (self.hidden_size,)

    def param_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every parameter of the model as ``(name, shape)``, in module order."""
        yield "model.embed_tokens.weight", (self.vocab_size, self.hidden_size)
        for layer in range(self.num_hidden_layers):
            for name, shape in self.layer_param_shapes():
                yield f"model.layers.{layer}.{name}", shape
        yield "model.norm.weight", (self.hidden_size,)
        if not self.tie_word_embeddings:
            yield "lm_head.weight", (self.vocab_size, self.hidden_size)

    @property
    def layer_params(self) -> int:
        return sum(_numel(shape) for _, shape in self.layer_param_shapes())

    @property
    def layer_linear_weights(self) -> int:
        """Elements of the linear weights of one layer (what autocast casts and TP shards)."""
        return sum(fan_in * fan_out for fan_in, fan_out in self.linear_shapes().values())

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        return sum(_numel(shape) for _, shape in self.param_shapes())

    def lora_params_per_layer(self, rank: int) -> int:
        """Adapter elements of one layer with LoRA rank ``rank`` on all seven linears (A: r x in, B: out x r)."""
        return sum(rank * (fan_in + fan_out) for fan_in, fan_out in self.linear_shapes().values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _llama(name, h, layers, heads, kv, inter, vocab, *, tie=False, model_type="llama", head_dim=None) -> ModelSpec:
    return ModelSpec(name=name, model_type=model_type, hidden_size=h, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                     tie_word_embeddings=tie, head_dim=head_dim)


def _moe(name, model_type, h, layers, heads, kv, inter, vocab, *, experts, top_k, expert_width,
         head_dim=None, attention_bias=False) -> ModelSpec:
    return ModelSpec(name=name, model_type=model_type, hidden_size=h, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                     head_dim=head_dim, attention_bias=attention_bias, num_experts=experts,
                     experts_per_token=top_k, moe_intermediate_size=expert_width)


MODEL_CATALOGUE: dict[str, ModelSpec] = {spec.name: spec for spec in (
    _llama("llama-2-7b", 4096, 32, 32, 32, 11008, 32000),
    _llama("llama-2-13b", 5120, 40, 40, 40, 13824, 32000),
    _llama("llama-2-70b", 8192, 80, 64, 8, 28672, 32000),
    _llama("llama-3-8b", 4096, 32, 32, 8, 14336, 128256),
    _llama("llama-3-70b", 8192, 80, 64, 8, 28672, 128256),
    _llama("llama-3.2-1b", 2048, 16, 32, 8, 8192, 128256, tie=True, head_dim=64),
    _llama("llama-3.2-3b", 3072, 28, 24, 8, 8192, 128256, tie=True, head_dim=128),
    _llama("mistral-7b", 4096, 32, 32, 8, 14336, 32000, model_type="mistral"),
    _llama("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, tie=True, model_type="qwen2"),
    _llama("qwen2.5-1.5b", 1536, 28, 12, 2, 8960, 151936, tie=True, model_type="qwen2"),
    _llama("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, model_type="qwen2"),
    _llama("qwen2.5-14b", 5120, 48, 40, 8, 13824, 152064, model_type="qwen2"),
    _llama("qwen2.5-32b", 5120, 64, 40, 8, 27648, 152064, model_type="qwen2"),
    _llama("qwen2.5-72b", 8192, 80, 64, 8, 29568, 152064, model_type="qwen2"),
    # Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, num_hidden_layers 48, num_attention_heads 32,
    # num_key_value_heads 4, head_dim 128, intermediate_size 6144 (no dense MLP layer: mlp_only_layers [],
    # decoder_sparse_step 1), num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768, vocab_size 151936
    _moe("qwen3-30b-a3b", "qwen3_moe", 2048, 48, 32, 4, 6144, 151936, experts=128, top_k=8, expert_width=768,
         head_dim=128),
    # Qwen/Qwen3-235B-A22B config.json: hidden_size 4096, num_hidden_layers 94, num_attention_heads 64,
    # num_key_value_heads 4, head_dim 128, intermediate_size 12288 (no dense MLP layer), num_experts 128,
    # num_experts_per_tok 8, moe_intermediate_size 1536, vocab_size 151936 (235B total, 22B active)
    _moe("qwen3-235b-a22b", "qwen3_moe", 4096, 94, 64, 4, 12288, 151936, experts=128, top_k=8, expert_width=1536,
         head_dim=128),
    # openai/gpt-oss-20b config.json: hidden_size 2880, num_hidden_layers 24, num_attention_heads 64,
    # num_key_value_heads 8, head_dim 64, intermediate_size 2880 (per expert), num_local_experts 32,
    # num_experts_per_tok 4, vocab_size 201088, attention_bias true (sliding/full layers alternate: same shapes)
    _moe("gpt-oss-20b", "gpt_oss", 2880, 24, 64, 8, 2880, 201088, experts=32, top_k=4, expert_width=2880,
         head_dim=64, attention_bias=True),
    # openai/gpt-oss-120b config.json: as gpt-oss-20b but num_hidden_layers 36, num_local_experts 128 (117B total)
    _moe("gpt-oss-120b", "gpt_oss", 2880, 36, 64, 8, 2880, 201088, experts=128, top_k=4, expert_width=2880,
         head_dim=64, attention_bias=True),
    # mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size 4096, num_hidden_layers 32, num_attention_heads 32,
    # num_key_value_heads 8, intermediate_size 14336 (per expert), num_local_experts 8, num_experts_per_tok 2,
    # vocab_size 32000
    _moe("mixtral-8x7b", "mixtral", 4096, 32, 32, 8, 14336, 32000, experts=8, top_k=2, expert_width=14336),
)}


def _from_config(config, name: str) -> ModelSpec:
    model_type = getattr(config, "model_type", None)
    if family(model_type).planner is None:
        raise ValueError(f"model_type={model_type!r} ({name}) is not modelled by the planner; supported: "
                         f"{', '.join(types_with('planner'))} (gated-MLP decoder-only causal LMs)")
    heads = config.num_attention_heads
    return ModelSpec(
        name=name, model_type=model_type, hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=heads, num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
        intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
        head_dim=getattr(config, "head_dim", None), tie_word_embeddings=bool(config.tie_word_embeddings),
        attention_bias=bool(getattr(config, "attention_bias", False)),
        **(_moe_fields(config) if num_experts(config) else {}),
    )


def _moe_fields(config) -> dict:
    """Experts, top-k and expert width of a MoE config (the field names differ by family)."""
    return dict(num_experts=num_experts(config), experts_per_token=config.num_experts_per_tok,
                moe_intermediate_size=getattr(config, "moe_intermediate_size", None) or config.intermediate_size)


def _read_local_config(folder: str):
    """``AutoConfig`` of a local folder, or a ``ValueError`` naming the file and what is wrong with it."""
    from transformers import AutoConfig

    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model={folder!r} is a folder without config.json; pass a model folder "
                         f"(save_pretrained output) or a catalogue name")
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{path} cannot be read as a model config ({err}); fix or replace the file") from err


def model_spec(model) -> ModelSpec:
    """A ``ModelSpec`` from a catalogue name, a local directory holding ``config.json``, or a ``PretrainedConfig``."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str | os.PathLike) and os.path.isfile(model) and os.path.basename(model) == "config.json":
        model = os.path.dirname(os.path.abspath(model))  # users pass the file; the folder is what HF reads
    if isinstance(model, str | os.PathLike) and os.path.isdir(model):
        return _from_config(_read_local_config(os.fspath(model)), os.fspath(model))
    if isinstance(model, str):
        key = model.lower()
        if key not in MODEL_CATALOGUE:
            raise ValueError(f"model={model!r} is neither a local config directory nor a catalogue name; "
                             f"catalogue: {', '.join(MODEL_CATALOGUE)}")
        return MODEL_CATALOGUE[key]
    if hasattr(model, "model_type") and hasattr(model, "hidden_size"):
        return _from_config(model, getattr(model, "name_or_path", "") or model.model_type)
    raise ValueError(f"model={model!r} is not a catalogue name, a config directory or a PretrainedConfig")


def get_model_config(name: str):
    """The catalogue entry ``name`` as a transformers ``PretrainedConfig`` (for config generators)."""
    return spec_config(model_spec(name))


@functools.lru_cache(maxsize=64)
def spec_config(spec: ModelSpec):
    """``spec`` as a transformers ``PretrainedConfig`` (what the TP shape rule and config generators read)."""
    from transformers import AutoConfig

    moe = {}
    if spec.is_moe:  # under the field names the type's config class uses
        default = AutoConfig.for_model(spec.model_type)
        experts = next((f for f in EXPERT_COUNT_FIELDS if hasattr(default, f)), "num_local_experts")
        moe = {experts: spec.num_experts, "num_experts_per_tok": spec.experts_per_token}
        if hasattr(default, "moe_intermediate_size"):
            moe["moe_intermediate_size"] = spec.moe_intermediate_size
    return AutoConfig.for_model(
        spec.model_type, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size, vocab_size=spec.vocab_size, head_dim=spec.head_dim,
        tie_word_embeddings=spec.tie_word_embeddings, **moe,
    )
