"""The benchmarks keep working (a tiny round; they assert no speed) and the GPU check parses."""

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
