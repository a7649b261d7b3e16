"""doctor.py: the task's own model and data pass (a warning at most), and each fault the doctor
is for is named, injected into small models in this process."""

import copy
import dataclasses
import gc
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import PROJECT, TINY, descendants, gpu_host, training_env
from doctor_models import (
    Experts,
    Normed,
    casts_inside,
    casts_inside_and_scales,
    fails_on_rank1,
    key_bias,
    linear,
    loss_fn,
    loss_per_class_present,
    normed,
    renormed,
    scales_by_a_millionth,
)
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from config import Config
from ddp_utils.configuration import parse_config
from ddp_utils.core.collector import Collector
from ddp_utils.core.units import size_text
from ddp_utils.doctor import equivalence as doctor_equivalence
from ddp_utils.doctor import memory as doctor_memory
from ddp_utils.doctor import model_checks
from ddp_utils.doctor import processes as doctor_processes
from ddp_utils.doctor import run as doctor
from ddp_utils.doctor.rows import halves, to_float64
from ddp_utils.errors import ConfigError
from ddp_utils.parallel.model_init import build_module
from task import TASK


@pytest.mark.quick
def test_the_shipped_task_passes_the_doctor(tmp_path):
    """On a machine with a GPU, as the doctor is run before renting more (torch's accelerator is
    cuda, and the model's build sees CUDA: a task may then pick GPU-only layers): its checks run
    on the CPU, on the model as --device cpu builds it, and pass."""
    # A loader worker: the data position check reads as a run with workers reads.
    flags = ["--output_dir", str(tmp_path), "--nodes", "2", "--gpus_per_node", "2", "--num_workers", "1"]
    done = subprocess.run([sys.executable, "doctor.py", *TINY, *flags], cwd=PROJECT, capture_output=True, text=True,
                          env=training_env(gpu_host("cuda_available")), timeout=600)  # fmt: skip
    printed = done.stdout + done.stderr
    failed = [line for line in printed.splitlines() if "| FAIL |" in line]  # first: pytest's summary line
    assert done.returncode == 0, "\n".join([*failed, printed])
    report = json.loads((tmp_path / "doctor.json").read_text())
    statuses = {row["check"]: row["status"] for row in report["checks"]}
    checks = ["memory plan", "activation checkpointing", "checkpoint space"]
    checks += ["host syncs on the GPU"] if torch.cuda.is_available() else []
    checks += ["1 vs 2 processes", "exact resume", "data position", "data per rank", "shard units", "fsdp = ddp"]
    checks += ["sharded steps"]
    checks += ["non-finite values", "unused parameters", "zero gradients", "host syncs"]
    assert list(statuses) == checks
    assert "fail" not in statuses.values(), printed
    passed = ["memory plan", "1 vs 2 processes", "exact resume", "data position", "data per rank", "fsdp = ddp"]
    passed += ["sharded steps", "checkpoint space"]
    for name in [*passed, "unused parameters"]:
        assert statuses[name] == "pass", printed
    # 2 nodes of 2: ddp holds everything, fsdp a quarter of the model state, hsdp a half.
    plans = report["memory_bytes_per_gpu"]
    state = {name: plan["parameters"] + plan["gradients"] + plan["optimizer"] for name, plan in plans.items()}
    assert state["fsdp"] == pytest.approx(state["ddp"] / 4) and state["hsdp"] == pytest.approx(state["ddp"] / 2)
    assert plans["ddp"]["activations"] > 0
    assert "| memory plan | PASS |" in printed
    # What each rank writes of a checkpoint: under ddp rank 0 all of it, under fsdp each GPU a share.
    written = report["checkpoint_bytes_per_rank"]
    assert written["ddp"]["rank 0"] == written["ddp"]["checkpoint"] > 0 and written["ddp"]["each other rank"] == 0
    assert 0 < written["fsdp"]["each other rank"] < written["fsdp"]["rank 0"] < written["fsdp"]["checkpoint"]


