#!/usr/bin/env bash
# The README's second command: set up .venv (requirements.txt, then the test requirements), then run
# the test suite (CPU, gloo). Extra arguments go to pytest (e.g. -m unit; docs/tests.md).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_test_requirements
# CI also checks the oldest supported torch (tests/test_torch_range.py runs launches on it; docs/tests.md).
if [ "${CI:-}" = true ] || [ "${MINIMIND_OLDEST_TORCH:-}" = 1 ]; then ensure_oldest_torch; fi
# Three workers, test by test, an idle worker taking queued tests from a busy one (a module's
# fixtures are built on each worker that runs its tests); PYTEST_WORKERS=0 runs in this process.
# Three on two cores: much of a launch is waiting (a slowed disk, a rendezvous, Slurm's
# scheduler), so a third worker fills the idle core (docs/tests.md).
# Under CI=true the generated matrix and the docs test join the suite unless -m chooses (pytest.ini
# leaves them out of a plain run here: they add about 20 minutes on two cores; docs/tests.md).
if [ "${CI:-}" = true ] && [[ " $* " != *" -m "* ]]; then set -- -m "" "$@"; fi
unset PYTHONDONTWRITEBYTECODE  # the repository's own modules compiled once, not at every launch
exec python -m pytest tests -n "${PYTEST_WORKERS:-3}" --dist worksteal "$@"
