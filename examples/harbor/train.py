"""The Harbor 13B fine-tune, reproduced with hf_dist — one script, two presets, full or LoRA.

Real run (8 x A100-80GB, FSDP FULL_SHARD, gradient checkpointing, bf16, global batch 64 = 1 x 8 x 8,
LR 2e-5 x 64/32):

    accelerate launch --config_file accelerate_configs/harbor_13b_fsdp_8gpu.yaml examples/harbor/train.py \
        --preset 13b --model_name_or_path meta-llama/Llama-2-13b-hf --data_path transcripts.jsonl

CPU twin (2 processes, a random-init Llama-class model built from a config, synthetic transcripts):

    accelerate launch --config_file accelerate_configs/fsdp.yaml examples/harbor/train.py --preset tiny

A real pretrained model, offline (``make demo``): ``--model_name_or_path "$(hf-dist demo-model)"``
(SmolLM2-135M-Instruct); ``--data_path`` also takes prompt/completion or plain-text files (``build_datasets``).

Any ``DistTrainingArguments`` flag overrides the preset (``--global_batch_size 32``, ``--tp_size 2``, ...).
The presets save no checkpoints; ``--save_steps N`` alone saves every N steps (``--eval_steps N`` alone evaluates
every N), and next to a ``--save_strategy`` other than ``steps`` it is refused.
``--resume_from_checkpoint true`` continues from the newest complete checkpoint in ``--output_dir`` (``auto``: the
same, or a fresh start when there is none); without it, an earlier run's checkpoints in the output dir are moved
into ``previous_run-<time>/`` there (``--overwrite_output_dir``: deleted) before the fresh run saves.
``--lora`` trains a LoRA adapter on a frozen base instead of the full model.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from hf_dist import DistTrainer, DistTrainingArguments, data
from hf_dist.file_modes import give_user_mode
from hf_dist.models import tiny_llama_config
from hf_dist.trainer import resume
from hf_dist.trainer.args import fp16_without_gpu

TINY_VOCAB = 1024
"""Tokens of the tokenizer the random-init model's run trains on its synthetic transcripts."""

# Each preset is a list of command-line defaults; flags given by the user come later and win.
PRESETS: dict[str, list[str]] = {
    "13b": [
        "--max_seq_len", "4096", "--per_device_train_batch_size", "1", "--global_batch_size", "64",
        "--base_learning_rate", "2e-5", "--base_batch_size", "32", "--lr_scaling", "linear",
        "--bf16", "true", "--activation_checkpointing", "true", "--num_train_epochs", "1",
        "--lr_scheduler_type", "cosine", "--warmup_steps", "0.03", "--weight_decay", "0.0",
        "--logging_steps", "10", "--eval_strategy", "steps", "--eval_steps", "500", "--save_strategy", "no",
        "--per_device_eval_batch_size", "1", "--output_dir", "runs/harbor-13b", "--report_to", "tensorboard",
        "--dist_logging", "true",  # tokens/s, MFU, memory in each log + OUTPUT_DIR/log_history.jsonl
    ],
    "tiny": [
        "--max_seq_len", "256", "--per_device_train_batch_size", "1", "--global_batch_size", "64",
        "--base_learning_rate", "1e-3", "--base_batch_size", "32", "--lr_scaling", "linear",
        "--max_steps", "40", "--lr_scheduler_type", "cosine", "--warmup_steps", "4", "--weight_decay", "0.0",
        "--logging_steps", "5", "--eval_strategy", "no", "--save_strategy", "no",
        "--per_device_eval_batch_size", "8", "--output_dir", "runs/harbor-tiny", "--report_to", "none",
        "--num_conversations", "1600", "--seed", "0", "--dataloader_num_workers", "0",
        "--ddp_find_unused_parameters", "false", "--disable_tqdm", "true", "--dataloader_pin_memory", "false",
        "--dist_logging", "true",
    ],
}


