"""Real runs of train.py: 2 processes under torchrun (gloo on CPU), and plain `python train.py`."""

import dataclasses
import inspect
import json
import math
import re
import sys

import pytest
import task_settings
import torch
from conftest import (
    LR,
    PROJECT,
    TINY_CONFIG,
    config_flags,
    flag_text,
    load_final_model,
    probe_output,
    read_metrics,
    run_training,
)

from config import Config
from ddp_utils.checkpoint.checkpointer import same_optimizer_implementation
from ddp_utils.core import compat
from ddp_utils.optim.optimizer import clip_grad_norm
from task import TASK

# The machinery's and val_loss, which every task reports (its other metrics are its own).
REQUIRED_METRICS = {"epoch", "step", "train_loss", "val_loss", "val_samples", "samples_per_s"}


def test_two_processes_write_one_metrics_line_per_epoch(two_process_run):
    output_dir, _ = two_process_run
    metrics = read_metrics(output_dir)
    assert [m["epoch"] for m in metrics] == [1, 2, 3]
    assert all(REQUIRED_METRICS <= m.keys() for m in metrics)
    assert all(m["val_samples"] == 256 for m in metrics)
    # 1024 samples, global batch 2 x 32 = 64: 16 optimizer steps per epoch.
    assert [m["step"] for m in metrics] == [16, 32, 48]


def test_no_full_garbage_collection_runs_inside_the_training_steps(tmp_path):
    """A full collection walks every object of the process (0.25-0.43 s on this CPU, on every
    rank at once): it runs after checkpoints and evaluations, where the run waits anyway, even
    when a leaky model makes Python's own thresholds ask for more (ddp_probe's 20,000 objects
    kept per micro-step; without the collector's settings they start a dozen inside the steps)."""
    result = run_training(tmp_path, "--checkpoint_every_steps", "8", probe="record_full_collections")
    (counts,) = probe_output(result)
    assert counts["full_collections_outside"] == 0, counts
    assert counts["by_collector"] >= len(read_metrics(tmp_path)), counts  # one at least after each evaluation


def test_training_learns(two_process_run):
    """Below the loss of a uniform guess over the classes (or bytes), and falling."""
    output_dir, _ = two_process_run
    metrics = read_metrics(output_dir)
    assert metrics[-1]["val_loss"] < task_settings.CHANCE_LOSS
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]


