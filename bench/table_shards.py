"""The tabular task's make_shards.py on tables of growing size: its time and peak memory, against
reading the same table whole as training does (build_datasets), which is what the writer did
before it read a chunk at a time; with its default 64 MiB shards and with 4 MiB ones (a shard is
held while it is written).

    .venv/bin/python bench/table_shards.py                  # 50k, 150k and 450k rows of 21 columns
    .venv/bin/python bench/table_shards.py --rows 2000 6000  # the script's path, not its numbers

Each table is a CSV of 20 numeric features and a text label (the generated test's
write_wide_table); each measure is a fresh process, its peak resident memory (VmHWM)
(pyarrow set to allocate from the C heap: its own pool keeps tens of MiB of slack whatever the
table's size). A benchmark, not a test: it asserts nothing.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run import bake

# VmHWM: the high-water mark of the process's own memory (ru_maxrss would count its parent's, inherited at exec).
PEAK = (
    "import atexit, sys\natexit.register(lambda: print('peak', [line.split()[1] for line in open('/proc/self/status') "
    "if line.startswith('VmHWM')][0], file=sys.stderr))\n"
)
WRITE = "import runpy, sys\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
READ = (
    "import sys\nsys.path.insert(0, '.')\nfrom config import Config\nfrom dataset import build_datasets\n"
    "from ddp_utils.configuration import parse_config\nbuild_datasets(parse_config(Config, sys.argv[1:]))\n"
)


def measured(project, code, args):
    """(seconds, peak MiB) of `code` run with `args` in a fresh process in the project."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ARROW_DEFAULT_MEMORY_POOL": "system"}
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", PEAK + code, *args], cwd=project, env=env, check=False,
                            capture_output=True, text=True)  # fmt: skip
    seconds = time.perf_counter() - started
    if result.returncode:
        sys.exit(result.stdout[-2000:] + result.stderr[-2000:])
    return seconds, int(result.stderr.split("peak ")[-1]) / 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[50_000, 150_000, 450_000])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-table-shards-"))
    project, _ = bake("tabular", work)
    sys.path.insert(0, str(project / "tests"))
    from test_streaming import write_wide_table  # the generated test's table

    print(f"# {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print("| rows | CSV MiB | make_shards.py s | its peak MiB | with 4 MiB shards: s | peak MiB | read whole s | "
          "its peak MiB |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rows in args.rows:
        table = write_wide_table(work / f"table-{rows}.csv", rows)
        flags = ["--data_file", str(table), "--target", "label"]
        write = measured(project, WRITE, ["make_shards.py", *flags, "--output_dir", str(work / f"shards-{rows}")])
        small = ["make_shards.py", *flags, "--output_dir", str(work / f"small-{rows}"), "--shard_mb", "4"]
        small = measured(project, WRITE, small)
        read = measured(project, READ, flags)
        size = table.stat().st_size / 2**20
        times = [f"{seconds:.1f} | {peak:.0f}" for seconds, peak in (write, small, read)]
        print(f"| {rows:,} | {size:.1f} | {' | '.join(times)} |")


if __name__ == "__main__":
    main()
