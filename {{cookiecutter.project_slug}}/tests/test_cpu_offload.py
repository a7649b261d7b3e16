"""--cpu_offload (fsdp and hsdp): the shards, their gradients and the optimizer state in host
memory and the optimizer step there, the same training as fsdp without it to the bit (clipped,
accumulated, under AdamW and Muon); sharded checkpoints that resume exactly after SIGTERM, and
on either side of the setting; the doctor's steps (fsdp and hsdp) and memory plan with it;
refused under ddp.

On this CPU the shards were in host memory already: what differs is FSDP2's offload path
(CPUOffloadPolicy, unpinned without an accelerator), which must change no number."""

import functools
import shutil
import subprocess
import sys

import conftest
import pytest
import torch
from conftest import PROJECT, TINY, assert_same_metrics, compared_metrics, probe_output, read_metrics, training_env
from test_fsdp import final_weights, in_float64, train_until_sigterm
from torch import nn

from config import Config
from ddp_utils.configuration import parse_config
from ddp_utils.doctor import memory as doctor_memory
from ddp_utils.doctor import processes as doctor_processes
from ddp_utils.doctor import run as doctor
from ddp_utils.doctor.rows import to_float64
from ddp_utils.errors import ConfigError
from ddp_utils.parallel import strategy
from ddp_utils.parallel.blocks import shard_units
from task import TASK

pytestmark = pytest.mark.fixed_amp  # comparisons need --amp none

run_training = in_float64(conftest.run_training)  # test_fsdp's train_until_sigterm runs in float64 too

# 8 optimizer steps of 2 micro-steps on 2 processes (a global batch of 64), clipped hard enough
# to bite every step; a sharded checkpoint every 2 steps, all kept.
MAX_GRAD_NORM = 0.05
ARGS = ["--amp", "none", "--max_steps", "8", "--grad_accum_steps", "2", "--max_grad_norm", str(MAX_GRAD_NORM)]
ARGS += ["--checkpoint_every_steps", "2", "--keep_checkpoints", "100", "--batch_size", "16", "--strategy", "fsdp"]
OFFLOAD = ["--cpu_offload", "true"]
MUON = ["--optimizer", "muon"]


class Runs:
    """Uninterrupted 2-process runs, each made the first time a test asks for it."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory

    def run(self, name, *args, probe="record_grad_norms,record_offload"):
        output_dir = self.tmp_path_factory.mktemp(name)
        return output_dir, run_training(output_dir, *ARGS, *args, nproc=2, probe=probe)

    @functools.cached_property
    def fsdp(self):
        return self.run("fsdp")

    @functools.cached_property
    def offload(self):
        return self.run("offload", *OFFLOAD)

    @functools.cached_property
    def muon(self):
        return self.run("muon", *MUON, probe=None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory)


def assert_identical(output_dir, reference_dir):
    """The same parameters to the bit, and the same metrics lines."""
    ours, theirs = final_weights(output_dir), final_weights(reference_dir)
    assert ours.keys() == theirs.keys()
    differ = [key for key in theirs if not torch.equal(ours[key], theirs[key])]
    assert not differ, f"parameters differ from fsdp's without --cpu_offload: {differ[:3]}"
    lines = [compared_metrics(line) for line in read_metrics(output_dir)]
    assert lines == [compared_metrics(line) for line in read_metrics(reference_dir)]


def units_of_the_tiny_model():
    """The FSDP2 units of the TINY model: its blocks (shard_units) and the root."""
    with torch.device("meta"):
        return len(shard_units(TASK.build_model(parse_config(Config, TINY)))) + 1


def test_offload_trains_fsdps_parameters_to_the_bit(runs):
    """Every unit, the root's included, offloaded (unpinned: no accelerator here); clipping on
    the host's gradient shards sees fsdp's norms, and accumulation, the optimizer step on the
    host and evaluation give fsdp's parameters and metrics to the bit."""
    (fsdp_dir, fsdp), (offload_dir, offload) = runs.fsdp, runs.offload
    units = units_of_the_tiny_model()
    (plain,) = [line["offload"] for line in probe_output(fsdp) if "offload" in line]
    (offloaded,) = [line["offload"] for line in probe_output(offload) if "offload" in line]
    assert plain == {"units": units, "kinds": [[False, False]]}, plain
    assert offloaded == {"units": units, "kinds": [[True, False]]}, offloaded
    (norms,) = [line["grad_norms"] for line in probe_output(offload) if "grad_norms" in line]
    (expected,) = [line["grad_norms"] for line in probe_output(fsdp) if "grad_norms" in line]
    assert len(norms) == 8 and min(norms) > MAX_GRAD_NORM  # clipping acted on every step
    assert norms == expected
    assert_identical(offload_dir, fsdp_dir)


