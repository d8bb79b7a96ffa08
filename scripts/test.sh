#!/usr/bin/env bash
# The README's second command: set up .venv (requirements.txt, then the test requirements), then run
# the test suite (CPU, gloo). Extra arguments go to pytest (e.g. -m unit; docs/tests.md).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_test_requirements
# Two workers, whole files each (module fixtures are built once per file); -n 0 runs in this process.
exec python -m pytest tests -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
