#!/usr/bin/env bash
# The README's second command: set up .venv, then run the test suite (CPU, gloo). Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python -m pytest tests "$@"
