"""--strategy fsdp: the same training as DDP from the same initial weights, sharded checkpoints
that resume exactly after SIGTERM and on another world size, past a damaged shard, and a
one-file export for sample.py, predict.py and sharing."""

import contextlib
import copy
import functools
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import conftest
import pytest
import torch
from conftest import (
    PROJECT,
    TINY,
    TINY_CONFIG,
    assert_same_metrics,
    compared_metrics,
    gap,
    gpu_host,
    kill_tree,
    probe_output,
    read_metrics,
    relative_difference,
    run_tolerance,
    training_env,
    wait_for,
)
from ddp_probe import InFloat64
from torch.distributed.checkpoint.staging import DefaultStager

from config import Config
from ddp_utils import export
from ddp_utils.checkpoint.sharded import check_sharded_checkpoint
from ddp_utils.configuration import parse_config
from ddp_utils.contract import model_inputs
from ddp_utils.core.compat import stager_reusable
from ddp_utils.distributed.process_group import DistContext
from ddp_utils.doctor import memory as doctor_memory
from ddp_utils.doctor import run as doctor
from ddp_utils.doctor.numerics import TOLERANCES
from ddp_utils.errors import ConfigError
from ddp_utils.parallel.activation_checkpointing import checkpointable_blocks
from ddp_utils.parallel.model_init import build_module
from ddp_utils.parallel.strategy import hsdp_replicas, mesh_group_settings
from task import TASK

pytestmark = pytest.mark.fixed_amp  # comparisons need --amp none


def in_float64(run):
    """Every run of this module computes in float64 (tests/ddp_probe.py float64): ddp, fsdp and
    hsdp, and checkpoints resumed on another world size, differ by the order of their sums alone
    (all-reduce or reduce-scatter, norms over whole tensors or shards), and are compared at
    conftest.run_tolerance; in float32, rounding noise amplified by AdamW would compare noise,
    not sharding."""

    def wrapped(*args, probe=None, **kwargs):
        return run(*args, probe=f"float64,{probe}" if probe else "float64", **kwargs)

    return wrapped


run_training, training_command = in_float64(conftest.run_training), in_float64(conftest.training_command)


@contextlib.contextmanager
def float64_default():
    """torch's default dtype float64, as in the runs: data made with it (torch.randn) differ."""
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


# 12 optimizer steps of 2 micro-steps, clipped hard enough to bite every step; a sharded
# checkpoint every 2 steps, all kept, so tests can resume from any of them.
MAX_GRAD_NORM = 0.05
ARGS = ["--amp", "none", "--max_steps", "12", "--grad_accum_steps", "2", "--max_grad_norm", str(MAX_GRAD_NORM)]
ARGS += ["--checkpoint_every_steps", "2", "--keep_checkpoints", "100"]
# 33 validation samples: 17 on rank 0, 16 on rank 1, so one rank has a batch more (of 16).
ARGS += ["--val_samples", "33"]
TWO = ["--batch_size", "16"]  # x 2 processes x 2 micro-steps: a global batch of 64
ONE = ["--batch_size", "32"]  # x 1 process x 2 micro-steps: the same global batch
# With activation checkpointing where the task's model takes it: it must combine with sharding.
CHECKPOINTED = ["--activation_checkpointing", "full"] if checkpointable_blocks(TASK.build_model(TINY_CONFIG)) else []
FSDP = ["--strategy", "fsdp", *CHECKPOINTED]
# Hybrid sharding: 4 processes (x 8 x 2 micro-steps: the same global batch) as 2 replicas of 2
# shards, as --replicate_degree's default makes of 2 nodes x 2 GPUs.
HSDP = ["--batch_size", "8", *FSDP, "--replicate_degree", "2"]


