#!/usr/bin/env bash
# Preemption, simulated with real signals: train under torchrun in a session of its own, kill the
# launcher and all its workers N times at random moments, resume each time until the run finishes, then compare the
# result with an uninterrupted reference run (model_sha256 and every logged loss): PASS or FAIL.
#
#   bash scripts/preempt.sh [--kills N] [--signal TERM|KILL|INT|USR1] [--nproc N] [--seed S]
#                           [--max-delay SECONDS] [--during-save] [--out DIR] [key=value ...]
#
#   --kills N        how many times to kill (default 3)
#   --signal SIG     TERM: graceful (the ranks agree, save, exit 75); KILL: hard, no warning (default TERM)
#   --nproc N        processes per launch (default 2)
#   --seed S         seed of the random kill moments (default 0)
#   --max-delay S    a kill lands 0..S seconds after the segment's first new step (default 4)
#   --during-save    kill while a checkpoint is being written (saves are slowed down to make that window)
#   --out DIR        where the two runs go (default runs/preempt)
#   key=value        config overrides for both runs (default: configs/tiny.yaml, 60 steps, a checkpoint every 10)
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

KILLS=3 SIG=TERM NPROC=2 SEED=0 MAX_DELAY=4 DURING_SAVE=0 OUT=runs/preempt
OVERRIDES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --kills) KILLS="$2"; shift 2 ;;
    --signal) SIG="${2#SIG}"; shift 2 ;;
    --nproc) NPROC="$2"; shift 2 ;;
    --seed) SEED="$2"; shift 2 ;;
    --max-delay) MAX_DELAY="$2"; shift 2 ;;
    --during-save) DURING_SAVE=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *=*) OVERRIDES+=("$1"); shift ;;
    *) echo "preempt.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$SIG" in TERM|KILL|INT|USR1) ;; *) echo "preempt.sh: --signal must be TERM, KILL, INT or USR1" >&2; exit 2 ;; esac

ARGS=(--config configs/tiny.yaml train.steps=60 checkpoint.interval=10 log.progress=false "${OVERRIDES[@]}")
REF="$OUT/reference" RUN="$OUT/interrupted"
rm -rf "$REF" "$RUN" "$OUT"/*.log; mkdir -p "$OUT"
RANDOM=$SEED
PGID=""
# torchrun starts each worker in a session of its own, so a signal to the launcher's process group
# does not reach them: a node going away is every process of the tree at once.
descendants() { local p; for p in $(pgrep -P "$1" || true); do echo "$p"; descendants "$p"; done; }
kill_tree() { local pids; pids="$2 $(descendants "$2")"; kill -"$1" $pids 2>/dev/null || true; }
# An EXIT trap that ends in a failed test (an empty PGID) would turn a PASS into exit 1 under set -e: an if, not an &&.
cleanup() { if [ -n "$PGID" ]; then kill_tree KILL "$PGID"; fi; }
trap cleanup EXIT

launch() {  # launch OUT_DIR LOG [SCRIPT]: torchrun in a new session (its own process group)
  local out="$1" log="$2" script="${3:-train.py}"
  setsid torchrun --standalone --nproc_per_node="$NPROC" "$script" "${ARGS[@]}" "out_dir=$out" >>"$log" 2>&1 &
  PGID=$!
}
steps_logged() { [ -f "$1/metrics.jsonl" ] && wc -l <"$1/metrics.jsonl" || echo 0; }

echo "[preempt] reference: torchrun x$NPROC, uninterrupted -> $REF"
launch "$REF" "$OUT/reference.log"
wait "$PGID" || { echo "[preempt] FAIL: the reference run failed, see $OUT/reference.log"; exit 1; }
PGID=""

echo "[preempt] interrupted: $KILLS x SIG$SIG at random moments (seed $SEED) -> $RUN"
landed=0 launches=0
while :; do
  launches=$((launches + 1))
  script=train.py
  # a slow disk (each checkpoint file takes SLOW_SAVE_S longer) opens a window to kill inside a save
  [ "$DURING_SAVE" = 1 ] && [ "$landed" -lt "$KILLS" ] && script=scripts/slow_save_train.py
  before=$(steps_logged "$RUN")
  SLOW_SAVE_S=1 launch "$RUN" "$OUT/interrupted.log" "$script"
  if [ "$landed" -lt "$KILLS" ]; then
    # Wait for this segment to train (or end), then pick the moment.
    while kill -0 "$PGID" 2>/dev/null && [ "$(steps_logged "$RUN")" -le "$before" ]; do sleep 0.05; done
    if [ "$DURING_SAVE" = 1 ]; then
      while kill -0 "$PGID" 2>/dev/null && ! compgen -G "$RUN/checkpoints/.tmp-*" >/dev/null; do sleep 0.02; done
      sleep 0.$((RANDOM % 10))
    else
      delay=$(awk -v r=$RANDOM -v m="$MAX_DELAY" 'BEGIN { printf "%.2f", r / 32767 * m }')
      sleep "$delay"
    fi
    if kill -0 "$PGID" 2>/dev/null; then
      step=$(steps_logged "$RUN")
      saving=$(compgen -G "$RUN/checkpoints/.tmp-*" >/dev/null && echo " while a checkpoint was being written" || true)
      kill_tree "$SIG" "$PGID"
      landed=$((landed + 1))
      echo "[preempt] kill $landed: SIG$SIG to torchrun and its workers at about step $step$saving"
    fi
  fi
  wait "$PGID" 2>/dev/null && rc=0 || rc=$?
  PGID=""
  [ "$rc" = 0 ] && break  # finished (a kill that came too late finds the run done)
  if [ "$launches" -gt $((KILLS + 3)) ]; then echo "[preempt] FAIL: no finished run after $launches launches (see $OUT/interrupted.log)"; exit 1; fi
done

echo "[preempt] $landed kill(s) landed over $launches launches; comparing with the reference"
if python -m checkpoint compare "$REF" "$RUN" >"$OUT/compare.json"; then
  verdict=PASS
else
  verdict=FAIL
fi
python - "$OUT/compare.json" "$verdict" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
print(f"[preempt] {sys.argv[2]}: model_sha256 {c['model_sha256'][0][:16]}... vs {c['model_sha256'][1][:16]}..., "
      f"max |dw| {c['max_abs_weight_diff']:.3g}, {c['logged_steps'][1]} logged losses, max |dloss| {c['max_abs_loss_diff']:.3g}")
PY
[ "$verdict" = PASS ]
