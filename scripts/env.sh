# Sourced by train.sh and test.sh: create .venv when missing and install requirements.txt into it.
# Reinstalls only when requirements.txt changed (its sha256 is kept in .venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[env] creating .venv with $($PY --version 2>&1)" >&2
  "$PY" -m venv .venv
fi
want="$(sha256sum requirements.txt | cut -d' ' -f1)"
if [ "$(cat .venv/.requirements.sha256 2>/dev/null || true)" != "$want" ]; then
  echo "[env] installing requirements.txt into .venv" >&2
  .venv/bin/python -m pip install --disable-pip-version-check -q -r requirements.txt
  echo "$want" > .venv/.requirements.sha256
fi
export PATH="$ROOT/.venv/bin:$PATH"

# launch_and_report NPROC CONFIG [key=value ...]: torchrun train.py, then exit with the run's own
# outcome read from OUT/status.json (torchrun's status on a signal is its own: 1, or death by signal).
# The caller traps TERM/INT/USR1 from its first line with `trap 'STOP=1; forward' ...` (see
# scripts/train.sh): a stop before torchrun starts ends with 75 there, and one after is passed on.
STOP="${STOP:-0}" PID="" FORWARDED=0
forward() { if [ -n "$PID" ] && [ "$FORWARDED" = 0 ]; then FORWARDED=1; kill -TERM "$PID" 2>/dev/null || true; fi; }
launch_and_report() {
  local nproc="$1" config="$2"; shift 2
  local out rc=0
  out="$(python -m configs --config "$config" "$@" --get out_dir)" || exit $?
  export MINIMIND_LAUNCH_ID="${MINIMIND_LAUNCH_ID:-$(python -c 'import uuid; print(uuid.uuid4().hex)')}"
  if [ "$STOP" = 1 ]; then exit 75; fi  # stopped during set-up: nothing started, nothing lost
  # Bash runs a trap only between foreground commands: torchrun runs in the background, and we wait.
  torchrun --standalone --nproc_per_node="$nproc" train.py --config "$config" "$@" &
  PID=$!
  if [ "$STOP" = 1 ]; then forward; fi  # a signal between the check above and $! being known
  while :; do
    rc=0; wait "$PID" || rc=$?
    kill -0 "$PID" 2>/dev/null || break  # still running: the wait was cut short by a trapped signal
  done
  python -m checkpoint status "$out" --exit-code --launch-id "$MINIMIND_LAUNCH_ID" --fallback "$rc" --stopped "$STOP" >/dev/null
}

# ensure_test_requirements: requirements-test.txt into .venv, and transformers 4.57 beside it
# (--no-deps --target .venv/transformers-4.57, for the export test); each only when its file changed.
ensure_test_requirements() {
  local want want4
  want="$(sha256sum requirements-test.txt | cut -d' ' -f1)"
  if [ "$(cat .venv/.requirements-test.sha256 2>/dev/null || true)" != "$want" ]; then
    echo "[env] installing requirements-test.txt into .venv" >&2
    .venv/bin/python -m pip install --disable-pip-version-check -q -r requirements-test.txt
    echo "$want" > .venv/.requirements-test.sha256
  fi
  want4="$(sha256sum requirements-test-transformers4.txt | cut -d' ' -f1)"
  if [ "$(cat .venv/transformers-4.57/.requirements.sha256 2>/dev/null || true)" != "$want4" ]; then
    echo "[env] installing requirements-test-transformers4.txt into .venv/transformers-4.57" >&2
    rm -rf .venv/transformers-4.57
    .venv/bin/python -m pip install --disable-pip-version-check -q --no-deps --target .venv/transformers-4.57 \
      -r requirements-test-transformers4.txt
    echo "$want4" > .venv/transformers-4.57/.requirements.sha256
  fi
}