class Runs:
    """Uninterrupted 2-process runs, each made the first time a test asks for it."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory

    @functools.cached_property
    def ddp(self):
        output_dir = self.tmp_path_factory.mktemp("ddp")
        probes = "record_initial_weights,record_grad_norms"
        return output_dir, run_training(output_dir, *ARGS, *TWO, nproc=2, probe=probes)

    @functools.cached_property
    def fsdp(self):
        """On a machine whose torch has a GPU for its accelerator, told to train on the CPU:
        FSDP2's mesh, parameters and inputs must stay where --device says."""
        output_dir = self.tmp_path_factory.mktemp("fsdp")
        probes = "record_initial_weights,record_grad_norms,record_gradient_memory"
        return output_dir, run_training(output_dir, *ARGS, *TWO, *FSDP, "--device", "cpu", nproc=2, probe=probes,
                                        env=gpu_host())  # fmt: skip

    @functools.cached_property
    def hsdp(self):
        output_dir = self.tmp_path_factory.mktemp("hsdp")
        return output_dir, run_training(output_dir, *ARGS, *HSDP, nproc=4, probe="record_grad_norms,record_mesh")

    @functools.cached_property
    def one_from_two(self):
        """fsdp on 1 process from the 2-process run's checkpoints of steps 4 and 6, the newest
        of them damaged: a shard file cut short."""
        source = self.fsdp[0] / "checkpoints"
        output_dir = self.tmp_path_factory.mktemp("one_from_two")
        for step in (4, 6):
            shutil.copytree(source / f"step_{step:09d}", output_dir / "checkpoints" / f"step_{step:09d}")
        damaged = output_dir / "checkpoints" / "step_000000006" / "__1_0.distcp"
        damaged.write_bytes(damaged.read_bytes()[:1000])
        return output_dir, run_training(output_dir, *ARGS, *ONE, *FSDP)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory)


def final_weights(output_dir):
    """The whole model of a run's newest checkpoint (one file, or gathered from its shards into
    the model built in float64, as the runs were: in float32 the shards would be rounded to it)."""
    checkpoints = output_dir / "checkpoints"
    with float64_default():
        return export.consolidated(
            TASK, checkpoints / "last.pt" if (checkpoints / "last.pt").exists() else checkpoints / "last"
        )["model"]


def assert_close_weights(ours, theirs):
    """Equal up to the order of the sums (float64; run_tolerance)."""
    assert ours.keys() == theirs.keys()
    worst = max(relative_difference(ours[key], theirs[key]) for key in theirs)
    tolerance = run_tolerance()
    assert worst < tolerance, (
        f"parameters differ by {worst:.2e} (relative), {worst / tolerance:.3g}x the tolerance {tolerance:g}"
    )


def trained_metrics(output_dir):
    """The last metrics line's numbers that every strategy must share: the task's own metrics,
    whatever their names, the loss, step and lr; not timings nor the model state a process holds."""
    line = compared_metrics(read_metrics(output_dir)[-1])
    del line["model_state_mb"]
    return line


@pytest.mark.quick
def test_fsdp_trains_the_same_parameters_as_ddp(runs):
    """Accumulation without a sync per micro-step, clipping on sharded gradients, and the
    meta-device start give what DDP gives (float rounding aside)."""
    (ddp_dir, ddp), (fsdp_dir, fsdp) = runs.ddp, runs.fsdp
    assert_close_weights(final_weights(fsdp_dir), final_weights(ddp_dir))
    (ddp_norms,) = probe_output(ddp)
    (fsdp_norms,) = [line for line in probe_output(fsdp) if "grad_norms" in line]
    assert len(fsdp_norms["grad_norms"]) == 12
    assert min(fsdp_norms["grad_norms"]) > MAX_GRAD_NORM  # clipping acted on every step
    assert fsdp_norms["grad_norms"] == pytest.approx(ddp_norms["grad_norms"], rel=run_tolerance()), gap(
        fsdp_norms["grad_norms"], ddp_norms["grad_norms"], "gradient norms", run_tolerance()
    )
    ours, theirs = trained_metrics(fsdp_dir), trained_metrics(ddp_dir)
    assert ours.keys() == theirs.keys() and ours == pytest.approx(theirs, rel=run_tolerance()), gap(
        [ours.get(key, float("nan")) for key in theirs], list(theirs.values()), "metrics", run_tolerance()
    )


