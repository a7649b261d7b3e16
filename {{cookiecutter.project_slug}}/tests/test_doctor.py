"""doctor.py: the task's own model and data pass (a warning at most), and each fault the doctor
is for is named, injected into small models in this process."""

import json

import pytest
import torch
from conftest import PROJECT, TINY
from torch import nn

import doctor
from config import parse_config


def test_the_shipped_task_passes_the_doctor(tmp_path, capsys):
    code = doctor.main([*TINY, "--output_dir", str(tmp_path), "--nodes", "2", "--gpus_per_node", "2"])
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "doctor.json").read_text())
    statuses = {row["check"]: row["status"] for row in report["checks"]}
    assert code == 0, printed
    assert set(statuses) == {"memory plan", "1 vs 2 processes", "exact resume", "non-finite values",
                             "unused parameters", "zero gradients", "host syncs"}  # fmt: skip
    assert "fail" not in statuses.values(), printed
    for name in ("memory plan", "1 vs 2 processes", "exact resume", "unused parameters"):
        assert statuses[name] == "pass", printed
    # 2 nodes of 2: ddp holds everything, fsdp a quarter of the model state, hsdp a half.
    plans = report["memory_bytes_per_gpu"]
    state = {name: plan["parameters"] + plan["gradients"] + plan["optimizer"] for name, plan in plans.items()}
    assert state["fsdp"] == pytest.approx(state["ddp"] / 4) and state["hsdp"] == pytest.approx(state["ddp"] / 2)
    assert plans["ddp"]["activations"] > 0
    assert "| memory plan | PASS |" in printed


def cfg_for(*flags):
    return parse_config([*TINY, "--output_dir", "unused", *flags], resolve=False)


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


def loss_fn(output, batch):
    return nn.functional.cross_entropy(output, batch[1])


BATCH = (torch.randn(6, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 3, 0, 1]))


@pytest.mark.parametrize(
    "fault, check, status, named",
    [
        ("none", "unused parameters", "fail", "unused.weight"),
        ("key_bias", "zero gradients", "warn", "zero in exact arithmetic: key.bias ("),
        ("not_finite", "non-finite values", "fail", "not finite"),
    ],
)
def test_each_fault_is_named(fault, check, status, named):
    rows = {row["check"]: row for row in doctor.gradient_checks(Faulty(fault), (BATCH, BATCH), loss_fn, cfg_for())}
    assert rows[check]["status"] == status and named in rows[check]["summary"], rows[check]
    assert rows[check]["fix"]


def test_unused_parameters_only_warn_when_ddp_is_told():
    rows = doctor.gradient_checks(Faulty("none"), (BATCH, BATCH), loss_fn, cfg_for("--find_unused_parameters", "true"))
    (row,) = [row for row in rows if row["check"] == "unused parameters"]
    assert row["status"] == "warn"


def test_host_syncs_in_forward_or_the_loss_are_found(tmp_path):
    model = tmp_path / "model.py"
    model.write_text(
        "class M:\n    def forward(self, x):\n        n = x.sum().item()\n        return x / n\n\n\n"
        "def loss_fn(output, batch):\n    return output.mean().cpu()\n\n\ndef report(x):\n    return x.tolist()\n"
    )
    row = doctor.host_sync_check([model, PROJECT / "dataset.py"])
    assert row["status"] == "warn"
    assert row["summary"] == "model.py:3 .item() in forward; model.py:8 .cpu() in loss_fn"  # not report()'s


def test_a_model_too_big_for_the_gpu_gets_the_way_to_fit():
    """ddp holds 16 bytes a parameter: 8 million parameters do not fit 0.05 GB; sharded over 8
    GPUs they do; on 1 GPU nothing fits."""
    model = nn.Sequential(*(nn.Linear(1000, 1000) for _ in range(8)))
    cfg = cfg_for("--amp", "none")
    plans, activations = doctor.memory_plan(model, (torch.randn(4, 1000), None), lambda o, b: o.sum(), cfg, 8, 8)
    row = doctor.memory_check(plans, activations, cfg, 0.05, 8)
    assert row["status"] == "warn" and row["fix"] == "--strategy fsdp", row
    # What each layer saves for backward: its input, 1000 values of 4 bytes a sample.
    assert activations == pytest.approx(8 * 1000 * 4 * cfg.batch_size)
    plans, activations = doctor.memory_plan(model, (torch.randn(4, 1000), None), lambda o, b: o.sum(), cfg, 1, 1)
    row = doctor.memory_check(plans, activations, cfg, 0.05, 1)
    assert row["status"] == "fail" and row["fix"].startswith("more GPUs with --strategy fsdp"), row


class Normed(nn.Module):
    """A batch norm without synchronisation: each process normalises its share alone."""

    def __init__(self):
        super().__init__()
        self.layer, self.norm = nn.Linear(8, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.layer(x))


def loss_per_class_present(output, batch):
    """Divided by a count that differs between the ranks' shares (the classes each holds)."""
    return nn.functional.cross_entropy(output, batch[1], reduction="sum") / batch[1].unique().numel()


@pytest.mark.parametrize(
    "build_model, loss, named",
    [
        (Normed, loss_fn, "norm normalises each process's share"),
        (lambda: nn.Linear(8, 4), loss_per_class_present, "the loss is not the mean over the batch's samples"),
    ],
)
def test_what_one_process_cannot_tell_from_two_is_named(build_model, loss, named):
    row = doctor.equivalence_check(build_model().double(), doctor.to_float64(BATCH), loss)
    assert row["status"] == "fail" and named in row["summary"], row


def test_a_synchronised_norm_and_a_plain_model_are_the_same_on_one_process_and_two():
    synced = Normed()
    synced.norm.same_buffers_on_every_rank = True  # as the vision task's SyncBatchNorm2d says
    for model in (synced, nn.Linear(8, 4)):
        assert doctor.equivalence_check(model.double(), doctor.to_float64(BATCH), loss_fn)["status"] == "pass"


class Stateful(nn.Module):
    """`draw`: where its randomness comes from; `count`: a Python attribute its output depends on."""

    def __init__(self, draw=None, count=False):
        super().__init__()
        self.layer, self.draw, self.count, self.calls = nn.Linear(8, 4), draw, count, 0
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x):
        self.calls += 1
        if self.draw == "global":
            x = x + torch.randn(x.shape, dtype=x.dtype)
        if self.draw == "own":
            x = x + torch.randn(x.shape, dtype=x.dtype, generator=self.generator)
        return self.layer(x) * (self.calls if self.count else 1)


@pytest.mark.parametrize(
    "model, status",
    [
        (dict(draw="global"), "pass"),  # torch's generator: the checkpoint saves and restores it
        (dict(draw="own"), "fail"),
        (dict(count=True), "fail"),
    ],
)
def test_a_resume_that_is_not_exact_is_found(model, status):
    row = doctor.resume_check(lambda: Stateful(**model), doctor.halves(doctor.to_float64(BATCH)), loss_fn, cfg_for())
    assert row["status"] == status, row
    if status == "fail":
        assert row["summary"] == "layer.weight differs after a resume" and "register_buffer" in row["fix"]
