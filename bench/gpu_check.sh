#!/usr/bin/env bash
# GPU check for one machine with a GPU, run by hand where one is lent (CI has none). Prints one
# table per part and exits non-zero if a check fails:
#   1. throughput: a 1-GPU NCCL run of the generated train.py for each amp mode, with and
#      without torch.compile, on an MLP large enough to be compute-bound: samples/s, MFU,
#      peak memory, data-wait share, bf16 speedup over none. Targets: bf16 >= 1.8x none;
#      MFU >= 40% in bf16; data wait < 5%.
#   2. one visible GPU that is not device 0: LOCAL_RANK=1 with one GPU trains (on cuda:0).
#   3. no host sync in steady state: bf16 steps under torch.cuda.set_sync_debug_mode("error").
#   4. NCCL's flight recorder writes a dump when a collective times out.
#   5. the preflight's predicted step time is within +-25% of the measured bf16 step.
#   6. the language task: a GPT big enough to be compute-bound (12 layers x 768, 1024-token
#      context) in bf16 with torch.compile: tokens/s and MFU. Target: MFU >= 40% on H100/H200.
#   7. the same GPT under --strategy fsdp (1 process, NCCL, bf16 MixedPrecisionPolicy, compile,
#      asynchronous sharded checkpoints, then export.py): tokens/s, MFU and peak memory beside
#      check 6's ddp run. Target: tokens/s >= 0.9x ddp (with one GPU nothing is sharded: this
#      checks the code path on CUDA and its overhead, not the memory saving).
#   8. --profile_steps on CUDA: the Chrome trace holds GPU kernels and the CUDA memory snapshot
#      loads with its segments; fp16 log lines carry grad_norm and loss_scale.
#   9. SIGTERM to torchrun during training with 4 DataLoader workers: the checkpoint is written
#      (no "DataLoader worker ... killed"), and the resumed run ends where an uninterrupted one
#      does (max relative parameter difference; GPU kernels need not be bit-reproducible).
#  10. AdamW fused=True (what the project uses on CUDA) against unfused, the GPT of check 6
#      without compile: tokens/s of each, the same loss.
#  11. Synchronised batch norm kernels: a ResNet's forward and backward with every BatchNorm
#      through torch.nn.SyncBatchNorm's function against the hand-written one, one GPU (a group
#      of one: this compares the kernels, not the communication): images/s. Then the vision
#      task trains on the GPU with torch's SyncBatchNorm layers (one process: they fall back to
#      plain batch norm; synchronisation over several GPUs is not checked on one).
#  12. --compile true --activation_checkpointing true under ddp and under fsdp: they run, and
#      their tokens/s.
#  13. The preflight names the network NCCL chose (NCCL_DEBUG=INFO's "Using network" line).
#  14. Where a bf16 step of the GPT of check 10 goes (bench/breakdown.py's parts, from a trace of
#      steps 21-40 through bench/profiled.py) and the share of those steps the GPU is idle;
#      the table prints after the checks.
#  15. doctor.py on each task with a GPU visible: no FAIL, and its steady-state forward and
#      backward under torch.cuda.set_sync_debug_mode("warn") PASS (no host sync in model.py
#      or the loss).
#
# The GPU machine has no cookiecutter (and no network): render the three tasks' projects here,
# send them with the repository, and point the script at them there:
#
#   bash bench/gpu_check.sh --bake DIR             # here: DIR/tabular, DIR/language, DIR/vision
#   bash bench/gpu_check.sh DIR                    # there: every check on DIR's projects
#   CHECKS="1 5 14" bash bench/gpu_check.sh DIR    # only these (a device call has 10 minutes)
#   bash bench/gpu_check.sh                        # renders them first (needs cookiecutter)
#
# Where OUT is set (the device tool's folder), every run's log and metrics, the doctor's reports
# and the breakdown's table are packed into $OUT/gpu_check_logs.tgz at the end, whatever happened.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
bake_all() {  # bake_all DIR: the generated project of each task in DIR/<task>/ (rendered afresh)
    for task in tabular language vision; do
        rm -rf "${1:?}/$task"
        "$python" -m cookiecutter --no-input "$here/.." --output-dir "$1/$task" task="$task" >&2
    done
}
if [[ ${1:-} == --bake ]]; then
    [[ $# -eq 2 ]] || { echo "usage: bash bench/gpu_check.sh --bake DIR" >&2; exit 2; }
    mkdir -p "$2"
    bake_all "$2"
    echo "gpu_check.sh: the projects are in $2/tabular, $2/language and $2/vision"
    exit 0
fi
if [[ $# -ge 1 ]]; then
    baked=$(cd "$1" && pwd)
else
    baked=$(mktemp -d)
    bake_all "$baked"
fi
project_of() {  # project_of TASK: the generated project in $baked/TASK/
    local dir
    dir=$(find "$baked/$1" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | head -n 1) || true
    [[ -f $dir/train.py ]] || { echo "gpu_check.sh: no generated project in $baked/$1/ (make them with --bake DIR)" >&2; exit 2; }
    echo "$dir"
}
project=$(project_of tabular)
language=$(project_of language)
vision=$(project_of vision)
for n in ${CHECKS:-}; do
    [[ $n =~ ^([1-9]|1[0-5])$ ]] || { echo "gpu_check.sh: CHECKS='$CHECKS': each must be a check number, 1 to 15, space-separated" >&2; exit 2; }
done
want() {  # want N...: whether any of these checks is selected (CHECKS="1 5"; all when unset)
    local n
    for n in "$@"; do [[ -z ${CHECKS:-} || " $CHECKS " == *" $n "* ]] && return 0; done
    return 1
}
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check.sh: no CUDA GPU visible')"
runs=$(mktemp -d)
pack_logs() {
    [[ -n ${OUT:-} ]] || return 0
    (cd "$runs" && find . \( -name '*.log' -o -name '*.md' -o -name metrics.jsonl -o -name doctor.json \) -print0 |
        tar czf "$OUT/gpu_check_logs.tgz" --null -T -) || true
}
trap pack_logs EXIT
cd "$project"
failed=0
check() {  # check NAME CONDITION_TEXT: prints a row, remembers a failure
    if [[ $2 == ok* ]]; then echo "| $1 | $2 |"; else echo "| $1 | FAILED: $2 |"; failed=1; fi
}
# Blobs: labels made without the synthetic task's teacher network (minutes of CPU at this size).
MLP=(--input_dim 1024 --hidden_dim 8192 --num_classes 1024 --batch_size 1024 --train_samples 131072
    --val_samples 4096 --dataset blobs --num_workers 4 --log_every_steps 0 --progress_bar false --resume none)
# The language task's GPT big enough to be compute-bound: 120 compiled steps for checks 6 and 7,
# 60 without compile for checks 10, 12 and 14.
GPT_MODEL=(--data_dir "$runs/text" --block_size 1024 --n_layer 12 --n_head 12 --n_embd 768 --batch_size 16 --amp bf16
    --val_samples 64 --log_every_steps 0 --progress_bar false --resume none)
GPT_COMPILED=("${GPT_MODEL[@]}" --compile true --max_steps 120 --eval_every_steps 60)
GPT=("${GPT_MODEL[@]}" --max_steps 60 --eval_every_steps 30)
mlp_run() {  # mlp_run AMP COMPILE: check 1's run, metrics in $runs/AMP_COMPILE; status 0 if it trained
    echo "gpu_check.sh: amp=$1 compile=$2" >&2
    "$python" -m torch.distributed.run --standalone --nproc_per_node=1 train.py "${MLP[@]}" --epochs 2 \
        --amp "$1" --compile "$2" --output_dir "$runs/$1_$2" >"$runs/$1_$2.log" 2>&1 ||
        { tail -n 30 "$runs/$1_$2.log" >&2; return 1; }
}
if want 6 7 10 12 14 15; then
    (cd "$language" && "$python" prepare_data.py --output_dir "$runs/text" >"$runs/prepare.log" 2>&1) ||
        echo "gpu_check.sh: the language task's text could not be written: $runs/prepare.log" >&2
fi
if want 11 15; then
    (cd "$vision" && "$python" prepare_data.py --output_dir "$runs/digits" >"$runs/digits.log" 2>&1) ||
        echo "gpu_check.sh: the vision task's digits could not be written (scikit-learn?): $runs/digits.log" >&2
fi

# --- 1. throughput --------------------------------------------------------------------------
failed_runs=()
if want 1; then
for compile in false true; do
    for amp in none bf16 fp16; do
        mlp_run "$amp" "$compile" || failed_runs+=("${amp}_$compile")
    done
done
"$python" - "$runs" <<'PY' || echo "gpu_check.sh: the throughput table failed (see the traceback above)" >&2
import json, sys
from pathlib import Path

runs = Path(sys.argv[1])
rows = {}
for compile_ in ("false", "true"):
    for amp in ("none", "bf16", "fp16"):
        path = runs / f"{amp}_{compile_}" / "metrics.jsonl"
        if not path.exists():
            continue  # that run failed: its row says so
        last = json.loads(path.read_text().splitlines()[-1])
        wait = last["data_wait_s"] / (last["data_wait_s"] + last["compute_s"])
        rows[amp, compile_] = (last["samples_per_s"], last.get("mfu"), last["peak_memory_mb"], wait)
print("| amp | compile | samples/s | MFU | peak memory (MB) | data wait | speedup vs none |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for (amp, compile_), (speed, mfu, memory, wait) in rows.items():
    speedup = f"{speed / rows['none', compile_][0]:.2f}x" if ("none", compile_) in rows else "n/a"
    mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
    print(f"| {amp} | {compile_} | {speed:.0f} | {mfu_text} | {memory:.0f} | {100 * wait:.1f}% | {speedup} |")
PY
echo
fi
echo "| check | result |"
echo "| --- | --- |"
for name in "${failed_runs[@]}"; do check "throughput run $name" "failed: $runs/$name.log"; done

# --- 2. a process whose only GPU is not device 0 ----------------------------------------------
if want 2; then
visible=${CUDA_VISIBLE_DEVICES:-0}
if CUDA_VISIBLE_DEVICES=${visible%%,*} RANK=0 LOCAL_RANK=1 WORLD_SIZE=1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
    MASTER_PORT=29531 "$python" train.py --epochs 1 --train_samples 8192 --amp bf16 --resume none \
    --output_dir "$runs/local_rank1" >"$runs/local_rank1.log" 2>&1; then
    check "LOCAL_RANK=1, one visible GPU, trains" "ok ($(grep -o 'val_accuracy [0-9.]*' "$runs/local_rank1.log" | tail -n 1))"
else
    check "LOCAL_RANK=1, one visible GPU, trains" "$(tail -n 3 "$runs/local_rank1.log" | tr '\n' ' ')"
fi
fi

# --- 3. no host sync in steady-state bf16 steps -----------------------------------------------
if want 3; then
# From the 4th step of each epoch until the loop's end, any synchronizing CUDA call raises.
if "$python" - "${MLP[@]}" --epochs 2 --amp bf16 --output_dir "$runs/sync" >"$runs/sync.log" 2>&1 <<'PY'
import sys
import torch
sys.path.insert(0, ".")
import train

train_step, settle = train.Trainer.train_step, train.Trainer.settle
checked = []

def checked_train_step(self, *args, **kwargs):
    if self.step >= 3 and self.batches_done >= 3:
        torch.cuda.set_sync_debug_mode("error")
        checked.append(self.step)
    return train_step(self, *args, **kwargs)

def unchecked_settle(self):
    torch.cuda.set_sync_debug_mode(0)  # the epoch's end: evaluation and checkpoints may sync
    return settle(self)

train.Trainer.train_step, train.Trainer.settle = checked_train_step, unchecked_settle
code = train.main(sys.argv[1:])
print(f"SYNC_CHECKED_STEPS {len(set(checked))}")
sys.exit(code)
PY
then
    check "steady-state bf16 steps under set_sync_debug_mode(\"error\")" "ok ($(grep -o 'SYNC_CHECKED_STEPS [0-9]*' "$runs/sync.log" | cut -d' ' -f2) steps, no sync)"
else
    check "steady-state bf16 steps under set_sync_debug_mode(\"error\")" "$(grep -m1 -i 'synchroniz' "$runs/sync.log" || tail -n 3 "$runs/sync.log" | tr '\n' ' ')"
fi
fi

# --- 4. the flight recorder dumps on a collective timeout -------------------------------------
if want 4; then
# One rank: a long GPU sleep queued before an all-reduce keeps it from finishing within the
# 5 s timeout; NCCL's watchdog times it out and dumps the trace, then ends the process.
rm -rf "$runs/trace"
"$python" - "$runs/trace" >"$runs/trace.log" 2>&1 <<'PY' || true
import sys, time
import torch
import torch.distributed as dist
sys.path.insert(0, ".")
from ddp_utils.dist import setup_distributed

ctx = setup_distributed(timeout_seconds=5, trace_dir=sys.argv[1])
value = torch.ones(1024, device=ctx.device)
dist.all_reduce(value)
torch.cuda.synchronize()
torch.cuda._sleep(50_000_000_000)  # ~25 s of GPU clock cycles
dist.all_reduce(value)
time.sleep(60)  # the watchdog times the all-reduce out and dumps meanwhile
PY
if ls "$runs/trace"/rank_* >/dev/null 2>&1; then
    # The dump is a pickle: its "entries" are the recorded collectives ("nccl:all_reduce").
    entries=$("$python" -c "
import glob, pickle, sys
dumps = [pickle.load(open(path, 'rb')) for path in glob.glob(sys.argv[1] + '/rank_*')]
print(sum(entry['profiling_name'] == 'nccl:all_reduce' for dump in dumps for entry in dump['entries']))
" "$runs/trace" 2>/dev/null) || entries="?"
    check "flight recorder dump on a collective timeout" "ok ($(ls "$runs/trace" | tr '\n' ' ')with $entries all-reduce entries)"
else
    check "flight recorder dump on a collective timeout" "no dump in $runs/trace: $(tail -n 2 "$runs/trace.log" | tr '\n' ' ')"
fi
fi

# --- 5. the preflight's prediction against the measured step ----------------------------------
if want 5 13; then
# Check 13 reads this preflight's log too.
"$python" -m torch.distributed.run --standalone --nproc_per_node=1 preflight.py "${MLP[@]}" --amp bf16 \
    >"$runs/preflight.log" 2>&1 || true
fi
if want 5; then
[[ -f $runs/bf16_false/metrics.jsonl ]] || mlp_run bf16 false || true  # check 1's bf16 run, when 1 was not run
predicted_ms=$(grep -o 'compute [0-9.]* ms' "$runs/preflight.log" | head -n 1 | cut -d' ' -f2) || predicted_ms=
measured_ms=$("$python" -c "
import json, sys
last = json.loads(open('$runs/bf16_false/metrics.jsonl').read().splitlines()[-1])
print(1000 * 1024 / last['samples_per_s'])  # one step of the global batch (1024) at the steady rate
" 2>/dev/null) || measured_ms=
if [[ -z $measured_ms ]]; then
    check "preflight predicted bf16 step vs measured" "no measured step: $runs/bf16_false.log"
elif [[ -n $predicted_ms ]]; then
    ratio=$("$python" -c "print(f'{$predicted_ms / $measured_ms:.2f}')")
    verdict=$("$python" -c "print('ok' if 0.75 <= $predicted_ms / $measured_ms <= 1.25 else 'off')")
    check "preflight predicted bf16 step vs measured" "$verdict (predicted $predicted_ms ms, measured $(printf '%.2f' "$measured_ms") ms, ratio $ratio)"
else
    check "preflight predicted bf16 step vs measured" "no prediction: $(tail -n 3 "$runs/preflight.log" | tr '\n' ' ')"
fi
fi

# --- 6. the language task: bf16 tokens/s and MFU on a compute-bound GPT ------------------------
if want 6 7; then  # check 7 compares its run with this one
if (cd "$language" && "$python" -m torch.distributed.run --standalone --nproc_per_node=1 train.py \
    "${GPT_COMPILED[@]}" --output_dir "$runs/gpt" >"$runs/gpt.log" 2>&1); then
    gpt=$("$python" -c "
import json
last = json.loads(open('$runs/gpt/metrics.jsonl').read().splitlines()[-1])
print(f\"{last['tokens_per_s']:.0f} tokens/s, MFU {100 * last.get('mfu', 0):.1f}%, peak {last['peak_memory_mb']:.0f} MB\")
ok = last.get('mfu', 0) >= 0.40
print('ok' if ok else 'below 40%')
" 2>&1) || gpt=$'no metrics\nthe run wrote no metrics line: see gpt.log'
    verdict=$(echo "$gpt" | tail -n 1)
    check "GPT 12x768, 1024 tokens, bf16, compile: MFU >= 40%" "$( [[ $verdict == ok ]] && echo ok || echo "$verdict" ) ($(echo "$gpt" | head -n 1))"
else
    check "GPT 12x768, 1024 tokens, bf16, compile: MFU >= 40%" "$(tail -n 3 "$runs/gpt.log" | tr '\n' ' ')"
fi
fi

# --- 7. the same GPT under --strategy fsdp ----------------------------------------------------
if want 7; then
if (cd "$language" && "$python" -m torch.distributed.run --standalone --nproc_per_node=1 train.py \
    "${GPT_COMPILED[@]}" --strategy fsdp --async_checkpoint true --checkpoint_every_steps 60 \
    --output_dir "$runs/gpt_fsdp" >"$runs/gpt_fsdp.log" 2>&1) &&
    (cd "$language" && "$python" export.py "$runs/gpt_fsdp/checkpoints/last" "$runs/gpt_fsdp.pt" >>"$runs/gpt_fsdp.log" 2>&1); then
    fsdp=$("$python" -c "
import json
ddp = json.loads(open('$runs/gpt/metrics.jsonl').read().splitlines()[-1])
fsdp = json.loads(open('$runs/gpt_fsdp/metrics.jsonl').read().splitlines()[-1])
ratio = fsdp['tokens_per_s'] / ddp['tokens_per_s']
print(f\"{fsdp['tokens_per_s']:.0f} tokens/s ({ratio:.2f}x ddp), MFU {100 * fsdp.get('mfu', 0):.1f}%, \"
      f\"peak {fsdp['peak_memory_mb']:.0f} MB (ddp {ddp['peak_memory_mb']:.0f} MB)\")
print('ok' if ratio >= 0.9 else 'below 0.9x ddp')
" 2>&1) || fsdp=$'no comparison\nno metrics of this run or of check 6 (the ddp run): see gpt.log, gpt_fsdp.log'
    verdict=$(echo "$fsdp" | tail -n 1)
    check "GPT 12x768 --strategy fsdp, bf16, compile: >= 0.9x ddp" "$( [[ $verdict == ok ]] && echo ok || echo "$verdict" ) ($(echo "$fsdp" | head -n 1))"
else
    check "GPT 12x768 --strategy fsdp, bf16, compile: >= 0.9x ddp" "$(tail -n 3 "$runs/gpt_fsdp.log" | tr '\n' ' ')"
fi
fi

# --- 8. --profile_steps on CUDA: kernels in the trace, a memory snapshot --------------------------
if want 8; then
if (cd "$project" && "$python" -m torch.distributed.run --standalone --nproc_per_node=1 train.py "${MLP[@]}" \
    --max_steps 8 --amp fp16 --log_every_steps 2 --profile_steps 4:5 --progress_bar false --resume none \
    --output_dir "$runs/profile" >"$runs/profile.log" 2>&1); then
    profiled=$("$python" -c "
import json, pickle
trace = json.load(open('$runs/profile/profile/trace_steps_4-5.json'))['traceEvents']
kernels = sum(1 for e in trace if e.get('cat') == 'kernel')
snapshot = pickle.load(open('$runs/profile/profile/memory_steps_4-5.pickle', 'rb'))
print(f\"{kernels} GPU kernels, {len(snapshot['segments'])} memory segments\")
print('ok' if kernels > 0 and snapshot['segments'] else 'empty')
" 2>&1) || profiled=$'no trace or snapshot\nno trace or memory snapshot to read: see profile.log'
    scale_lines=$(grep -c 'grad_norm [0-9.e+-]* loss_scale' "$runs/profile.log" || true)
    verdict=$(echo "$profiled" | tail -n 1)
    [[ $verdict == ok && $scale_lines -ge 4 ]] || verdict="$verdict, $scale_lines fp16 log lines with loss_scale"
    check "--profile_steps 4:5 on CUDA: trace kernels, memory snapshot" "$verdict ($(echo "$profiled" | head -n 1))"
else
    check "--profile_steps 4:5 on CUDA: trace kernels, memory snapshot" "$(tail -n 3 "$runs/profile.log" | tr '\n' ' ')"
fi
fi

# --- 9. SIGTERM with 4 DataLoader workers: checkpoint written, resume where it would have been ---
if want 9; then
SIGTERM_RUN=(--input_dim 256 --hidden_dim 2048 --num_classes 64 --batch_size 256 --train_samples 65536 --val_samples 4096
    --input_noise_std 0.1 --num_workers 4 --epochs 2 --checkpoint_every_steps 50 --log_every_steps 0 --amp bf16
    --progress_bar false)
"$python" -m torch.distributed.run --standalone --nproc_per_node=1 train.py "${SIGTERM_RUN[@]}" --resume none \
    --output_dir "$runs/whole" >"$runs/whole.log" 2>&1 || true
"$python" -m torch.distributed.run --standalone --nproc_per_node=1 train.py "${SIGTERM_RUN[@]}" \
    --output_dir "$runs/stopped" >"$runs/stopped.log" 2>&1 &
torchrun_pid=$!
for _ in $(seq 600); do [[ -e $runs/stopped/checkpoints/step_000000100.pt ]] && break; sleep 0.1; done
kill -TERM "$torchrun_pid" 2>/dev/null || true
wait "$torchrun_pid" || true
"$python" -m torch.distributed.run --standalone --nproc_per_node=1 train.py "${SIGTERM_RUN[@]}" \
    --output_dir "$runs/stopped" >"$runs/resumed.log" 2>&1 || true
sigterm=$("$python" - "$runs" <<'PY'
import sys
from pathlib import Path
import torch

runs = Path(sys.argv[1])
stopped = (runs / "stopped.log").read_text()
if "stopped by SIGTERM" not in stopped or "killed by signal" in stopped:
    print(f"no preemption checkpoint: {stopped.strip().splitlines()[-1:]}")
    sys.exit()
if "resumed from" not in (runs / "resumed.log").read_text():
    print("did not resume")
    sys.exit()
try:
    ours = torch.load(runs / "stopped/checkpoints/last.pt", map_location="cpu", weights_only=True)["model"]
    theirs = torch.load(runs / "whole/checkpoints/last.pt", map_location="cpu", weights_only=True)["model"]
except Exception as error:  # a run that failed: say so in the row
    print(f"no final checkpoint to compare ({type(error).__name__}: {error})")
    sys.exit()
worst = max(((ours[k].float() - theirs[k].float()).norm() / theirs[k].float().norm().clamp_min(1e-12)).item() for k in theirs)
print(f"{'ok' if worst < 1e-3 else 'differs'} (stopped and resumed, max relative parameter difference {worst:.1e})")
PY
) || sigterm="the comparison failed: see $runs/whole.log, stopped.log, resumed.log"
check "SIGTERM with 4 DataLoader workers: checkpoint, resume" "$sigterm"
fi

# --- 10. fused AdamW against unfused ----------------------------------------------------------
if want 10; then
for fused in true false; do
    (cd "$language" && "$python" - "${GPT[@]}" --output_dir "$runs/adamw_$fused" "$fused" >"$runs/adamw_$fused.log" 2>&1 <<'PY'
import sys
import torch
sys.path.insert(0, ".")
from ddp_utils import optim
import train

fused = sys.argv.pop() == "true"
build = optim.build_optimizer

def build_optimizer(model, cfg, device):
    optimizer = build(model, cfg, device)
    for group in optimizer.param_groups:
        group["fused"] = fused
        group["foreach"] = None if fused else True
    return optimizer

train.build_optimizer = build_optimizer
sys.exit(train.main(sys.argv[1:]))
PY
    ) || true
done
adamw=$("$python" - "$runs" <<'PY'
import json, sys
from pathlib import Path

runs = Path(sys.argv[1])
try:
    fused, plain = (json.loads((runs / f"adamw_{f}/metrics.jsonl").read_text().splitlines()[-1]) for f in ("true", "false"))
    ratio = fused["tokens_per_s"] / plain["tokens_per_s"]
    same = abs(fused["val_loss"] - plain["val_loss"]) <= 0.02 * plain["val_loss"]
except (OSError, IndexError, KeyError, ValueError) as error:
    print(f"a run failed ({type(error).__name__}: {error}; see adamw_true.log, adamw_false.log)")
    sys.exit()
verdict = "ok" if ratio >= 1.0 and same else ("slower" if ratio < 1.0 else "other loss")
print(f"{verdict} (fused {fused['tokens_per_s']:.0f} tokens/s, unfused {plain['tokens_per_s']:.0f}: {ratio:.2f}x; "
      f"val_loss {fused['val_loss']:.4f} vs {plain['val_loss']:.4f})")
PY
) || adamw="the comparison failed"
check "AdamW fused=True against unfused, GPT 12x768 bf16" "$adamw"
fi

# --- 11. torch.nn.SyncBatchNorm's kernels against the hand-written ones ------------------------
if want 11; then
syncbn=$(cd "$vision" && "$python" - 2>"$runs/syncbn.log" <<'PY'
import os, sys, time
import torch
import torch.distributed as dist
from torch import nn
sys.path.insert(0, ".")
import model as vision

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
torch.cuda.set_device(0)

class TorchKernels(nn.BatchNorm2d):
    """Every training forward through torch's SyncBatchNorm function (a group of one)."""
    def forward(self, x):
        self.num_batches_tracked += 1
        return torch.nn.modules._functions.SyncBatchNorm.apply(
            x, self.weight, self.bias, self.running_mean, self.running_var, self.eps, self.momentum,
            dist.group.WORLD, 1)

class HandWritten(nn.BatchNorm2d):
    def forward(self, x):
        self.num_batches_tracked += 1
        return vision._SyncBatchNorm.apply(x, self.weight, self.bias, self.running_mean, self.running_var,
                                           self.momentum, self.eps)

def swap(module, cls):
    for name, child in module.named_children():
        if type(child) is nn.BatchNorm2d:
            setattr(module, name, cls(child.num_features).cuda())
        else:
            swap(child, cls)
    return module

images = torch.randn(256, 3, 64, 64, device="cuda")
rates = {}
for cls in (TorchKernels, HandWritten):
    net = swap(vision.ResNet(100, 64, 2), cls).cuda().to(memory_format=torch.channels_last)
    for step in range(25):
        if step == 5:
            torch.cuda.synchronize(); started = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            net(images).float().sum().backward()
    torch.cuda.synchronize()
    rates[cls.__name__] = 20 * len(images) / (time.perf_counter() - started)
ratio = rates["TorchKernels"] / rates["HandWritten"]
verdict = "ok" if ratio >= 1.0 else "slower"
print(f"{verdict} (torch.nn.SyncBatchNorm {rates['TorchKernels']:.0f} images/s, hand-written {rates['HandWritten']:.0f}: {ratio:.2f}x)")
dist.destroy_process_group()
PY
) || syncbn="failed: $(tail -n 2 "$runs/syncbn.log" | tr '\n' ' ')"
check "SyncBatchNorm kernels: torch's against the hand-written, ResNet bf16" "${syncbn:-no output}"
if (cd "$vision" && "$python" -m torch.distributed.run --standalone --nproc_per_node=1 train.py --data_dir "$runs/digits" \
    --epochs 2 --image_size 32 --amp bf16 --progress_bar false --resume none --output_dir "$runs/vision" \
    >"$runs/vision.log" 2>&1); then
    check "vision task on the GPU (torch's SyncBatchNorm layers)" "ok ($(grep -o 'val_accuracy [0-9.]*' "$runs/vision.log" | tail -n 1))"
else
    check "vision task on the GPU (torch's SyncBatchNorm layers)" "$(tail -n 3 "$runs/vision.log" | tr '\n' ' ')"
fi
fi

# --- 12. compile with activation checkpointing, under ddp and fsdp -----------------------------
if want 12; then
for strategy in ddp fsdp; do
    if (cd "$language" && "$python" -m torch.distributed.run --standalone --nproc_per_node=1 train.py "${GPT[@]}" \
        --compile true --activation_checkpointing true --strategy "$strategy" --output_dir "$runs/ac_$strategy" \
        >"$runs/ac_$strategy.log" 2>&1); then
        tokens=$("$python" -c "import json; print(round(json.loads(open('$runs/ac_$strategy/metrics.jsonl').read().splitlines()[-1])['tokens_per_s']))") ||
            tokens="no metrics line"
        check "--compile true --activation_checkpointing true, $strategy" "ok ($tokens tokens/s)"
    else
        check "--compile true --activation_checkpointing true, $strategy" "$(tail -n 3 "$runs/ac_$strategy.log" | tr '\n' ' ')"
    fi
done
fi

# --- 13. the network NCCL chose ---------------------------------------------------------------
if want 13; then
network=$(grep -o 'NCCL network: .*' "$runs/preflight.log" | head -n 1) || network=  # check 5's preflight
if [[ -n $network ]]; then
    check "preflight: the network NCCL chose" "ok ($network)"
else
    check "preflight: the network NCCL chose" "no line: $(tail -n 2 "$runs/preflight.log" | tr '\n' ' ')"
fi
fi

# --- 14. where a bf16 step goes, and the GPU's idle share --------------------------------------
if want 14; then
if (cd "$language" && "$python" -m torch.distributed.run --standalone --nproc_per_node=1 "$here/profiled.py" train.py \
    "${GPT[@]}" --max_steps 45 --eval_every_steps 0 --profile_steps 21:40 --output_dir "$runs/breakdown" \
    >"$runs/breakdown.log" 2>&1) &&
    "$python" "$here/breakdown.py" --trace "$runs/breakdown/profile/trace_steps_21-40.json" >"$runs/breakdown.md" 2>&1; then
    idle=$(grep -o 'GPU idle share | [0-9.]*' "$runs/breakdown.md" | grep -o '[0-9.]*$' || echo 100)
    verdict=$("$python" -c "print('ok' if $idle < 5 else 'above the 5% target')")
    check "step breakdown, GPT 12x768 bf16, steps 21-40: GPU idle < 5%" "$verdict (GPU idle $idle% of the steps; table below)"
    echo
    cat "$runs/breakdown.md"
else
    check "step breakdown, GPT 12x768 bf16, steps 21-40: GPU idle < 5%" "$(tail -n 3 "$runs/breakdown.log" "$runs/breakdown.md" 2>/dev/null | tr '\n' ' ')"
fi
fi

# --- 15. the doctor with a GPU: no FAIL, no host sync in a steady-state step --------------------
if want 15; then
for name in tabular language vision; do
    case $name in
        tabular) task_dir=$project data=() ;;
        language) task_dir=$language data=(--data_dir "$runs/text") ;;
        vision) task_dir=$vision data=(--data_dir "$runs/digits") ;;
    esac
    code=0
    (cd "$task_dir" && "$python" doctor.py "${data[@]}" --amp bf16 --output_dir "$runs/doctor_$name") \
        >"$runs/doctor_$name.log" 2>&1 || code=$?
    row=$(grep -o '| host syncs on the GPU | [A-Z]* | [^|]*' "$runs/doctor_$name.log" || echo "no GPU row")
    if [[ $code == 0 && $row == *"| PASS |"* ]]; then
        check "doctor.py with a GPU, $name task" "ok (${row#| host syncs on the GPU | PASS | })"
    else
        check "doctor.py with a GPU, $name task" "exit $code: $row; $(grep -c '| FAIL |' "$runs/doctor_$name.log") FAIL rows"
    fi
done
fi

exit $failed
