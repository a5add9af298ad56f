"""Supervised fine-tuning of a Qwen3 mixture-of-experts model: TRL's ``SFTTrainer`` as hf_dist's ``DistSFTTrainer``,
the experts split over ranks by expert parallelism (EP) and everything else sharded by FSDP2.

    torchrun --nproc-per-node 8 examples/moe/train.py --recipe qwen3-30b-a3b \\
        --model_name_or_path Qwen/Qwen3-30B-A3B --dataset_path chats.jsonl

Each recipe is the layout ``hf-dist plan`` chooses for it (``examples/moe/README.md`` shows the plans):

- ``qwen3-30b-a3b``: Qwen3-30B-A3B on one node of 8 x H100-80GB, full fine-tune, FSDP2 FULL_SHARD with the experts
  split over 2 ranks (EP2 x FSDP2), global batch 32 of 4,096 tokens;
- ``qwen3-235b-a22b``: Qwen3-235B-A22B on 4 nodes of 8, LoRA r16 on attention and on the stacked expert weights
  (PEFT's ``target_parameters``) of a frozen bf16 base, FSDP2 with the experts split over 8 ranks, global batch 64.

The model is loaded with ``hf_dist.from_pretrained``: built on ``meta`` and laid out first, each rank then reads only
its own slices of the safetensors files (no rank holds the whole model). The data is a JSONL file of chats
(``{"messages": [...]}``) or texts (``{"text": ...}``), as TRL reads them, packed into rows of ``--max_length`` tokens
without attention across documents (TRL's padding-free packing). The router's load-balancing loss is on, at the
model's own coefficient (TRL adds it). Every ``DistSFTConfig`` flag overrides the recipe (``--ep_size 4``,
``--max_steps 500``, ``--cp_size 2`` for long rows, ...). A checkpoint is saved every ``--save_steps`` steps;
``--resume_from_checkpoint true`` continues from the newest one in ``--output_dir``. Output: ``OUTPUT_DIR/final``
(the model, or the adapter under LoRA, with the tokenizer) and ``OUTPUT_DIR/summary.json`` (every logged step).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from datasets import load_dataset
from transformers import AutoConfig, AutoTokenizer, HfArgumentParser

import hf_dist
from hf_dist.trainer.sft import DistSFTConfig, DistSFTTrainer

COMMON: list[str] = [
    "--per_device_train_batch_size", "1", "--max_length", "4096", "--packing", "true", "--bf16", "true",
    "--fsdp2", "true", "--fsdp2_activation_checkpointing", "true", "--gradient_checkpointing", "false",
    "--lr_scheduler_type", "cosine", "--warmup_steps", "0.03", "--logging_steps", "1", "--save_strategy", "steps",
    "--save_steps", "200", "--report_to", "none", "--seed", "0",
]
"""Both recipes: micro batch 1 of packed 4,096-token rows, bf16, FSDP2 with every decoder block recomputed in
backward (FSDP2's own activation checkpointing: TRL's ``gradient_checkpointing`` is the Trainer's, left off)."""
RECIPES: dict[str, list[str]] = {
    "qwen3-30b-a3b": ["--output_dir", "runs/qwen3-30b-a3b-sft", "--ep_size", "2", "--global_batch_size", "32",
                      "--learning_rate", "1e-5", "--max_steps", "1000"],
    "qwen3-235b-a22b": ["--output_dir", "runs/qwen3-235b-a22b-lora", "--ep_size", "8", "--global_batch_size", "64",
                        "--learning_rate", "1e-4", "--max_steps", "1000"],
}
LORA = {"qwen3-235b-a22b": 16}
"""Recipe -> LoRA rank (the others are full fine-tunes)."""


@dataclass
class ScriptArguments:
    recipe: str = field(metadata={"help": f"one of {', '.join(RECIPES)}: the layout and batch hf-dist plan sizes"})
    model_name_or_path: str = field(metadata={"help": "a local model folder or a Hub id already in the cache"})
    dataset_path: str = field(metadata={"help": "JSONL of chats ({\"messages\": [...]}) or texts ({\"text\": ...})"})


def split_argv(argv: list[str]) -> tuple[str, list[str]]:
    """The ``--recipe`` named in ``argv`` (``ValueError`` naming the choices otherwise) and the command line with its
    defaults first (the user's own flags come later and win)."""
    recipe = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--recipe"), None)
    if recipe not in RECIPES:
        raise ValueError(f"--recipe {recipe}: use one of {', '.join(RECIPES)}")
    return recipe, COMMON + RECIPES[recipe] + list(argv)


def lora_config(rank: int):
    """Adapters on the attention projections and, through PEFT's ``target_parameters``, on the stacked expert
    weights (``tests/test_sft_moe.py`` trains this shape under EP x FSDP2 equal to one process)."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def main(argv: list[str]) -> int:
    recipe, argv = split_argv(argv)
    parser = HfArgumentParser((ScriptArguments, DistSFTConfig))
    script, args = parser.parse_args_into_dataclasses(args=argv)
    hf_dist.check_model_support(AutoConfig.from_pretrained(script.model_name_or_path), args)  # before any weights
    tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
    peft_config = lora_config(LORA[recipe]) if recipe in LORA else None
    model = hf_dist.from_pretrained(script.model_name_or_path, args, peft_config=peft_config)
    dataset = load_dataset("json", data_files=script.dataset_path, split="train")
    trainer = DistSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    final_dir = Path(args.output_dir) / "final"
    trainer.save_model(str(final_dir))
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(final_dir)
        steps = [{k: v for k, v in log.items() if "time" not in k and "per_second" not in k}
                 for log in trainer.state.log_history if "loss" in log]
        summary = {"recipe": recipe, "model": script.model_name_or_path, "layout": trainer.args.layout.name,
                   "steps": steps}
        (Path(args.output_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"\nloss {steps[0]['loss']:.4f} (step 1) -> {steps[-1]['loss']:.4f} (step {steps[-1]['step']}); "
              f"saved to {final_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
