"""--activation_checkpointing, for any model the project trains: each mode keeps fewer activations
than none, and a run with it is the run without it, to the bit (float64), resumed from a
checkpoint saved without it; a model whose blocks cannot be found refuses it in one line."""

import copy
import dataclasses

import pytest
import torch
from conftest import ARGS, TINY_CONFIG, TWO, assert_same_parameters, checkpoint, run_training, start_from
from torch import nn

from ddp_utils.doctor.memory import activations_at, memory_plan
from ddp_utils.doctor.run import build
from ddp_utils.errors import ConfigError
from ddp_utils.parallel.activation_checkpointing import MODES, apply_activation_checkpointing
from task import TASK

CHECKPOINTED = [mode for mode in MODES if mode != "none"]


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
    for mode in CHECKPOINTED:
        with pytest.raises(ConfigError, match=f"--activation_checkpointing {mode}: Linear has no blocks"):
            apply_activation_checkpointing(nn.Linear(3, 3), mode)
    assert apply_activation_checkpointing(nn.Linear(3, 3), "none") == 0


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
