"""Offline stand-ins for the Hub fixtures of TRL's SFT, DPO and GRPO tests (see trl_sft_fidelity).

Nothing is fetched. Models: tiny random models of the architectures the tests name, written
into a Hub-layout cache (``HF_HUB_CACHE``) so that ``from_pretrained("trl-internal-testing/tiny-...")`` resolves
offline; one byte-level BPE tokenizer trained on the Zen of Python, with each architecture's chat template read from
the installed ``trl`` package (``trl/chat_templates``); one-label sequence classifiers as GRPO's reward models; a
remote-code model (a Qwen2 declared as ``RemoteForCausalLM``). Datasets: the Zen of Python (``import this``) in the
configurations the tests load (``zen``: standard/conversational x language-modeling/prompt-completion/prompt-only/
preference, implicit-prompt preference; ``harmony`` with a ``thinking`` field; ``toolcall`` with tools as a JSON
string), 17 train and 2 test rows each, as JSON files that ``datasets.load_dataset`` is redirected to. No image
datasets or vision-language models: the tests that need them fail in both runs.

The stand-ins differ from the Hub fixtures in vocabulary and token counts; they serve both runs of the comparison
equally. Tests that assert Qwen's token ids (151643-151645) need ``TRL_STANDINS_QWEN_VOCAB=1``: the Qwen2.5
stand-in then has Qwen's vocabulary size and special-token ids (about ten times slower to train on this machine).
Not a test module and not part of hf_dist.
"""

from __future__ import annotations

import codecs
import json
import os
import random
import sys
from pathlib import Path


REV = "0" * 40
HUB_DATASETS = ("trl-internal-testing/zen", "trl-internal-testing/harmony", "trl-internal-testing/toolcall")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_VOCAB, QWEN_SPECIAL_START = 151936, 151643  # Qwen2.5: vocab_size, id of <|endoftext|> (then im_start, im_end)
# name -> (model_type, chat template in trl/chat_templates or None, eos token, pad token or None)
MODELS = {
    "tiny-Qwen2ForCausalLM-2.5": ("qwen2", "qwen2_5.jinja", "<|im_end|>", "<|endoftext|>"),
    "tiny-Qwen2ForCausalLM-R1-Distill": ("qwen2", "deepseek_r1_distill.jinja", "<|im_end|>", "<|endoftext|>"),
    "tiny-Qwen3ForCausalLM": ("qwen3", "qwen3.jinja", "<|im_end|>", "<|endoftext|>"),
    "tiny-Qwen3MoeForCausalLM": ("qwen3_moe", "qwen3.jinja", "<|im_end|>", "<|endoftext|>"),
    "tiny-DeepseekV3ForCausalLM": ("deepseek_v3", "deepseekv3.jinja", "<|im_end|>", "<|endoftext|>"),
    "tiny-MistralForCausalLM-0.2": ("mistral", None, "<|endoftext|>", None),
    "tiny-GPTNeoXForCausalLM": ("gpt_neox", None, "<|endoftext|>", "<|endoftext|>"),
    "tiny-LlamaForCausalLM-3.2": ("llama", "llama3_2.jinja", "<|im_end|>", "<|endoftext|>"),
    "tiny-Cohere2ForCausalLM": ("cohere2", "cohere2.jinja", "<|im_end|>", "<|endoftext|>"),
    "tiny-FalconMambaForCausalLM": ("falcon_mamba", None, "<|endoftext|>", "<|endoftext|>"),
    "tiny-Glm4MoeForCausalLM": ("glm4_moe", "glm4moe.jinja", "<|im_end|>", "<|endoftext|>"),
    "tiny-GptOssForCausalLM": ("gpt_oss", "gptoss.jinja", "<|im_end|>", "<|endoftext|>"),
    "tiny-NemotronHForCausalLM-nano": ("nemotron_h", "nemotron_3_nano.jinja", "<|im_end|>", "<|endoftext|>"),
    "tiny-Olmo3ForCausalLM": ("olmo3", None, "<|endoftext|>", "<|endoftext|>"),
    "tiny-Lfm2ForCausalLM": ("lfm2", "lfm2.jinja", "<|im_end|>", "<|endoftext|>"),
    "tiny-Lfm2ForCausalLM-2.5": ("lfm2", "lfm2_2_5.jinja", "<|im_end|>", "<|endoftext|>"),
    "tiny-Gemma2ForCausalLM": ("gemma2", None, "<|endoftext|>", "<|endoftext|>"),
}
# name -> (model_type, chat template, extra special token the tests set as pad token or None)
REWARD_MODELS = {"tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "qwen2_5.jinja", None),
                 "tiny-Qwen3ForSequenceClassification": ("qwen3", "qwen3.jinja", None),
                 "tiny-LlamaForSequenceClassification-3.2": ("llama", "llama3_2.jinja", "<|finetune_right_pad_id|>")}
