#!/usr/bin/env bash
# Run all tests: bake the template, lint and validate every option, then run each baked
# project's own tests (real 2-process gloo training on CPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup.sh
export OMP_NUM_THREADS=1
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-4}" --dist loadgroup --durations=15 -m "not alone" "$@"
# Tests that time training (the network tests) last, one at a time: nothing else on the
# machine. Exit status 5: the arguments selected none of them.
.venv/bin/python -m pytest -p no:xdist --durations=5 -m alone "$@" || (( $? == 5 ))
