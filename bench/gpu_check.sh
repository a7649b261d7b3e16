#!/usr/bin/env bash
# shellcheck disable=SC2317  # the check_N functions are called as "check_$one"
# GPU check for one machine with a GPU, run by hand where one is lent (CI has none). Each check
# runs under its own time limit (a hang costs that check, not the command) and writes its rows
# to a result table as it finishes; the script exits non-zero unless every selected check ran
# and passed. Targets that are goals (MFU, speedups) are printed beside the figures, not failed.
#
# The GPU machine has no cookiecutter (and no network): render the three tasks' projects and
# their data here, send them with the repository, and point the script at them there:
#
#   bash bench/gpu_check.sh --bake DIR           # here: DIR/{tabular,language,vision}, DIR/data
#   PLAN=1a bash bench/gpu_check.sh DIR          # there: the checks of plan 1a (a 6-minute command)
#   AC_BENCH_ARGS=--tiny GPU_CHECK_RUNS=$(mktemp -d) GPU_CHECK_RESULTS=/dev/null GPU_CHECK_TEXT=DIR/data/text \
#       bash bench/gpu_check.sh --one 23 DIR     # here, no GPU: check 23's path at --tiny sizes (24 too)
#   CHECKS="3 17" bash bench/gpu_check.sh DIR    # there: only these, in this order
#   bash bench/gpu_check.sh --plans              # the plans: checks, estimated and limit seconds
#   bash bench/gpu_check.sh                      # every check; renders the projects first
#
# A plan is sized for one device command of 6 minutes: 1a then 1b (one loan: the guarantees on
# a GPU), 2a, 2b and 3a (a later loan: the rest), 4a then 4b (one loan: issue 55's speed), 5a then 5b
# (one loan: issue 63's activation checkpointing). Its BUDGET_S (330 s) bounds the command:
# a check starts only while its estimate fits in what is left, and runs at most to the end of
# the budget. BENCHMARKS.md (GPU section) has the exact device commands.
#
# Where OUT is set (the device tool's folder), $OUT/gpu_check_results.txt gets each row as it is
# written and $OUT/gpu_check_logs.tgz every log, rewritten after each check (only 8 files come
# back from $OUT). The "s" column is the check's seconds when the row was written.
#
# The checks (number, what; the plan table below has each one's plan and seconds):
#   0. always: the GPU's name, torch's version and the peak ddp_utils/observe/flops.py matches for MFU.
#   1. throughput: a 1-GPU NCCL run of train.py per amp mode, with and without torch.compile, on
#      a compute-bound MLP: samples/s, MFU, peak memory, data-wait share, speedup over none.
#      Targets: bf16 >= 1.8x none (1.5x compiled); MFU >= 40% in bf16; data wait < 5%.
#   2. one visible GPU that is not device 0: LOCAL_RANK=1 with one GPU trains (on cuda:0).
#   3. no host sync: steady-state training steps in bf16 and in fp16 under
#      torch.cuda.set_sync_debug_mode("error"); evaluation under "warn": no sync between its
#      batches (only before the first forward and after the last).
#   4. NCCL's flight recorder writes a dump when a collective times out.
#   5. the preflight's predicted step time against the measured bf16 step (target +-25%).
#   6. the language task's GPT (12 layers x 768, 1024-token context, 64 windows a micro-step: the
#      anchors' 64 x 1024 tokens) in bf16 with torch.compile: steady-state tokens/s and MFU (the
#      median of its metrics periods after the first). Target: MFU >= 40% on H100/H200.
#   7. the same GPT under --strategy fsdp (1 process, bf16 MixedPrecisionPolicy, each block
#      compiled, an asynchronous DCP checkpoint at step 30, then export.py): steady-state tokens/s
#      (the periods without a save) beside check 6's ddp run, and what the save cost the period
#      it fell in (its blocking copy, checkpoint_s, and the slower steps while it was written).
#      Target: steady state >= 0.9x ddp.
#   8. --profile_steps on CUDA: kernels in the trace, a memory snapshot; fp16 log lines carry
#      grad_norm and loss_scale.
#   9. SIGTERM to torchrun during training with 4 DataLoader workers: the checkpoint is written
#      (no "DataLoader worker ... killed"), and the resumed run ends where an uninterrupted one
#      does (max relative parameter difference < 1e-3).
#  10. AdamW fused=True against unfused on check 6's GPT without compile, 16 windows a micro-step:
#      tokens/s (target: fused faster); the validation loss of unfused twice (the same seed: the
#      run-to-run spread of the GPU's kernels) sets the tolerance for fused's (3x the spread, at
#      least 0.1%).
#  11. torch.nn.SyncBatchNorm's kernels against the hand-written ones (a group of one GPU):
#      images/s (target: torch's faster); then the vision task trains on the GPU.
#  12. --compile true --activation_checkpointing true under ddp and under fsdp: they run; tokens/s.
#  13. the preflight names the network NCCL chose (its "NCCL network:" line).
#  14. where a compiled bf16 step of check 6's GPT goes (bench/breakdown.py's parts of steps
#      21-40) and the share of those steps the GPU is idle (target < 5%); the table is
#      breakdown.md in the logs. bench/profiled.py and breakdown.py beside this script (--bake
#      copies bench/ into DIR/bench, so a bake carries the scripts it was made with).
#  15. doctor.py on each task with a GPU visible: no FAIL (its CPU checks build the model for the
#      CPU: the vision task's batch norm, FSDP2's mesh), and its steady-state forward and
#      backward under torch.cuda.set_sync_debug_mode("warn") PASS.
#  16. fsdp on the device the run was given: 1 process on the GPU trains; --device cpu with 2
#      gloo processes trains on the CPU while torch's accelerator is cuda.
#  17. after a run with --tf32 true, torch.get_float32_matmul_precision() and
#      torch.backends.cuda.matmul.allow_tf32 read without "mix of the legacy and new APIs" (and
#      after set_tf32(False)); inductor's max-autotune compiles an fp32 matmul afterwards.
#  18. fsdp with --grad_accum_steps 4: after a micro-step that does not step the optimizer every
#      parameter already holds its sharded gradient (reduce-scattered each micro-step, so no
#      unsharded gradient is held); peak memory of accum 4 and accum 1 printed. With one GPU a
#      shard is the whole gradient, so the peaks alone cannot show the saving.
#  19. CUDA_VISIBLE_DEVICES=one GPU, 2 local ranks: the preflight fails, naming the shared GPU
#      before NCCL's "Duplicate GPU detected".
#  20. --optimizer muon on the GPU (Newton-Schulz in bf16; whole matrices gathered under fsdp,
#      NCCL): a GPT 6x512 for 300 steps with AdamW, Muon, and Muon under fsdp, each at its
#      defaults (--lr, --muon_lr): validation loss by step and tokens/s (plan 3a).
#  21. Muon's step on check 6's GPT (compiled, bf16, its Newton-Schulz batched by shape and
#      compiled): steady-state tokens/s against check 6's AdamW. Target >= 0.85x.
#   5 (diagnosis). the preflight's timing of the same MLP step done again in one process, as it
#      does it, then with 10x the warm-up and the sample, then on batches already on the GPU:
#      which of them moves the prediction to the measured step.
#  22. a real CUDA out-of-memory (check 6's GPT at --batch_size 1024: hundreds of GB of
#      activations): the run stops with one line naming the rank, step 1, the phase, the GPU's
#      memory in use and total and the knobs; no worker traceback; the folder claim let go of.
#  23. --activation_checkpointing (issue 63), check 6's GPT in bf16 without compile, per mode (none,
#      full, every_other, ops): the largest micro-batch that trains (doubling from 64, then halving
#      the gap to 1/8; two steps a size; out of memory caught), the activations at 64 against the
#      doctor's memory plan (target within 20%); before them --strategy fsdp without and with
#      --cpu_offload: step time and peak memory. bench/activation_checkpointing_gpu.py --part offload,search.
#  24. the same modes on check 6's job compiled (--compile true): tokens/s, peak memory
#      (max_memory_allocated), the activations measured against the doctor's plan (target within
#      20%); full at most 1/3 of none's activations at no more than 1.4x its step time (targets).
#      bench/activation_checkpointing_gpu.py --part steady. Both run the doctor's plan per mode on
#      the CPU beside the GPU's work (kept in /tmp/activation_checkpointing_doctor for the next).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
self="$here/gpu_check.sh"
python=${PYTHON:-python3}