TOKENIZER_ONLY = {"Qwen/Qwen3-4B": ("qwen3", "qwen3.jinja")}  # chat_template_path="Qwen/Qwen3-4B"
ARCH_EXTRAS = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1,
                        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1,
                     first_k_dense_replace=1, head_dim=8),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8),
    "falcon_mamba": dict(state_size=4, expand=2, conv_kernel=4, time_step_rank=4),
    "nemotron_h": dict(hybrid_override_pattern="M*", mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8,
                       n_groups=1),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "gemma2": dict(head_dim=8, tie_word_embeddings=True),  # Gemma2 ties the LM head to the embeddings
}


def _root() -> Path:
    return Path(os.environ["TRL_STANDINS"])


# ---- data ------------------------------------------------------------------------------------------------------

def zen_lines() -> list[str]:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    return [line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line.strip()]


def _write_rows(dataset: str, config: str, rows: list[dict]) -> None:
    folder = _root() / "data" / dataset / config
    folder.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", rows[:-2]), ("test", rows[-2:])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))


def build_datasets() -> None:
    lines = zen_lines()
    halves = []
    for line in lines:
        words = line.split(" ")
        cut = max(1, len(words) // 2)
        halves.append((" ".join(words[:cut]), " " + " ".join(words[cut:])))
    chats = [[{"role": "user", "content": f"Complete: {p}"}, {"role": "assistant", "content": c.strip()}]
             for p, c in halves]
    shuffled = lines[:]
    random.Random(0).shuffle(shuffled)
    _write_rows("zen", "standard_language_modeling", [{"text": x} for x in lines])
    _write_rows("zen", "standard_prompt_completion", [{"prompt": p, "completion": c} for p, c in halves])
    _write_rows("zen", "conversational_language_modeling", [{"messages": m} for m in chats])
    _write_rows("zen", "conversational_prompt_completion", [{"prompt": m[:1], "completion": m[1:]} for m in chats])
    _write_rows("zen", "standard_implicit_prompt_preference",
                [{"chosen": a, "rejected": b} for a, b in zip(lines, shuffled)])
    others = [" " + line.split(" ", 1)[-1] for line in shuffled]  # a rejected completion: another line's tail
    _write_rows("zen", "standard_preference",
                [{"prompt": p, "chosen": c, "rejected": r} for (p, c), r in zip(halves, others)])
    _write_rows("zen", "conversational_preference", [
        {"prompt": m[:1], "chosen": m[1:], "rejected": [{"role": "assistant", "content": r.strip()}]}
        for m, r in zip(chats, others)])
    _write_rows("zen", "conversational_implicit_prompt_preference", [
        {"chosen": m, "rejected": [m[0], {"role": "assistant", "content": r.strip()}]}
        for m, r in zip(chats, others)])
    _write_rows("zen", "standard_prompt_only", [{"prompt": p} for p, _ in halves])
    _write_rows("zen", "conversational_prompt_only", [{"prompt": m[:1]} for m in chats])
    thinking = [[m[0], dict(m[1], thinking="The Zen of Python.")] for m in chats]
    _write_rows("harmony", "language_modeling", [{"messages": m} for m in thinking])
    _write_rows("harmony", "prompt_completion", [{"prompt": m[:1], "completion": m[1:]} for m in thinking])
    _write_rows("harmony", "preference", [
        {"prompt": m[:1], "chosen": m[1:],
         "rejected": [{"role": "assistant", "content": r.strip(), "thinking": "Another line."}]}
        for m, r in zip(thinking, others)])
    tools = json.dumps([{"type": "function", "function": {
        "name": "zen_line", "description": "Line i of the Zen of Python.",
        "parameters": {"type": "object", "properties": {"i": {"type": "integer", "description": "line"}},
                       "required": ["i"]}}}])
    call = {"type": "function", "function": {"name": "zen_line", "arguments": {"i": 0}}}
    _write_rows("toolcall", "language_modeling", [{"tools": tools, "messages": [
        {"role": "user", "content": f"What is line {i} of the Zen?"},
        {"role": "assistant", "tool_calls": [dict(call, function=dict(call["function"], arguments={"i": i}))]},
        {"role": "tool", "name": "zen_line", "content": x},
        {"role": "assistant", "content": x},
    ]} for i, x in enumerate(lines)])
    _write_rows("toolcall", "preference", [{"tools": tools, "prompt": [
        {"role": "user", "content": f"What is line {i} of the Zen?"},
        {"role": "assistant", "tool_calls": [dict(call, function=dict(call["function"], arguments={"i": i}))]},
        {"role": "tool", "name": "zen_line", "content": x},
    ], "chosen": [{"role": "assistant", "content": x}], "rejected": [{"role": "assistant", "content": r.strip()}]}
        for i, (x, r) in enumerate(zip(lines, others))])


def load_standin_dataset(path, name=None, split=None, streaming=False, **kwargs):
    """``datasets.load_dataset`` for the Hub datasets above, read from the local JSON files."""
    import datasets

    folder = _root() / "data" / path.split("/")[1] / name
    files = {s: str(folder / f"{s}.jsonl") for s in ("train", "test")}
    return datasets.load_dataset("json", data_files=files, split=split, streaming=streaming)


# ---- models ----------------------------------------------------------------------------------------------------

def _tokenizer_object():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(zen_lines() * 4 + ["user assistant system Complete: <think></think>"], trainer)
    return tok


def _with_qwen_ids(tok_obj):
    """The same BPE with Qwen2.5's ids: learned tokens first, unused fillers, the specials at 151643-151645."""
    from tokenizers import AddedToken, Tokenizer

    data = json.loads(tok_obj.to_str())
    learned = [t for t, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1]) if t not in SPECIAL]
    vocab = {t: i for i, t in enumerate(learned)}
    vocab.update({f"<|unused_{i}|>": i for i in range(len(learned), QWEN_SPECIAL_START)})
    vocab.update({t: QWEN_SPECIAL_START + i for i, t in enumerate(SPECIAL)})
    data["model"]["vocab"], data["added_tokens"] = vocab, []
    wide = Tokenizer.from_str(json.dumps(data))
    wide.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return wide


