#!/usr/bin/env bash
# The GPU check, prepared to run once on a lent GPU machine (under 5 minutes on one GPU):
#   bash scripts/gpu_check.sh            # on a machine with CUDA
#   bash scripts/gpu_check.sh --cpu-dry-run   # the same plan, shrunk, on a CPU: checks the script
# It uses the python that has torch with CUDA (the GPU machine's own, torch with CUDA, no package
# registry there), or this checkout's .venv when that one sees a GPU. Prints one table; writes
# gpu_check.json and launches.log into $OUT (or runs/gpu_check).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && { [ "${1:-}" = "--cpu-dry-run" ] || .venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; }; then
  PY=.venv/bin/python
fi
"$PY" -c 'import torch, numpy, yaml, tqdm' || { echo "gpu_check: $PY lacks torch/numpy/pyyaml/tqdm" >&2; exit 2; }
exec "$PY" scripts/gpu_check.py "$@"
