#!/usr/bin/env bash
# Render the template with its defaults (the language task) into demo/, prepare text (the
# Python standard library's own source), train a small GPT with 2 CPU processes (gloo), and
# print a sample of what it learned.
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup.sh
rm -rf demo
.venv/bin/cookiecutter --no-input . --output-dir demo
project=$(find demo -mindepth 1 -maxdepth 1 -type d | head -n 1)
cd "$project"
export PATH="$OLDPWD/.venv/bin:$PATH" OMP_NUM_THREADS=1
python prepare_data.py
echo "rendered $project; training a small GPT with 2 processes on CPU (gloo)"
# The project's quick CPU experiment (experiments/quick_cpu.toml: 600 steps of a 2-layer GPT).
NNODES=1 NPROC_PER_NODE=2 scripts/launch.sh --config experiments/quick_cpu.toml
echo "a sample from the trained model:"
python sample.py --checkpoint runs/quick_cpu/checkpoints/last.pt --prompt "def " --max_new_tokens 300 --seed 0