# number  plan  estimated-s  limit-s  title. A plan runs its checks in this order. The estimates
# are not timings (no GPU has run this yet): ~15 s a launch (torch, CUDA, NCCL), ~60-90 s a cold
# inductor compile of the 12x768 GPT, the doctor's CPU seconds measured on a 2-core CPU machine.
plan_table() {
    cat <<'EOF'
2   1a  20   60   a process whose only GPU is not device 0 trains
3   1a  50   120  no host sync: bf16 and fp16 steps, evaluation
4   1a  20   60   flight recorder dump on a collective timeout
9   1a  60   120  SIGTERM with 4 DataLoader workers: checkpoint, resume
16  1a  40   90   fsdp on the run's device (GPU; --device cpu)
17  1a  35   90   TF32 on: both precision APIs readable afterwards
19  1a  20   60   the preflight names one GPU shared by 2 local ranks
18  1a  45   100  fsdp --grad_accum_steps 4: sharded gradients each micro-step
15  1b  60   150  doctor.py on each task with a GPU visible
13  2a  5    60   preflight: the network NCCL chose
8   2a  25   60   --profile_steps on CUDA: trace kernels, memory snapshot
11  2a  40   120  SyncBatchNorm kernels; the vision task on the GPU
12  2b  230  300  compile + activation checkpointing, ddp and fsdp
20  3a  100  220  --optimizer muon on the GPU: GPT 6x512 bf16, AdamW against Muon (ddp, fsdp)
22  3a  30   90   a real CUDA out of memory (GPT 12x768, batch 1024): one line, the claim let go of
6   4a  110  200  GPT 12x768 64x1024 bf16 compile, ddp: steady tokens/s, MFU
7   4a  150  240  GPT 12x768 64x1024 bf16 per-block compile, fsdp, async DCP, export
21  4a  50   120  Muon's step on the GPT 12x768 64x1024 against AdamW's
1   4b  130  240  throughput: amp x compile on an MLP
5   4b  45   120  preflight predicted bf16 step vs measured, and why
14  4b  90   180  step breakdown of the compiled GPT and the GPU's idle share
10  4b  60   150  AdamW fused against unfused, and the run-to-run spread
23  5a  200  320  activation checkpointing: largest micro-batch per mode (eager), --cpu_offload's step
24  5b  240  330  activation checkpointing per mode, GPT 12x768 64x1024 bf16 compile: tokens/s, peak, the doctor
EOF
}

declare -A EST LIMIT TITLE PLAN_CHECKS
while read -r n plan est limit title; do
    EST[$n]=$est LIMIT[$n]=$limit TITLE[$n]=$title
    PLAN_CHECKS[$plan]="${PLAN_CHECKS[$plan]:-}${PLAN_CHECKS[$plan]:+ }$n"
done < <(plan_table)
PLANS="1a 1b 2a 2b 3a 4a 4b 5a 5b"

if [[ ${1:-} == --plans ]]; then
    echo "| plan | checks, in order | estimated s | limits s |"
    echo "| --- | --- | --- | --- |"
    for plan in $PLANS; do
        est=0 lim=0
        for n in ${PLAN_CHECKS[$plan]}; do est=$((est + EST[$n])) lim=$((lim + LIMIT[$n])); done
        echo "| $plan | ${PLAN_CHECKS[$plan]} | $est | $lim |"
    done
    exit 0
fi

