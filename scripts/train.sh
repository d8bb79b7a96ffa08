#!/usr/bin/env bash
# The README's first command: set up .venv, then train configs/tiny.yaml under torchrun,
# on 2 CPU processes, or on every GPU when CUDA is present. Extra arguments are config overrides:
#   bash scripts/train.sh train.steps=400 out_dir=runs/longer
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
NPROC="$(python -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 2)')"
exec torchrun --standalone --nproc_per_node="$NPROC" train.py --config configs/tiny.yaml "$@"
