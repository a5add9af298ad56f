"""A plain Hugging Face training script: nothing here knows about hf_dist.

Swap the import line for ``from hf_dist import DistTrainer as Trainer, DistTrainingArguments as
TrainingArguments`` and it runs real data parallelism under ``torchrun``/``accelerate launch`` — on a machine
without GPUs too, where the plain Trainer would run one independent training per process.
tests/test_drop_in.py does exactly that swap.
"""

import json
import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers import Trainer, TrainingArguments


def main(output_dir: str) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(0)
    ids = (torch.randint(0, 256, (64, 1), generator=gen) + torch.arange(32)) % 256
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(
        output_dir=output_dir, max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
        seed=0, disable_tqdm=True, dataloader_pin_memory=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        result = {"num_processes": trainer.accelerator.num_processes, "losses": losses}
        with open(f"{output_dir}/result.json", "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