@dataclass
class ScriptArguments:
    preset: str = field(default="tiny", metadata={"help": "tiny (CPU twin) or 13b (the real recipe)", "choices": tuple(PRESETS)})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub id or local dir; tiny builds a random-init Llama from a config when unset"}
    )
    data_path: str | None = field(
        default=None,
        metadata={"help": "json/jsonl/parquet/csv/txt with 'messages', 'prompt'+'completion' or 'text' columns "
                          "(hf_dist.data.build_datasets); tiny generates synthetic transcripts when unset"},
    )
    num_conversations: int = field(default=1600, metadata={"help": "synthetic transcripts to generate (tiny)"})
    max_seq_len: int = field(default=256, metadata={"help": "tokens per sequence (longer ones are truncated)"})
    loss_on: str = field(default="assistant", metadata={"help": "all or assistant", "choices": ("all", "assistant")})
    packed: bool = field(default=False, metadata={"help": "pack several conversations per sequence"})
    eval_fraction: float = field(default=0.05, metadata={"help": "share of conversations held out for eval"})
    lora: bool = field(default=False, metadata={"help": "train a LoRA adapter on a frozen base"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha"})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout"})
    show_answers: int = field(
        default=0, metadata={"help": "print greedy answers to this many held-out prompts (of --data_path; else new "
                                     "synthetic customer messages) before and after training, and from the saved "
                                     "model reloaded (which must give the same)"}
    )
    answer_tokens: int = field(default=32, metadata={"help": "new tokens per answer (--show_answers)"})


def parse(argv: list[str]) -> tuple[ScriptArguments, DistTrainingArguments]:
    preset = "tiny"
    for i, arg in enumerate(argv):
        if arg == "--preset" and i + 1 < len(argv):
            preset = argv[i + 1]
        elif arg.startswith("--preset="):
            preset = arg.split("=", 1)[1]
    if preset not in PRESETS:
        raise ValueError(f"--preset {preset!r} is not a preset; use one of {', '.join(PRESETS)}")
    parser = HfArgumentParser((ScriptArguments, DistTrainingArguments))
    script, args = parser.parse_args_into_dataclasses(args=PRESETS[preset] + implied_strategies(argv) + list(argv))
    check_strategies(argv, args)
    if script.data_path is not None and script.model_name_or_path is None:
        raise ValueError(
            f"--data_path {script.data_path} needs --model_name_or_path (a local model folder or Hub id) whose "
            f"tokenizer encodes it; the random-init tiny model only trains on the synthetic transcripts"
        )
    # Before any process group or data: an output path that is a file, or a resume flag naming no checkpoint
    check_output_path(args.output_dir)
    check_show_answers(script, args)
    check_sequence_length(script, args)
    if why := fp16_without_gpu(args):  # the Trainer only warns; the recipe never trains in another precision
        raise ValueError(why)
    check_resume_path(args.resume_from_checkpoint, args.output_dir)
    check_model(script, args)  # from the config alone: EP on a dense model, CP on a type or head count it cannot run
    return script, args


# Each interval flag and the strategy it belongs to: the presets turn saving (tiny: evaluation too) off.
STRATEGY_OF: dict[str, str] = {"save_steps": "save_strategy", "eval_steps": "eval_strategy"}


def given(argv: list[str], name: str) -> bool:
    """Whether the user's own command line (not the preset) sets ``--name``."""
    return any(arg == f"--{name}" or arg.startswith(f"--{name}=") for arg in argv)


def implied_strategies(argv: list[str]) -> list[str]:
    """``--save_steps N`` alone means "save every N steps" (likewise ``--eval_steps``), whatever the preset says."""
    return [arg for steps, strategy in STRATEGY_OF.items()
            if given(argv, steps) and not given(argv, strategy) for arg in (f"--{strategy}", "steps")]


def check_strategies(argv: list[str], args: DistTrainingArguments) -> None:
    """An interval the user gave next to a strategy that never reads it is a contradiction, not a silent no-op."""
    for steps, strategy in STRATEGY_OF.items():
        chosen = str(getattr(getattr(args, strategy), "value", getattr(args, strategy)))
        if given(argv, steps) and given(argv, strategy) and chosen != "steps":
            raise ValueError(
                f"--{steps} {getattr(args, steps):g} with --{strategy} {chosen}: --{steps} is used only with "
                f"--{strategy} steps; drop --{strategy} (--{steps} alone implies steps), set --{strategy} steps, or drop --{steps}"
            )