def small_config(model_type: str, vocab: int):
    from transformers import AutoConfig

    kwargs = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
    return AutoConfig.for_model(model_type, **{**kwargs, **ARCH_EXTRAS.get(model_type, {})})


def _snapshot(repo_id: str) -> Path:
    org, name = repo_id.split("/")
    repo = _root() / "hub" / f"models--{org}--{name}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REV)
    snap = repo / "snapshots" / REV
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def build_models() -> dict[str, str]:
    """Write every stand-in; returns name -> "ok" or why it could not be built (its tests then fail in both runs)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerFast

    templates = Path(__import__("trl").__file__).parent / "chat_templates"
    tok_obj = _tokenizer_object()

    qwen_ids = os.environ.get("TRL_STANDINS_QWEN_VOCAB") == "1"
    wide_obj = _with_qwen_ids(tok_obj) if qwen_ids else None

    def tokenizer(eos, pad, template, obj=tok_obj):
        tok = PreTrainedTokenizerFast(tokenizer_object=obj, eos_token=eos, pad_token=pad)
        if template is not None:
            tok.chat_template = (templates / template).read_text()
        return tok

    status = {}
    for name, (model_type, template) in TOKENIZER_ONLY.items():
        snap = _snapshot(name)
        tokenizer("<|im_end|>", "<|endoftext|>", template).save_pretrained(snap)
        small_config(model_type, tok_obj.get_vocab_size()).save_pretrained(snap)  # AutoTokenizer reads it
        status[name] = "ok (tokenizer)"
    for name, (model_type, template, eos, pad) in MODELS.items():
        try:
            torch.manual_seed(0)
            wide = qwen_ids and name == "tiny-Qwen2ForCausalLM-2.5"
            config = small_config(model_type, QWEN_VOCAB if wide else tok_obj.get_vocab_size())
            if wide:  # keep the 151936-row embedding cheap
                config.tie_word_embeddings, config.hidden_size, config.intermediate_size = True, 16, 32
            model = AutoModelForCausalLM.from_config(config)
            tok = tokenizer(eos, pad, template, wide_obj if wide else tok_obj)
            model.config.pad_token_id, model.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
            snap = _snapshot(f"trl-internal-testing/{name}")
            model.save_pretrained(snap)
            tok.save_pretrained(snap)
            status[name] = "ok"
        except Exception as exc:  # noqa: BLE001 -- reported in the table; the tests naming it fail in both runs
            status[name] = f"not built: {type(exc).__name__}: {str(exc)[:100]}"
    for name, (model_type, template, extra) in REWARD_MODELS.items():  # GRPO's reward models: one-label classifiers
        torch.manual_seed(0)
        tok = tokenizer("<|im_end|>", "<|endoftext|>", template)
        if extra is not None:
            tok.add_special_tokens({"additional_special_tokens": [extra]})
        config = small_config(model_type, len(tok))
        config.num_labels = 1
        config.pad_token_id = tok.pad_token_id
        snap = _snapshot(f"trl-internal-testing/{name}")
        AutoModelForSequenceClassification.from_config(config).save_pretrained(snap)
        tok.save_pretrained(snap)
        status[name] = "ok (reward model)"
    snap = _snapshot("trl-internal-testing/tiny-RemoteForCausalLM")
    AutoModelForCausalLM.from_config(small_config("qwen2", tok_obj.get_vocab_size())).save_pretrained(snap)
    config = json.loads((snap / "config.json").read_text())  # the same weights, declared as repository code
    config.update(model_type="remote", architectures=["RemoteForCausalLM"],
                  auto_map={"AutoConfig": "configuration_remote.RemoteConfig",
                            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
    (snap / "config.json").write_text(json.dumps(config))
    (snap / "configuration_remote.py").write_text(
        "from transformers import Qwen2Config\n\n\nclass RemoteConfig(Qwen2Config):\n    model_type = 'remote'\n")
    (snap / "modeling_remote.py").write_text(
        "from transformers import Qwen2ForCausalLM\n\nfrom .configuration_remote import RemoteConfig\n\n\n"
        "class RemoteForCausalLM(Qwen2ForCausalLM):\n    config_class = RemoteConfig\n")
    tokenizer("<|im_end|>", "<|endoftext|>", "qwen2_5.jinja").save_pretrained(snap)
    status["tiny-RemoteForCausalLM"] = "ok (remote code)"
    return status


if __name__ == "__main__":
    if len(sys.argv) > 2 or sys.argv[1:2] and sys.argv[1].startswith("-"):
        sys.exit(f"usage: python {sys.argv[0]} [FOLDER]  (default /tmp/trl_standins)\n\n{__doc__}")
    os.environ.setdefault("TRL_STANDINS", sys.argv[1] if len(sys.argv) > 1 else "/tmp/trl_standins")
    build_datasets()
    for model, state in build_models().items():
        print(f"{model}: {state}")
