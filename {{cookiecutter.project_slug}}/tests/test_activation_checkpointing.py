"""--activation_checkpointing, for any model the project trains: each mode keeps fewer activations
than none, and a run with it is the run without it, to the bit (float64): resumed from a
one-file checkpoint saved without it, and without it from one saved with it; under fsdp with
accumulation and --optimizer muon, from a sharded checkpoint saved under one mode, under
another and under none; on 1 process as on 1 without it (and as on 2, up to the order of the
sums). Compiled under ddp with accumulation, it trains as eager does, up to the order of the
sums. A model whose blocks cannot be found refuses it in one line."""

import copy
import dataclasses
import shutil

import pytest
import torch
from conftest import (
    ARGS,
    ONE,
    TINY_CONFIG,
    TWO,
    assert_same_metrics,
    assert_same_parameters,
    checkpoint,
    compared_metrics,
    gap,
    probe_output,
    read_metrics,
    relative_difference,
    run_tolerance,
    run_training,
    start_from,
)
from test_fsdp import final_weights
from torch import nn

from ddp_utils.doctor.memory import activations_at, memory_plan
from ddp_utils.doctor.run import build
from ddp_utils.errors import ConfigError
from ddp_utils.parallel.activation_checkpointing import MODES, apply_activation_checkpointing, checkpointable_blocks
from task import TASK

pytestmark = pytest.mark.fixed_amp  # exact comparisons need --amp none (ARGS)

CHECKPOINTED = [mode for mode in MODES if mode != "none"]


# The task's model takes the knob where its blocks are of several layers; a model of single
# layers refuses it (test_a_model_without_blocks_refuses_the_knob), and these have nothing to run.
on_the_task = pytest.mark.skipif(
    not checkpointable_blocks(TASK.build_model(TINY_CONFIG)), reason="the task's model refuses the knob"
)


@on_the_task
def test_every_mode_keeps_fewer_activations_than_none():
    """The task's model at its tiny sizes, in training mode: the bytes the forward and the loss
    hold at their peak (the doctor's measure), per mode. full keeps each block's input alone."""
    cfg = dataclasses.replace(TINY_CONFIG, amp="none").resolved()
    model, _, (batch, _) = build(TASK, cfg)
    model.train()
    peaks = {}
    for mode in MODES:
        copied = copy.deepcopy(model)
        apply_activation_checkpointing(copied, mode)
        peaks[mode] = activations_at(copied, batch, TASK.loss_fn, cfg)
    assert peaks["full"] < peaks["none"], peaks
    assert peaks["every_other"] < peaks["none"] or peaks["every_other"] == peaks["full"], peaks  # one block: full
    assert peaks["full"] <= peaks["ops"] < peaks["none"], peaks


@on_the_task
def test_the_doctors_plan_counts_the_activations_of_the_configured_mode():
    """doctor.py's memory plan measures the model as training will run it: with
    --activation_checkpointing full its activations are those full keeps, fewer than none's."""
    cfg = dataclasses.replace(TINY_CONFIG, amp="none").resolved()
    model, _, (batch, _) = build(TASK, cfg)
    model.train()
    planned = {}
    for mode in ("none", "full"):
        plans, _, configured = memory_plan(
            model, batch, TASK.loss_fn, dataclasses.replace(cfg, activation_checkpointing=mode), 2, 2
        )
        planned[mode] = plans[configured]["activations"]
    assert planned["full"] < planned["none"], planned


class Block(nn.Module):
    """Attention, a normalisation, dropout and keyword arguments: what a recompute must replay."""

    def __init__(self):
        super().__init__()
        self.norm, self.attention = nn.LayerNorm(16), nn.MultiheadAttention(16, 2, batch_first=True)
        self.up, self.down, self.dropout = nn.Linear(16, 64), nn.Linear(64, 16), nn.Dropout(0.3)

    def forward(self, x, scale=1.0):
        h = self.norm(x)
        h = h + self.attention(h, h, h, need_weights=False)[0]
        return x + scale * self.dropout(self.down(torch.relu(self.up(h))))


