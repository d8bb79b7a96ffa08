#!/usr/bin/env bash
# The README's first command: set up .venv, then train configs/tiny.yaml under torchrun,
# on 2 CPU processes, or on every GPU when CUDA is present. Extra arguments are config overrides:
#   bash scripts/train.sh train.steps=400 out_dir=runs/longer
# Exit code, for a scheduler: 0 finished or halted; 75 stopped on a signal with its checkpoint
# published (run the same command again to resume); 2 bad input or config; 1 any other failure.
# SIGTERM/SIGINT to this script, to torchrun or to the whole tree all end in the agreed save.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
NPROC="$(python -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 2)')"
CONFIG=configs/tiny.yaml
launch_and_report "$NPROC" "$CONFIG" "$@"