class WithUnused(nn.Module):
    """The task's model with a parameter its forward never uses."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.unused = inner, nn.Linear(2, 2)

    def forward(self, x):
        return self.inner(x)


def test_a_fail_exits_1_and_bad_input_2(tmp_path, monkeypatch, capsys):
    """The task's model and data with an unused parameter: the report names it and the exit
    status is 1. A bad doctor flag or train.py flag: one error line, exit status 2."""
    wrapped = TASK.replace(build_model=lambda cfg: WithUnused(TASK.build_model(cfg)))
    assert doctor.main(wrapped, [*TINY, "--output_dir", str(tmp_path)]) == 1
    rows = {row["check"]: row for row in json.loads((tmp_path / "doctor.json").read_text())["checks"]}
    assert rows["unused parameters"]["status"] == "fail" and "unused.weight" in rows["unused parameters"]["summary"]
    for flags, error in [(["--nodes", "0"], "--nodes 0: must be positive"), (["--lr", "-1"], "--lr")]:
        done = subprocess.run([sys.executable, "doctor.py", *TINY, "--output_dir", str(tmp_path), *flags],
                              cwd=PROJECT, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2 and done.stderr.startswith(f"error: {error}"), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def cfg_for(*flags):
    return parse_config(Config, [*TINY, "--output_dir", "unused", *flags], resolve=False)


class Faulty(nn.Module):
    """A small model with one of the faults the doctor names."""

    def __init__(self, fault):
        super().__init__()
        self.fault = fault
        self.layer = nn.Linear(8, 4)
        self.unused = nn.Linear(8, 4)
        self.key = nn.Linear(8, 8)  # an attention's keys: their bias shifts every score alike
        self.query = nn.Linear(8, 8)

    def forward(self, x):
        out = self.layer(x)
        if self.fault == "key_bias":
            scores = torch.softmax(self.query(x) @ self.key(x).T, dim=-1)
            out = out + (scores @ x)[:, :4]
        if self.fault == "not_finite":
            out = out / 0.0
        return out


BATCH = (torch.randn(6, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 3, 0, 1]))


@pytest.mark.parametrize(
    "fault, check, status, named",
    [
        # No gradient from any sample (not only from some: that is a mixture of experts' row).
        ("none", "unused parameters", "fail", "no gradient for unused.weight"),
        ("key_bias", "zero gradients", "warn", "zero in exact arithmetic: key.bias ("),
        ("not_finite", "non-finite values", "fail", "not finite"),
    ],
)
def test_each_fault_is_named(fault, check, status, named):
    rows = {
        row["check"]: row for row in model_checks.gradient_checks(Faulty(fault), (BATCH, BATCH), loss_fn, cfg_for())
    }
    assert rows[check]["status"] == status and named in rows[check]["summary"], rows[check]
    assert rows[check]["fix"]


def test_parameters_that_some_batches_leave_out_are_found():
    """A mixture of experts whose experts get no sample in some batches: every parameter gets a
    gradient from the whole batch, yet DDP would stop at the step after one that leaves an expert
    out. The row says so and names the knob; with it set, it passes."""
    batch = (torch.tensor([[1.0] * 8, [2.0] * 8, [-1.0] * 8, [1.0] + [0.0] * 7]), torch.tensor([0, 1, 2, 3]))
    for flags, status in [((), "fail"), (("--find_unused_parameters", "true"), "pass")]:
        rows = model_checks.gradient_checks(Experts(), (batch, batch), loss_fn, cfg_for(*flags))
        (row,) = [row for row in rows if row["check"] == "unused parameters"]
        assert row["status"] == status and "no gradient from some samples for experts.0.weight" in row["summary"], row
        assert "--find_unused_parameters true" in row["fix"], row


def test_unused_parameters_only_warn_when_ddp_is_told():
    rows = model_checks.gradient_checks(
        Faulty("none"), (BATCH, BATCH), loss_fn, cfg_for("--find_unused_parameters", "true")
    )
    (row,) = [row for row in rows if row["check"] == "unused parameters"]
    assert row["status"] == "warn"


def test_host_syncs_in_forward_or_the_loss_are_found(tmp_path):
    model = tmp_path / "model.py"
    model.write_text(
        "class M:\n    def forward(self, x):\n        n = x.sum().item()\n        return x / n\n\n\n"
        "def loss_fn(output, batch):\n    return output.mean().cpu()\n\n\ndef report(x):\n    return x.tolist()\n"
    )
    row = model_checks.host_sync_check([model, PROJECT / "dataset.py"])
    assert row["status"] == "warn"
    assert row["summary"] == "model.py:3 .item() in forward; model.py:8 .cpu() in loss_fn"  # not report()'s


def test_a_gpu_sync_is_named_by_the_projects_own_line_never_the_machinerys():
    """The GPU's sync check names the innermost frame of the project's own code (model.py,
    dataset.py, their helpers): never a file of the machinery, in whichever of its folders, nor
    doctor.py, nor an installed package."""
    machinery = sorted((PROJECT / "ddp_utils").rglob("*.py"))
    assert len({path.parent for path in machinery}) > 1  # its folders too
    assert model_checks.in_project(str(PROJECT / "model.py")) and model_checks.in_project(str(PROJECT / "dataset.py"))
    assert not [path for path in machinery if model_checks.in_project(str(path))]
    assert not model_checks.in_project(str(PROJECT / "doctor.py"))
    assert not model_checks.in_project(torch.__file__)


def test_a_model_too_big_for_the_gpu_gets_the_way_to_fit():
    """ddp holds 16 bytes a parameter: 8 million parameters do not fit 0.05 GiB; sharded over 8
    GPUs they do; on 1 GPU nothing fits. On 2 nodes of 4, --strategy fsdp is hybrid (a replica
    a node) unless --replicate_degree 1 says otherwise."""
    model = nn.Sequential(*(nn.Linear(1000, 1000) for _ in range(8)))
    batch = (torch.randn(4, 1000), None)
    cfg = cfg_for("--amp", "none")
    row = doctor_memory.memory_check(
        *doctor_memory.memory_plan(model, batch, lambda o, b: o.sum(), cfg, 8, 8), cfg, 0.05, 8
    )
    assert row["status"] == "warn" and row["fix"] == "--strategy fsdp", row
    plans, flags, configured = doctor_memory.memory_plan(model, batch, lambda o, b: o.sum(), cfg, 8, 4)
    assert flags == {"ddp": "--strategy ddp", "fsdp": "--strategy fsdp --replicate_degree 1", "hsdp": "--strategy fsdp"}
    assert configured == "ddp" and plans["hsdp"]["optimizer"] == 2 * plans["fsdp"]["optimizer"]
    # Each layer's output, 1000 values of 4 bytes a sample: the next layer's saved input, the last the loss's.
    assert plans["ddp"]["activations"] == pytest.approx(8 * 1000 * 4 * cfg.batch_size, rel=1e-5)
    row = doctor_memory.memory_check(
        *doctor_memory.memory_plan(model, batch, lambda o, b: o.sum(), cfg, 1, 1), cfg, 0.05, 1
    )
    assert row["status"] == "fail" and row["fix"].startswith("more GPUs with --strategy fsdp"), row


def test_the_activation_checkpointing_row_names_the_mode_that_fits_and_what_it_costs():
    """Blocks whose inner activations dominate, each mode measured: full keeps the least, at the
    FLOPs of the forward run again (counted as it runs); on a GPU that holds the model state and full's
    activations alone, the row names full as the fix with its recompute; on a large one none
    fits, and under full the row says none would do too, without the recompute."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)) for _ in range(4)))
    batch, loss_fn = (torch.randn(4, 256), None), lambda o, b: o.sum()
    cfg = cfg_for("--amp", "none", "--batch_size", "4096")
    modes = doctor_memory.checkpointing_plan(model, batch, loss_fn, cfg)
    assert list(modes) == ["none", "full", "every_other", "ops"]
    sizes = {mode: modes[mode]["activations"] for mode in modes}
    assert sizes["full"] < sizes["every_other"] < sizes["none"], sizes  # (ops keeps each Linear's output: no less here)
    with FlopCounterMode(display=False) as forward:
        model(batch[0])
    with FlopCounterMode(display=False) as step:
        model(batch[0]).sum().backward()
    assert modes["none"]["recompute_flops"] == 0
    # The recompute stops at the last tensor the backward needs (torch's early stop): each block's
    # first Linear and its ReLU again, not the second Linear, whose output nothing saves.
    half_forward = forward.get_total_flops() / 2
    assert modes["full"]["recompute_flops"] == pytest.approx(half_forward / step.get_total_flops())
    plans, flags, configured = doctor_memory.memory_plan(model, batch, loss_fn, cfg, 1, 1)
    state = sum(plans["ddp"].values()) - plans["ddp"]["activations"]
    tight = (state + sizes["full"]) / 0.9 / 2**30 * 1.01  # GiB: full fits, no other mode does
    assert state + sizes["every_other"] > 0.9 * tight * 2**30
    row = doctor_memory.checkpointing_check(modes, plans, configured, cfg, tight)
    cost = f"+{modes['full']['recompute_flops']:.0%} FLOPs"
    assert row["status"] == "warn" and "ddp does not fit" in row["summary"], row
    assert row["fix"] == f"--activation_checkpointing full ({size_text(sizes['full'])} of activations, {cost})", row
    assert f"full {size_text(sizes['full'])} ({cost})" in row["summary"], row
    row = doctor_memory.checkpointing_check(modes, plans, configured, cfg, 80)
    assert row["status"] == "pass" and row["summary"].endswith("ddp fits 80 GiB with none") and not row["fix"], row
    full = dataclasses.replace(cfg, activation_checkpointing="full")
    row = doctor_memory.checkpointing_check(modes, plans, configured, full, 80)
    assert row["status"] == "pass" and row["fix"].startswith("--activation_checkpointing none ("), row


