#!/usr/bin/env bash
# `make demo`: the tiny Harbor fine-tune across 2 processes on this machine, through `accelerate launch`,
# with the same script and FSDP FULL_SHARD layout as the 13B run (FSDP2 applied by hf_dist on CPU).
# Then the LoRA path with the same script. Outputs land in runs/.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

echo "== hf-dist batch: the 13B recipe's contract on 8 GPUs =="
hf-dist batch --world-size 8 --global-batch 64 --micro-batch 1 --seq-len 4096 \
  --base-lr 2e-5 --base-batch 32 --lr-scaling linear

echo
echo "== Full fine-tune, tiny preset, 2 processes, accelerate_configs/fsdp.yaml =="
accelerate launch --config_file accelerate_configs/fsdp.yaml \
  examples/harbor/train.py --preset tiny --eval_fraction 0.05 --output_dir runs/harbor-tiny

echo
echo "== LoRA fine-tune, tiny preset, 2 processes, accelerate_configs/ddp.yaml =="
accelerate launch --config_file accelerate_configs/ddp.yaml \
  examples/harbor/train.py --preset tiny --lora --max_steps 20 --output_dir runs/harbor-tiny-lora

echo
echo "Demo done. Full model: runs/harbor-tiny/final  LoRA adapter: runs/harbor-tiny-lora/final"
echo "Summaries: runs/harbor-tiny/summary.json runs/harbor-tiny-lora/summary.json"