bake_all() {  # bake_all DIR: each task's project in DIR/<task>/ (rendered afresh) and their data in DIR/data/
    for task in tabular language vision; do
        rm -rf "${1:?}/$task"
        "$python" -m cookiecutter --no-input "$here/.." --output-dir "$1/$task" task="$task" >&2
    done
    rm -rf "$1/data"
    # 4 MB of text (8 MB of uint16 tokens: the carried folder has 64 MiB) and the digits (needs
    # scikit-learn here; the GPU image has it too, and makes them there when they are missing).
    (cd "$1"/language/*/ && "$python" prepare_data.py --output_dir "$1/data/text" --max_bytes 4000000 >&2) ||
        echo "gpu_check.sh: the language task's text was not written: the GPU machine makes it" >&2
    (cd "$1"/vision/*/ && "$python" prepare_data.py --output_dir "$1/data/digits" >&2) ||
        echo "gpu_check.sh: the vision task's digits were not written: the GPU machine makes them" >&2
}
if [[ ${1:-} == --bake ]]; then
    [[ $# -eq 2 ]] || { echo "usage: bash bench/gpu_check.sh --bake DIR" >&2; exit 2; }
    mkdir -p "$2"
    dir=$(cd "$2" && pwd)
    bake_all "$dir"
    # The scripts too, as they are now: a bake run later with its own gpu_check.sh finds its helpers.
    mkdir -p "$dir/bench"
    cp "$here"/*.py "$here/gpu_check.sh" "$dir/bench/"
    echo "gpu_check.sh: the projects are in $2/tabular, $2/language and $2/vision, their data in $2/data, the scripts in $2/bench"
    exit 0
fi
one=
if [[ ${1:-} == --one ]]; then  # internal: --one N DIR, one check, run by this script under its limit
    one=$2
    shift 2
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

# --- one check (the script runs itself with --one N under the check's time limit) -------------
if [[ -n $one ]]; then
runs=${GPU_CHECK_RUNS:?} results=${GPU_CHECK_RESULTS:?}
started=${GPU_CHECK_STARTED:-$(date +%s)} deadline=${GPU_CHECK_DEADLINE:-$(( $(date +%s) + 3600 ))}
text=${GPU_CHECK_TEXT:-$runs/text} digits=${GPU_CHECK_DIGITS:-$runs/digits}
failed=0
check() {  # check NAME CONDITION_TEXT: a row of the table (stdout and the results file); remembers a failure
    local row
    if [[ $2 == ok* ]]; then row="| $one. $1 | $2 | $(( $(date +%s) - started )) |"; else
        row="| $one. $1 | FAILED: $2 | $(( $(date +%s) - started )) |"; failed=1; fi
    echo "$row"
    echo "$row" >>"$results"
}
target() {  # target CONDITION: "met" or "NOT met" (a goal: printed, never a failure)
    if "$python" -c "import sys; sys.exit(0 if ($1) else 1)" 2>/dev/null; then echo met; else echo "NOT met"; fi
}
left() {  # seconds left to this check, less a margin for writing its rows
    local s=$(( deadline - $(date +%s) - 8 ))
    echo $(( s > 1 ? s : 1 ))
}
last_metrics() {  # last_metrics FILE EXPR: EXPR over the last metrics.jsonl line `m` (empty on error)
    "$python" -c "
import json, sys
m = json.loads(open(sys.argv[1]).read().splitlines()[-1])
print($2)" "$1" 2>/dev/null || true
}
tail_text() { tail -n "${2:-3}" "$1" 2>/dev/null | tr '\n' ' ' | cut -c1-400; }
cd "$project"
# Blobs: labels made without the synthetic task's teacher network (minutes of CPU at this size).
MLP=(--input_dim 1024 --hidden_dim 8192 --num_classes 1024 --batch_size 1024 --train_samples 65536
    --val_samples 4096 --dataset blobs --num_workers 4 --log_every_steps 0 --progress_bar false --resume none)
SMALL=(--train_samples 8192 --val_samples 1024 --max_steps 20 --log_every_steps 0 --progress_bar false --resume none)
# The language task's GPT big enough to be compute-bound, at the anchors' 64 x 1024 tokens a
# micro-step (nanochat, the speedrun, llm.c): 60 compiled steps for checks 6, 7, 14 and 21, a
# metrics line every 10 (steady state: the median of the periods after the first, whose first
# step compiles), 60 without compile for checks 10 and 12.
GPT_MODEL=(--data_dir "$text" --block_size 1024 --n_layer 12 --n_head 12 --n_embd 768 --batch_size 64 --amp bf16
    --val_samples 64 --log_every_steps 0 --progress_bar false --resume none)
GPT_COMPILED=("${GPT_MODEL[@]}" --compile true --max_steps 60 --eval_every_steps 10)
GPT=("${GPT_MODEL[@]}" --max_steps 60 --eval_every_steps 30)
steady() {  # steady DIR [STEPS...]: the median tokens/s, MFU and peak of a run's metrics periods after the first (or those ending at STEPS), as JSON
    "$python" - "$@" <<'PY'
import json, statistics, sys
from pathlib import Path

lines = [json.loads(line) for line in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines()]
steps = {int(step) for step in sys.argv[2:]}
chosen = [m for m in lines[1:] if not steps or m["step"] in steps]
print(json.dumps({"tokens_per_s": statistics.median(m["tokens_per_s"] for m in chosen),
                  "mfu": statistics.median(m.get("mfu", 0.0) for m in chosen),
                  "peak_memory_mb": max(m["peak_memory_mb"] for m in chosen), "periods": len(chosen)}))
PY
}
torchrun1=("$python" -m torch.distributed.run --standalone --nproc_per_node=1)
mlp_run() {  # mlp_run AMP COMPILE: check 1's run, metrics in $runs/AMP_COMPILE; status 0 if it trained
    "${torchrun1[@]}" train.py "${MLP[@]}" --epochs 2 --amp "$1" --compile "$2" --output_dir "$runs/$1_$2" \
        >"$runs/$1_$2.log" 2>&1
}
preflight_run() {  # the MLP's preflight (checks 5 and 13), once
    [[ -f $runs/preflight.log ]] && return 0
    "${torchrun1[@]}" preflight.py "${MLP[@]}" --amp bf16 >"$runs/preflight.log" 2>&1 || true
}

check_1() {
    local amp compile row
    for compile in false true; do
        for amp in none bf16 fp16; do
            if ! mlp_run "$amp" "$compile"; then
                check "throughput amp=$amp compile=$compile" "$(tail_text "$runs/${amp}_$compile.log")"
                continue
            fi
            row=$("$python" - "$runs" "$amp" "$compile" <<'PY' 2>&1
import json, sys
from pathlib import Path

runs, amp, compile_ = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def last(name):
    path = runs / name / "metrics.jsonl"
    return json.loads(path.read_text().splitlines()[-1]) if path.exists() else None
m, none = last(f"{amp}_{compile_}"), last(f"none_{compile_}")
wait = m["data_wait_s"] / (m["data_wait_s"] + m["compute_s"])
speedup = m["samples_per_s"] / none["samples_per_s"] if none else None
mfu = m.get("mfu")
text = (f"{m['samples_per_s']:.0f} samples/s, MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}, "
        f"peak {m['peak_memory_mb']:.0f} MB, data wait {100 * wait:.1f}%")
if amp != "none":
    text += f", {speedup:.2f}x none" if speedup else ", no none run to compare"
goals = [("data wait < 5%", wait < 0.05)]
if amp == "bf16":
    target = 1.5 if compile_ == "true" else 1.8  # compiled: issue 55's target for the one-gather loader
    goals += [(f"bf16 >= {target}x none", bool(speedup and speedup >= target)), ("MFU >= 40%", bool(mfu and mfu >= 0.40))]
print(f"ok ({text}; targets: " + ", ".join(f"{g} {'met' if ok else 'NOT met'}" for g, ok in goals) + ")")
PY
            ) || row="no metrics line: $(tail_text "$runs/${amp}_$compile.log")"
            check "throughput amp=$amp compile=$compile" "$row"
        done
    done
}

check_2() {
    local visible=${CUDA_VISIBLE_DEVICES:-0}
    if CUDA_VISIBLE_DEVICES=${visible%%,*} RANK=0 LOCAL_RANK=1 WORLD_SIZE=1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=29531 "$python" train.py "${SMALL[@]}" --amp bf16 --output_dir "$runs/local_rank1" \
        >"$runs/local_rank1.log" 2>&1; then
        check "LOCAL_RANK=1, one visible GPU, trains" "ok ($(grep -o 'val_accuracy [0-9.]*' "$runs/local_rank1.log" | tail -n 1))"
    else
        check "LOCAL_RANK=1, one visible GPU, trains" "$(tail_text "$runs/local_rank1.log")"
    fi
}

check_3() {
    # Training: from the 4th step of each epoch until the loop's end, any synchronizing CUDA
    # call raises. Evaluation: every sync is recorded (mode "warn") with how many of its
    # forwards were done; a sync after the first forward and before the last is a sync per batch.
    local amp code
    for amp in bf16 fp16; do
        code=0
        "$python" - "${MLP[@]}" --train_samples 32768 --epochs 2 --amp "$amp" --output_dir "$runs/sync_$amp" \
            >"$runs/sync_$amp.log" 2>&1 <<'PY' || code=$?
import sys, traceback, warnings
import torch
sys.path.insert(0, ".")
from ddp_utils.train import run
from ddp_utils.train.trainer import Trainer
from task import TASK

train_step, read_agreement, evaluate = Trainer.train_step, Trainer.read_agreement, Trainer.evaluate
checked, evaluations = [], []

def checked_train_step(self, *args, **kwargs):
    if self.step >= 3 and self.batches_done >= 3:
        torch.cuda.set_sync_debug_mode("error")
        checked.append(self.step)
    return train_step(self, *args, **kwargs)

def unchecked_read_agreement(self):
    torch.cuda.set_sync_debug_mode(0)  # the epoch's end or a checkpoint: they may sync
    return read_agreement(self)

def checked_evaluate(self):
    forwards, syncs = [0], []
    def count(*_):
        forwards[0] += 1
    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing CUDA operation" in str(message):  # not the mode's own first note
            syncs.append((forwards[0], "".join(traceback.format_stack(limit=6)[:-1])))
    hook = self.strategy.module.register_forward_hook(count)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return evaluate(self)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            hook.remove()
            evaluations.append((forwards[0], syncs))

Trainer.train_step, Trainer.read_agreement, Trainer.evaluate = checked_train_step, unchecked_read_agreement, checked_evaluate
code = run.main(TASK, sys.argv[1:])
print(f"SYNC_CHECKED_STEPS {len(set(checked))}")
for batches, syncs in evaluations:
    between = [where for done, where in syncs if 1 <= done < batches]
    before = sum(done == 0 for done, _ in syncs)
    print(f"EVAL_SYNCS batches {batches} before {before} between {len(between)} after {len(syncs) - before - len(between)}")
    for where in between[:2]:  # where the first ones were
        print("".join(f"EVAL_SYNC_BETWEEN_BATCHES {line}\n" for line in where.splitlines()), end="")
sys.exit(code)
PY
        local log=$runs/sync_$amp.log steps
        steps=$(grep -o 'SYNC_CHECKED_STEPS [0-9]*' "$log" | cut -d' ' -f2) || true
        if [[ $code == 0 && -n $steps && $steps -gt 0 ]]; then
            check "steady-state $amp steps under set_sync_debug_mode(\"error\")" "ok ($steps steps, no sync)"
        else
            check "steady-state $amp steps under set_sync_debug_mode(\"error\")" "exit $code: $(grep -v '^EVAL' "$log" | grep -m1 -i 'synchroniz' || tail_text "$log")"
        fi
        local evals bad
        evals=$(grep '^EVAL_SYNCS' "$log" | cut -d' ' -f2- | tr '\n' ';') || true
        bad=$(grep -c '^EVAL_SYNCS batches [0-9]* before [0-9]* between [1-9]' "$log") || true
        if [[ -z $evals ]]; then
            check "$amp evaluation: no host sync between batches" "no evaluation recorded: $(tail_text "$log")"
        elif [[ $bad -gt 0 ]] || grep -q '^EVAL_SYNCS batches [0-2] ' "$log"; then
            check "$amp evaluation: no host sync between batches" "per evaluation: $evals (fewer than 3 batches, or syncs between them: $log)"
        else
            check "$amp evaluation: no host sync between batches" "ok (per evaluation: $evals)"
        fi
    done
}

check_4() {
    # One rank: a long GPU sleep queued before an all-reduce keeps it from finishing within the
    # 5 s timeout; NCCL's watchdog times it out and dumps the trace, then ends the process.
    rm -rf "$runs/trace"
    "$python" - "$runs/trace" >"$runs/trace.log" 2>&1 <<'PY' || true
import glob, os, sys, time
import torch
import torch.distributed as dist
sys.path.insert(0, ".")
from ddp_utils.distributed.process_group import setup_distributed

ctx = setup_distributed(timeout_seconds=5, trace_dir=sys.argv[1])
value = torch.ones(1024, device=ctx.device)
dist.all_reduce(value)
torch.cuda.synchronize()
torch.cuda._sleep(50_000_000_000)  # ~25 s of GPU clock cycles
dist.all_reduce(value)
for _ in range(400):  # the watchdog times the all-reduce out and dumps meanwhile (or ends us)
    if glob.glob(sys.argv[1] + "/rank_*"):
        time.sleep(2)  # the dump finishes writing
        break
    time.sleep(0.1)
print("gpu_check: leaving", flush=True)
os._exit(0)
PY
    if ls "$runs/trace"/rank_* >/dev/null 2>&1; then
        # The dump is a pickle: its "entries" are the recorded collectives ("nccl:all_reduce").
        local entries
        entries=$("$python" -c "
import glob, pickle, sys
dumps = [pickle.load(open(path, 'rb')) for path in glob.glob(sys.argv[1] + '/rank_*')]
print(sum(entry['profiling_name'] == 'nccl:all_reduce' for dump in dumps for entry in dump['entries']))
" "$runs/trace" 2>/dev/null) || entries="?"
        check "flight recorder dump on a collective timeout" "ok ($(ls "$runs/trace" | tr '\n' ' ')with $entries all-reduce entries)"
    else
        check "flight recorder dump on a collective timeout" "no dump in $runs/trace: $(tail_text "$runs/trace.log" 2)"
    fi
}

check_5() {
    preflight_run
    [[ -f $runs/bf16_false/metrics.jsonl ]] || mlp_run bf16 false || true  # check 1's bf16 run, when 1 did not run
    local predicted_ms measured_ms diagnosis
    predicted_ms=$(grep -o 'compute [0-9.]* ms' "$runs/preflight.log" | head -n 1 | cut -d' ' -f2) || predicted_ms=
    measured_ms=$(last_metrics "$runs/bf16_false/metrics.jsonl" "1000 * 1024 / m['samples_per_s']")  # one global batch (1024)
    if [[ -z $measured_ms ]]; then
        check "preflight predicted bf16 step vs measured" "no measured step: $(tail_text "$runs/bf16_false.log")"
    elif [[ -n $predicted_ms ]]; then
        check "preflight predicted bf16 step vs measured" "ok (predicted $predicted_ms ms, measured $(printf '%.2f' "$measured_ms") ms, ratio $("$python" -c "print(f'{$predicted_ms / $measured_ms:.2f}')"); target +-25%: $(target "0.75 <= $predicted_ms / $measured_ms <= 1.25"))"
    else
        check "preflight predicted bf16 step vs measured" "no prediction: $(tail_text "$runs/preflight.log")"
    fi
    # Why they differ: the preflight's timing (step_times) again in one process on the same job,
    # as it runs (2 warm-up steps, at most 25 timed), then with 20 warm-up steps and 200 timed,
    # then the same steps on 8 batches already on the GPU (no loader, no copy).
    diagnosis=$("$python" - "${MLP[@]}" --amp bf16 --compile false --output_dir "$runs/diagnosis" 2>"$runs/diagnosis.log" <<'PY'
import itertools, sys, time
sys.path.insert(0, ".")
from ddp_utils.preflight import run as preflight
from ddp_utils.configuration import parse_config
from ddp_utils.contract import to_device
from ddp_utils.distributed.process_group import cleanup_distributed, setup_distributed
from ddp_utils.train.inputs import check_inputs
from ddp_utils.train.trainer import Trainer
from task import TASK

cfg = parse_config(TASK.config, sys.argv[1:])
ctx = setup_distributed(cfg.timeout_seconds, device=cfg.device)
trainer = Trainer(cfg, ctx, TASK, check_inputs(TASK, cfg, ctx)[0])
as_preflight = preflight.step_times(ctx, trainer, (False,))[False]
preflight.TIMED_SECONDS, preflight.MAX_REPEATS = 10.0, 200
longer = preflight.step_times(ctx, trainer, (False,), warmup=20)[False]
batches = [to_device(batch, ctx.device) for batch in itertools.islice(preflight.training_batches(trainer), 8)]
for batch in batches[:4]:  # warm
    trainer.train_step(batch, sync=False)
    trainer.optimizer_step()
preflight.synchronize(ctx)
started = time.perf_counter()
for batch in itertools.islice(itertools.cycle(batches), 200):
    trainer.train_step(batch, sync=False)
    trainer.optimizer_step()
preflight.synchronize(ctx)
on_device = (time.perf_counter() - started) / 200
trainer.read_agreement()
trainer.close("finished")
cleanup_distributed()
print(f"as the preflight times it {1000 * as_preflight:.2f} ms, with 20 warm-up and 200 timed steps "
      f"{1000 * longer:.2f} ms, on batches already on the GPU {1000 * on_device:.2f} ms")
PY
    ) || diagnosis=
    if [[ -n $diagnosis ]]; then
        check "preflight's timing, diagnosed" "ok ($diagnosis; training measured ${measured_ms:-?} ms)"
    else
        check "preflight's timing, diagnosed" "$(tail_text "$runs/diagnosis.log")"
    fi
}

check_6() {
    if (cd "$language" && "${torchrun1[@]}" train.py "${GPT_COMPILED[@]}" --output_dir "$runs/gpt" >"$runs/gpt.log" 2>&1); then
        local gpt
        gpt=$(steady "$runs/gpt" | "$python" -c "
import json, sys
m = json.load(sys.stdin)
print(f\"{m['tokens_per_s']:.0f} tokens/s, MFU {100 * m['mfu']:.1f}% (median of {m['periods']} periods), peak {m['peak_memory_mb']:.0f} MB; target MFU >= 40%: {'met' if m['mfu'] >= 0.40 else 'NOT met'}, at least 35%: {'met' if m['mfu'] >= 0.35 else 'NOT met'}\")" 2>&1) ||
            gpt="no metrics: see gpt.log"
        check "GPT 12x768, 64x1024 tokens, bf16, compile, ddp" "ok ($gpt)"
    else
        check "GPT 12x768, 64x1024 tokens, bf16, compile, ddp" "$(tail_text "$runs/gpt.log")"
    fi
}

check_7() {
    # One asynchronous save, after step 30 (the metrics line of step 30 comes first): its
    # blocking copy is the period 31-40's checkpoint_s, its writing overlaps steps 31-40. The
    # steady state: the periods ending at 20, 30, 50 and 60 (the final save comes after 60's line).
    if (cd "$language" && "${torchrun1[@]}" train.py "${GPT_COMPILED[@]}" --strategy fsdp --async_checkpoint true \
        --checkpoint_every_steps 30 --output_dir "$runs/gpt_fsdp" >"$runs/gpt_fsdp.log" 2>&1); then
        local fsdp
        fsdp=$("$python" - "$runs" "$(steady "$runs/gpt_fsdp" 20 30 50 60)" "$(steady "$runs/gpt" 2>/dev/null || echo null)" <<'PY' 2>&1
import json, statistics, sys
from pathlib import Path

runs, fsdp, ddp = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
lines = {m["step"]: m for m in map(json.loads, (runs / "gpt_fsdp/metrics.jsonl").read_text().splitlines())}
train_s = lambda m: m["compute_s"] + m["data_wait_s"]  # the period's steps, its first included; no checkpoint
steady_s = statistics.median(train_s(lines[step]) for step in (20, 30, 50, 60))
saved = lines[40]
text = (f"steady {fsdp['tokens_per_s']:.0f} tokens/s, MFU {100 * fsdp['mfu']:.1f}%, peak {fsdp['peak_memory_mb']:.0f} MB; "
        f"the save at step 30: {1000 * saved['checkpoint_s']:.0f} ms blocking (checkpoint_s) + "
        f"{1000 * (train_s(saved) - steady_s):.0f} ms of slower steps 31-40 ({train_s(saved):.2f} s against {steady_s:.2f} s)")
if ddp:
    ratio = fsdp["tokens_per_s"] / ddp["tokens_per_s"]
    text += f"; ddp {ddp['tokens_per_s']:.0f} tokens/s: {ratio:.2f}x ddp; target >= 0.9x: {'met' if ratio >= 0.9 else 'NOT met'}"
else:
    text += "; no ddp run to compare (check 6)"
print(text)
PY
        ) || fsdp="no metrics line: see gpt_fsdp.log"
        check "GPT 12x768 --strategy fsdp, bf16, per-block compile, async DCP" "ok ($fsdp)"
        if (cd "$language" && "$python" export.py "$runs/gpt_fsdp/checkpoints/last" "$runs/gpt_fsdp.pt" >"$runs/export.log" 2>&1); then
            check "export.py of the fsdp run's last DCP checkpoint" "ok ($(du -h "$runs/gpt_fsdp.pt" | cut -f1))"
        else
            check "export.py of the fsdp run's last DCP checkpoint" "$(tail_text "$runs/export.log")"
        fi
        rm -f "$runs/gpt_fsdp.pt"
    else
        check "GPT 12x768 --strategy fsdp, bf16, per-block compile, async DCP" "$(tail_text "$runs/gpt_fsdp.log")"
    fi
}

check_21() {
    # Muon on check 6's job: Newton-Schulz batched by shape and compiled (one graph per shape),
    # each rank its share (one rank here). Against check 6's AdamW, steady state both.
    if (cd "$language" && "${torchrun1[@]}" train.py "${GPT_COMPILED[@]}" --optimizer muon --output_dir "$runs/gpt_muon" \
        >"$runs/gpt_muon.log" 2>&1); then
        local muon
        muon=$("$python" - "$(steady "$runs/gpt_muon")" "$(steady "$runs/gpt" 2>/dev/null || echo null)" <<'PY' 2>&1
import json, sys

muon, adamw = json.loads(sys.argv[1]), json.loads(sys.argv[2])
text = f"Muon {muon['tokens_per_s']:.0f} tokens/s, peak {muon['peak_memory_mb']:.0f} MB"
if adamw:
    ratio = muon["tokens_per_s"] / adamw["tokens_per_s"]
    text += f"; AdamW {adamw['tokens_per_s']:.0f} tokens/s: {ratio:.2f}x; target >= 0.85x: {'met' if ratio >= 0.85 else 'NOT met'}"
else:
    text += "; no AdamW run to compare (check 6)"
print(text)
PY
        ) || muon="no metrics line: see gpt_muon.log"
        check "Muon's step, GPT 12x768 64x1024 bf16 compile" "ok ($muon)"
    else
        check "Muon's step, GPT 12x768 64x1024 bf16 compile" "$(grep -m1 -E 'Error|error:' "$runs/gpt_muon.log" || tail_text "$runs/gpt_muon.log")"
    fi
}

check_8() {
    if "${torchrun1[@]}" train.py "${MLP[@]}" --max_steps 8 --amp fp16 --log_every_steps 2 --profile_steps 4:5 \
        --output_dir "$runs/profile" >"$runs/profile.log" 2>&1; then
        local profiled scale_lines verdict
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
        check "--profile_steps 4:5 on CUDA: trace kernels, memory snapshot" "$(tail_text "$runs/profile.log")"
    fi
}

check_9() {
    local SIGTERM_RUN=(--input_dim 256 --hidden_dim 2048 --num_classes 64 --batch_size 256 --train_samples 32768
        --val_samples 4096 --dataset blobs --input_noise_std 0.1 --num_workers 4 --epochs 2 --checkpoint_every_steps 50
        --log_every_steps 0 --amp bf16 --progress_bar false)
    "${torchrun1[@]}" train.py "${SIGTERM_RUN[@]}" --resume none --output_dir "$runs/whole" >"$runs/whole.log" 2>&1 || true
    "${torchrun1[@]}" train.py "${SIGTERM_RUN[@]}" --output_dir "$runs/stopped" >"$runs/stopped.log" 2>&1 &
    local torchrun_pid=$! sigterm
    for _ in $(seq 600); do [[ -e $runs/stopped/checkpoints/step_000000100.pt ]] && break; sleep 0.1; done
    kill -TERM "$torchrun_pid" 2>/dev/null || true
    wait "$torchrun_pid" || true
    "${torchrun1[@]}" train.py "${SIGTERM_RUN[@]}" --output_dir "$runs/stopped" >"$runs/resumed.log" 2>&1 || true
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
    ) || sigterm="the comparison failed: see whole.log, stopped.log, resumed.log"
    check "SIGTERM with 4 DataLoader workers: checkpoint, resume" "$sigterm"
}

check_10() {
    # The setting where fused and unfused ended 2.2% apart (60 bf16 steps, 16 windows a micro-step,
    # no compile): unfused twice with the same seed first, whose difference is what the GPU's own
    # run-to-run spread is (atomic adds in backward kernels), then fused.
    local run name
    for run in false false_again true; do
        (cd "$language" && "$python" - "${GPT[@]}" --batch_size 16 --output_dir "$runs/adamw_$run" "${run%_again}" \
            >"$runs/adamw_$run.log" 2>&1 <<'PY'
import sys
sys.path.insert(0, ".")
from ddp_utils.optim import optimizer as optim
from ddp_utils.train import run
from ddp_utils.train import trainer
from task import TASK

fused = sys.argv.pop() == "true"
build = optim.build_optimizer

def build_optimizer(model, cfg, device, module=None):
    optimizer = build(model, cfg, device, module)
    for group in optimizer.param_groups:
        group["fused"] = fused
        group["foreach"] = None if fused else True
    return optimizer

trainer.build_optimizer = build_optimizer  # the name the Trainer calls
sys.exit(run.main(TASK, sys.argv[1:]))
PY
        ) || true
    done
    adamw=$("$python" - "$runs" <<'PY'
import json, sys
from pathlib import Path

runs = Path(sys.argv[1])
try:
    fused, plain, again = (json.loads((runs / f"adamw_{f}/metrics.jsonl").read_text().splitlines()[-1])
                           for f in ("true", "false", "false_again"))
except (OSError, IndexError, KeyError, ValueError) as error:
    print(f"a run failed ({type(error).__name__}: {error}; see adamw_*.log)")
    sys.exit()
ratio = fused["tokens_per_s"] / plain["tokens_per_s"]
spread = abs(again["val_loss"] - plain["val_loss"]) / plain["val_loss"]
tolerance = max(3 * spread, 1e-3)
apart = abs(fused["val_loss"] - plain["val_loss"]) / plain["val_loss"]
print(f"{'ok' if apart <= tolerance else 'other loss'} (val_loss unfused {plain['val_loss']:.4f} and again "
      f"{again['val_loss']:.4f}: spread {100 * spread:.2f}%, tolerance {100 * tolerance:.2f}%; fused "
      f"{fused['val_loss']:.4f}: {100 * apart:.2f}% apart; fused {fused['tokens_per_s']:.0f} tokens/s, unfused "
      f"{plain['tokens_per_s']:.0f}: {ratio:.2f}x, target fused faster: {'met' if ratio > 1.0 else 'NOT met'})")
PY
    ) || adamw="the comparison failed"
    check "AdamW fused=True against unfused, GPT 12x768 bf16, and the spread" "$adamw"
}

check_11() {
    local syncbn
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
print(f"ok (torch.nn.SyncBatchNorm {rates['TorchKernels']:.0f} images/s, hand-written {rates['HandWritten']:.0f}: "
      f"{ratio:.2f}x; target torch's faster: {'met' if ratio > 1.0 else 'NOT met'})")
dist.destroy_process_group()
PY
    ) || syncbn="failed: $(tail_text "$runs/syncbn.log" 2)"
    check "SyncBatchNorm kernels: torch's against the hand-written, ResNet bf16" "${syncbn:-no output}"
    if (cd "$vision" && "${torchrun1[@]}" train.py --data_dir "$digits" --epochs 2 --image_size 32 --amp bf16 \
        --progress_bar false --resume none --output_dir "$runs/vision" >"$runs/vision.log" 2>&1); then
        check "vision task on the GPU (torch's SyncBatchNorm layers)" "ok ($(grep -o 'val_accuracy [0-9.]*' "$runs/vision.log" | tail -n 1))"
    else
        check "vision task on the GPU (torch's SyncBatchNorm layers)" "$(tail_text "$runs/vision.log")"
    fi
}

check_12() {
    local strategy tokens
    for strategy in ddp fsdp; do
        if (cd "$language" && "${torchrun1[@]}" train.py "${GPT[@]}" --compile true --activation_checkpointing true \
            --strategy "$strategy" --output_dir "$runs/ac_$strategy" >"$runs/ac_$strategy.log" 2>&1); then
            tokens=$(last_metrics "$runs/ac_$strategy/metrics.jsonl" "round(m['tokens_per_s'])")
            check "--compile true --activation_checkpointing true, $strategy" "ok (${tokens:-no metrics line, } tokens/s)"
        else
            check "--compile true --activation_checkpointing true, $strategy" "$(tail_text "$runs/ac_$strategy.log")"
        fi
    done
}

check_13() {
    preflight_run  # check 5's, when it ran
    local network
    network=$(grep -o 'NCCL network: .*' "$runs/preflight.log" | head -n 1) || network=
    if [[ -n $network ]]; then
        check "preflight: the network NCCL chose" "ok ($network)"
    else
        check "preflight: the network NCCL chose" "no line: $(tail_text "$runs/preflight.log" 2)"
    fi
}

check_14() {
    if [[ ! -f $here/profiled.py || ! -f $here/breakdown.py || ! -f $here/run.py ]]; then
        check "step breakdown, GPT 12x768 bf16 compile, steps 21-40" "bench/profiled.py, breakdown.py and run.py are not beside $self: run the repository's bench/gpu_check.sh, or DIR/bench/gpu_check.sh of a --bake DIR"
        return
    fi
    if (cd "$language" && "${torchrun1[@]}" "$here/profiled.py" train.py "${GPT_COMPILED[@]}" --max_steps 45 \
        --eval_every_steps 0 --profile_steps 21:40 --output_dir "$runs/breakdown" >"$runs/breakdown.log" 2>&1) &&
        "$python" "$here/breakdown.py" --trace "$runs/breakdown/profile/trace_steps_21-40.json" >"$runs/breakdown.md" 2>&1; then
        local idle
        idle=$(grep -o 'GPU idle share | [0-9.]*' "$runs/breakdown.md" | grep -o '[0-9.]*$' || echo 100)
        check "step breakdown, GPT 12x768 bf16 compile, steps 21-40" "ok (GPU idle $idle% of the steps, target < 5%: $(target "$idle < 5"); table: breakdown.md in the logs)"
    else
        check "step breakdown, GPT 12x768 bf16 compile, steps 21-40" "$(tail_text "$runs/breakdown.log") $(tail_text "$runs/breakdown.md" 2)"
    fi
    rm -f "$runs/breakdown/profile/"*.json  # tens of MB; the table holds what it says
}

check_15() {
    local name task_dir data code row fails
    for name in tabular language vision; do
        case $name in
            tabular) task_dir=$project data=() ;;
            language) task_dir=$language data=(--data_dir "$text" --n_layer 2 --block_size 128) ;;  # the CPU float64 steps: 2 blocks
            vision) task_dir=$vision data=(--data_dir "$digits") ;;
        esac
        code=0
        (cd "$task_dir" && "$python" doctor.py "${data[@]}" --amp bf16 --output_dir "$runs/doctor_$name") \
            >"$runs/doctor_$name.log" 2>&1 || code=$?
        row=$(grep -o '| host syncs on the GPU | [A-Z]* | [^|]*' "$runs/doctor_$name.log" || echo "no GPU row")
        fails=$(grep '| FAIL |' "$runs/doctor_$name.log" | cut -d'|' -f2 | sed 's/^ *//; s/ *$//' | tr '\n' ',' | sed 's/,$//') || true
        if [[ $code == 0 && $row == *"| PASS |"* && -z $fails ]]; then
            check "doctor.py with a GPU, $name task" "ok (${row#| host syncs on the GPU | PASS | })"
        else
            check "doctor.py with a GPU, $name task" "exit $code: $row; FAIL rows: ${fails:-none}$( [[ $code == 0 || -n $fails ]] || echo "; $(tail_text "$runs/doctor_$name.log" 2)")"
        fi
    done
}

check_20() {
    # Muon's Newton-Schulz in bf16 on CUDA (and whole matrices under fsdp, NCCL), against AdamW,
    # each at its defaults (--lr, --muon_lr), the same steps: validation loss by step, tokens/s.
    # A time-to-quality figure on a small GPT, not a tuned comparison (bench/time_to_quality.py
    # sweeps the lrs on CPUs).
    local muon_gpt=(--data_dir "$text" --block_size 512 --n_layer 6 --n_head 8 --n_embd 512 --batch_size 32
        --amp bf16 --val_samples 256 --log_every_steps 0 --progress_bar false --resume none --max_steps 300
        --eval_every_steps 50 --warmup_steps 30)
    local name
    for name in adamw muon muon_fsdp; do
        local flags=(--optimizer "${name%_fsdp}")
        [[ $name == *_fsdp ]] && flags+=(--strategy fsdp)
        if (cd "$language" && timeout -k 5 "$(left)" "${torchrun1[@]}" train.py "${muon_gpt[@]}" "${flags[@]}"             --output_dir "$runs/$name" >"$runs/$name.log" 2>&1); then
            check "--optimizer ${flags[*]:1}, GPT 6x512 bf16, 300 steps" "ok ($("$python" - "$runs/$name" <<'PY'
import json, sys
from pathlib import Path

lines = [json.loads(line) for line in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines()]
losses = " ".join(f"{m['step']}:{m['val_loss']:.3f}" for m in lines)
print(f"val_loss by step {losses}; {lines[-1]['tokens_per_s']:.0f} tokens/s")
PY
))"
        else
            check "--optimizer ${flags[*]:1}, GPT 6x512 bf16, 300 steps" "$(grep -m1 -E 'Error|error:' "$runs/$name.log" || tail_text "$runs/$name.log")"
        fi
    done
}