class Residual(nn.Module):
    """A convolution and a batch norm, whose running statistics a recompute must not update twice."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        return x + torch.relu(self.norm(self.conv(x)))


@pytest.mark.parametrize("mode", CHECKPOINTED)
def test_a_checkpointed_step_is_the_same_step_to_the_bit(mode):
    """float64 gradients with dropout (the random generator restored for the recompute), and batch
    norm statistics, equal to those without checkpointing; the state dict's keys unchanged; a deep
    copy of the model (the doctor makes them) checkpoints itself, not the original."""
    with torch.random.fork_rng(devices=[]):
        torch.set_default_dtype(torch.float64)
        try:
            torch.manual_seed(0)
            attention = nn.ModuleList(Block() for _ in range(3))
            convolution = nn.Sequential(Residual(), Residual())
            tokens, images = torch.randn(4, 8, 16), torch.randn(2, 4, 8, 8)

            def step(model):
                torch.manual_seed(1)
                out = model(images) if isinstance(model, nn.Sequential) else sum(b(tokens, scale=0.5) for b in model)
                out.sum().backward()
                return {**{k: p.grad for k, p in model.named_parameters()}, **dict(model.named_buffers())}

            for model in (attention, convolution):
                expected = step(copy.deepcopy(model))
                checkpointed = copy.deepcopy(model)
                assert apply_activation_checkpointing(checkpointed, mode) >= 1
                assert list(checkpointed.state_dict()) == list(model.state_dict())
                copied = copy.deepcopy(checkpointed)  # before any step: the same statistics
                for got in (step(checkpointed), step(copied)):
                    assert got.keys() == expected.keys()
                    assert [k for k in expected if not torch.equal(got[k], expected[k])] == [], mode
        finally:
            torch.set_default_dtype(torch.float32)


def test_a_model_without_blocks_refuses_the_knob():
    """No blocks, or blocks of one layer each (which keep only their input already): refused, not
    accepted to do nothing."""
    single_layers = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 3))
    for mode in CHECKPOINTED:
        with pytest.raises(ConfigError, match=f"--activation_checkpointing {mode}: Linear: it has no blocks"):
            apply_activation_checkpointing(nn.Linear(3, 3), mode)
        with pytest.raises(ConfigError, match=r"Sequential: its blocks are single layers \(Linear\)"):
            apply_activation_checkpointing(single_layers, mode)
    assert apply_activation_checkpointing(nn.Linear(3, 3), "none") == 0


@on_the_task
@pytest.mark.parametrize("mode", CHECKPOINTED)
def test_a_run_checkpointed_from_a_checkpoint_saved_without_is_the_same_run(mode, reference, tmp_path):
    """2 processes in float64: the uninterrupted run without checkpointing, resumed at step 20
    from its own checkpoint with `mode` on, ends with the same parameters to the bit."""
    output_dir = start_from(checkpoint(reference.two, 20), tmp_path / mode)
    run_training(output_dir, *ARGS, *TWO, "--activation_checkpointing", mode, nproc=2, probe="float64")
    assert_same_parameters(output_dir, reference.two)


def test_the_former_yes_no_values_still_read(tmp_path):
    """Projects made before had a yes/no knob: true is full, false is none, as flags and in TOML."""
    from config import Config
    from ddp_utils.configuration import parse_config

    assert (
        parse_config(Config, ["--activation_checkpointing", "true"], resolve=False).activation_checkpointing == "full"
    )
    assert (
        parse_config(Config, ["--activation_checkpointing", "false"], resolve=False).activation_checkpointing == "none"
    )
    toml = tmp_path / "old.toml"
    toml.write_text("activation_checkpointing = true\n")
    assert parse_config(Config, ["--config", str(toml)], resolve=False).activation_checkpointing == "full"


# The runs below are in float64 (tests/ddp_probe.py float64), as the reference runs, with ARGS'
# checkpoint every 4 steps.


def assert_identical(output_dir, reference_dir):
    """The same parameters (one file, or gathered from shards) and metrics lines, to the bit."""
    ours, theirs = final_weights(output_dir), final_weights(reference_dir)
    assert ours.keys() == theirs.keys()
    differ = [key for key in theirs if not torch.equal(ours[key], theirs[key])]
    worst = max((relative_difference(ours[key], theirs[key]), key) for key in differ) if differ else None
    assert not differ, f"parameters differ from the uninterrupted run: {worst[1]} by {worst[0]:.2e} (relative)"
    assert_same_metrics(output_dir, reference_dir)


def assert_close(output_dir, reference_dir):
    """The same parameters and last metrics up to the order of the sums (float64; run_tolerance)."""
    ours, theirs = final_weights(output_dir), final_weights(reference_dir)
    assert ours.keys() == theirs.keys()
    worst, key = max((relative_difference(ours[key], theirs[key]), key) for key in theirs)
    tolerance = run_tolerance()
    assert worst < tolerance, f"{key} differs by {worst:.2e} (relative), {worst / tolerance:.3g}x {tolerance:g}"
    ours, theirs = compared_metrics(read_metrics(output_dir)[-1]), compared_metrics(read_metrics(reference_dir)[-1])
    assert ours.keys() == theirs.keys() and ours == pytest.approx(theirs, rel=tolerance), gap(
        [ours[key] for key in theirs], list(theirs.values()), "metrics", tolerance
    )


def grad_norms(result):
    (line,) = [line for line in probe_output(result) if "grad_norms" in line]
    return line["grad_norms"]


@on_the_task
def test_a_sharded_checkpoint_saved_with_a_mode_resumes_exactly_under_another_and_under_none(tmp_path):
    """fsdp on 2 processes x 2 micro-steps of 16 under --optimizer muon, an epoch (16 steps) with
    ops on; resumed from its sharded checkpoint of step 8 under none, and of step 12 under full:
    each takes the uninterrupted run's steps (their gradient norms) and ends with its parameters
    and metrics, to the bit: accumulation, Muon's matrices gathered from their shards, and the
    sharded state dict's keys, whatever the mode."""
    fsdp = [*ARGS, "--epochs", "1", "--strategy", "fsdp", "--optimizer", "muon"]
    fsdp += ["--batch_size", "16", "--grad_accum_steps", "2"]
    uninterrupted = tmp_path / "ops"
    first = run_training(uninterrupted, *fsdp, "--activation_checkpointing", "ops", nproc=2,
                         probe="float64,record_grad_norms")  # fmt: skip
    assert len(grad_norms(first)) == 16
    for step, mode in ((8, "none"), (12, "full")):
        output_dir = tmp_path / mode
        saved = uninterrupted / "checkpoints" / f"step_{step:09d}"
        shutil.copytree(saved, output_dir / "checkpoints" / saved.name)
        resumed = run_training(output_dir, *fsdp, "--activation_checkpointing", mode, nproc=2,
                               probe="float64,record_grad_norms")  # fmt: skip
        assert grad_norms(resumed) == grad_norms(first)[step:], mode
        assert_identical(output_dir, uninterrupted)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """1 process x 64 with every_other on, from the start: reference.one's run with it on."""
    output_dir = tmp_path_factory.mktemp("one_every_other")
    run_training(output_dir, *ARGS, *ONE, "--activation_checkpointing", "every_other", probe="float64")
    return output_dir