def check_output_path(output_dir: str) -> None:
    """``--output_dir`` must be (or become) a folder this user can write, checked before anything loads."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--output_dir {output_dir} is an existing file, not a folder: the run writes its data, "
                         f"checkpoints and final model under it; choose another --output_dir or move the file away")
    existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--output_dir {output_dir} lies under {existing}, which is a file, not a folder; choose "
                         f"an --output_dir whose parents are folders")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output_dir {output_dir}: {existing} is not writable by this user; choose another "
                         f"--output_dir or fix the folder's permissions")


def check_resume_path(value: str | None, output_dir: str) -> None:
    """``--resume_from_checkpoint`` names something resumable, checked before the model loads (pure)."""
    value = resume.parse_resume(value)
    if isinstance(value, str) and value != resume.AUTO and not Path(value).exists():
        raise ValueError(
            f"Can't find a valid checkpoint at {value}: no such file or folder; pass a checkpoint-N folder, a run "
            f"folder holding one, --resume_from_checkpoint true (the newest in --output_dir) or auto (that, or a "
            f"fresh start when there is none)"
        )
    if value is not None:  # the Trainer's own resolution (its refusal) now rather than after the model loads
        resume.resolve_resume(value, output_dir, native_only=False)


def check_show_answers(script: ScriptArguments, args: DistTrainingArguments) -> None:
    """In-memory answers need ``generate`` on the whole model: a pipeline stage has neither (before any data)."""
    if script.show_answers and args.pp_size > 1:
        raise ValueError(
            f"--show_answers {script.show_answers} with --pp_size {args.pp_size}: a pipeline-parallel model holds only "
            f"its own stages on each rank and cannot answer in memory; drop --show_answers (and answer with the saved "
            f"model reloaded from <output_dir>/final) or use a layout without pipeline parallelism"
        )


def check_sequence_length(script: ScriptArguments, args: DistTrainingArguments) -> None:
    """Context parallelism gives each rank an equal slice of every sequence: the collator pads each batch to a
    multiple of cp_size, which must not take a row past ``--max_seq_len`` (pure, before any data or model)."""
    cp = args.layout.cp
    if cp > 1 and script.max_seq_len % cp:
        below, above = script.max_seq_len // cp * cp, -(-script.max_seq_len // cp) * cp
        raise ValueError(
            f"--max_seq_len {script.max_seq_len} with cp_size={cp}: context parallelism splits every sequence into "
            f"{cp} equal slices, so batches are padded to a multiple of {cp} and a row of {script.max_seq_len} "
            f"tokens would become {above}, longer than --max_seq_len; use --max_seq_len {below} or {above}"
        )


def prepare_data(script: ScriptArguments, args: DistTrainingArguments):
    """Tokenizer and datasets. The main process writes shared files first; the others then read them."""
    out = Path(args.output_dir) / "data"
    # One writer per filesystem: the job's main process, or each node's with --save_on_each_node (local disks).
    writer = args.local_process_index == 0 if args.save_on_each_node else args.process_index == 0
    with args.main_process_first(local=args.save_on_each_node, desc="prepare data"):
        source = script.data_path or out / "transcripts.jsonl"
        if script.data_path is None and writer:
            if script.model_name_or_path is None:  # the random-init model gets a tokenizer trained on the data
                data.prepare_demo_data(out, n=script.num_conversations, seed=args.seed, vocab_size=TINY_VOCAB)
            else:  # a pretrained model brings its own tokenizer
                data.write_jsonl(source, script.num_conversations, args.seed)
        if script.model_name_or_path is None:  # written by the main process, which went first
            tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
        else:
            tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
        train, eval_ = data.build_datasets(
            source, tokenizer, max_seq_len=script.max_seq_len, loss_on=script.loss_on,
            eval_fraction=script.eval_fraction, seed=args.seed, packed=script.packed,
        )
    return tokenizer, train, eval_


def build_model(script: ScriptArguments, args: DistTrainingArguments, tokenizer):
    if script.model_name_or_path is not None:
        import hf_dist

        # Laid out for args as it loads: FSDP2/TP/PP ranks read only their slices (built on meta, no rank holds the
        # whole model). The dtype is the layout's: fp32 master weights for a full fine-tune (bf16 compute through
        # FSDP2 param_dtype / autocast); a LoRA base stays bf16 with --bf16, PEFT keeping the adapters in fp32.
        peft_config = lora_config(script) if script.lora else None
        return hf_dist.from_pretrained(script.model_name_or_path, args, peft_config=peft_config)
    else:
        from hf_dist.models import build_tiny_model

        model = build_tiny_model(tiny_config(script, tokenizer), seed=args.seed)
    if script.lora:
        model = add_lora(model, script, args)
    return model


def tiny_config(script: ScriptArguments, tokenizer=None):
    """The random-init model's config: a small Llama over the tokenizer trained on the data (before the data is
    prepared, ``tokenizer=None``: the size that tokenizer is trained to, for the checks)."""
    special = {} if tokenizer is None else dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return tiny_llama_config(
        vocab_size=TINY_VOCAB if tokenizer is None else len(tokenizer), hidden_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(512, script.max_seq_len), **special,
    )


def check_model(script: ScriptArguments, args: DistTrainingArguments) -> None:
    """Whether the model may run the layout (``hf_dist.check_model_support``), from its config alone: before the
    data is prepared into ``--output_dir`` and before any weights load."""
    from transformers import AutoConfig

    import hf_dist

    layout = args.layout
    if max(layout.tp, layout.pp, layout.ep, layout.cp) == 1:  # no rule reads the model: do not open it here
        return
    if script.model_name_or_path is None:
        config = tiny_config(script)
    else:
        config = AutoConfig.from_pretrained(script.model_name_or_path)
    hf_dist.check_model_support(config, args)


def add_lora(model, script: ScriptArguments, args: DistTrainingArguments):
    from hf_dist.models import add_adapters

    if script.model_name_or_path is None:  # the adapter needs its base on disk to be reloadable
        base_dir = Path(args.output_dir) / "base"
        if args.process_index == 0:
            model.save_pretrained(base_dir)
            give_user_mode(base_dir)  # save_pretrained leaves its safetensors 0600
        model.name_or_path = model.config.name_or_path = str(base_dir.resolve())  # recorded in adapter_config
    return add_adapters(model, lora_config(script), seed=args.seed)  # as hf_dist.from_pretrained: one init per seed


def lora_config(script: ScriptArguments):
    from peft import LoraConfig

    return LoraConfig(
        r=script.lora_r, lora_alpha=script.lora_alpha, lora_dropout=script.lora_dropout, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )


def reload_check(final_dir: Path, lora: bool, tokenizer=None, prompts: list | None = None, answer_tokens: int = 32):
    """Load what was saved the way a user would; say what came back and its answers (main process only).

    LoRA: the adapter loads with ``AutoPeftModelForCausalLM``; it is then merged into its base, saved to
    ``<final_dir>-merged`` and that plain directory is reloaded with ``AutoModelForCausalLM`` to answer.
    """
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # else from_pretrained under ZeRO-3 waits for the other ranks (zero.Init)
    if lora:
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(final_dir)
        trainable = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
        line = f"AutoPeftModelForCausalLM.from_pretrained: ok ({trainable:,} adapter parameters)"
        if prompts:
            merged_dir = final_dir.with_name(final_dir.name + "-merged")
            resume.move_earlier_model(merged_dir)  # an earlier run's merge, sharded otherwise, must not mix in
            model.merge_and_unload().save_pretrained(merged_dir)
            give_user_mode(merged_dir)
            tokenizer.save_pretrained(merged_dir)
            model = AutoModelForCausalLM.from_pretrained(merged_dir)
            line += f"; merged into {merged_dir}, reloaded with AutoModelForCausalLM.from_pretrained"
    else:
        model = AutoModelForCausalLM.from_pretrained(final_dir)
        line = f"AutoModelForCausalLM.from_pretrained: ok ({model.num_parameters():,} parameters)"
    return line, answers(model, tokenizer, prompts or [], answer_tokens)


def held_out_prompts(script: ScriptArguments, args: DistTrainingArguments) -> list[list[dict] | str]:
    """``--show_answers`` prompts: ``--data_path``'s held-out ones (``data.held_out_prompts``), else system + first
    customer message of new synthetic conversations (another seed)."""
    if script.data_path is not None:
        return data.held_out_prompts(script.data_path, script.show_answers, eval_fraction=script.eval_fraction,
                                     seed=args.seed)
    conversations = data.generate_conversations(script.show_answers, seed=args.seed + 1)
    return [[m for m in c["messages"] if m["role"] != "assistant"][:2] for c in conversations]


def answers(model, tokenizer, prompts: list, max_new_tokens: int) -> list[str]:
    """Greedy answers (a string continued as plain text); on FSDP2 every rank must call this with the same prompts."""
    from hf_dist.models import greedy_answer

    return [greedy_answer(model, tokenizer, p, max_new_tokens=max_new_tokens, chat=not isinstance(p, str))
            for p in prompts]


def print_answers(prompts: list, columns: dict[str, list[str]]) -> None:
    for i, prompt in enumerate(prompts):
        who, what = ("prompt", prompt) if isinstance(prompt, str) else (prompt[-1]["role"], prompt[-1]["content"])
        print(f"\n[{i + 1}] {who}: {what}")
        for label, texts in columns.items():
            print(f"    {label:>9}: {texts[i]}")


def layout_line(trainer) -> str:
    return next(line for line in trainer.describe().splitlines() if line.startswith("layout"))


def main(argv: list[str]) -> int:
    script, args = parse(argv)
    tokenizer, train, eval_ = prepare_data(script, args)
    model = build_model(script, args, tokenizer)
    trainer = DistTrainer(
        model=model, args=args, train_dataset=train, eval_dataset=eval_, processing_class=tokenizer,
        data_collator=data.data_collator(  # with CP every batch padded to a multiple of cp_size (labels -100)
            tokenizer, packed=script.packed, attn_implementation=model.config._attn_implementation,
            cp_size=args.layout.cp,
        ),
        preprocess_logits_for_metrics=data.preprocess_logits_for_metrics, compute_metrics=data.compute_metrics,
    )
    prompts = held_out_prompts(script, args) if script.show_answers else []
    in_memory = trainer.accelerator.unwrap_model(trainer.model)
    answers_before = answers(in_memory, tokenizer, prompts, script.answer_tokens)
    before = trainer.evaluate(metric_key_prefix="before") if eval_ is not None else {}
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)  # true | auto | PATH
    after = trainer.evaluate(metric_key_prefix="after") if eval_ is not None else {}
    answers_after = answers(in_memory, tokenizer, prompts, script.answer_tokens)
    final_dir = Path(args.output_dir) / "final"
    trainer.save_model(str(final_dir))
    if trainer.is_world_process_zero():
        reload_line, answers_reloaded = reload_check(final_dir, script.lora, tokenizer, prompts, script.answer_tokens)
        losses = [round(log["loss"], 4) for log in trainer.state.log_history if "loss" in log]
        summary = {
            "preset": script.preset, "lora": script.lora, "layout": layout_line(trainer),
            "losses": losses, "train_loss": result.training_loss,
            "perplexity_before": before.get("before_perplexity"), "perplexity_after": after.get("after_perplexity"),
            "final_dir": str(final_dir), "reload": reload_line, "prompts": prompts, "answers_before": answers_before,
            "answers_after": answers_after, "answers_reloaded": answers_reloaded,
            "reload_same_answers": answers_reloaded == answers_after,
        }
        (Path(args.output_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
        print("\n== Harbor fine-tune summary ==")
        logged = " -> ".join(str(l) for l in losses) if losses else "none logged (--logging_steps > the steps run)"
        print(f"loss: {logged}; mean over the run {result.training_loss:.4f}")
        if before:
            print(f"eval perplexity: {summary['perplexity_before']:.2f} before -> {summary['perplexity_after']:.2f} after")
        print(f"model saved to: {final_dir}  ({summary['reload']})")
        if prompts:
            print_answers(prompts, {"before": answers_before, "after": answers_after, "reloaded": answers_reloaded})
            same = "yes" if summary["reload_same_answers"] else "NO"
            print(f"\nreloaded model gives the same answers as the trained one: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
