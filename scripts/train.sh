#!/usr/bin/env bash
# The README's first command: set up .venv, then train under torchrun, on 2 CPU processes, or on
# every GPU when CUDA is present. Options first: --config FILE (default configs/tiny.yaml), --nproc N
# (processes, default: one per GPU, or 2); then config overrides; --help lists every key:
#   bash scripts/train.sh train.steps=400 out_dir=runs/longer
#   bash scripts/train.sh --config configs/minimind2_small.yaml out_dir=runs/small
#   bash scripts/train.sh --nproc 3 dist.reduce=canonical train.global_batch=48 out_dir=runs/demo
# The run's outcome is the last line (torchrun's summary of failed workers is one line above it;
# a finished run's greedy sample reply, log.sample_prompt, is the line above it).
# Exit code, for a scheduler (common/outcome.py's table, the one place it is decided): 0 finished or
# halted; 75 stopped on a signal (its checkpoint published, or stopped before anything was under way:
# nothing lost either way; run the same command again to resume); 2 bad input or config; 1 failure.
# SIGTERM/SIGINT/SIGUSR1 to this script, to torchrun or to the whole tree, at any moment from the
# first line of this script on, end in the agreed save (or, before the run is under way, in nothing
# to save), and in 75. TRAIN_PY (default train.py) is for the tests' doubles of train.py.
code() { python3 "$(dirname "${BASH_SOURCE[0]}")/../common/outcome.py" "$1"; }  # the table (no .venv needed)
STOP=0 PID="" FORWARDED=0
forward() { if [ -n "$PID" ] && [ "$FORWARDED" = 0 ]; then FORWARDED=1; kill -TERM "$PID" 2>/dev/null || true; fi; }
trap 'STOP=1; forward' TERM INT USR1
# A stop before the launch (during the venv set-up or the config check) ends here with 75, even
# when the same signal killed the command that was running then.
trap 'if [ "$STOP" = 1 ] && [ -z "$PID" ]; then echo "[train.sh] stopped before the run started: nothing lost; exit $(code stopped) (run the same command again)" >&2; exit "$(code stopped)"; fi' EXIT
CONFIG=configs/tiny.yaml NPROC=gpus-or-2 HELP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --config) [ -n "${2:-}" ] || { echo "scripts/train.sh: --config needs a file" >&2; exit "$(code bad_input)"; }
              CONFIG="$2"; shift 2 ;;
    --nproc) [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || { echo "scripts/train.sh: --nproc needs a number of processes, got '${2:-}'" >&2
                                                  exit "$(code bad_input)"; }
             NPROC="$2"; shift 2 ;;
    *) break ;;
  esac
done
for arg in "$@"; do case "$arg" in -h|--help) HELP=1 ;; esac; done
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
if [ "$HELP" = 1 ]; then  # once, in this process: not a launch of one help per rank
  sed -n '2,/^code()/{/^code()/d;s/^# \{0,1\}//;p}' "$0"
  echo
  exec python "${TRAIN_PY:-train.py}" --help
fi
OUT="$(python -m configs --config "$CONFIG" "$@" --get out_dir)" || exit $?
export MINIMIND_LAUNCH_ID="${MINIMIND_LAUNCH_ID:-$(cat /proc/sys/kernel/random/uuid)}"
if [ "$STOP" = 1 ]; then exit "$(code stopped)"; fi  # stopped during set-up: nothing started, nothing lost
# torchrun through runtime/launch.py, whose exit code says when a signal stopped it (128 + the
# signal). Bash runs a trap only between foreground commands: it runs in the background, and we wait.
python -m runtime.launch --standalone --nproc_per_node="$NPROC" "${TRAIN_PY:-train.py}" --config "$CONFIG" "$@" &
PID=$!
if [ "$STOP" = 1 ]; then forward; fi  # a signal between the check above and $! being known
RC=0
while :; do
  RC=0; wait "$PID" || RC=$?
  kill -0 "$PID" 2>/dev/null || break  # still running: the wait was cut short by a trapped signal
done
# The run's recorded outcome decides, and its one line is printed last; without one, the launcher's
# code (a signal: stopped; 2: refused before the run kept a folder).
# A run that ended with 0 says what its model now says first (log.sample_prompt; "" for none).
python -m checkpoint status "$OUT" --exit-code --sample --launch-id "$MINIMIND_LAUNCH_ID" --fallback "$RC" --stopped "$STOP" >/dev/null