def test_the_gpu_memory_is_in_gib_as_its_spec_sheet_says():
    """--gpu_memory_gb is in GiB (2**30 bytes), as a GPU's spec sheet counts it (an "80GB" H100
    has 80 GiB), and so is the row: a plan fits in 90% of it, to the byte."""
    cfg = cfg_for("--amp", "none")
    flags, fitting = {"ddp": "--strategy ddp"}, 0.9 * 2**30
    row = doctor_memory.memory_check({"ddp": {"parameters": fitting, "activations": 0}}, flags, "ddp", cfg, 1, 1)
    settings = f"per GPU at 1 GPUs, --batch_size {cfg.batch_size}, --amp none"
    assert row["status"] == "pass" and row["summary"] == f"ddp 922 MiB {settings}: ddp fits 1 GiB", row
    row = doctor_memory.memory_check({"ddp": {"parameters": fitting + 1, "activations": 0}}, flags, "ddp", cfg, 1, 1)
    assert row["status"] == "fail" and row["summary"] == f"ddp 922 MiB {settings}: ddp does not fit 1 GiB", row


def test_the_configured_strategy_is_the_one_judged():
    """With --strategy fsdp the plan that must fit is fsdp's (hybrid by default on 2 nodes),
    not ddp's."""
    model = nn.Sequential(*(nn.Linear(1000, 1000) for _ in range(8)))
    batch = (torch.randn(4, 1000), None)
    cfg = cfg_for("--amp", "none", "--strategy", "fsdp")
    plans, flags, configured = doctor_memory.memory_plan(model, batch, lambda o, b: o.sum(), cfg, 16, 8)
    assert configured == "hsdp"
    row = doctor_memory.memory_check(plans, flags, configured, cfg, 0.05, 16)
    assert row["status"] == "pass" and "hsdp fits" in row["summary"], row
    cfg = cfg_for("--amp", "none", "--strategy", "fsdp", "--replicate_degree", "3")
    row = doctor_memory.memory_check(
        *doctor_memory.memory_plan(model, batch, lambda o, b: o.sum(), cfg, 16, 8), cfg, 0.05, 16
    )
    assert row["status"] == "fail" and "--replicate_degree 3 does not divide the 16 GPUs" in row["summary"], row