check_22() {
    # A batch far beyond the GPU (check 6's GPT, 1024 sequences of 1024 tokens a step): torch's
    # OutOfMemoryError in the first step, turned into ddp_utils/train/out_of_memory.py's one line.
    local log=$runs/oom.log line
    if (cd "$language" && timeout -k 5 "$(left)" "${torchrun1[@]}" train.py "${GPT_MODEL[@]}" --batch_size 1024 \
        --max_steps 1 --output_dir "$runs/oom" >"$log" 2>&1); then
        check "--batch_size 1024 on the GPT runs out of memory" "it trained: the GPU holds it; raise --batch_size"
        return
    fi
    line=$(grep -m1 'ran out of CUDA memory' "$log" || true)
    if [[ -z $line ]]; then
        check "out of memory named in one line" "no such line: $(grep -m1 -E 'Error|error:' "$log" || tail_text "$log")"
    elif [[ $(grep -c 'ran out of CUDA memory' "$log") -ne 1 || $line != *"GiB free of the GPU's"* \
        || $line != *"--grad_accum_steps"* ]] || grep -q 'OutOfMemoryError' "$log"; then
        check "out of memory named in one line" "$(echo "$line" | cut -c1-400); $(grep -c Traceback "$log") tracebacks"
    elif [[ -e $runs/oom/.owner.json ]]; then
        check "out of memory named in one line" "the folder claim was kept: $line"
    else
        check "out of memory named in one line" "ok ($(echo "$line" | sed 's/^.*ERROR //' | cut -c1-400))"
    fi
}

