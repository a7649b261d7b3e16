#!/usr/bin/env bash
# Benchmark the generated train.py against a minimal DDP loop (see bench/run.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup.sh
exec .venv/bin/python bench/run.py "$@"