def test_activations_count_once_what_does_not_grow_with_the_batch():
    """Under bf16 autocast the forward keeps a bf16 copy of each weight, whatever the batch:
    the estimate for --batch_size 64 from 4 samples is what 64 samples measure, not 16 times
    what 4 do."""
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    cfg = cfg_for("--amp", "bf16", "--batch_size", "64")
    plans, _, _ = doctor_memory.memory_plan(model, (torch.randn(4, 256), None), lambda o, b: o.sum(), cfg, 1, 1)
    measured = max(
        doctor_memory.activation_trace(model, (torch.randn(64, 256), None), lambda o, b: o.sum(), torch.bfloat16)
    )
    assert plans["ddp"]["activations"] == pytest.approx(measured, rel=0.01)
    scaled = 16 * max(
        doctor_memory.activation_trace(model, (torch.randn(4, 256), None), lambda o, b: o.sum(), torch.bfloat16)
    )
    assert measured > 2 * 256 * 256 * 2 and scaled > 2 * measured  # the copies, 16 times


PEAK = """
import json, sys
import torch
from torch.utils._pytree import tree_map_only
from config import Config
from ddp_utils.doctor import run as doctor
from ddp_utils.doctor import memory as doctor_memory
from ddp_utils.configuration import parse_config
from task import TASK
from ddp_utils.contract import count_samples, model_inputs

flags, amp = json.loads(sys.argv[1]), sys.argv[2]
task = TASK
model, small, _ = doctor.build(task, parse_config(Config, flags))


def planned(samples):
    cfg = parse_config(Config, [*flags, "--amp", amp, "--batch_size", str(samples)])
    return doctor_memory.activations_at(model, small, task.loss_fn, cfg)


size = int(256e6 * 1000 / (planned(1001) - planned(1))) + 1  # samples for 256 MB or so
repeats = -(-size // count_samples(small))
batch = tree_map_only(torch.Tensor, lambda t: torch.cat([t] * repeats)[:size], small)


def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))


open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) from here
before = status("VmRSS:")
with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16"):
    loss = task.loss_fn(model(model_inputs(batch)), batch)
print(json.dumps({"planned": planned(size), "measured": status("VmHWM:") - before, "samples": size}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures the peak with Linux's /proc")
@pytest.mark.parametrize("amp", ["none", "bf16"])
def test_the_activation_estimate_is_the_measured_peak(amp, tmp_path):
    """The memory plan's activations for a batch of about 256 MB, planned from 4 samples, are
    within 25% of the growth of the process's peak resident memory in a forward and loss of
    that batch (a fresh process; every large allocation its own mapping, returned when freed:
    MALLOC_MMAP_THRESHOLD_)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(PROJECT)}
    flags = json.dumps([*TINY, "--output_dir", str(tmp_path)])
    done = subprocess.run(
        [sys.executable, "-c", PEAK, flags, amp], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["planned"] == pytest.approx(result["measured"], rel=0.25), result


@pytest.mark.parametrize(
    "build_model, loss, named",
    [
        (Normed, loss_fn, "norm normalises each process's share"),
        (lambda: nn.Linear(8, 4), loss_per_class_present, "the loss is not the mean over the batch's samples"),
    ],
)
def test_what_one_process_cannot_tell_from_two_is_named(build_model, loss, named):
    row = doctor_equivalence.equivalence_check(build_model().double(), to_float64(BATCH), loss)
    assert row["status"] == "fail" and named in row["summary"], row


@pytest.mark.parametrize(
    "build_model, loss, named",
    [
        (normed, loss_fn, "norm normalises each process's share"),
        (linear, loss_per_class_present, "the loss is not the mean over the batch's samples"),
    ],
)
def test_two_gloo_processes_under_ddp_find_what_one_cannot(build_model, loss, named):
    """The same faults, in 2 real processes (DDP, gloo) against this one; none left behind.
    (That a model without them passes, the task's own, is test_the_shipped_task_passes_the_doctor.)"""
    before = set(descendants(os.getpid()))
    row, _ = doctor_processes.processes_check(build_model, to_float64(BATCH), loss, cfg_for())
    assert set(descendants(os.getpid())) == before
    assert row["status"] == "fail" and named in row["summary"], row


@pytest.mark.parametrize(
    "build_model, loss, status, named",
    [
        # A key bias: its gradient is zero in exact arithmetic, rounding noise in each run (the
        # zero gradients row's), and AdamW's steps of that noise differ: neither is a fault.
        (key_bias, loss_fn, "pass", "agree to 1e-10 (float64)"),
        # A fault a millionth in size, in float64 throughout: far above float64's rounding.
        (scales_by_a_millionth, loss_fn, "fail", "the loss is not the mean over the batch's samples"),
        # Computing in float32 inside (as Mamba does) is not a fault: a warning naming where...
        (casts_inside, loss_fn, "warn", "decay (float)"),
        # ...and a fault in such a model still fails: a loss that is not the mean, a forward
        # that depends on the world size by 1e-4 (a looser float32 tolerance would miss it).
        (casts_inside, loss_per_class_present, "fail", "the loss is not the mean over the batch's samples"),
        (casts_inside_and_scales, loss_fn, "fail", "the loss is not the mean over the batch's samples"),
    ],
)
def test_two_processes_are_judged_at_the_precision_the_model_computes_in(build_model, loss, status, named):
    """Compared at the scale of the whole gradient, to float64's rounding, or to float32's where
    the model computes in float32 whatever it is given (named, as a warning)."""
    row, _ = doctor_processes.processes_check(build_model, to_float64(BATCH), loss, cfg_for())
    assert row["status"] == status and named in row["summary"], row
    if status == "warn":
        assert "compute in float32 whatever dtype they are given" in row["summary"] and row["fix"], row


def test_one_process_judges_at_the_precision_the_model_computes_in_too():
    row = doctor_equivalence.equivalence_check(key_bias(None).double(), to_float64(BATCH), loss_fn)
    assert row["status"] == "pass", row
    row = doctor_equivalence.equivalence_check(casts_inside(None).double(), to_float64(BATCH), loss_fn)
    assert row["status"] == "warn" and "decay (float)" in row["summary"], row
    row = doctor_equivalence.equivalence_check(casts_inside(None).double(), to_float64(BATCH), loss_per_class_present)
    assert row["status"] == "fail", row


def test_a_forward_that_changes_parameters_is_found_by_the_steps_of_two_processes():
    """nn.Embedding(max_norm=...) renormalises, in place, the rows each process's share looks up:
    the gradients agree (a backward passes), the parameters after steps do not, under DDP with
    accumulation, fsdp and hsdp alike. Token 15 is only in rank 1's shares."""
    tokens = torch.tensor([[0, 1, 2], [3, 4, 15], [5, 6, 7], [8, 9, 15]])
    batch = (tokens, torch.tensor([0, 1, 2, 3]))
    before = set(descendants(os.getpid()))
    ddp, sharded = doctor_processes.processes_check(renormed, batch, loss_fn, cfg_for())
    assert set(descendants(os.getpid())) == before
    assert ddp["status"] == "fail" and ddp["summary"].startswith("embedding.weight's parameter differs after 2 steps")
    assert "the forward changes embedding.weight in place" in ddp["summary"], ddp
    assert sharded["status"] == "fail", sharded  # and not for the shard units: the same cause
    assert sharded["summary"].startswith("embedding.weight's parameter differs after 2 steps under fsdp"), sharded
    assert "from DDP's: the forward changes embedding.weight in place" in sharded["summary"], sharded
    assert "shard unit" not in sharded["fix"], sharded


def test_the_rank_that_raised_is_named_not_the_peer_it_left():
    ddp, sharded = doctor_processes.processes_check(fails_on_rank1, to_float64(BATCH), loss_fn, cfg_for())
    assert ddp["status"] == "fail", ddp
    assert ddp["summary"] == "a backward under DDP, rank 1 raises ValueError: rank 1's own fault", ddp
    assert sharded["status"] == "warn", sharded


def test_a_model_with_torchs_sync_batch_norm_is_checked_in_one_process():
    """DDP refuses nn.SyncBatchNorm on the CPU: the 2 processes are not started, and the report
    falls back to the arithmetic in one process, where it counts as synchronised."""

    def build(cfg=None):
        return nn.Sequential(nn.Linear(8, 4), nn.SyncBatchNorm(4))

    ddp, sharded = doctor_processes.processes_check(build, to_float64(BATCH), loss_fn, cfg_for())
    assert ddp["status"] == sharded["status"] == "warn" and "SyncBatchNorm" in ddp["summary"], ddp
    row = doctor_equivalence.equivalence_check(build().double(), to_float64(BATCH), loss_fn)
    assert row["status"] == "pass", row


def test_a_synchronised_norm_and_a_plain_model_are_the_same_on_one_process_and_two():
    synced = Normed()
    synced.norm.same_buffers_on_every_rank = True  # as the vision task's SyncBatchNorm2d says
    for model in (synced, nn.Linear(8, 4)):
        assert doctor_equivalence.equivalence_check(model.double(), to_float64(BATCH), loss_fn)["status"] == "pass"


class Stateful(nn.Module):
    """`draw`: where its randomness comes from; `count`: a Python attribute its output depends on."""

    def __init__(self, draw=None, count=False):
        super().__init__()  # draw="aside": a number drawn on odd calls only, which the output ignores
        self.layer, self.draw, self.count, self.calls = nn.Linear(8, 4), draw, count, 0
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x):
        self.calls += 1
        if self.draw == "global":
            x = x + torch.randn(x.shape, dtype=x.dtype)
        if self.draw == "own":
            x = x + torch.randn(x.shape, dtype=x.dtype, generator=self.generator)
        if self.draw == "aside" and self.calls % 2:
            torch.rand(1)
        return self.layer(x) * (self.calls if self.count else 1)


