#!/usr/bin/env bash
# The README's second command: set up .venv (requirements.txt, then requirements-test.txt), then run
# the test suite (CPU, gloo). Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
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
exec python -m pytest tests "$@"