def test_fsdp_accumulates_gradients_as_shards(runs):
    """Between the micro-steps of an optimizer step each process holds its shard of the
    gradients, not the whole model's unsharded gradient (the memory fsdp is chosen to save)."""
    (held,) = [line["gradient_memory"] for line in probe_output(runs.fsdp[1]) if "gradient_memory" in line]
    assert held is not None and held <= 1.0, f"{held:.2f} parameter shards' worth of gradient held"


def test_fsdp_holds_half_the_model_state_per_process(runs):
    """Parameters, gradients and AdamW state: each of the 2 processes keeps about half."""
    ddp_mb = read_metrics(runs.ddp[0])[-1]["model_state_mb"]
    fsdp_mb = read_metrics(runs.fsdp[0])[-1]["model_state_mb"]
    assert fsdp_mb <= 0.55 * ddp_mb, (fsdp_mb, ddp_mb)


def test_the_doctor_plans_the_model_state_each_process_held(runs):
    """doctor.py's memory plan for this job (2 processes) is within 5% of the parameters,
    gradients and AdamW state each process of the ddp and fsdp runs held (model_state_mb)."""
    cfg = parse_config(Config, [*TINY, *ARGS, *TWO])
    with float64_default():  # as the runs were: the model and its data in float64 (tests/ddp_probe.py float64)
        task = TASK.replace(build_datasets=lambda cfg: tuple(map(InFloat64, TASK.build_datasets(cfg))))
        built, small, _ = doctor.build(task, cfg)
        plans, _, _ = doctor_memory.memory_plan(built, small, task.loss_fn, cfg, world_size=2, gpus_per_node=2)
    for name in ("ddp", "fsdp"):
        planned = sum(plans[name][part] for part in ("parameters", "gradients", "optimizer")) / 2**20
        held = read_metrics(getattr(runs, name)[0])[-1]["model_state_mb"]
        assert planned == pytest.approx(held, rel=0.05), (name, planned, held)


@pytest.mark.quick
def test_both_strategies_start_from_the_weights_the_model_makes(runs):
    """ddp and fsdp start from the same weights: those build_model(cfg) makes with torch seeded
    by --seed, its own initialisation kept; or, for a model with init_weights, those of the
    module-by-module start, which a meta-device start (--init_on_meta) gives too."""
    cfg = parse_config(Config, [*TINY, *ARGS, *TWO, *FSDP])
    ddp_start = torch.load(runs.ddp[0] / "initial_weights.pt", weights_only=True)
    fsdp_start = torch.load(runs.fsdp[0] / "initial_weights.pt", weights_only=True)
    with torch.device("meta"):
        by_module = hasattr(TASK.build_model(cfg), "init_weights")
    with float64_default():  # as the runs were
        if by_module:
            expected = build_module(cfg, TASK.build_model, torch.device("cpu"), on_meta=True).state_dict()
        else:
            torch.manual_seed(cfg.seed)
            expected = TASK.build_model(cfg).state_dict()
    for start in (ddp_start, fsdp_start):
        assert start.keys() == expected.keys()
        assert [key for key in expected if not torch.equal(start[key], expected[key])] == []