check_23() {
    # Issue 63: --cpu_offload's step under fsdp (first: before the doctor's CPU processes start);
    # then per --activation_checkpointing mode the largest micro-batch of check 6's GPT that trains,
    # without compile (train.py compiles with dynamic=False: every size would compile again), and
    # the eager activations at 64 against the doctor's plan.
    activation_checkpointing_rows 5a --part offload,search
}

check_24() {
    # Issue 63: each mode on check 6's job compiled, as train.py runs it: tokens/s, peak memory, the
    # activations against the doctor's plan (computed on the CPU meanwhile, or kept by check 23).
    activation_checkpointing_rows 5b --part steady
}

activation_checkpointing_rows() {  # TAG ARGS...: bench/activation_checkpointing_gpu.py ARGS in the language project; its ROW lines are the rows
    local tag=$1 code=0 rows=0 name result
    local out=$runs/activation_checkpointing_$tag.md err=$runs/activation_checkpointing_$tag.err
    shift
    if [[ ! -f $here/activation_checkpointing_gpu.py || ! -f $here/activation_checkpointing.py ]]; then
        check "activation checkpointing ($tag)" "bench/activation_checkpointing_gpu.py and activation_checkpointing.py are not beside $self: run the repository's bench/gpu_check.sh, or DIR/bench/gpu_check.sh of a --bake DIR"
        return
    fi
    # shellcheck disable=SC2086  # AC_BENCH_ARGS: extra flags, word-split (--tiny: the CPU dry run)
    (cd "$language" && timeout -k 5 "$(left)" "$python" "$here/activation_checkpointing_gpu.py" "$@" --data_dir "$text" \
        --seconds "$(( $(left) - 10 ))" ${AC_BENCH_ARGS:-} >"$out" 2>"$err") || code=$?
    grep -v $'^ROW\t' "$out" | sed '/^$/d' || true  # the tables, for the command's output
    while IFS=$'\t' read -r _ name result; do
        check "$name" "$result"
        rows=$((rows + 1))
    done < <(grep $'^ROW\t' "$out")
    if [[ $code != 0 || $rows == 0 ]]; then
        check "bench/activation_checkpointing_gpu.py $* ran to its end" "exit $code, $rows rows: $(tail_text "$err")"
    fi
}

