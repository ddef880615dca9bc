#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. This is what CI runs (.ci/run).
# pytest's own exit code is kept: 5 ("no tests collected") fails the run too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash examples/setup_env.sh
source examples/env.sh
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"
