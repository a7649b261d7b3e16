"""Shared helpers: run train.py for real, as one process or under torchrun with gloo on CPU.

Every process a test starts ends with the test, whatever happens: torchrun starts its workers
in sessions of their own, so killing torchrun (or its process group) does not reach them. This
process is made the "subreaper" of everything it starts (workers whose torchrun died are
handed to it, not to init), and after each test every process it started and left running
is killed by PID (`end_leftover_processes`).
"""

import atexit
import ctypes
import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))

import task_settings  # noqa: E402 (tests/task_settings.py: what the tests must know of this project's data)

from config import Config  # noqa: E402
from ddp_utils.configuration import parse_config  # noqa: E402
from ddp_utils.doctor.equivalence import gradients  # noqa: E402
from ddp_utils.doctor.numerics import TOLERANCES, Tolerance, watching_casts  # noqa: E402
from ddp_utils.doctor.rows import halves, to_float64  # noqa: E402
from task import TASK  # noqa: E402

# Small and fast: every test trains for real, so keep the task tiny: 1024 training and 256
# validation samples, a tiny model, a global batch of 64 (16 steps an epoch) with 2 processes.
DATA = Path(tempfile.mkdtemp(prefix="ddp-test-data-"))
atexit.register(shutil.rmtree, DATA, ignore_errors=True)


def config_flags(path):
    """The flags that set what a config file sets (but its output_dir): the tests add their
    own flags after them, and some pass --config themselves."""
    cfg, defaults = parse_config(Config, ["--config", str(path)], resolve=False), Config()
    changed = [f.name for f in dataclasses.fields(Config) if getattr(cfg, f.name) != getattr(defaults, f.name)]
    values = {name: getattr(cfg, name) for name in changed if name != "output_dir"}
    return [text for name, value in values.items() for text in (f"--{name}", flag_text(value))]