def test_export_writes_one_weights_only_file_with_the_run_validation_loss(runs, tmp_path):
    fsdp_dir, _ = runs.fsdp
    out = tmp_path / "model.pt"
    command = [sys.executable, "export.py", str(fsdp_dir / "checkpoints" / "last"), str(out)]
    result = subprocess.run(command, cwd=PROJECT, env=training_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    state = torch.load(out, weights_only=True)
    cfg = Config(**state["config"])
    functions = TASK
    totals = {}
    with float64_default(), torch.no_grad():
        net = functions.build_model(cfg)
        net.load_state_dict(state["model"])
        net.eval()
        _, val_set = functions.build_datasets(cfg)
        for batch in torch.utils.data.DataLoader(val_set, batch_size=64):
            batch = torch.utils._pytree.tree_map_only(
                torch.Tensor, lambda t: t.double() if t.is_floating_point() else t, batch
            )
            for name, value in functions.evaluation_sums(net(model_inputs(batch)), batch).items():
                totals[name] = totals.get(name, 0.0) + float(value)
    val_loss = functions.evaluation_metrics(totals)["val_loss"]  # the run's sums, in another order
    # export.py builds the model in torch's default dtype, float32, and loads the float64 run's
    # shards into it: every weight rounded to float32 (6e-8), which moves the loss by about as
    # much (3e-9 for the tabular MLP); float32's tolerance (the doctor's) holds it.
    tolerance = max(run_tolerance(), TOLERANCES[torch.float32])
    assert val_loss == pytest.approx(read_metrics(fsdp_dir)[-1]["val_loss"], rel=tolerance)


def train_until_sigterm(output_dir, args, nproc, probe):
    """Train in the background until the step-4 checkpoint exists, then SIGTERM torchrun; returns
    the run's output."""
    log_path = output_dir.parent / f"{output_dir.name}.log"
    with open(log_path, "w") as log:
        command = training_command(output_dir, *args, nproc=nproc, probe=probe)
        process = subprocess.Popen(command, cwd=PROJECT, env=training_env(), stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            wait_for(output_dir / "checkpoints" / "step_000000004", process)
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) != 0
        finally:
            kill_tree(process.pid)
            process.wait()
    return log_path.read_text()


def test_sigterm_under_fsdp_saves_shards_and_resume_is_exact(runs, tmp_path):
    """SIGTERM to torchrun: the ranks agree, finish the (asynchronous) sharded save and exit;
    the same command resumes, bit for bit the uninterrupted run. Every asynchronous save
    staged the shards into the same host buffers (none allocated afresh per save)."""
    output_dir = tmp_path / "run"
    args = [*ARGS, *TWO, *FSDP, "--async_checkpoint", "true"]
    log = train_until_sigterm(output_dir, args, nproc=2, probe="slow_until_stopped,record_staging")
    stopped_at = int(log.split("stopped by SIGTERM at step ", 1)[1].split(";")[0])
    assert 4 < stopped_at < 12  # before --max_steps 12: the resume has steps to take
    (staged,) = [json.loads(line.removeprefix("PROBE "))["staging_buffers"] for line in log.splitlines()
                 if line.startswith("PROBE {\"staging_buffers")]  # fmt: skip
    assert len(staged) >= 3, staged
    if stager_reusable(DefaultStager):  # torch 2.11's stages once: a new one (new buffers) each save
        assert all(buffers == staged[0] for buffers in staged), staged
    # The save in flight when the stop came is complete, and `last` is it.
    assert torch.load(output_dir / "checkpoints" / "last" / "trainer.pt", weights_only=True)["step"] == stopped_at
    run_training(output_dir, *args, nproc=2)  # the same command again
    ours, theirs = final_weights(output_dir), final_weights(runs.fsdp[0])
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs), "parameters differ from the uninterrupted run"
    assert_same_metrics(output_dir, runs.fsdp[0])


def test_damaged_shard_falls_back_and_two_process_checkpoint_resumes_on_one(runs):
    output_dir, result = runs.one_from_two
    assert "step_000000006 is unreadable" in result.stdout and "trying an older checkpoint" in result.stdout
    assert "resumed from" in result.stdout and "step_000000004: epoch 1, step 4" in result.stdout
    check_sharded_checkpoint(output_dir / "checkpoints" / "step_000000006")  # saved again, whole
    assert_close_weights(final_weights(output_dir), final_weights(runs.fsdp[0]))
    ours, theirs = read_metrics(output_dir)[-1], read_metrics(runs.fsdp[0])[-1]
    assert (ours["step"], ours["lr"]) == (theirs["step"], theirs["lr"])  # the schedule on course


def test_one_process_checkpoint_resumes_on_two(runs, tmp_path):
    source = runs.one_from_two[0] / "checkpoints" / "step_000000008"
    assert torch.load(source / "trainer.pt", weights_only=True)["world_size"] == 1
    shutil.copytree(source, tmp_path / "checkpoints" / source.name)
    # Gathered parameters kept from forward to backward: fewer all-gathers, the same numbers.
    args = [*ARGS, *TWO, *FSDP, "--reshard_after_forward", "false", "--keep_checkpoints", "1"]
    result = run_training(tmp_path, *args, nproc=2)
    assert "step_000000008: epoch 1, step 8" in result.stdout
    # One step folder kept (steps 10 and 12 written since), the one `last` names.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last", "step_000000012"]
    assert (tmp_path / "checkpoints" / "last").resolve().name == "step_000000012"
    assert_close_weights(final_weights(tmp_path), final_weights(runs.fsdp[0]))
    ours, theirs = read_metrics(tmp_path)[-1], read_metrics(runs.fsdp[0])[-1]
    assert (ours["step"], ours["lr"]) == (theirs["step"], theirs["lr"])


