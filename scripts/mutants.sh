#!/usr/bin/env bash
# Deliberate breaks of the core promises, one at a time in a temporary copy of the repository, each
# caught by a test (docs/design.md I21; the list and the test that catches each: docs/tests.md).
#   bash scripts/mutants.sh            # every mutant; exit 0 only when all are caught
#   bash scripts/mutants.sh --list     # what they are
#   bash scripts/mutants.sh --only rng-not-restored skip-off-by-one
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_test_requirements
exec python scripts/mutants.py "$@"