def test_sigterm_with_offload_resumes_exactly(runs, tmp_path):
    """SIGTERM to torchrun: the sharded save of the host's shards is complete, and the same
    command resumes, bit for bit the uninterrupted run."""
    output_dir = tmp_path / "run"
    args = [*ARGS, *OFFLOAD]
    log = train_until_sigterm(output_dir, args, nproc=2, probe="slow_until_stopped")
    stopped_at = int(log.split("stopped by SIGTERM at step ", 1)[1].split(";")[0])
    assert 4 <= stopped_at < 8, log  # before --max_steps: the resume has steps to take
    run_training(output_dir, *args, nproc=2)  # the same command again
    ours, theirs = final_weights(output_dir), final_weights(runs.offload[0])
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs), "parameters differ from the uninterrupted run"
    assert_same_metrics(output_dir, runs.offload[0])


@pytest.mark.parametrize("saved_by, resumed_with", [("offload", []), ("muon", [*MUON, *OFFLOAD])])
def test_a_checkpoint_resumes_on_either_side_of_the_setting(runs, tmp_path, saved_by, resumed_with):
    """Saved with --cpu_offload, resumed without it; and the other way under Muon (its rows
    exchanged by all-to-alls of the host's shards, its step and momentum on the host): the
    checkpoint is the same sharded state, and the runs end to the bit where the uninterrupted
    ones without it do."""
    reference = runs.fsdp if saved_by == "offload" else runs.muon
    step_4 = getattr(runs, saved_by)[0] / "checkpoints" / "step_000000004"
    shutil.copytree(step_4, tmp_path / "checkpoints" / step_4.name)
    result = run_training(tmp_path, *ARGS, *resumed_with, nproc=2)
    assert "step_000000004: epoch 1, step 4" in result.stdout, result.stdout
    assert_identical(tmp_path, reference[0])


def test_ddp_refuses_offload_in_one_line(tmp_path):
    """Before any process starts a group: one line naming the knob, exit status 2, nothing written."""
    output_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "train.py", *TINY, *OFFLOAD, "--max_steps", "1", "--output_dir", output_dir],
                          cwd=PROJECT, env=training_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert not output_dir.exists()
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0] == "error: --cpu_offload needs --strategy fsdp (ddp keeps the whole model state on every device)"
    with pytest.raises(ConfigError) as error:
        Config(cpu_offload=True)
    assert error.value.field == "cpu_offload"


def test_the_doctor_steps_fsdp_and_hsdp_with_offload_as_ddp():
    """The doctor's 2 processes under Muon: DDP (without offload, which ddp refuses), then fsdp
    and hsdp with it, against one process."""
    cfg = parse_config(Config, [*TINY, *ARGS, *MUON, *OFFLOAD])
    _, small, _ = doctor.build(TASK, cfg)
    ddp, sharded = doctor_processes.processes_check(TASK.build_model, to_float64(small), TASK.loss_fn, cfg)
    assert ddp["status"] == "pass", ddp
    assert sharded["status"] == "pass", sharded


def test_the_memory_plan_keeps_only_gathered_units_and_activations_on_the_gpu():
    """With --cpu_offload the sharded plans hold no parameters, gradients nor AdamW state on
    the GPU, but a gathered unit (also on one GPU) and the activations; ddp's is unchanged."""
    model = nn.Sequential(*(nn.Linear(1000, 1000) for _ in range(8)))
    batch = (torch.randn(4, 1000), None)
    loss = lambda output, batch: output.sum()  # noqa: E731
    without = Config(amp="none", strategy="fsdp")
    with_offload = Config(amp="none", strategy="fsdp", cpu_offload=True)
    for world_size, gpus_per_node in ((16, 8), (1, 1)):
        plans, _, _ = doctor_memory.memory_plan(model, batch, loss, without, world_size, gpus_per_node)
        offloaded, _, _ = doctor_memory.memory_plan(model, batch, loss, with_offload, world_size, gpus_per_node)
        assert offloaded["ddp"] == plans["ddp"]
        for name in [name for name in plans if name != "ddp"]:
            assert offloaded[name]["parameters"] == offloaded[name]["gradients"] == offloaded[name]["optimizer"] == 0
            assert offloaded[name]["activations"] == plans[name]["activations"]
            # The largest unit (a layer of 1001 x 1000) gathered, the next one prefetched, one's gradient.
            assert offloaded[name]["gathered"] == 1001 * 1000 * 3 * 4
    row = doctor_memory.memory_check(*doctor_memory.memory_plan(model, batch, loss, with_offload, 1, 1), with_offload,
                                     0.05, 1)  # fmt: skip
    assert row["status"] == "pass" and "fsdp fits" in row["summary"], row  # 8 million parameters, 50 MiB


def test_hsdp_groups_on_gpus_take_nccls_options_beside_gloo(monkeypatch):
    """On GPUs with --cpu_offload the default group is "cuda:nccl,cpu:gloo": HSDP's mesh groups
    are made alike, with NCCL's options (gloo takes none), as a group of NCCL alone."""

    class Options:
        pass

    monkeypatch.setattr(strategy.dist, "get_backend", lambda: "cuda:nccl,cpu:gloo")
    monkeypatch.setattr(strategy.dist, "ProcessGroupNCCL", type("ProcessGroupNCCL", (), {"Options": Options}),
                        raising=False)  # fmt: skip
    (backend, options), _ = strategy.mesh_group_settings(("replicate", "shard"), 77).values()
    assert backend == "cuda:nccl,cpu:gloo" and isinstance(options, Options) and options._timeout.total_seconds() == 77
