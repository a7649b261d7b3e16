#!/usr/bin/env bash
# Mutation check of the generated project's tests (not CI; see dev/mutants.py). Arguments go
# to dev/mutants.py: mutant names, --repeat N, --list.
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup.sh
export OMP_NUM_THREADS=1
exec .venv/bin/python dev/mutants.py "$@"