def test_sharded_checkpoint_of_the_one_group_optimizer_resumes_with_its_state(tmp_path):
    """As test_resilience.py's, for sharded checkpoints: written with one AdamW group, resumed
    into the two groups (by parameter name), bit for bit an uninterrupted run."""
    args = [*ARGS, *TWO, *FSDP, "--weight_decay", "0", "--max_steps", "4"]
    run_training(tmp_path / "old", *args, nproc=2, probe="single_param_group")
    run_training(tmp_path / "new", *args, nproc=2)
    step_2 = Path("checkpoints") / "step_000000002"
    shutil.copytree(tmp_path / "old" / step_2, tmp_path / "resumed" / step_2)
    result = run_training(tmp_path / "resumed", *args, nproc=2)
    assert result.stdout.count("was saved with weight decay on every parameter") == 1, result.stdout
    assert "step_000000002: epoch 1, step 2" in result.stdout
    ours, theirs = final_weights(tmp_path / "resumed"), final_weights(tmp_path / "new")
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs), "parameters differ from the uninterrupted run"


# --- hybrid sharding (HSDP) ---------------------------------------------------------------


def test_hsdp_trains_the_same_parameters_as_ddp(runs):
    """Each replica all-gathers within its own 2 processes, and only the gradient shards are
    all-reduced between the replicas: the same training as DDP, half the model state per process."""
    (ddp_dir, ddp), (hsdp_dir, hsdp) = runs.ddp, runs.hsdp
    assert "hsdp: 2 replicas, each sharded over 2 process(es)" in hsdp.stdout
    assert_close_weights(final_weights(hsdp_dir), final_weights(ddp_dir))
    (ddp_norms,) = probe_output(ddp)
    (mesh,) = [line["mesh"] for line in probe_output(hsdp) if "mesh" in line]
    # Rank 0's groups: its replica's 2 processes shard, one process of each replica replicates;
    # both with --timeout_seconds (600), not torch's default for new groups (gloo: 30 min).
    assert mesh == {"replicate": {"ranks": [0, 2], "timeout_s": 600}, "shard": {"ranks": [0, 1], "timeout_s": 600}}
    (hsdp_norms,) = [line for line in probe_output(hsdp) if "grad_norms" in line]
    # Clipping saw the norm over every shard, once.
    assert hsdp_norms["grad_norms"] == pytest.approx(ddp_norms["grad_norms"], rel=run_tolerance())
    ours, theirs = trained_metrics(hsdp_dir), trained_metrics(ddp_dir)
    assert ours.keys() == theirs.keys() and ours == pytest.approx(theirs, rel=run_tolerance())
    # Each process holds its replica's half, not a quarter (sharded over all 4) nor the whole.
    ratio = read_metrics(hsdp_dir)[-1]["model_state_mb"] / read_metrics(ddp_dir)[-1]["model_state_mb"]
    assert 0.45 <= ratio <= 0.55, ratio


@pytest.mark.parametrize("strategy, nproc", [("fsdp", 2), ("ddp", 1)])
def test_hsdp_checkpoint_resumes_under_fsdp_and_ddp_on_another_world_size(runs, tmp_path, strategy, nproc):
    """The shards of 2 x 2 processes, read by 2 plain fsdp processes or by one ddp process (whole
    tensors: ddp reads sharded checkpoints too); the runs end where DDP does."""
    source = runs.hsdp[0] / "checkpoints" / "step_000000006"
    args = [*ARGS, *(TWO if nproc == 2 else ONE), *(FSDP if strategy == "fsdp" else [])]
    result = run_training(tmp_path, *args, "--resume", source, nproc=nproc)
    assert f"resumed from {source}: epoch 1, step 6" in result.stdout
    assert_close_weights(final_weights(tmp_path), final_weights(runs.ddp[0]))


