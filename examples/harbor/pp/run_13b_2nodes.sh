#!/usr/bin/env bash
# Harbor 13B with pipeline parallelism across 2 nodes x 8 GPUs (pp=2 x FSDP2 dp_shard=8).
# Run the same command on both nodes, with NODE_RANK=0 on the first and NODE_RANK=1 on the second:
#
#   NODE_RANK=0 MAIN_IP=10.0.0.1 bash examples/harbor/pp/run_13b_2nodes.sh
#   NODE_RANK=1 MAIN_IP=10.0.0.1 bash examples/harbor/pp/run_13b_2nodes.sh
#
# Layout (ParallelDims axes pp, dp_replicate, dp_shard, tp; pp outermost, so each node holds one stage):
#   world 16 = pp 2 x dp_shard 8; global batch 64 = micro 1 x dp 8 x 8 pipeline micro-batches (1F1B:
#   8 >= 2 x 2 stages, bubble (p-1)/(m+p-1) = 1/9 of the step). Gradient accumulation is the pipeline's
#   micro-batches: the Trainer runs 1 accumulation step per optimizer step with 8 sequences per dp rank.
#   LR 2e-5 x 64/32 (linear). The final model is saved as one HF directory (gathered on rank 0).
set -euo pipefail
cd "$(dirname "$0")/../../.."
: "${NODE_RANK:?set NODE_RANK=0 or 1}" "${MAIN_IP:?set MAIN_IP to node 0's address}"
accelerate launch --config_file examples/harbor/pp/harbor_13b_pp2_fsdp_2x8.yaml \
  --machine_rank "$NODE_RANK" --main_process_ip "$MAIN_IP" \
  examples/harbor/train.py --preset 13b \
  --model_name_or_path meta-llama/Llama-2-13b-hf --data_path transcripts.jsonl \
  --pp_size 2 --pp_schedule 1f1b --output_dir runs/harbor-13b-pp2 "$@"