WEIGHT_DIFFERS = "layer.weight differs after a resume"


@pytest.mark.parametrize(
    "model, summary",
    [
        (dict(draw="global"), None),  # torch's generator: the checkpoint saves and restores it
        (dict(draw="own"), WEIGHT_DIFFERS),
        (dict(count=True), WEIGHT_DIFFERS),
        (dict(draw="aside"), "the torch random generator's position differs after a resume"),
    ],
)
def test_a_resume_that_is_not_exact_is_found(model, summary):
    row = doctor_equivalence.resume_check(lambda: Stateful(**model), halves(to_float64(BATCH)), loss_fn, cfg_for())
    assert row["status"] == ("fail" if summary else "pass"), row
    if summary:
        assert row["summary"] == summary and row["fix"], row


class RankedData(torch.utils.data.Dataset):
    """Rows of a table, chosen by the process's rank: `where` it reads the rank, torchrun's
    RANK when built, or torch.distributed when a sample is read; or none, with a NaN in each
    row, or waiting for rank 0 in a barrier when built."""

    def __init__(self, where):
        self.where = where
        self.offset = int(os.environ.get("RANK", 0)) if where == "built" else 0
        if where == "barrier" and torch.distributed.is_initialized():
            torch.distributed.barrier()  # rank 0 downloads, the others wait: needs the processes

    def __len__(self):
        return 8

    def __getitem__(self, index):
        rank = torch.distributed.get_rank() if self.where == "read" and torch.distributed.is_initialized() else 0
        nan = float("nan") if self.where == "nan" else 0.0  # the same NaN on both ranks: the same data
        return torch.tensor([float(index + self.offset + rank), nan]), index % 2