check_16() {
    # The first: FSDP2 meshed on the run's GPU. The second: torch's accelerator is cuda, the run
    # is told --device cpu: FSDP2's mesh must be on the CPU (gloo), not on torch's default.
    if "${torchrun1[@]}" train.py "${SMALL[@]}" --strategy fsdp --amp bf16 --output_dir "$runs/fsdp_gpu" \
        >"$runs/fsdp_gpu.log" 2>&1; then
        check "--strategy fsdp, 1 process on the GPU, trains" "ok ($(grep -o 'val_accuracy [0-9.]*' "$runs/fsdp_gpu.log" | tail -n 1))"
    else
        check "--strategy fsdp, 1 process on the GPU, trains" "$(tail_text "$runs/fsdp_gpu.log")"
    fi
    if "$python" -m torch.distributed.run --standalone --nproc_per_node=2 train.py "${SMALL[@]}" --strategy fsdp \
        --device cpu --amp none --output_dir "$runs/fsdp_cpu" >"$runs/fsdp_cpu.log" 2>&1; then
        check "--strategy fsdp --device cpu, 2 gloo processes, GPU visible, trains" "ok ($(grep -o 'val_accuracy [0-9.]*' "$runs/fsdp_cpu.log" | tail -n 1))"
    else
        check "--strategy fsdp --device cpu, 2 gloo processes, GPU visible, trains" "$(grep -m1 -E 'Error|error:' "$runs/fsdp_cpu.log" || tail_text "$runs/fsdp_cpu.log")"
    fi
}

