"""The benchmark keeps working (a tiny round; it asserts no speed) and the GPU check parses."""

import sys

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
