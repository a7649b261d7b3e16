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
    """The GPU machine has no cookiecutter: --bake renders the three tasks' projects here, and
    the script run on them gets as far as looking for a GPU (none here); a folder without
    them is refused with the way to make them."""
    baked = tmp_path / "baked"
    result = run(["bash", "bench/gpu_check.sh", "--bake", str(baked)], cwd=TEMPLATE)
    assert result.returncode == 0, result.stderr
    assert all((baked / task / "ddp_training" / "train.py").exists() for task in ("tabular", "language", "vision"))
    no_gpu = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # on a machine with one too
    result = run(["bash", "bench/gpu_check.sh", str(baked)], cwd=TEMPLATE, env_override=no_gpu)
    assert (result.returncode, result.stderr.strip()) == (1, "gpu_check.sh: no CUDA GPU visible")
    result = run(["bash", "bench/gpu_check.sh", str(baked)], cwd=TEMPLATE, env_override={**no_gpu, "CHECKS": "1,5"})
    assert result.returncode == 2 and "CHECKS='1,5'" in result.stderr
    result = run(["bash", "bench/gpu_check.sh", str(tmp_path)], cwd=TEMPLATE)
    assert result.returncode == 2 and "no generated project in" in result.stderr and "--bake DIR" in result.stderr


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
    test = "tests/test_bake.py::test_a_non_editable_install_imports_every_entry_point"
    result = run([sys.executable, "bench/ci_cpu.py", test, "-q"], cwd=TEMPLATE)
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = [line for line in result.stdout.splitlines() if line.startswith("| imported torch only")]
    count, cpu, in_torch = (float(cell) for cell in row.split("|")[2:5])
    assert count >= 1 and 0 < in_torch <= cpu, row
    assert "| tests/test_bake.py |" in result.stdout
    assert sorted(p.name for p in site_packages.glob("*.pth")) == hooks_before