def flag_text(value):
    """A config value as its flag takes it (booleans as true/false)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


# The task's smallest model (experiments/tiny.toml: its sizes and lr), on the shared sizes.
TINY = ["--train_samples", "1024", "--val_samples", "256", "--batch_size", "32", "--epochs", "2"]
TINY += [
    "--log_every_steps",
    "0",
    *config_flags(PROJECT / "experiments" / "tiny.toml"),
    *task_settings.prepare_data(DATA),
]
TINY_CONFIG = parse_config(Config, TINY, resolve=False)  # the config of a TINY run (nothing read from the data)
LR = TINY_CONFIG.lr  # the peak lr of TINY runs


def training_command(output_dir, *args, nproc=1, probe=None, torchrun_args=(), tiny=True):
    """train.py with `nproc` processes (torchrun when nproc > 1), on the TINY task (with
    `tiny`; without, only `args` and the output folder: a --config file's run, say).

    With `probe`, run it through tests/ddp_probe.py with that fault or instrument installed.
    """
    script = ["tests/ddp_probe.py", probe] if probe else ["train.py"]
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun_args]
    return [*launcher, *script, *(TINY if tiny else []), "--output_dir", str(output_dir), *map(str, args)]


def training_env(env=None):
    # scripts/launch.sh runs `torchrun`: take it from this interpreter's environment even when
    # that environment is not activated (`.venv/bin/python -m pytest`).
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PATH": path, **(env or {})}


def gpu_host(what="accelerator"):
    """Environment for processes that answer as on a machine with a GPU (tests/sitecustomize.py):
    `accelerator`, torch's accelerator query says cuda; `cuda_available`, the model's build
    also sees CUDA available."""
    return {"PYTHONPATH": str(PROJECT / "tests"), "FAKE_GPU_HOST": what}


def run_training(
    output_dir, *args, nproc=1, probe=None, timeout=180, env=None, check=True, torchrun_args=(), tiny=True
):
    """Run training to the end; returns the CompletedProcess (raises if it failed and `check`).

    Past `timeout` seconds the whole job, workers included, is killed and TimeoutExpired raised.
    """
    command = training_command(output_dir, *args, nproc=nproc, probe=probe, torchrun_args=torchrun_args, tiny=tiny)
    process = subprocess.Popen(command, cwd=PROJECT, env=training_env(env), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException:  # timed out or interrupted: torchrun and its workers, by PID
        kill_tree(process.pid)
        process.wait()
        raise
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def probe_output(result):
    """The PROBE lines printed by rank 0, as dicts."""
    lines = [line.removeprefix("PROBE ") for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    return [json.loads(line) for line in lines]


def read_metrics(output_dir):
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


# --- two suites: the quick check (`pytest`) and the full one (`pytest --full -n 2`) ----------
#
# A plain `pytest` runs the tests marked `quick` alone: the guarantees that break when the
# model or the data is swapped (1 vs 2 processes and accumulation, exact resume after SIGTERM,
# fsdp = ddp, the doctor's rows), a few minutes on 2 cores, the check to run after every change
# of model.py or dataset.py. Everything else is in the full suite only: a test joins the quick
# check by being marked, so a new module, unmarked, runs in the full suite. `--full` runs every
# test; so does naming test files or tests (`pytest tests/test_fsdp.py`: all of that file) or
# choosing by marker yourself (`pytest -m "not cluster"`).
FULL_SUITE = "pytest --full -n 2"  # both cores: pytest-xdist, in the dev extra


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help="run the whole suite (about 15 minutes on 2 cores with -n 2), not only the quick check "
        "(the tests marked quick, which a plain pytest runs)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "fixed_amp: sets --amp itself, so the project's default amp does not matter")
    config.addinivalue_line("markers", "alone: times things; run with nothing else on the machine")
    config.addinivalue_line(
        "markers", "cluster: a SLURM cluster, network-namespace hosts or Kubernetes manifests (tests/cluster/)"
    )
    config.addinivalue_line(
        "markers",
        f"quick: in the check a plain pytest runs (the guarantees a swapped model can break); {FULL_SUITE}: all",
    )


def quick_check(config):
    """Whether this run is the quick check: no --full, no -m of the user's, no test file named."""
    if config.getoption("full") or config.getoption("markexpr"):
        return False
    return not named_files(config)


def named_files(config):
    """The test files named on the command line (alone or with a test: FILE::TEST)."""
    where = config.invocation_params.dir
    paths = (Path(where, arg.split("::", 1)[0]) for arg in config.args)
    return {path.resolve() for path in paths if path.is_file()}


def pytest_report_header(config):
    if quick_check(config):
        return f"the quick check: the tests marked quick (the whole suite: {FULL_SUITE})"
    return None


def pytest_collection_modifyitems(config, items):
    """Everything under tests/cluster/ is marked `cluster`: `pytest -m "not cluster"` runs the
    unit and 2-process tests alone (the cluster tests skip by themselves where they cannot run).
    The quick check keeps the tests marked `quick` (see FULL_SUITE above)."""
    cluster = Path(__file__).parent / "cluster"
    for item in items:
        if cluster in Path(item.path).parents:
            item.add_marker(pytest.mark.cluster)
    if quick_check(config):
        kept = [item for item in items if item.get_closest_marker("quick")]
        config.hook.pytest_deselected(items=[item for item in items if not item.get_closest_marker("quick")])
        items[:] = kept


def pytest_terminal_summary(terminalreporter, config):
    deselected = len(terminalreporter.stats.get("deselected", []))
    if quick_check(config) and deselected:
        terminalreporter.write_line(f"the quick check only: {FULL_SUITE} runs the {deselected} other tests too")


def relative_difference(a, b):
    """|a - b| / |b| of two tensors; counters (BatchNorm's num_batches_tracked) must be equal."""
    if not b.is_floating_point():
        return 0.0 if torch.equal(a, b) else float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def load_final_model(output_dir):
    state = torch.load(Path(output_dir) / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    return state["model"]


@pytest.fixture(scope="session")
def one_node_run(tmp_path_factory):
    """One node, 2 processes, --amp none: what multi-node and Kubernetes runs must reproduce bit for bit."""
    output_dir = tmp_path_factory.mktemp("one_node")
    run_training(output_dir, "--amp", "none", nproc=2)
    return output_dir


@pytest.fixture(scope="session")
def two_process_run(tmp_path_factory):
    """One 2-process gloo run shared by the tests that only inspect its outputs."""
    output_dir = tmp_path_factory.mktemp("two_process_run")
    result = run_training(output_dir, "--epochs", "3", "--log_every_steps", "4", nproc=2)
    return output_dir, result


# --- runs that stop and resume (test_resilience.py, test_preemption.py) -------------------

# 1024 samples, global batch 64: 16 optimizer steps per epoch, 48 in all; a checkpoint every
# 4 steps, all kept, so tests can resume from any of them.
ARGS = ["--amp", "none", "--epochs", "3", "--checkpoint_every_steps", "4", "--keep_checkpoints", "100"]
TWO = ["--batch_size", "32"]  # with 2 processes
ONE = ["--batch_size", "64"]  # with 1 process: the same global batch


class ReferenceRuns:
    """Uninterrupted runs, each made the first time a test asks for it: `two` (2 processes x
    32) and `one` (1 process x 64, the same global batch). Both in float64 (tests/ddp_probe.py
    float64), as is every run that resumes from their checkpoints or is compared with them
    (probe="float64"): a resume on the same world size is then still bit for bit, and one on
    the other world size differs by summation order alone (run_tolerance). In float32 an
    entry whose gradient is zero in exact arithmetic (an attention key bias) gets rounding
    noise near AdamW's eps, which it scales to whole steps that differ with the order of the
    sums: the runs would compare noise, not the world size's arithmetic."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory

    @functools.cached_property
    def two(self):
        output_dir = self.tmp_path_factory.mktemp("reference_two")
        run_training(output_dir, *ARGS, *TWO, nproc=2, probe="float64")
        return output_dir

    @functools.cached_property
    def one(self):
        output_dir = self.tmp_path_factory.mktemp("reference_one")
        run_training(output_dir, *ARGS, *ONE, probe="float64")
        return output_dir


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Read only, so one pytest run's modules share them (a run of the whole suite makes each once)."""
    return ReferenceRuns(tmp_path_factory)


def checkpoint(output_dir, step):
    return output_dir / "checkpoints" / f"step_{step:09d}.pt"


def start_from(source_checkpoint, output_dir):
    """An output folder whose newest checkpoint is `source_checkpoint`, as if the run had stopped there."""
    (output_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(source_checkpoint, output_dir / "checkpoints" / "last.pt")
    return output_dir


def assert_same_parameters(output_dir, reference_dir):
    ours, theirs = load_final_model(output_dir), load_final_model(reference_dir)
    assert ours.keys() == theirs.keys()
    differ = [key for key in theirs if not torch.equal(ours[key], theirs[key])]
    worst = max((relative_difference(ours[key], theirs[key]), key) for key in differ) if differ else None
    assert not differ, f"parameters differ from the uninterrupted run: {worst[1]} by {worst[0]:.2e} (relative)"


def gap(ours, theirs, what, tolerance):
    """Why two numbers (or lists of them) are not equal to `tolerance`, relative: the worst
    difference and how many times the tolerance it is (a fault's margin over the tolerance)."""
    pairs = zip(ours, theirs, strict=True) if isinstance(theirs, (list, tuple)) else [(ours, theirs)]
    worst = max(abs(a - b) / max(abs(b), 1e-300) for a, b in pairs)
    return f"{what} differ by {worst:.2e} (relative), {worst / tolerance:.3g}x the tolerance {tolerance:g}"


TIMINGS = {
    "samples_per_s",
    "tokens_per_s",
    "data_wait_s",
    "compute_s",
    "checkpoint_s",
    "cpu_s",
    "peak_memory_mb",
    "mfu",
    "hfu",
}


@functools.cache
def run_tolerance():
    """How closely two float64 runs of TINY that split the work differently (world size,
    accumulation, sharding) must agree, relative: judged as the doctor judges its 1 vs 2
    processes row (ddp_utils/doctor/equivalence.py), exact where the model's runs agree exactly.

    Their sums differ in order only, ~1e-16 each: after 32 steps the GPT's and a Llama's
    parameters and metrics agree to 1e-13, so 1e-9, far below any fault (a loss not averaged, a
    sample seen twice, an evaluation that averages the ranks' averages). A model that computes
    in a lower precision inside whatever it is given gets that precision's tolerance (the
    doctor's, ddp_utils/doctor/numerics.py; float32: 1e-6) only where that changes what a split
    of the work computes: the gradients of a batch and of its two halves are compared in float64
    at the doctor's EXACT, and must differ by more. A Mamba's scan in float32 sums over the batch
    in float32 (its runs' metrics differ by 5e-8): 1e-6. A Llama's RMSNorm casts each token to
    float32 and back, the same on every split (its runs agree to 5e-16): 1e-9, so a fault on it
    is caught with a thousand times the room 1e-6 would leave."""
    cfg, previous = TINY_CONFIG.resolved(), torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(cfg.seed)
        model = TASK.build_model(cfg).eval()  # no dropout; batch norms on their running statistics
        train, _ = TASK.build_datasets(cfg)
        batch = to_float64(default_collate([train[index] for index in range(min(cfg.batch_size, len(train)))]))
        with watching_casts() as watch:
            whole = gradients(model, [batch], TASK.loss_fn)
        tolerance = Tolerance.watched(model, watch)
        if tolerance.lowest == torch.float64:
            return 1e-9
        verdict, _ = tolerance.compare(whole, gradients(model, halves(batch), TASK.loss_fn))
    finally:
        torch.set_default_dtype(previous)
    # "differs" is a fault of the model itself (a loss that is no mean): the runs then show it at 1e-9.
    return TOLERANCES[tolerance.lowest] if verdict == "close" else 1e-9


def compared_metrics(line):
    """A metrics line's numbers that two runs of the same training must share: all but timings
    (the task's own metrics whatever their names)."""
    return {key: value for key, value in line.items() if key not in TIMINGS}


def assert_same_metrics(output_dir, reference_dir):
    """The metrics lines present in `output_dir` equal the reference's lines for those epochs."""
    ours = read_metrics(output_dir)
    theirs = {m["epoch"]: m for m in read_metrics(reference_dir)}
    assert ours, "no metrics written"
    for line in ours:
        expected = theirs[line["epoch"]]
        assert compared_metrics(line) == compared_metrics(expected)


def saved_step(output_dir):
    state = torch.load(output_dir / "checkpoints" / "last.pt", weights_only=True)
    return state["step"], state["epoch"], state["batches_done"]


def wait_for(path, process, seconds=180):
    """Wait until `path` exists; fail at once if `process` ends first, or after `seconds` (start-up
    and training on a busy machine: minutes, not the seconds an idle one takes)."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, f"training ended (rc {process.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


# --- no process outlives its test --------------------------------------------------------

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper():
    """Orphans among our descendants (workers whose torchrun was killed) become our children."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: leftovers are then found only while torchrun lives
        pass


become_subreaper()


def descendants(pid):
    """PIDs of every living descendant of `pid`, from /proc."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid):
    """SIGKILL `pid` and all its descendants, by PID (descendants first: once `pid` is gone,
    its children can no longer be found from it)."""
    for target in [*descendants(pid), pid]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(autouse=True)
def end_leftover_processes():
    """After each test, kill every process it started that still runs (fixtures of a wider
    scope, started before, are left alone), and reap those handed to us."""
    before = set(descendants(os.getpid()))
    yield
    leftovers = set(descendants(os.getpid())) - before
    for pid in leftovers:
        kill_tree(pid)
    for pid in leftovers:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # not our child (its own parent reaps it), or reaped already
            pass