@pytest.mark.parametrize(
    "where, status", [("built", "fail"), ("read", "fail"), ("nowhere", "pass"), ("nan", "pass"), ("barrier", "warn")]
)
def test_data_that_depends_on_the_rank_is_found(where, status):
    task = TASK.replace(build_datasets=lambda cfg: (RankedData(where), RankedData(where)))
    row = doctor_equivalence.rank_data_check(task, cfg_for())
    assert row["status"] == status, row
    assert "RANK" not in os.environ and not torch.distributed.is_initialized()  # as they were
    if status == "fail":
        assert (
            row["summary"] == "training sample 0 differs between rank 0 and rank 1"
            and "DistributedSampler" in row["fix"]
        )


class Augmented(torch.utils.data.Dataset):
    """Rows with noise drawn from the reading process's generator (`draw`), scaled by a count
    of the reads this copy has served (`count`), or shifted by the epoch `set_epoch` sets in
    a plain attribute (`epoch`), which persistent workers' copies never see."""

    def __init__(self, draw=False, count=False, epoch=False):
        self.draw, self.count, self.reads, self.epoch = draw, count, 0, 0
        if epoch:
            self.set_epoch = lambda epoch: setattr(self, "epoch", epoch)

    def __len__(self):
        return 64

    def __getitem__(self, index):
        self.reads += 1
        row = torch.full((8,), float(index + 100 * self.epoch)) + (torch.rand(8) if self.draw else 0)
        return row * (self.reads if self.count else 1), index % 4


