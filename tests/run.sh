#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. This is what CI runs (.ci/run).
# pytest's own exit code is kept: 5 ("no tests collected") fails the run too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash examples/setup_env.sh
source examples/env.sh
# --durations: the slowest tests in every log, to keep the run under its 30-minute budget.
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider --durations=15 "$@"
