#!/usr/bin/env bash
# One elastic agent of the Harbor recipe: torchrun restarts its ranks whenever a node leaves or joins, and the
# ranks resume from the newest complete checkpoint, resharded to the new world, with the same global batch.
#
#   # on every node (any number between MIN_NODES and MAX_NODES, joining or leaving at any time):
#   RDZV_ENDPOINT=node0:29400 NPROC_PER_NODE=8 bash examples/multinode/elastic.sh --preset 13b \
#       --model_name_or_path meta-llama/Llama-2-13b-hf --data_path /shared/transcripts.jsonl \
#       --fsdp2 true --save_steps 50 --output_dir /shared/runs/harbor-13b
#
# Knobs (environment): MIN_NODES (1), MAX_NODES (2), NPROC_PER_NODE (1), MAX_RESTARTS (3), RDZV_ENDPOINT
# (127.0.0.1:29400; the first agent on that host serves the rendezvous store, so keep that node up), RDZV_ID
# (harbor), LAST_CALL (seconds to wait for more nodes once MIN_NODES are there; 10), TRAIN_SCRIPT
# (examples/harbor/train.py; tests/test_elastic.py runs a wrapper recording sample ids). Arguments go to the
# script after --resume_from_checkpoint auto (the output dir must be on a shared filesystem). SHUTDOWN_TIMEOUT
# (300): seconds the agent gives its ranks after SIGTERM (at each restart) to finish their step and save, before
# SIGKILL; torchrun's own default of 30 s is too short for a large model's checkpoint.
# On Kubernetes: harbor_13b_k8s.yaml (the same torchrun command, the rendezvous store in a pod of its own).
set -euo pipefail
cd "$(dirname "$0")/../.."
# torch 2.13: with the rendezvous TCP store shared with the ranks (the default), an agent that was rank 0 keeps its
# round-0 address info and never publishes MASTER_ADDR for a later round, so a node joining later waits for it
# forever (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, `_bootstrap_store_info` cache). Publishing
# it every round (no shared store) lets nodes join.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
exec torchrun --nnodes "${MIN_NODES:-1}:${MAX_NODES:-2}" --nproc_per_node "${NPROC_PER_NODE:-1}" \
  --max-restarts "${MAX_RESTARTS:-3}" --rdzv-backend c10d --rdzv-endpoint "${RDZV_ENDPOINT:-127.0.0.1:29400}" \
  --rdzv-id "${RDZV_ID:-harbor}" --rdzv-conf "last_call_timeout=${LAST_CALL:-10}" \
  --shutdown-timeout "${SHUTDOWN_TIMEOUT:-300}" \
  "${TRAIN_SCRIPT:-examples/harbor/train.py}" --resume_from_checkpoint auto "$@"