check_17() {
    # A run with --tf32 true, then both APIs read in the same process; then set_tf32(False);
    # then inductor's max-autotune (which reads them) compiles an fp32 matmul.
    timeout -k 5 "$(left)" "$python" - "${SMALL[@]}" --tf32 true --amp none --output_dir "$runs/tf32" \
        >"$runs/tf32.log" 2>&1 <<'PY' || true
import sys
import torch
sys.path.insert(0, ".")
from ddp_utils.train import run
from ddp_utils.distributed.device import set_tf32
from task import TASK

def readings():
    values = {}
    for name, read in (("get_float32_matmul_precision()", torch.get_float32_matmul_precision),
                       ("cuda.matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
                       ("cudnn.allow_tf32", lambda: torch.backends.cudnn.allow_tf32)):
        try:
            values[name] = read()
        except Exception as error:
            values[name] = f"raises {type(error).__name__}: {str(error).splitlines()[0][:80]}"
    return values

code = run.main(TASK, sys.argv[1:])
after_run = readings()
ok_on = after_run["get_float32_matmul_precision()"] in ("high", "medium") and after_run["cuda.matmul.allow_tf32"] is True
set_tf32(False)
after_off = readings()
ok_off = after_off["get_float32_matmul_precision()"] == "highest" and after_off["cuda.matmul.allow_tf32"] is False
text = ", ".join(f"{k} {v!r}" for k, v in after_run.items())
text_off = ", ".join(f"{k} {v!r}" for k, v in after_off.items())
print(f"TF32_ON {'ok' if code == 0 and ok_on else 'wrong'} (run exit {code}; {text})", flush=True)
print(f"TF32_OFF {'ok' if ok_off else 'wrong'} ({text_off})", flush=True)
set_tf32(True)
try:
    matmul = torch.compile(lambda a, b: a @ b, mode="max-autotune-no-cudagraphs")
    a, b = torch.randn(512, 512, device="cuda"), torch.randn(512, 512, device="cuda")
    error = ((matmul(a, b) - a.double() @ b.double()).norm() / (a.double() @ b.double()).norm()).item()
    print(f"TF32_AUTOTUNE ok (relative error {error:.1e} against float64)", flush=True)
except Exception as failure:
    print(f"TF32_AUTOTUNE {type(failure).__name__}: {str(failure).splitlines()[0][:200]}", flush=True)
PY
    local line
    for kind in ON OFF AUTOTUNE; do
        line=$(grep -m1 "^TF32_$kind " "$runs/tf32.log" | cut -d' ' -f2-) || line=
        case $kind in
            ON) name="--tf32 true run, then both precision APIs read" ;;
            OFF) name="set_tf32(False), then both precision APIs read" ;;
            AUTOTUNE) name="inductor max-autotune fp32 matmul after set_tf32(True)" ;;
        esac
        check "$name" "${line:-no result: $(tail_text "$runs/tf32.log" 2)}"
    done
}

check_18() {
    # Accumulation 4 in this process: after the first micro-step that does not step the optimizer,
    # do the (sharded, DTensor) parameters hold their gradient? Then accumulation 1, for the peaks.
    local FSDP_GPT=(--data_dir "$text" --block_size 256 --n_layer 12 --n_head 12 --n_embd 768 --batch_size 4 --amp bf16
        --strategy fsdp --max_steps 4 --val_samples 16 --log_every_steps 0 --progress_bar false --resume none)
    (cd "$language" && "$python" - "${FSDP_GPT[@]}" --grad_accum_steps 4 --output_dir "$runs/accum4" >"$runs/accum4.log" 2>&1 <<'PY'
import sys
import torch
sys.path.insert(0, ".")
from ddp_utils.train import run
from ddp_utils.train.trainer import Trainer
from task import TASK

train_step, seen = Trainer.train_step, []

def inspected_train_step(self, batch, sync):
    loss = train_step(self, batch, sync)
    if not sync and not seen:
        trained = [p for p in self.parameters if p.requires_grad]
        seen.append((sum(p.grad is not None for p in trained), len(trained), torch.cuda.memory_allocated() / 2**20))
    return loss

Trainer.train_step = inspected_train_step
code = run.main(TASK, sys.argv[1:])
if seen:
    held, total, allocated = seen[0]
    print(f"ACCUM_GRADS {held} {total} {allocated:.0f}")
sys.exit(code)
PY
    ) || true
    (cd "$language" && "${torchrun1[@]}" train.py "${FSDP_GPT[@]}" --grad_accum_steps 1 --output_dir "$runs/accum1" \
        >"$runs/accum1.log" 2>&1) || true
    local grads peak4 peak1 state
    grads=$(grep -o 'ACCUM_GRADS .*' "$runs/accum4.log" | cut -d' ' -f2-) || grads=
    peak4=$(last_metrics "$runs/accum4/metrics.jsonl" "round(m['peak_memory_mb'])")
    peak1=$(last_metrics "$runs/accum1/metrics.jsonl" "round(m['peak_memory_mb'])")
    state=$(last_metrics "$runs/accum4/metrics.jsonl" "round(m['model_state_mb'] / 4)")  # params, grads, 2 AdamW moments: 1/4 is a gradient
    local memory="peak accum 4 ${peak4:-?} MB, accum 1 ${peak1:-?} MB (a whole fp32 gradient ${state:-?} MB; one GPU: a shard is all of it)"
    if [[ -z $grads ]]; then
        check "fsdp --grad_accum_steps 4: gradients sharded each micro-step" "no micro-step seen: $(tail_text "$runs/accum4.log")"
    else
        read -r held total allocated <<<"$grads"
        if [[ $held == "$total" && -n $peak4 ]]; then
            check "fsdp --grad_accum_steps 4: gradients sharded each micro-step" "ok (after micro-step 1 of 4: $held of $total parameters hold their sharded gradient, ${allocated} MB allocated; $memory)"
        else
            check "fsdp --grad_accum_steps 4: gradients sharded each micro-step" "after micro-step 1 of 4 $held of $total parameters hold a sharded gradient (the rest held unsharded until the last micro-step?); $memory"
        fi
    fi
}

