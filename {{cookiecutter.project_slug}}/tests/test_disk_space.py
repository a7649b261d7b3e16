"""Room for checkpoints: a disk that fills during training stops the save with one line in plain
words, the checkpoints before it untouched, and the same command resumes once there is room; a
disk too small for the kept checkpoints is said before the first step; the doctor says what
each rank writes of a checkpoint; every size is said in binary units (core.units.size_text).

The checkpoint folder is a tmpfs of its own, mounted over output_dir/checkpoints (root only:
the tests skip elsewhere), whose size a test changes while a run writes to it (a remount: no
filler file to write). Sizes come from the runs' own checkpoints, not from this project's model.
"""

import os
import re
import subprocess

import pytest
import torch
from conftest import (
    ARGS,
    ONE,
    PROJECT,
    TINY_CONFIG,
    TWO,
    assert_same_metrics,
    assert_same_parameters,
    checkpoint,
    kill_tree,
    relative_difference,
    run_tolerance,
    run_training,
    training_command,
    training_env,
    wait_for,
)

from ddp_utils import export
from ddp_utils.checkpoint import loading, sharded
from ddp_utils.core.units import size_text
from ddp_utils.doctor import memory as doctor_memory
from task import TASK

pytestmark = pytest.mark.fixed_amp  # compared with the reference runs, which set --amp none