@pytest.mark.parametrize(
    "data, workers, status",
    [
        (dict(draw=True), 0, "pass"),  # drawn in this process: the checkpoint restores the generators
        (dict(draw=True), 1, "fail"),  # a worker's generator restarts at the epoch's seed on a resume
        (dict(count=True), 0, "fail"),
        (dict(epoch=True), 0, "pass"),
        (dict(epoch=True), 1, "fail"),  # persistent workers (the default) keep epoch 0
        (dict(), 1, "pass"),
    ],
)
def test_a_resume_that_reads_other_data_is_found(data, workers, status):
    task = TASK.replace(build_datasets=lambda cfg: (Augmented(**data), Augmented(**data)))
    before = set(descendants(os.getpid()))
    row = doctor_equivalence.data_position_check(task, cfg_for("--num_workers", str(workers), "--persistent_workers",
                                                               "true"))  # fmt: skip
    assert set(descendants(os.getpid())) == before  # the workers are gone
    assert row["check"] == "data position" and row["status"] == status, row
    if status == "fail":
        assert row["summary"].startswith("training batch 2 of an epoch differs after a resume there"), row
        assert "(seed, epoch, index)" in row["fix"], row


class Scaled(nn.Module):
    """A block with a parameter of its own and no reset_parameters(): nothing initialises it
    on the meta device."""

    def __init__(self):
        super().__init__()
        self.layer, self.gain = nn.Linear(8, 8), nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.layer(x) * self.gain


@pytest.mark.parametrize(
    "model, flags, status, named",
    [
        (
            nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)),
            (),
            "pass",
            "2 Linear units of at most 67% of the parameters, 0% with",
        ),
        (Faulty("none"), (), "warn", "fsdp finds no blocks to shard one by one"),
        (nn.Sequential(Scaled(), Scaled()), (), "warn", "on the meta device, 0 (Scaled) has parameters and no reset"),
        (nn.Sequential(Scaled(), Scaled()), ("--init_on_meta", "true"), "fail", "0 (Scaled) has parameters"),
    ],
)
def test_the_shard_units_and_a_module_the_meta_start_cannot_reach(model, flags, status, named):
    row = model_checks.sharding_check(lambda cfg: copy.deepcopy(model), model, cfg_for(*flags))
    assert row["status"] == status and named in row["summary"], row


