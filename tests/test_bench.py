"""The benchmarks keep working (a tiny round; they assert no speed) and the GPU check parses."""

import json
import os
import sys
import sysconfig
from pathlib import Path

from conftest import TEMPLATE, run


def test_benchmark_runs_end_to_end_at_a_tiny_size(tmp_path):
    result = run([sys.executable, "bench/run.py", "--tiny", "--markdown", str(tmp_path / "report.md")], cwd=TEMPLATE)
    assert result.returncode == 0, result.stdout + result.stderr
    report = (tmp_path / "report.md").read_text()
    assert "| metric | minimal DDP loop (floor) | generated train.py" in report
    for row in ("loop throughput", "CPU per token", "whole process", "launch to first step", "peak RSS"):
        assert f"| {row}" in report or row in report


def test_gpu_check_script_parses():
    assert run(["bash", "-n", "bench/gpu_check.sh"], cwd=TEMPLATE).returncode == 0


def test_gpu_check_runs_on_projects_baked_elsewhere(tmp_path):
    """The GPU machine has no cookiecutter: --bake renders the three tasks' projects and their
    data here, and the script run on them gets as far as looking for a GPU (none here); a bad
    CHECKS or PLAN, or both at once, and a folder without the projects are refused."""
    baked = tmp_path / "baked"
    result = run(["bash", "bench/gpu_check.sh", "--bake", str(baked)], cwd=TEMPLATE)
    assert result.returncode == 0, result.stderr
    assert all((baked / task / "ddp_training" / "train.py").exists() for task in ("tabular", "language", "vision"))
    assert (baked / "data" / "text" / "train.bin").stat().st_size == 2 * 3_600_000  # 4 MB of text, uint16 tokens
    assert (baked / "data" / "digits" / "train").is_dir()
    # the benchmarks checks run (check 14's profiler, check 21's Muon step) travel with the bake
    assert all((baked / "bench" / name).exists() for name in ("gpu_check.sh", "profiled.py", "muon_step.py"))
    no_gpu = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # on a machine with one too
    for selection in ({}, {"PLAN": "1a"}, {"CHECKS": "19 3"}):
        result = run(["bash", "bench/gpu_check.sh", str(baked)], cwd=TEMPLATE, env_override={**no_gpu, **selection})
        assert (result.returncode, result.stderr.strip()) == (1, "gpu_check.sh: no CUDA GPU visible"), selection
    for selection, message in (({"CHECKS": "1,5"}, "CHECKS='1,5'"), ({"CHECKS": "99"}, "CHECKS='99'"),
                               ({"PLAN": "3"}, "PLAN='3': one of 1a 1b 2a 2b 3a 4a 4b"),
                               ({"PLAN": "1a", "CHECKS": "2"}, "PLAN or CHECKS, not both")):  # fmt: skip
        result = run(["bash", "bench/gpu_check.sh", str(baked)], cwd=TEMPLATE, env_override={**no_gpu, **selection})
        assert result.returncode == 2 and message in result.stderr, (selection, result.stderr)
    result = run(["bash", "bench/gpu_check.sh", str(tmp_path)], cwd=TEMPLATE)
    assert result.returncode == 2 and "no generated project in" in result.stderr and "--bake DIR" in result.stderr


def test_gpu_check_plans_cover_every_check_once_and_fit_a_command():
    """`--plans` (no GPU needed): each of the 24 checks is in exactly one plan; plans 1a and 1b
    (one loan: two commands of 6 minutes) hold the checks that matter most, plans 4a and 4b
    (another loan) issue 55's speed figures, and each plan's estimated seconds fit its 330 s
    budget."""
    result = run(["bash", "bench/gpu_check.sh", "--plans"], cwd=TEMPLATE)
    assert result.returncode == 0, result.stderr
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines()[2:]]
    plans = {name.strip(): ([int(n) for n in checks.split()], int(estimate)) for name, checks, estimate, _ in rows}
    assert list(plans) == ["1a", "1b", "2a", "2b", "3a", "4a", "4b", "5a", "5b"]
    every = [n for checks, _ in plans.values() for n in checks]
    assert sorted(every) == list(range(1, 25))
    first_loan = set(plans["1a"][0] + plans["1b"][0])
    # device binding, host syncs, flight recorder, SIGTERM, the doctor, the fixes
    assert {2, 3, 4, 9, 15, 16, 17, 19} <= first_loan
    # MFU, fsdp against ddp, Muon against AdamW; the loop's and the preflight's costs, fused AdamW
    assert set(plans["4a"][0]) == {6, 7, 21} and set(plans["4b"][0]) == {1, 5, 10, 14}
    assert plans["5a"][0] == [23] and plans["5b"][0] == [24]
    assert all(estimate <= 330 for _, estimate in plans.values())


FAKE_PYTHON = """#!/bin/bash
# A python for bench/gpu_check.sh's own logic: the GPU probe answers; every other call leaves a
# process in a session of its own (as torchrun's workers are), keeps a copy of the results so
# far, and hangs.
if [[ $1 == - ]]; then
    script=$(cat)
    [[ $script == *cuda.is_available* ]] && { echo "ok (a fake GPU)"; exit 0; }
fi
cp "$OUT/gpu_check_results.txt" "$FAKE_DIR/seen_$$" 2>/dev/null
setsid sleep 300 </dev/null >/dev/null 2>&1 &
echo $! >>"$FAKE_DIR/pids"
exec sleep 300
"""


