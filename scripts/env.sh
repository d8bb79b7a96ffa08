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
