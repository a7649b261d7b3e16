#!/usr/bin/env bash
# Run all tests: bake the template, lint and validate every option, then run each baked
# project's own tests (real 2-process gloo training on CPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup.sh
export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-4}" --dist loadgroup --durations=15 "$@"