@on_the_task
def test_one_process_with_it_on_trains_as_one_and_two_without(one_process, reference):
    """1 process with every_other on: reference.one's parameters and metrics to the bit, and
    reference.two's (2 processes, which train the same with each mode on: the resumed runs
    above) up to the order of the sums."""
    assert_same_parameters(one_process, reference.one)
    assert_same_metrics(one_process, reference.one)
    assert_close(one_process, reference.two)


@on_the_task
def test_a_one_file_checkpoint_saved_with_a_mode_resumes_exactly_under_none(one_process, tmp_path):
    """The every_other run resumed from its checkpoint of step 40 with it off: the same run."""
    output_dir = start_from(checkpoint(one_process, 40), tmp_path)
    run_training(output_dir, *ARGS, *ONE, probe="float64")
    assert_identical(output_dir, one_process)


@on_the_task
def test_compiled_with_it_on_trains_as_eager_without(reference, tmp_path):
    """--compile with ops on (its policy traced by torch.compile) under ddp, 2 processes x 2
    micro-steps of 16, resumed from reference.two's checkpoint of step 44: the model is compiled
    whole, and its last 4 steps give reference.two's parameters and metrics up to the order of
    the sums (compiled kernels and the micro-batches sum in their own order)."""
    output_dir = start_from(checkpoint(reference.two, 44), tmp_path)
    flags = ["--batch_size", "16", "--grad_accum_steps", "2", "--activation_checkpointing", "ops", "--compile", "true"]
    result = run_training(output_dir, *ARGS, *flags, nproc=2, probe="float64,record_compiled_units", timeout=600)
    (compiled,) = [line for line in probe_output(result) if "compiled_whole" in line]
    assert compiled["compiled_whole"], compiled
    assert_close(output_dir, reference.two)
