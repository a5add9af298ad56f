#!/usr/bin/env bash
# The one command for a lent GPU machine (the device tool's `run`): its image has torch with CUDA, accelerate and
# peft but an older transformers and no hf_dist, so this installs what `make gpu-wheels` put in .whl/ (carried with
# the call) into /tmp/site, runs bench/gpu_check.py from this checkout, and leaves the table and the whole log in
# $OUT (the device tool's folder that comes back; ./gpu_out where it is unset).
#
#   here:       make gpu-wheels
#   device run: command "bash bench/gpu_session.sh", carry [".whl"], timeout_s 600
#
# GPU_CHECK_ARGS: more arguments for bench/gpu_check.py (tests/test_gpu_check.py passes --cpu-smoke);
# GPU_CHECK_TIMEOUT: seconds before the check is stopped (default 540, inside the device's 600 a call).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
"$PYTHON" -c "import torch, transformers, accelerate, peft; print('torch', torch.__version__, '| cuda',
torch.cuda.is_available(), '| transformers', transformers.__version__, '| accelerate', accelerate.__version__,
'| peft', peft.__version__)" 2>&1 | tee "$OUT/versions.txt" || exit 1
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
    | tee -a "$OUT/versions.txt"
# shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of arguments
timeout "${GPU_CHECK_TIMEOUT:-540}" "$PYTHON" bench/gpu_check.py --out "$OUT/gpu_check.md" ${GPU_CHECK_ARGS:-} 2>&1 \
    | tee "$OUT/gpu_check.log"
