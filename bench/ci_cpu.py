"""Where the test suite's CPU time goes: every Python process it starts, by what it imported.

    bash dev/bench.sh --ci-cpu                          # dev/test.sh's main phase (~18 min)
    bash dev/bench.sh --ci-cpu tests/test_own_model.py  # other pytest arguments instead

CI's machine has 2 cores, and the suite keeps both busy from start to end: its wall time is its
CPU time halved, so only less CPU makes it shorter. Each Python process the suite starts writes
one line at exit: its own CPU time, the CPU time it spent in `import torch` and in `import
torch._dynamo` (each module's execution, with everything it imports, timed where it runs:
this machine's speed drifts, so a separate timing would not do), and the test it ran for.
The hook is a .pth file put in this environment's site-packages for the run and removed after
it (inert without CI_CPU_LOG in the environment). Processes killed with SIGKILL, and programs
that are not Python (ruff, g++ under --compile, slurmd), write nothing: the table counts them
together as the CPU not logged.

Every training process imports both modules: torch 2.13's DistributedDataParallel reads a
torch._dynamo setting in its constructor, and the optimizer's add_param_group is wrapped by
torch._disable_dynamo, which imports it on its first call.
"""

import argparse
import collections
import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# dev/test.sh's main phase; the `alone` tests time training and run after it, one at a time.
MAIN_PHASE = ["-n", "4", "--dist", "loadgroup", "-m", "not alone"]

LOGGER = """\
import atexit, json, os, resource, sys, time

_imports = {}  # CPU seconds spent executing these modules (and what they import)


class _ImportTimer:
    def find_spec(self, name, path=None, target=None):
        if name not in ("torch", "torch._dynamo"):
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module  # a loader of this module alone: time it there

        def exec_module(module):
            started = time.process_time()
            try:
                run(module)
            finally:
                _imports[name] = time.process_time() - started

        spec.loader.exec_module = exec_module
        return spec


def _write():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    line = json.dumps({"cpu": usage.ru_utime + usage.ru_stime, "imports": _imports,
                       "test": os.environ.get("PYTEST_CURRENT_TEST", "")})
    fd = os.open(os.environ["CI_CPU_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, (line + "\\n").encode())  # one write: lines from parallel processes stay whole
    os.close(fd)


sys.meta_path.insert(0, _ImportTimer())
atexit.register(_write)
"""


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_logged(pytest_args, log):
    """The suite with every Python process logging to `log`: (wall seconds, CPU seconds)."""
    folder = Path(tempfile.mkdtemp(prefix="ci-cpu-"))
    (folder / "_ci_cpu_log.py").write_text(LOGGER)
    pth = Path(sysconfig.get_paths()["purelib"]) / f"zz_ci_cpu_log_{os.getpid()}.pth"  # runs may overlap
    load = f"(sys.path.append({str(folder)!r}) or __import__('_ci_cpu_log'))"  # last: it shadows nothing
    pth.write_text(f"import os, sys; os.environ.get('CI_CPU_LOG') and {load}\n")  # a .pth line that imports runs
    env = {**os.environ, "CI_CPU_LOG": str(log), "OMP_NUM_THREADS": "1"}
    try:
        started, before = time.monotonic(), children_cpu()
        result = subprocess.run([sys.executable, "-m", "pytest", *pytest_args], check=False, cwd=REPO, env=env)
        wall, cpu = time.monotonic() - started, children_cpu() - before
    finally:
        pth.unlink()
        shutil.rmtree(folder)
    if result.returncode != 0:
        print(f"warning: pytest exited {result.returncode}: the figures cover a failed run", file=sys.stderr)
    return wall, cpu


def kind(record):
    if "torch._dynamo" in record["imports"]:
        return "imported torch and torch._dynamo (training processes, the doctor's ranks)"
    if "torch" in record["imports"]:
        return "imported torch only (torchrun launchers, pytest sessions, sample.py, export.py)"
    return "imported no torch (cookiecutter, hooks, helpers)"


def report(records, wall, cpu, pytest_args):
    lines = [f"`pytest {' '.join(pytest_args)}`: {wall:.0f} s wall, {cpu:.0f} CPU-s ({cpu / wall:.2f} cores busy)", ""]
    lines += ["| processes | count | CPU s | in `import torch` | in `import torch._dynamo` | share of the CPU |"]
    lines += ["|---|---:|---:|---:|---:|---:|"]
    by_kind = collections.defaultdict(list)
    for record in records:
        by_kind[kind(record)].append(record)
    for name, group in sorted(by_kind.items(), key=lambda item: -sum(r["cpu"] for r in item[1])):
        total = sum(r["cpu"] for r in group)
        torch_s, dynamo_s = (sum(r["imports"].get(module, 0) for r in group) for module in ("torch", "torch._dynamo"))
        lines.append(f"| {name} | {len(group)} | {total:.0f} | {torch_s:.0f} | {dynamo_s:.0f} | {total / cpu:.0%} |")
    unlogged = cpu - sum(r["cpu"] for r in records)
    lines.append(f"| not logged: killed processes, ruff, g++, slurmd | | {unlogged:.0f} | | | {unlogged / cpu:.0%} |")
    floor = sum(sum(r["imports"].values()) for r in records)
    lines += [
        "",
        f"In those two imports: {floor:.0f} CPU-s, {floor / cpu:.0%} of the run's CPU; on 2 cores, {floor / 2:.0f} s.",
    ]
    by_module = collections.Counter()
    for record in records:
        by_module[record["test"].split("::")[0] or "(outside a test)"] += record["cpu"]
    lines += ["", "| test module (of whichever pytest ran the process) | CPU s logged |", "|---|---:|"]
    lines += [f"| {module} | {seconds:.0f} |" for module, seconds in by_module.most_common(12)]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pytest_args", nargs="*", help=f"instead of dev/test.sh's main phase ({' '.join(MAIN_PHASE)})")
    args, options = parser.parse_known_args()  # pytest's own options (-k, -x) pass through
    pytest_args = [*args.pytest_args, *options] or MAIN_PHASE
    with tempfile.TemporaryDirectory(prefix="ci-cpu-log-") as folder:
        log = Path(folder) / "processes.jsonl"
        wall, cpu = run_logged(pytest_args, log)
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    print(report(records, wall, cpu, pytest_args))


if __name__ == "__main__":
    main()