class HeadZeroed(nn.Module):
    """A model with init_weights: training builds it module by module, its head zeroed."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

    def init_weights(self, name, module):
        if name == "head":
            nn.init.zeros_(module.weight)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


@pytest.mark.parametrize(
    "build_model, flags",
    [
        (lambda cfg: HeadZeroed(), ()),
        (lambda cfg: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), ()),
        (lambda cfg: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), ("--init_on_meta", "true")),
        (lambda cfg: nn.Sequential(Scaled(), Scaled()), ("--init_on_meta", "true")),
    ],
    ids=["init_weights", "as_built", "init_on_meta", "meta_start_fails"],
)
def test_the_doctor_checks_the_model_training_builds(build_model, flags):
    """Its model has training's initial weights (parallel/model_init.py, the one function of
    both): a model's init_weights applied module by module, --init_on_meta's start on the meta
    device. Where the meta start fails, the model as its own code makes it (the shard units row
    says why; training refuses it)."""
    cfg, task = cfg_for(*flags), SimpleNamespace(build_model=build_model)
    ours = doctor.built(task, cfg).state_dict()
    try:
        trained = build_module(cfg, build_model, torch.device("cpu"), on_meta=cfg.init_on_meta).state_dict()
    except ConfigError:  # the meta start fails
        trained = build_module(cfg, build_model, torch.device("cpu")).state_dict()
    assert list(ours) == list(trained)
    for name, value in ours.items():
        assert torch.equal(value, trained[name]), f"{name}: not training's initial weights"
    if isinstance(build_model(cfg), HeadZeroed):
        assert not ours["head.weight"].any()


# A run in a process that goes on: a notebook, a sweep, the doctor run next.
RUN_IN_PROCESS = """
import gc, json, sys
sys.path.insert(0, ".")
import task
from ddp_utils.train import run
gc.set_threshold(1234, 11, 12)
code = run.main(task.TASK, json.loads(sys.argv[1]))
print("GC " + json.dumps([code, gc.get_threshold(), gc.get_freeze_count()]))
"""


def test_a_run_that_ends_gives_the_garbage_collector_back_its_thresholds(tmp_path):
    """Training turns automatic full collections off and freezes what survives (core/collector.py);
    once train.py's main returns, the process collects as before it: its own thresholds, nothing
    left frozen."""
    args = [*TINY, "--output_dir", str(tmp_path), "--max_steps", "2"]
    done = subprocess.run([sys.executable, "-c", RUN_IN_PROCESS, json.dumps(args)], cwd=PROJECT, capture_output=True,
                          text=True, env=training_env(), timeout=300)  # fmt: skip
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("GC ")] or [done.stdout + done.stderr]
    assert json.loads(line.removeprefix("GC ")) == [0, [1234, 11, 12], 0], line


def test_a_collector_started_twice_gives_back_the_thresholds_of_before():
    """A Trainer trained again (a notebook) starts its collector twice: still the process's own."""
    before = gc.get_threshold()
    collector = Collector()
    try:
        gc.set_threshold(1234, 11, 12)
        collector.start()
        collector.start()
        collector.close()
        assert gc.get_threshold() == (1234, 11, 12)
    finally:
        collector.close()
        gc.set_threshold(*before)


class Reaching(nn.Module):
    """Two blocks (the shard units); with `reach`, the second also reads the first one's weight,
    which under fsdp is gathered only during the first block's forward."""

    def __init__(self, reach):
        super().__init__()
        self.reach, self.blocks = reach, nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 4)])

    def forward(self, x):
        h = self.blocks[0](x)
        out = self.blocks[1](h)
        return out + (x @ self.blocks[0].weight.T)[:, :4] if self.reach else out


@pytest.mark.parametrize("reach, status", [(False, "pass"), (True, "fail"), ("dropout", "pass")])
def test_a_parameter_used_outside_its_shard_unit_fails_under_fsdp(reach, status):
    """With dropout both steps draw the same masks: they still agree."""
    dropped = lambda cfg: nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4))  # noqa: E731
    build = dropped if reach == "dropout" else (lambda cfg: Reaching(reach))
    state = torch.get_rng_state()
    row = doctor_equivalence.fsdp_check(build, to_float64(BATCH), loss_fn, cfg_for())
    assert torch.equal(torch.get_rng_state(), state)
    assert row["status"] == status, row
    if status == "fail":
        assert row["summary"].startswith("a step under fsdp raises") and "shard unit" in row["fix"], row
    assert not torch.distributed.is_initialized() and torch.get_default_dtype() == torch.float32  # as they were


class Syncing(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 4)

    def forward(self, x):
        return self.layer(x) / x.abs().sum().item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: set_sync_debug_mode is CUDA's")
def test_a_host_sync_on_the_gpu_is_named_by_its_line():
    lines, first = inspect.getsourcelines(Syncing.forward)
    line = first + next(i for i, text in enumerate(lines) if ".item()" in text)
    row = model_checks.gpu_sync_check(Syncing(), BATCH, loss_fn, cfg_for("--amp", "none"))
    assert row["status"] == "warn" and row["summary"].startswith(f"the host waits for the GPU at test_doctor.py:{line}")
    assert model_checks.gpu_sync_check(nn.Linear(8, 4), BATCH, loss_fn, cfg_for("--amp", "none"))["status"] == "pass"


class Float32Only(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 4)

    def forward(self, x):
        return self.layer(x.float())  # fails on float64 weights


def test_a_model_that_cannot_run_a_check_gets_a_warning_and_the_report_goes_on():
    (row,) = doctor.attempt("1 vs 2 processes", doctor_equivalence.equivalence_check, Float32Only().double(),
                            to_float64(BATCH), loss_fn)  # fmt: skip
    assert row["check"] == "1 vs 2 processes" and row["status"] == "warn", row
    assert row["summary"].startswith("not checked: it raises RuntimeError"), row