def alive(pid):
    """Whether the process runs (a zombie, killed and not yet reaped by init, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_gpu_check_times_each_check_out_alone_and_writes_each_row_as_it_goes(tmp_path):
    """Each check under its own limit: a hang costs that check (a FAILED row), the next one
    starts, what a check left running is killed (also outside its process group), each row is
    in $OUT's results file before the next check starts, the logs are packed after each check,
    and a check whose estimate no longer fits the budget is not started."""
    baked, out, fake = tmp_path / "baked", tmp_path / "out", tmp_path / "fake"
    for task in ("tabular", "language", "vision"):
        (baked / task / "ddp_training").mkdir(parents=True)
        (baked / task / "ddp_training" / "train.py").write_text("")
    out.mkdir()
    fake.mkdir()
    (fake / "python").write_text(FAKE_PYTHON)
    (fake / "python").chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake / "python"), "OUT": str(out), "FAKE_DIR": str(fake),
           "CHECKS": "2 4 16", "GPU_CHECK_LIMIT_S": "2", "BUDGET_S": "30"}  # fmt: skip
    try:
        result = run(["bash", "bench/gpu_check.sh", str(baked)], cwd=TEMPLATE, env_override=env, timeout=120)
        left = [int(pid) for pid in (fake / "pids").read_text().split()]
        assert len(left) == 2  # checks 2 and 4 started; 16 did not
        assert not [pid for pid in left if alive(pid)], "a check's process outlived it"
    finally:
        for pid in (int(p) for p in (fake / "pids").read_text().split()) if (fake / "pids").exists() else ():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    assert result.returncode == 1, result.stdout + result.stderr
    table = (out / "gpu_check_results.txt").read_text().splitlines()
    assert table[1:3] == ["| check | result | s |", "| --- | --- | --- |"]
    assert table[3].startswith("| 0. the GPU and its MFU peak | ok (a fake GPU) |")
    assert table[4].startswith("| 2. ") and "| FAILED: timed out after 2 s" in table[4]
    assert table[5].startswith("| 4. ") and "| FAILED: timed out after 2 s" in table[5]
    assert table[6].startswith("| 16. ") and "| NOT RUN: " in table[6] and "of the 30 s budget" in table[6]
    assert len(table) == 7 and result.stdout.splitlines() == table
    seen = [path.read_text() for path in fake.glob("seen_*")]
    assert len(seen) == 2 and any(table[4] in text and table[5] not in text for text in seen)
    assert (out / "gpu_check_logs.tgz").stat().st_size > 0


def test_breakdown_reads_a_trace_whose_backward_runs_on_another_thread(tmp_path):
    """With CUDA tensors, autograd runs backward's nodes on a thread of its own (check 14 of
    bench/gpu_check.sh): a Chrome trace shaped so, two steps of 1000 µs, splits backward from
    the all-reduce wait and gives the GPU's idle share."""
    events = []
    for start in (0, 1000):
        events += [
            {"ph": "X", "name": "enumerate(DataLoader)#_next", "pid": 1, "tid": 1, "ts": start, "dur": 10},
            {"ph": "X", "name": "bench:backward", "pid": 1, "tid": 1, "ts": start + 100, "dur": 500},
            {"ph": "X", "name": "autograd::engine::evaluate_function: MmBackward0", "pid": 1, "tid": 2,
             "ts": start + 150, "dur": 300},
            {"ph": "X", "name": "gemm", "cat": "kernel", "pid": 0, "tid": 7, "ts": start + 100, "dur": 400},
        ]  # fmt: skip
    events.append({"ph": "X", "name": "enumerate(DataLoader)#_next", "pid": 1, "tid": 1, "ts": 2000, "dur": 10})
    trace = tmp_path / "run" / "profile" / "trace.json"
    trace.parent.mkdir(parents=True)
    trace.write_text(json.dumps({"traceEvents": events}))
    result = run([sys.executable, "bench/breakdown.py", "--trace", str(trace)], cwd=TEMPLATE)
    assert result.returncode == 0, result.stderr
    rows = {cells[1].strip(): cells[2].strip() for cells in (line.split("|") for line in result.stdout.splitlines())
            if len(cells) > 3}  # fmt: skip
    assert (rows["backward"], rows["all-reduce wait"], rows["GPU idle share"]) == ("350", "150", "60.0%")


def test_ci_cpu_logs_each_process_and_leaves_the_environment_as_it_was():
    """bench/ci_cpu.py on one test that starts a Python process importing torch: the table
    counts it with its import time, and the .pth hook it adds for the run is gone after it."""
    site_packages = Path(sysconfig.get_paths()["purelib"])
    hooks_before = sorted(p.name for p in site_packages.glob("*.pth"))
    test = "tests/test_bake.py::test_an_install_adds_the_machinery_and_no_generic_top_level_module"
    result = run([sys.executable, "bench/ci_cpu.py", test, "-q"], cwd=TEMPLATE)
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = [line for line in result.stdout.splitlines() if line.startswith("| imported torch only")]
    count, cpu, in_torch = (float(cell) for cell in row.split("|")[2:5])
    assert count >= 1 and 0 < in_torch <= cpu, row
    assert "| tests/test_bake.py |" in result.stdout
    assert sorted(p.name for p in site_packages.glob("*.pth")) == hooks_before