check_19() {
    # Two local ranks, one visible GPU: the preflight must name the shared GPU before NCCL does.
    local visible=${CUDA_VISIBLE_DEVICES:-0} code=0 named dup named_at=0 dup_at=0
    CUDA_VISIBLE_DEVICES=${visible%%,*} "$python" -m torch.distributed.run --standalone --nproc_per_node=2 preflight.py \
        "${SMALL[@]}" >"$runs/shared_gpu.log" 2>&1 || code=$?
    # preflight.py's line: "local ranks 0 and 1 on HOST would all train on one GPU, NAME GPU-UUID (NCCL
    # stops with 'Duplicate GPU detected'): ..."; NCCL's own is any other line naming a duplicate GPU.
    named=$(grep -n -m1 -i -E 'would all train on one GPU|same GPU|share[sd]? (one |a |the |this |its )?GPU' \
        "$runs/shared_gpu.log") || named=
    dup=$(grep -n 'Duplicate GPU' "$runs/shared_gpu.log" | grep -v -i 'would all train on one GPU' | head -n 1) || dup=
    [[ -n $named ]] && named_at=${named%%:*}
    [[ -n $dup ]] && dup_at=${dup%%:*}
    if [[ $code != 0 && -n $named && ( $dup_at == 0 || $named_at -lt $dup_at ) ]]; then
        check "2 local ranks on one GPU: the preflight names it" "ok (exit $code: ${named#*:})"
    else
        check "2 local ranks on one GPU: the preflight names it" "exit $code; its line: ${named:-none}; NCCL's: ${dup:-none}; first errors: $(grep -m2 -E 'PROBLEM|[Ee]rror:' "$runs/shared_gpu.log" | tr '\n' ' ' | cut -c1-300)"
    fi
}

"check_$one"
exit $failed
fi

# --- the run: which checks, the GPU, the data, then each check under its limit ---------------
if [[ -n ${PLAN:-} && -n ${CHECKS:-} ]]; then
    echo "gpu_check.sh: give PLAN or CHECKS, not both" >&2; exit 2
fi
if [[ -n ${PLAN:-} ]]; then
    [[ " $PLANS " == *" $PLAN "* ]] || { echo "gpu_check.sh: PLAN='$PLAN': one of $PLANS (bash bench/gpu_check.sh --plans)" >&2; exit 2; }
    selected=${PLAN_CHECKS[$PLAN]}
    budget=${BUDGET_S:-330}
else
    for n in ${CHECKS:-}; do
        [[ $n =~ ^[0-9]+$ && -n ${LIMIT[$n]:-} ]] || { echo "gpu_check.sh: CHECKS='$CHECKS': each must be a check number of the plan table (bench/gpu_check.sh --plans), space-separated" >&2; exit 2; }
    done
    selected=${CHECKS:-$(for plan in $PLANS; do echo "${PLAN_CHECKS[$plan]}"; done | tr '\n' ' ')}
    budget=${BUDGET_S:-0}  # 0: no budget
fi
started_all=$(date +%s)
# 0. The GPU, and the peak the project's MFU table matches for it (the only output without a GPU:
# the line the caller checks for).
gpu=$("$python" - "$project" <<'PY'
import sys
import torch

sys.path.insert(0, sys.argv[1])
from ddp_utils.observe.flops import peak_tflops  # first: a machine without a GPU checks the import too

if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: no CUDA GPU visible")

name = torch.cuda.get_device_name()
peaks = {"bf16": peak_tflops(name, "bf16", True), "fp16": peak_tflops(name, "fp16", True),
         "tf32": peak_tflops(name, "none", True), "fp32": peak_tflops(name, "none", False)}
text = ", ".join(f"{k} {v:g}" for k, v in peaks.items())
status = "ok" if peaks["bf16"] > 0 or peaks["fp16"] > 0 else "no peak in the table (MFU not reported; --peak_tflops)"
print(f"{status} ({torch.cuda.device_count()} x {name!r}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
      f"ddp_utils/observe/flops.py peak TFLOP/s: {text})")
PY
) || exit 1
runs=$(mktemp -d)
results=${OUT:+$OUT/gpu_check_results.txt}
results=${results:-$runs/gpu_check_results.txt}
pack_logs() {  # every log so far, in one file under $OUT (8 files at most come back)
    [[ -n ${OUT:-} ]] || return 0
    if (cd "$runs" && find . -type f -size -8M \( -name '*.log' -o -name '*.md' -o -name '*.out' -o -name '*.txt' \
        -o -name metrics.jsonl -o -name doctor.json -o -name 'rank_*' \) -print0 |
        tar czf "$runs/logs.tgz.partial" --null -T -) 2>/dev/null; then
        mv -f "$runs/logs.tgz.partial" "$OUT/gpu_check_logs.tgz" || true
    fi
}
trap pack_logs EXIT
{
    echo "# bench/gpu_check.sh ${PLAN:+PLAN=$PLAN }checks: $selected; $(date -u +%Y-%m-%dT%H:%M:%SZ); $( [[ $budget -gt 0 ]] && echo "budget $budget s" || echo "no budget")"
    echo "| check | result | s |"
    echo "| --- | --- | --- |"
} | tee -a "$results"
row() { echo "$1" | tee -a "$results"; }
failed=0
[[ $gpu == ok* ]] || failed=1
row "| 0. the GPU and its MFU peak | $gpu | $(( $(date +%s) - started_all )) |"

# The data: made here (--bake), else written now.
text=$baked/data/text digits=$baked/data/digits
needs() { local n; for n in "$@"; do [[ " $selected " == *" $n "* ]] && return 0; done; return 1; }
if [[ ! -f $text/train.bin ]] && needs 6 7 10 12 14 15 18 20 21 23 24; then
    text=$runs/text
    (cd "$language" && "$python" prepare_data.py --output_dir "$text" --max_bytes 4000000 >"$runs/prepare.log" 2>&1) ||
        echo "gpu_check.sh: the language task's text could not be written: $runs/prepare.log" >&2
fi
if [[ ! -d $digits/train ]] && needs 11 15; then
    digits=$runs/digits
    (cd "$vision" && "$python" prepare_data.py --output_dir "$digits" >"$runs/digits.log" 2>&1) ||
        echo "gpu_check.sh: the vision task's digits could not be written (scikit-learn?): $runs/digits.log" >&2
fi

sweep() {  # sweep TAG: kill what a check left running (its processes carry the tag in their environment)
    local pid n=0
    for pid in $(grep -lsz "^GPU_CHECK_TAG=$1\$" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); do
        [[ $pid == "$$" ]] && continue
        kill -KILL "$pid" 2>/dev/null && n=$((n + 1))
    done
    echo "$n"
}
for n in $selected; do
    now=$(date +%s)
    limit=${GPU_CHECK_LIMIT_S:-${LIMIT[$n]}}
    if [[ $budget -gt 0 ]]; then
        left=$(( started_all + budget - now ))
        if [[ $left -lt ${EST[$n]} ]]; then
            row "| $n. ${TITLE[$n]} | NOT RUN: ${left} s left of the ${budget} s budget, it needs about ${EST[$n]} s | 0 |"
            failed=1
            continue
        fi
        [[ $limit -le $left ]] || limit=$left
    fi
    echo "gpu_check.sh: check $n (${TITLE[$n]}), at most $limit s" >&2
    lines_before=$(wc -l <"$results")
    code=0
    GPU_CHECK_TAG="check_${n}_$$" GPU_CHECK_RUNS=$runs GPU_CHECK_RESULTS=$results GPU_CHECK_STARTED=$now \
        GPU_CHECK_DEADLINE=$(( now + limit )) GPU_CHECK_TEXT=$text GPU_CHECK_DIGITS=$digits PYTHON=$python \
        PYTHONUNBUFFERED=1 timeout -k 10 "$limit" bash "$self" --one "$n" "$baked" </dev/null 2>>"$runs/check_$n.out" ||
        code=$?
    leftover=$(sweep "check_${n}_$$")
    spent=$(( $(date +%s) - now ))
    if [[ $code == 124 || $code == 137 ]]; then
        row "| $n. ${TITLE[$n]} | FAILED: timed out after $limit s (its limit; rows above are what it finished)$( [[ $leftover == 0 ]] || echo "; killed what it left running: $leftover processes") | $spent |"
        failed=1
    elif [[ $(wc -l <"$results") == "$lines_before" ]]; then
        row "| $n. ${TITLE[$n]} | FAILED: stopped with exit $code before writing a row: $(tail -n 2 "$runs/check_$n.out" | tr '\n' ' ' | cut -c1-300) | $spent |"
        failed=1
    elif [[ $code != 0 ]]; then
        failed=1
    fi
    [[ $leftover == 0 || $code == 124 || $code == 137 ]] || echo "gpu_check.sh: check $n left $leftover processes: killed" >&2
    pack_logs
done
echo "gpu_check.sh: $(( $(date +%s) - started_all )) s; results in $results${OUT:+, logs in $OUT/gpu_check_logs.tgz}" >&2
exit $failed