def test_hsdp_checkpoint_resumes_exactly_under_hsdp(runs, tmp_path):
    """A mid-epoch checkpoint of the 2 x 2 run, resumed by the same command: bit for bit the
    uninterrupted run. (A signal is agreed on every rank alike under each strategy: the fsdp
    SIGTERM test above covers the stop.)"""
    output_dir = tmp_path / "run"
    step_6 = Path("checkpoints") / "step_000000006"
    shutil.copytree(runs.hsdp[0] / step_6, output_dir / step_6)
    result = run_training(output_dir, *ARGS, *HSDP, nproc=4)
    assert "step_000000006: epoch 1, step 6" in result.stdout
    ours, theirs = final_weights(output_dir), final_weights(runs.hsdp[0])
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs), "parameters differ from the uninterrupted run"
    assert_same_metrics(output_dir, runs.hsdp[0])


def test_one_replica_per_node_by_default():
    def replicas(world_size, local_world_size, replicate_degree=0):
        ctx = DistContext(0, 0, world_size, torch.device("cpu"), None, local_world_size)
        return hsdp_replicas(Config(strategy="fsdp", replicate_degree=replicate_degree), ctx)

    assert replicas(16, 8) == 2 and replicas(8, 8) == 1
    assert replicas(4, 1) == 1  # one process per node: replicas of one process would shard nothing
    assert replicas(16, 8, replicate_degree=4) == 4
    with pytest.raises(ConfigError, match="--replicate_degree 3 does not divide the 16 processes"):
        replicas(16, 8, replicate_degree=3)


@pytest.fixture
def group_of_one():
    """This process as a gloo process group of one, for the test (in-memory store)."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_each_mesh_dimension_gets_its_own_group_options(group_of_one):
    """Making a process group may change the options object it is given (NCCL's split does):
    HSDP's two dimensions each get their own, with --timeout_seconds."""
    settings = mesh_group_settings(("replicate", "shard"), 77)
    (_, replicate), (_, shard) = settings["replicate"], settings["shard"]
    assert replicate is not shard
    assert replicate._timeout.total_seconds() == shard._timeout.total_seconds() == 77


def test_clipping_sharded_gradients_takes_torchs_foreach_kernels(monkeypatch, group_of_one):
    """FSDP's gradients are DTensors: the clip still takes torch's foreach kernels (one kernel
    for every gradient's norm on a GPU, not one per tensor: torch.distributed.tensor registers
    DTensor as a foreach type), and gives the same norm and gradients as the plain model's."""
    from torch.distributed.fsdp import fully_shard

    from ddp_utils.optim.optimizer import clip_grad_norm

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    sharded = copy.deepcopy(plain)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    for module in (*sharded, sharded):
        fully_shard(module, mesh=mesh)
    x = torch.randn(4, 8)
    for net in (plain, sharded):
        net(x).square().sum().backward()
    calls = []
    foreach_norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: calls.append(1) or foreach_norm(*a, **k))
    norm = clip_grad_norm(list(sharded.parameters()), 0.1)
    assert calls, "a norm per gradient, in Python"
    expected = torch.nn.utils.clip_grad_norm_(list(plain.parameters()), 0.1, foreach=False)
    assert torch.allclose(norm.full_tensor(), expected)
    for ours, theirs in zip(sharded.parameters(), plain.parameters()):
        assert torch.allclose(ours.grad.full_tensor(), theirs.grad)


def test_a_stager_that_stages_once_is_told_apart():
    """torch 2.11's DefaultStager empties its cache at the end of each stage: every save then
    gets a new stager. Newer ones keep their buffers for the next save."""

    class Older:
        def _stage(self, state_dict):
            state_dict = self._state_dict_stager.stage(state_dict)
            self._state_dict_stager.close()
            return state_dict

    class Newer:
        def _stage(self, state_dict):
            return self._state_dict_stager.stage(state_dict)

    assert not stager_reusable(Older) and stager_reusable(Newer)
