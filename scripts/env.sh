# Sourced by train.sh, test.sh and preempt.sh: create .venv when missing and install requirements.txt
# into it. Reinstalls only when requirements.txt changed (its sha256 is kept in .venv).
# MINIMIND_VENV=DIR uses that virtual environment instead of .venv (the tests pass their own when they
# run the scripts from a copy of the repository: scripts/mutants.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="${MINIMIND_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[env] creating $VENV with $($PY --version 2>&1)" >&2
  "$PY" -m venv "$VENV"
fi
want="$(sha256sum requirements.txt | cut -d' ' -f1)"
if [ "$(cat "$VENV/.requirements.sha256" 2>/dev/null || true)" != "$want" ]; then
  echo "[env] installing requirements.txt into $VENV" >&2
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q -r requirements.txt
  echo "$want" > "$VENV/.requirements.sha256"
fi
export PATH="$VENV/bin:$PATH"

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

# ensure_oldest_torch: the oldest torch of the supported range (requirements-torch-oldest.txt, its smallest
# CPU-usable install) in .venv/torch-oldest with the rest of requirements.txt, for tests/test_torch_range.py;
# only when the file changed. scripts/test.sh calls it under CI=true (or MINIMIND_OLDEST_TORCH=1): about 3.5 GB
# to download and 5.7 GB on disk (docs/tests.md).
ensure_oldest_torch() {
  local want dir=.venv/torch-oldest
  want="$(cat requirements-torch-oldest.txt requirements.txt | sha256sum | cut -d' ' -f1)"
  if [ "$(cat "$dir/.requirements.sha256" 2>/dev/null || true)" != "$want" ]; then
    echo "[env] installing requirements-torch-oldest.txt into $dir" >&2
    rm -rf "$dir"
    "$PY" -m venv "$dir"
    "$dir/bin/python" -m pip install --disable-pip-version-check -q --no-deps -r requirements-torch-oldest.txt
    grep -v '^torch==' requirements.txt > "$dir/requirements-rest.txt"
    "$dir/bin/python" -m pip install --disable-pip-version-check -q -r "$dir/requirements-rest.txt"
    echo "$want" > "$dir/.requirements.sha256"
  fi
}