class SmallDisk:
    """A tmpfs mounted at `path`, resized while a run writes to it."""

    def __init__(self, path):
        self.path = path
        path.mkdir(parents=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=50%", "tmpfs", str(path)], capture_output=True,
                              text=True)  # fmt: skip
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")

    def used(self):
        stat = os.statvfs(self.path)
        return (stat.f_blocks - stat.f_bfree) * stat.f_frsize

    def resize(self, size):
        option = size if isinstance(size, str) else f"{size}"
        return subprocess.run(["mount", "-o", f"remount,size={option}", str(self.path)], capture_output=True).returncode

    def leave_free(self, nbytes):
        """Shrink it to what it holds now and `nbytes` more (a run writing meanwhile: again)."""
        for _ in range(50):
            if self.resize(self.used() + nbytes) == 0:
                return
        raise AssertionError(f"could not shrink the tmpfs at {self.path}")

    def unmount(self):
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """The checkpoint folder of a run in tmp_path/run, a tmpfs of its own (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = SmallDisk(tmp_path / "run" / "checkpoints")
    yield disk
    disk.unmount()


UNIT_BYTES = {"byte": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def size_in(line, pattern):
    """The bytes a line says where `pattern` has N, a size in any unit size_text writes (e.g.
    "needs about N" in "... needs about 3.25 MiB ...")."""
    size = r"(-?[\d.]+) (" + "|".join(UNIT_BYTES) + ")"
    found = re.search(re.escape(pattern).replace("N", size), line)
    assert found, (pattern, line)
    return float(found[1]) * UNIT_BYTES[found[2]]


@pytest.mark.parametrize(
    "nbytes, text",
    [
        (0, "0 bytes"),
        (1, "1 byte"),
        (1023, "1023 bytes"),
        (1024, "1.00 KiB"),
        (1023.5, "1.00 KiB"),  # rounds to 1024 bytes: a KiB
        (1536, "1.50 KiB"),
        (10 * 2**20, "10.0 MiB"),
        (10 * 2**20 - 1, "10.0 MiB"),  # 9.999...: three digits, not "10.00"
        (99.96 * 2**20, "100 MiB"),  # not "100.0"
        (1023.7 * 2**20, "1.00 GiB"),  # not "1024 MiB"
        (1.5e9, "1.40 GiB"),  # a decimal 1.5 GB
        (100 * 2**30, "100 GiB"),
        (2**50, "1024 TiB"),  # TiB at most
        (-3 * 2**20, "-3.00 MiB"),
    ],
)
def test_sizes_are_said_in_binary_units_with_two_or_three_digits(nbytes, text):
    assert size_text(nbytes) == text


def test_every_size_said_reads_back_within_its_rounding():
    for nbytes in [0, 1, 7, 999, 1000, 1023, 1024, 5000, 123_456, 10**7, 3 * 2**30, 10**12, 5 * 2**40]:
        said = size_text(nbytes)
        assert abs(size_in(f"x {said} y", "x N y") - nbytes) <= 0.005 * nbytes, (nbytes, said)


def the_line(output, words):
    lines = [line for line in output.splitlines() if words in line]
    assert len(lines) == 1, output  # said once
    return lines[0]


def fill_during(command, disk, first, log):
    """Run `command` until it ends (its output into `log`); once its checkpoint `first` (a file
    or folder on `disk`) is complete, leave less room than a quarter of it. Returns (exit
    status, output)."""
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=PROJECT, env=training_env(), stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            wait_for(first, process)
            size = sum(p.stat().st_size for p in [first, *first.rglob("*")] if p.is_file())
            disk.leave_free(size // 4)
            process.wait(timeout=300)
        finally:
            kill_tree(process.pid)
            process.wait()
    return process.returncode, log.read_text()


def test_a_full_disk_stops_the_save_in_plain_words_and_the_same_command_resumes(reference, small_disk, tmp_path):
    """ddp: the disk fills after the first checkpoint. The next save stops the run with one line
    that names the folder, the space free and needed, and what to do; the temporary file is
    gone, last.pt is the checkpoint before, whole; with room again the same command resumes
    and ends as the uninterrupted run."""
    output_dir = tmp_path / "run"
    args = [*ARGS, *ONE]
    command = training_command(output_dir, *args, probe="float64,slow")  # slow: the test fills it mid-run
    first = checkpoint(output_dir, int(args[args.index("--checkpoint_every_steps") + 1]))
    returncode, output = fill_during(command, small_disk, first, tmp_path / "log")
    assert returncode == 1, output
    line = the_line(output, "no space left on device in")
    assert f"no space left on device in {small_disk.path}: " in line
    saved = sorted(small_disk.path.glob("step_*.pt"))
    size = saved[-1].stat().st_size
    needs = size_in(line, "needs about N")
    assert abs(needs - size) < 0.1 * size, (line, size)  # the size it says is the checkpoint's
    assert size_in(line, "N free") < needs  # and the free space it says is less
    assert "--keep_checkpoints" in line and "run the same command to resume" in line
    assert not list(small_disk.path.glob(".*")), list(small_disk.path.iterdir())  # no temporary file left
    last = loading.load_checkpoint(small_disk.path / "last.pt")
    assert os.path.samefile(small_disk.path / "last.pt", saved[-1])
    step = last["step"]
    assert f"checkpoint of step {step} " not in line and "is not saved" in line
    small_disk.resize("50%")  # room again
    resumed = run_training(output_dir, *args, probe="float64")  # not slowed: nothing is done to it mid-run
    assert f"step {step}" in resumed.stdout and "resumed from" in resumed.stdout
    assert_same_parameters(output_dir, reference.one)
    assert_same_metrics(output_dir, reference.one)


def test_a_full_disk_under_fsdp_removes_the_partial_checkpoint_and_resumes(reference, small_disk, tmp_path):
    """fsdp, every rank writing its shards in the background (--async_checkpoint): the save that
    found the disk full is said in plain words when it is waited for, its partial folder is
    removed, `last` is the checkpoint before it, whole; the same command resumes with room and
    ends as the uninterrupted (ddp) run, up to the order of the sums."""
    output_dir = tmp_path / "run"
    args = [*ARGS, *TWO, "--strategy", "fsdp", "--async_checkpoint", "true"]
    command = training_command(output_dir, *args, nproc=2, probe="float64")
    first = output_dir / "checkpoints" / f"step_{int(args[args.index('--checkpoint_every_steps') + 1]):09d}"
    returncode, output = fill_during(command, small_disk, first, tmp_path / "log")
    assert returncode != 0, output
    line = the_line(output, "no space left on device in")
    assert "is not saved" in line and size_in(line, "N free") < size_in(line, "needs about N")
    assert not re.search(r'ddp_utils/checkpoint/\w+\.py", line', output)  # one line, no traceback
    assert not list(small_disk.path.glob(".*")), list(small_disk.path.iterdir())  # the partial folder is gone
    last = small_disk.path / "last"
    sharded.check_sharded_checkpoint(last)
    step = loading.load_checkpoint(last)["step"]
    small_disk.resize("50%")
    resumed = run_training(output_dir, *args, nproc=2, probe="float64")
    assert f"step {step}" in resumed.stdout and "resumed from" in resumed.stdout
    torch.set_default_dtype(torch.float64)  # the runs' dtype: the shards gathered into a float64 model
    try:
        ours = export.consolidated(TASK, last)["model"]
    finally:
        torch.set_default_dtype(torch.float32)
    theirs = torch.load(reference.two / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert max(relative_difference(ours[key], theirs[key]) for key in theirs) < run_tolerance()


def test_a_disk_too_small_for_the_kept_checkpoints_stops_before_the_first_step(reference, small_disk, tmp_path):
    """The checkpoint folder holds three checkpoints, the run keeps --keep_checkpoints of them and
    writes one more: it stops before its first step with one line that says the numbers."""
    args = [*ARGS, *ONE]
    size = checkpoint(reference.one, 4).stat().st_size  # what a checkpoint of this run takes
    keep = int(args[args.index("--keep_checkpoints") + 1])
    assert keep > 2, "the test needs more kept checkpoints than three fit"
    assert small_disk.resize(int(3.5 * size)) == 0
    result = run_training(tmp_path / "run", *args, probe="float64", check=False)
    assert result.returncode == 1
    line = the_line(result.stdout, "not enough space for checkpoints in")
    needs = size_in(line, "needs about N")
    assert abs(needs - size) < 0.1 * size, (line, size)
    assert abs(size_in(line, "N free") - 3.5 * size) < 0.1 * size, line
    peak = size_in(line, f"--keep_checkpoints {keep} keeps up to N at once")
    assert abs(peak - (keep + 1) * needs) < 0.02 * peak, line  # the kept ones and the one being written
    assert "pass --keep_checkpoints 2" in line, line  # what fits
    assert not list(small_disk.path.iterdir())  # nothing written
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_doctor_says_what_each_rank_writes_of_a_checkpoint(reference):
    """The doctor's checkpoint sizes, for the model in float64 as the reference run trained it:
    under ddp, rank 0 writes about the size of the run's checkpoint; under fsdp each rank a
    share."""
    torch.set_default_dtype(torch.float64)
    try:
        model = TASK.build_model(TINY_CONFIG.resolved())
    finally:
        torch.set_default_dtype(torch.float32)
    plan = doctor_memory.checkpoint_plan(model, TINY_CONFIG, 1)
    size = checkpoint(reference.one, 4).stat().st_size
    assert abs(plan["ddp"]["rank 0"] - size) < 0.1 * size, (plan, size)
    assert plan["ddp"]["each other rank"] == 0
    shared = doctor_memory.checkpoint_plan(model, TINY_CONFIG, 4)["fsdp"]
    assert shared["rank 0"] > shared["each other rank"] > 0
    assert shared["rank 0"] + 3 * shared["each other rank"] > shared["checkpoint"] * 0.9
    row = doctor_memory.checkpoint_check(plan, TINY_CONFIG, 1)
    assert row["status"] == "pass" and "under ddp, all from rank 0" in row["summary"]
