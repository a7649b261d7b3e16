"""How long a job takes to recover when one of its ranks dies at a checkpoint (issue 56): a
2-process run (ddp, the language task's tiny settings) whose rank 0 is SIGKILLed while it
writes its second checkpoint and rank 1 waits for it at the checkpoint's barrier; torchrun
(--max-restarts=1) restarts both and the run resumes from the first checkpoint.

    .venv/bin/python bench/rank_loss.py                    # this template, 3 repeats
    .venv/bin/python bench/rank_loss.py --project DIR      # an already generated project

Prints, per repeat, the seconds from the kill to rank 1's exit (the survivor leaving the
store's wait: by itself, or by torchrun's SIGKILL after its stop signal and grace) and to
the restarted run's "resumed from" line, then the median of each. The project needs the
probe `slow_second_save` in its tests/ddp_probe.py (for an older project, copy that file in).
"""

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run import TEMPLATE, cpu_model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", type=Path, help="a generated project (default: bake this template)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rank-loss-bench-"))
    project = args.project
    if project is None:
        from cookiecutter.main import cookiecutter

        project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(work)))
    project = project.resolve()
    sys.path[:0] = [str(project / "tests"), str(project)]
    os.chdir(project)
    from conftest import ARGS, TWO, descendants, kill_tree, training_command, training_env

    exits, resumes = [], []
    for repeat in range(args.repeats):
        output_dir, log = work / f"run{repeat}", work / f"run{repeat}.log"
        command = training_command(output_dir, *ARGS, *TWO, nproc=2, probe="slow_second_save",
                                   torchrun_args=["--max-restarts=1"])  # fmt: skip
        with open(log, "w") as out:
            process = subprocess.Popen(command, cwd=project, env=training_env(), stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            while "second checkpoint write started" not in log.read_text():
                assert process.poll() is None, log.read_text()[-3000:]
                time.sleep(0.02)
            workers = {rank(pid): pid for pid in descendants(process.pid) if rank(pid) is not None}
            killed = time.monotonic()
            os.kill(workers[0], signal.SIGKILL)
            while Path(f"/proc/{workers[1]}").exists() and not zombie(workers[1]):
                time.sleep(0.01)
            exited = time.monotonic() - killed
            while "resumed from" not in log.read_text():
                assert process.poll() is None, log.read_text()[-3000:]
                time.sleep(0.01)
            resumed = time.monotonic() - killed
            assert process.wait(timeout=300) == 0, log.read_text()[-3000:]
        finally:
            kill_tree(process.pid)
            process.wait()
        exits.append(exited)
        resumes.append(resumed)
        how = "by itself" if "stopped answering" in log.read_text() else "killed by torchrun"
        print(f"repeat {repeat + 1}: rank 1 gone {exited:5.1f} s after the kill ({how}), "
              f"resumed {resumed:5.1f} s after it", flush=True)  # fmt: skip
    print(f"median: rank 1 gone after {statistics.median(exits):.1f} s, resumed after "
          f"{statistics.median(resumes):.1f} s ({args.repeats} repeats; {cpu_model()}, {os.cpu_count()} CPUs)")  # fmt: skip


def rank(pid):
    """The RANK of a torchrun worker, None for another process."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    values = dict(item.split(b"=", 1) for item in environ if b"=" in item)
    return int(values[b"RANK"]) if b"RANK" in values and b"ddp_probe.py" in cmdline else None


def zombie(pid):
    try:
        return re.split(r"\) ", Path(f"/proc/{pid}/stat").read_text(), maxsplit=1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


if __name__ == "__main__":
    main()
