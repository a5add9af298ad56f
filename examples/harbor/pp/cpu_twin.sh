#!/usr/bin/env bash
# The CPU twin of the 13B pipeline-parallel recipe: the same script and flags, 2 processes on one machine,
# pipeline parallel over 2 stages (pp=2, dp=1, 1F1B, 64 micro-batches of 1 sequence per step), then the same
# run in one process; prints both eval losses, which match (the pipeline computes the same global-batch loss).
#
#   bash examples/harbor/pp/cpu_twin.sh            # 40 steps (the tiny preset)
#   MAX_STEPS=4 bash examples/harbor/pp/cpu_twin.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
STEPS="${MAX_STEPS:-40}"
OUT="${OUT:-runs/harbor-tiny-pp}"

echo "== tiny preset, pipeline parallel: 2 processes, --pp_size 2 =="
accelerate launch --multi_gpu --num_processes 2 examples/harbor/train.py \
  --preset tiny --pp_size 2 --pp_schedule 1f1b --max_steps "$STEPS" --output_dir "$OUT/pp2"

echo "== tiny preset, one process (the reference) =="
python examples/harbor/train.py --preset tiny --max_steps "$STEPS" --output_dir "$OUT/single"

python - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {name: json.loads((out / name / "summary.json").read_text()) for name in ("pp2", "single")}
for name, s in runs.items():
    print(f"{name:>7}: eval perplexity {s['perplexity_before']:.4f} -> {s['perplexity_after']:.4f}, "
          f"train_loss {s['train_loss']:.6f}, layout {s['layout']}")
gap = abs(runs["pp2"]["perplexity_after"] - runs["single"]["perplexity_after"]) / runs["single"]["perplexity_after"]
print(f"relative eval-perplexity gap after training: {gap:.2e}")
PY