def test_checkpoint_is_complete_and_loads_weights_only(two_process_run):
    output_dir, _ = two_process_run
    state = torch.load(output_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert {"model", "optimizer", "scaler", "epoch", "step", "config", "ranks"} <= state.keys()
    assert (state["epoch"], state["step"]) == (3, 48)
    assert not any(key.startswith("module.") for key in state["model"])
    assert state["optimizer"]["state"], "optimizer state (AdamW moments) must be saved"
    tiny = config_flags(PROJECT / "experiments" / "tiny.toml")  # the model's sizes: saved as trained
    assert all(flag_text(state["config"][flag[2:]]) == value for flag, value in zip(tiny[::2], tiny[1::2]))
    assert len(state["ranks"]) == 2
    json.dumps(state["config"])  # plain data


def test_checkpoint_rotation_keeps_newest(two_process_run):
    output_dir, _ = two_process_run
    names = sorted(p.name for p in (output_dir / "checkpoints").iterdir())
    assert names == ["last.pt", "step_000000016.pt", "step_000000032.pt", "step_000000048.pt"]


def test_only_rank_zero_logs_info(two_process_run):
    output_dir, result = two_process_run
    assert "[rank 0] INFO" in result.stdout
    assert "[rank 1]" not in result.stdout + result.stderr
    log_text = (output_dir / "train.log").read_text()
    assert "step 4 loss" in log_text and "val_loss" in log_text
    assert log_text.count("epoch 3 step 48") == 1


def test_single_process_without_torchrun(tmp_path):
    run_training(tmp_path, "--epochs", "1")
    metrics = read_metrics(tmp_path)
    assert len(metrics) == 1 and metrics[0]["val_samples"] == 256
    state = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert state["model"].keys() == TASK.build_model(Config(**state["config"])).state_dict().keys()  # unwrapped


@pytest.mark.fixed_amp
def test_training_by_steps_evaluates_every_n_steps(tmp_path):
    """--max_steps 20 runs past the first epoch (16 steps) and stops mid-epoch; --eval_every_steps
    8 writes a metrics line (with its epoch and step) every 8 steps and at the end; the
    schedule spans the 20 steps and ends at the floor."""
    by_steps = ["--amp", "none", "--batch_size", "64", "--max_steps", "20", "--eval_every_steps", "8"]
    run_training(tmp_path, *by_steps)
    metrics = read_metrics(tmp_path)
    assert [(m["epoch"], m["step"]) for m in metrics] == [(1, 8), (1, 16), (2, 20)]
    assert metrics[-1]["lr"] == pytest.approx(LR * 0.1)
    state = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert (state["step"], state["epoch"], state["batches_done"]) == (20, 1, 4)
    rerun = run_training(tmp_path, *by_steps)
    assert "run already complete" in rerun.stdout


@pytest.mark.fixed_amp
def test_the_trainer_follows_the_schedule_from_the_first_step(tmp_path):
    """Each optimizer step trains at lr_at(samples trained once it is done): with 4 warmup steps,
    lr/4, lr/2, 3lr/4 and lr at steps 1 to 4 (not 0 at step 1: that step would be wasted)."""
    result = run_training(tmp_path, "--amp", "none", "--epochs", "1", "--warmup_steps", "4", "--log_every_steps", "1",
                          "--lr_schedule", "constant", "--lr", "0.01")  # fmt: skip
    logged = re.findall(r"step (\d+) loss \S+ lr (\S+)", result.stdout)
    assert [(int(step), float(lr)) for step, lr in logged[:5]] == [
        (1, 0.0025),
        (2, 0.005),
        (3, 0.0075),
        (4, 0.01),
        (5, 0.01),
    ]


@pytest.mark.fixed_amp
def test_weight_decay_shrinks_matrices_and_never_biases_or_norms(tmp_path):
    """AdamW's two parameter groups (optim.build_optimizer): --weight_decay acts on every
    parameter of 2 or more dimensions (matrices, convolution kernels, embeddings) and on none
    of 1 (biases, LayerNorm and BatchNorm weights). One step from the same start with
    --weight_decay 0 and 0.5 (the same gradients): exactly the former differ, but for a matrix
    that starts at zero (a head the model zero-initialises), which has nothing to decay yet."""
    one_step = ["--amp", "none", "--max_steps", "1", "--lr", "0.01"]
    run_training(tmp_path / "off", *one_step, "--weight_decay", "0")
    run_training(tmp_path / "on", *one_step, "--weight_decay", "0.5", probe="record_initial_weights")
    off, on = load_final_model(tmp_path / "off"), load_final_model(tmp_path / "on")
    start = torch.load(tmp_path / "on" / "initial_weights.pt", weights_only=True)
    cfg = Config(**torch.load(tmp_path / "on" / "checkpoints" / "last.pt", weights_only=True)["config"])
    parameters = {name for name, _ in TASK.build_model(cfg).named_parameters(remove_duplicate=False)}
    decayed = sorted(name for name in parameters if not torch.equal(off[name], on[name]))
    zero_at_start = {name for name, value in start.items() if not value.any()}
    assert decayed == sorted(name for name in parameters if off[name].dim() >= 2 and name not in zero_at_start), decayed
    assert decayed, "no parameter decayed"
    assert any(off[name].dim() < 2 for name in parameters)  # biases or norms: there is something to spare


def test_resume_keeps_this_machines_optimizer_implementation():
    """A saved optimizer state carries the saving machine's implementation (fused, foreach);
    a resume keeps this machine's (fused on CUDA), or a checkpoint from a CPU run would step
    unfused on GPUs."""
    parameters = [torch.nn.Parameter(torch.zeros(2, 2))]
    saved = torch.optim.AdamW(parameters, foreach=True).state_dict()
    optimizer = torch.optim.AdamW(parameters, foreach=False)
    with same_optimizer_implementation(optimizer):
        optimizer.load_state_dict(saved)
    assert (optimizer.param_groups[0]["foreach"], optimizer.param_groups[0]["fused"]) == (False, None)


@pytest.mark.parametrize("clipped", [True, False])
def test_clipping_is_torchs_to_the_bit(clipped):
    """optim.clip_grad_norm, the loop's own clipping, returns the norm and leaves the gradients
    that torch.nn.utils.clip_grad_norm_ does, bit for bit, on the task's model (a parameter
    without a gradient left out, as both do): small gradients clipped to a tenth of their norm,
    where torch's 1e-6 beside the norm counts, and measured only (max_norm inf)."""
    model = TASK.build_model(TINY_CONFIG)
    gradients = torch.Generator().manual_seed(0)
    for p in list(model.parameters())[1:]:
        p.grad = 1e-3 * torch.randn(p.shape, generator=gradients)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for copy, p in zip(copies, model.parameters()):
        copy.grad = None if p.grad is None else p.grad.clone()
    max_norm = 0.1 * torch.nn.utils.get_total_norm([p.grad for p in copies if p.grad is not None]).item()
    max_norm = max_norm if clipped else math.inf
    before = [p.grad.clone() for p in copies if p.grad is not None]
    theirs_norm = torch.nn.utils.clip_grad_norm_(copies, max_norm)
    theirs = [p.grad for p in copies if p.grad is not None]
    norm = clip_grad_norm(model.parameters(), max_norm)
    assert torch.equal(norm, theirs_norm)
    mine = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    assert clipped == any(not torch.equal(a, b) for a, b in zip(mine, before))  # scaled down when clipped


@pytest.mark.fixed_amp
def test_amp_modes_train(tmp_path):
    for amp in ("bf16", "fp16"):
        run_training(tmp_path / amp, "--epochs", "1", "--amp", amp)
        loss = read_metrics(tmp_path / amp)[0]["val_loss"]
        assert loss < task_settings.CHANCE_LOSS  # finite and learning


def test_readme_config_table_matches_config():
    """Every Config field is in docs/configuration.md's tables with its default and help text, and nothing else."""
    rows, in_table = [], False
    for line in (PROJECT / "docs" / "configuration.md").read_text().splitlines():  # "field | default | meaning"
        in_table = line == "| field | default | meaning |" or (in_table and line.startswith("|"))
        if in_table and line.startswith("| `"):
            rows.append(line.split(" | "))
    table = {cells[0].strip("| `"): (cells[1].strip("`"), cells[2].rstrip(" |")) for cells in rows}
    expected = {}
    for field in dataclasses.fields(Config):
        default = str(field.default).lower() if isinstance(field.default, bool) else str(field.default)
        choices = field.metadata["choices"]
        meaning = field.metadata["help"] + (f"; one of: {', '.join(choices)}" if choices else "")
        expected[field.name] = (default, meaning)
    missing, gone = sorted(expected.keys() - table.keys()), sorted(table.keys() - expected.keys())
    changed = sorted(name for name in expected.keys() & table.keys() if table[name] != expected[name])
    assert table == expected, (
        f"docs/configuration.md's tables are not Config's fields (after a change of ModelConfig or DataConfig: "
        f"its section 'This task's fields'): no row for {missing}, rows for fields that are gone {gone}, "
        f"another default or help text for {changed}"
    )


def test_ddps_buffer_setting_is_the_name_each_supported_torch_knows():
    """torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers (the old name warns);
    the project's oldest torch knows only the old one."""
    assert compat.buffer_sync_setting({"broadcast_buffers": None}) == "broadcast_buffers"
    both = {"broadcast_buffers": None, "forward_sync_buffers": None}
    assert compat.buffer_sync_setting(both) == "forward_sync_buffers"
    assert compat.BUFFER_SYNC in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters


def test_older_torchrun_gives_the_workers_launch_shs_stop_grace():
    """torchrun 2.11 has no --shutdown-timeout: scripts/torchrun_status.py gives the workers
    PET_SHUTDOWN_TIMEOUT seconds through the close its agent calls; a torchrun with the flag is
    left as it is."""
    sys.path.insert(0, str(PROJECT / "scripts"))
    try:
        import torchrun_status
    finally:
        sys.path.remove(str(PROJECT / "scripts"))

    class Processes:
        def close(self, death_sig=None, timeout=30):
            return death_sig, timeout

    class OlderAgent:  # torch 2.11's LocalElasticAgent._shutdown
        def _shutdown(self, death_sig=None):
            pass

    class NewerAgent:
        def _shutdown(self, death_sig=None, timeout=30):
            pass

    environ = {"PET_SHUTDOWN_TIMEOUT": "77"}
    assert not torchrun_status.shutdown_grace_for_older_torchrun(NewerAgent, Processes, environ)
    assert Processes().close("SIGTERM") == ("SIGTERM", 30)
    assert not torchrun_status.shutdown_grace_for_older_torchrun(OlderAgent, Processes, {})
    assert torchrun_status.shutdown_grace_for_older_torchrun(OlderAgent, Processes, environ)
    assert Processes().close("SIGTERM") == ("SIGTERM", 77)
    assert Processes().close("SIGTERM", 5) == ("SIGTERM", 5)
