#!/usr/bin/env bash
# GPU check for one machine with a GPU: a 1-GPU NCCL run of the generated train.py for each amp
# mode, with and without torch.compile, on a model large enough to be compute-bound. Prints
# samples/s, MFU, peak memory and the share of step time spent waiting for data, and the bf16
# speedup over none. Targets: bf16 >= 1.8x none; MFU >= 40% in bf16; data wait < 5%.
#
#   bash bench/gpu_check.sh                 # renders the template (needs cookiecutter)
#   bash bench/gpu_check.sh PROJECT_DIR     # an already generated project
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
if [[ $# -ge 1 ]]; then
    project=$(cd "$1" && pwd)
else
    out=$(mktemp -d)
    "$python" -m cookiecutter --no-input "$here/.." --output-dir "$out" >/dev/null
    project=$(find "$out" -mindepth 1 -maxdepth 1 -type d)
fi
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check.sh: no CUDA GPU visible')"
runs=$(mktemp -d)
cd "$project"
for compile in false true; do
    for amp in none bf16 fp16; do
        echo "gpu_check.sh: amp=$amp compile=$compile" >&2
        "$python" -m torch.distributed.run --standalone --nproc_per_node=1 train.py \
            --input_dim 1024 --hidden_dim 8192 --num_classes 1024 --batch_size 1024 \
            --train_samples 131072 --val_samples 4096 --epochs 2 --num_workers 4 \
            --amp "$amp" --compile "$compile" --log_every_steps 0 --progress_bar false \
            --resume none --output_dir "$runs/${amp}_${compile}" >"$runs/${amp}_${compile}.log" 2>&1 ||
            { tail -n 30 "$runs/${amp}_${compile}.log" >&2; exit 1; }
    done
done
"$python" - "$runs" <<'PY'
import json, sys
from pathlib import Path

runs = Path(sys.argv[1])
rows = {}
for compile_ in ("false", "true"):
    for amp in ("none", "bf16", "fp16"):
        last = json.loads((runs / f"{amp}_{compile_}" / "metrics.jsonl").read_text().splitlines()[-1])
        wait = last["data_wait_s"] / (last["data_wait_s"] + last["compute_s"])
        rows[amp, compile_] = (last["samples_per_s"], last.get("mfu"), last["peak_memory_mb"], wait)
print("| amp | compile | samples/s | MFU | peak memory (MB) | data wait | speedup vs none |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for (amp, compile_), (speed, mfu, memory, wait) in rows.items():
    speedup = speed / rows["none", compile_][0]
    mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
    print(f"| {amp} | {compile_} | {speed:.0f} | {mfu_text} | {memory:.0f} | {100 * wait:.1f}% | {speedup:.2f}x |")
PY
