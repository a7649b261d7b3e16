#!/usr/bin/env bash
# Render the template with its defaults into demo/ and train it with 2 CPU processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup.sh
rm -rf demo
.venv/bin/cookiecutter --no-input . --output-dir demo
project=$(find demo -mindepth 1 -maxdepth 1 -type d | head -n 1)
echo "rendered $project; training 2 processes on CPU (gloo)"
cd "$project"
PATH="$OLDPWD/.venv/bin:$PATH" OMP_NUM_THREADS=1 NPROC_PER_NODE=2 scripts/launch.sh --epochs 4
