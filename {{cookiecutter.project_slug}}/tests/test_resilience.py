"""Nothing lost: atomic and complete checkpoints, exact resume (also on another world size,
batch size or amp mode), bad files. Preemption and restarts: test_preemption.py.

Every test runs real processes and compares against an uninterrupted run, bit for bit.
"""

import dataclasses
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from conftest import (
    ARGS,
    LR,
    ONE,
    TINY_CONFIG,
    TWO,
    assert_same_metrics,
    assert_same_parameters,
    checkpoint,
    load_final_model,
    read_metrics,
    relative_difference,
    run_tolerance,
    run_training,
    saved_step,
    start_from,
)

from ddp_utils.checkpoint import loading, single_file
from ddp_utils.errors import CheckpointError
from model import ModelConfig
from task import TASK

pytestmark = pytest.mark.fixed_amp  # bit-exact comparisons need --amp none


def test_checkpoint_holds_everything_to_continue(reference):
    state = torch.load(checkpoint(reference.two, 20), map_location="cpu", weights_only=True)
    assert (state["step"], state["epoch"], state["batches_done"]) == (20, 1, 4)
    assert {"model", "optimizer", "scaler", "config", "ranks", "world_size"} <= state.keys()
    assert len(state["ranks"]) == 2 and {"rng", "loss_totals"} <= state["ranks"][1].keys()
    assert {"torch", "python", "numpy"} <= state["ranks"][0]["rng"].keys()
    assert state["config"]["checkpoint_every_steps"] == 4
    names = sorted(p.name for p in (reference.two / "checkpoints").iterdir())
    assert names == ["last.pt"] + [f"step_{step:09d}.pt" for step in range(4, 49, 4)]  # no temporary files left


def test_resume_maps_the_checkpoint_into_host_memory(reference):
    """Every rank reads the checkpoint through a memory map on the host and copies what it needs
    (onto its GPU, in load_state_dict): nothing is loaded whole onto a device, and a node's
    processes share the file's pages."""
    path = checkpoint(reference.two, 16)
    state = loading.load_checkpoint(path)
    maps = Path("/proc/self/maps").read_text().splitlines()
    assert any(line.endswith(" " + os.path.realpath(path)) for line in maps), "not memory-mapped"
    assert {tensor.device.type for tensor in state["model"].values()} == {"cpu"}


def test_a_folder_of_both_strategies_resumes_its_newest_checkpoint(tmp_path):
    """ddp reads sharded checkpoints too, so a run may switch strategy in one output folder:
    checkpoints are ordered by their step across both kinds, `last.pt` and `last` with the
    numbered one they name, and fsdp refuses when the newest is a one-file (ddp) checkpoint
    rather than silently resuming an older sharded one."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step in (4, 12):
        (folder / f"step_{step:09d}").mkdir()
    (folder / "last").symlink_to("step_000000012")
    for step in (8, 16):
        (folder / f"step_{step:09d}.pt").write_bytes(b"")
    os.link(folder / "step_000000008.pt", folder / "last.pt")  # last.pt is step 8: older than 16
    names = [path.name for path in loading.checkpoint_candidates(folder)]
    assert names == ["step_000000016.pt", "last", "step_000000012", "last.pt", "step_000000008.pt", "step_000000004"]
    with pytest.raises(CheckpointError, match="newest checkpoint .*step_000000016.pt, is one file"):
        loading.load_latest_checkpoint(folder, sharded_only=True)


def test_resume_at_an_epoch_boundary_is_bit_identical(reference, tmp_path):
    output_dir = start_from(checkpoint(reference.two, 16), tmp_path)
    run_training(output_dir, *ARGS, *TWO, nproc=2, probe="float64")  # as the reference ran
    assert_same_parameters(output_dir, reference.two)
    assert [m["epoch"] for m in read_metrics(output_dir)] == [2, 3]
    assert_same_metrics(output_dir, reference.two)


@pytest.mark.quick
def test_resume_mid_epoch_is_bit_identical(reference, tmp_path):
    output_dir = start_from(checkpoint(reference.two, 20), tmp_path)
    result = run_training(output_dir, *ARGS, *TWO, nproc=2, probe="float64")
    assert "resumed from" in result.stdout and "epoch 2, step 20" in result.stdout
    assert_same_parameters(output_dir, reference.two)
    assert_same_metrics(output_dir, reference.two)  # epoch 2's train_loss includes steps 17-20


def test_truncated_last_checkpoint_falls_back_to_the_newest_valid_one(reference, tmp_path):
    output_dir = start_from(checkpoint(reference.one, 40), tmp_path)
    shutil.copy(checkpoint(reference.one, 36), checkpoint(output_dir, 36))
    last = output_dir / "checkpoints" / "last.pt"
    whole = checkpoint(reference.one, 44).read_bytes()
    last.write_bytes(whole[: len(whole) // 2])  # a copy cut short
    result = run_training(output_dir, *ARGS, *ONE, probe="float64")
    assert result.stdout.count(f"checkpoint {last} is unreadable") == 1, result.stdout
    assert "resumed from" in result.stdout and "step 36" in result.stdout
    assert_same_parameters(output_dir, reference.one)


def test_no_readable_checkpoint_stops_with_one_message_and_keeps_the_files(tmp_path):
    last = tmp_path / "checkpoints" / "last.pt"
    last.parent.mkdir()
    last.write_bytes(b"not a checkpoint")
    result = run_training(tmp_path, "--amp", "none", nproc=2, check=False)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert output.count("no readable checkpoint among") == 1 and str(last) in output
    assert 'train.py", line' not in output and 'trainer.py", line' not in output
    assert last.read_bytes() == b"not a checkpoint"
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_crash_during_any_checkpoint_write_loses_nothing(reference, tmp_path):
    """SIGKILL in the middle of the 2nd write of a checkpoint file, whichever file that is
    (last.pt too, if it were written in place), then again in the 2nd write of the run started
    again: the folder's 2nd and 3rd writes. Each time last.pt is still the newest complete
    checkpoint, the very file of the newest numbered one (a hard link, never a second write),
    and the next start reads it without an "unreadable" warning; the last ends as the
    uninterrupted run. (One folder crashed twice: the second crash needs no fresh run of its own.)"""
    folder = tmp_path / "checkpoints"
    for saved, crashed in [(None, 4), (4, 8)]:  # the checkpoint it starts from, the one before its crash
        result = run_training(tmp_path, *ARGS, *ONE, probe="float64,crash_in_checkpoint_write",
                              env={"CRASH_AT_WRITE": "2"}, check=False)  # fmt: skip
        assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr
        assert saved is None or ("resumed from" in result.stdout and f"step {saved}" in result.stdout), result.stdout
        assert "unreadable" not in result.stdout + result.stderr
        newest = max(folder.glob("step_*.pt"))
        assert os.path.samefile(folder / "last.pt", newest), sorted(p.name for p in folder.iterdir())
        assert saved_step(tmp_path) == (crashed, 0, crashed)  # the checkpoint before the crash
    resumed = run_training(tmp_path, *ARGS, *ONE, probe="float64")
    assert "unreadable" not in resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout and "step 8" in resumed.stdout
    assert_same_parameters(tmp_path, reference.one)
    assert not list(folder.glob(".*"))  # the crashes' temporary files are gone


def test_the_restarts_repeated_steps_are_in_metrics_jsonl_once(tmp_path):
    """A run killed before its first checkpoint (SIGKILL in its first write, its first metrics
    line written) starts afresh when run again: metrics.jsonl holds each step's line once, the
    killed run's lines replaced by the restart's."""
    args = ["--max_steps", "4", "--eval_every_steps", "2", "--checkpoint_every_steps", "0"]
    killed = run_training(tmp_path, *args, probe="crash_in_checkpoint_write", env={"CRASH_AT_WRITE": "1"},
                          check=False)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL and [m["step"] for m in read_metrics(tmp_path)] == [2]
    run_training(tmp_path, *args)
    assert [m["step"] for m in read_metrics(tmp_path)] == [2, 4]


def test_a_save_never_prunes_the_checkpoint_it_has_just_written(tmp_path):
    """A folder with newer steps than the run saves (it resumed from another folder's
    checkpoint, or --keep_checkpoints was lowered): the newest --keep_checkpoints stay, and the
    one just saved, which last.pt names, always."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step in (100, 200):
        torch.save({"step": step}, folder / f"step_{step:09d}.pt")
    assert single_file._write_checkpoint({"step": 50}, folder, 50, 2) is None
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["last.pt", "step_000000050.pt", "step_000000200.pt"], names
    assert os.path.samefile(folder / "last.pt", folder / "step_000000050.pt")


def test_resume_mid_epoch_restores_the_random_generators(tmp_path):
    """A model that draws from the global random generator every step (dropout) still resumes
    bit-identically mid-epoch: the checkpoint holds the generator states (of every rank)."""
    whole = tmp_path / "whole"
    run_training(whole, *ARGS, *ONE, probe="with_dropout")
    resumed = start_from(checkpoint(whole, 20), tmp_path / "resumed")
    run_training(resumed, *ARGS, *ONE, probe="with_dropout")
    assert_same_parameters(resumed, whole)


@pytest.mark.parametrize("saved_by, resumed_by", [("two", "one"), ("one", "two")])
def test_another_world_size_continues_from_an_epoch_boundary(reference, tmp_path, saved_by, resumed_by):
    """In float64: the same data order, so the same parameters up to summation order."""
    source = checkpoint(getattr(reference, saved_by), 16)
    batch, nproc = (ONE, 1) if resumed_by == "one" else (TWO, 2)
    run_training(tmp_path, *ARGS, *batch, "--resume", source, nproc=nproc, probe="float64")
    ours, theirs = load_final_model(tmp_path), load_final_model(getattr(reference, resumed_by))
    for key in theirs:
        assert relative_difference(ours[key], theirs[key]) < run_tolerance(), key


def shape_change():
    """A change a checkpoint must refuse, and the line that says so: the first of model.py's
    SHAPE_FIELDS that is a positive whole number of ModelConfig (0 is "read from the data"),
    doubled."""
    model_fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    values = {name: getattr(TINY_CONFIG, name) for name in TASK.shape_fields
              if name in model_fields and model_fields[name].type is int}  # fmt: skip
    name, value = next(((name, value) for name, value in values.items() if value > 0), (None, None))
    if name is None:
        pytest.skip("model.py's SHAPE_FIELDS name no positive whole-number field of ModelConfig")
    return [f"--{name}", str(2 * value)], f"--{name} is {2 * value}, the checkpoint's is {value}"


def test_checkpoint_of_another_model_shape_is_refused(reference, tmp_path):
    change, message = shape_change()
    result = run_training(tmp_path, *ARGS, *change, "--resume", checkpoint(reference.two, 16), probe="float64",
                          check=False)  # fmt: skip
    assert result.returncode == 1
    assert message in result.stdout


def test_resume_none_refuses_to_overwrite_a_run(reference, tmp_path):
    output_dir = start_from(checkpoint(reference.two, 16), tmp_path)
    result = run_training(output_dir, *ARGS, "--resume", "none", check=False)
    assert result.returncode == 1
    assert "--resume none, but" in result.stdout and "--resume auto" in result.stdout
    assert sorted(p.name for p in (output_dir / "checkpoints").iterdir()) == ["last.pt"]


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    """--keep_checkpoints 2: of the step files every 2 steps, the newest two stay (and last.pt)."""
    run_training(tmp_path, "--max_steps", "8", "--checkpoint_every_steps", "2", "--keep_checkpoints", "2")
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["last.pt", "step_000000006.pt", "step_000000008.pt"], names


def test_mid_epoch_checkpoint_resumes_on_another_world_size(reference, tmp_path):
    """Step 20 of the 2-process run is 256 samples into epoch 2: 4 batches of 64 for one process
    (the same data order, so the same result), and for a global batch of 48 the nearest whole
    batch is sample 240: 16 samples trained twice, said in one warning, and the run completes."""
    source = checkpoint(reference.two, 20)
    run_training(tmp_path / "one", *ARGS, *ONE, "--resume", source, probe="float64")
    ours, theirs = load_final_model(tmp_path / "one"), load_final_model(reference.one)
    for key in theirs:  # in float64: summation order aside
        assert relative_difference(ours[key], theirs[key]) < run_tolerance(), key
    result = run_training(tmp_path / "odd", *ARGS, "--batch_size", "48", "--resume", source, probe="float64")
    warning = "stopped 256 samples into epoch 2, not a whole number of global batches of 48: resuming at sample 240"
    assert result.stdout.count(warning) == 1, result.stdout
    assert "16 samples are trained twice this epoch" in result.stdout
    assert [m["epoch"] for m in read_metrics(tmp_path / "odd")] == [2, 3]


@pytest.mark.parametrize(
    "saved_by, resumed_with", [("two", "one process, batch 32"), ("one", "two processes, batch 64")]
)
def test_the_learning_rate_stays_on_course_when_the_world_size_changes(reference, tmp_path, saved_by, resumed_with):
    """The per-process batch stays and the world size changes, as when an elastic job loses or
    gains a node: the global batch halves (or doubles). The schedule runs on samples, so every
    epoch ends at the lr of the uninterrupted run and the last one at the floor (lr x 0.1)."""
    source = checkpoint(getattr(reference, saved_by), 16)
    batch, nproc = (TWO, 1) if saved_by == "two" else (ONE, 2)
    run_training(tmp_path, *ARGS, *batch, "--resume", source, nproc=nproc, probe="float64")
    ours = [m["lr"] for m in read_metrics(tmp_path)]
    theirs = [m["lr"] for m in read_metrics(getattr(reference, saved_by))]
    assert ours == pytest.approx(theirs[1:], rel=1e-12), resumed_with
    assert ours[-1] == pytest.approx(LR * 0.1)


def test_checkpoint_of_the_one_group_optimizer_resumes_with_its_state(tmp_path):
    """Checkpoints written before AdamW's two parameter groups (one group, decay on every
    parameter; tests/ddp_probe.py single_param_group) resume with their optimizer state, said
    once. Without weight decay both layouts do the same arithmetic: the run resumed at step 4
    equals the old one's uninterrupted run bit for bit, so every moment went to its own
    parameter. (That run is the uninterrupted one: a run of this version would be another
    launch, for the same parameters.)"""
    args = [*ONE, "--amp", "none", "--weight_decay", "0", "--max_steps", "8", "--checkpoint_every_steps", "4"]
    run_training(tmp_path / "old", *args, "--keep_checkpoints", "100", probe="single_param_group")
    resumed = start_from(checkpoint(tmp_path / "old", 4), tmp_path / "resumed")
    result = run_training(resumed, *args)
    assert result.stdout.count("was saved with weight decay on every parameter") == 1, result.stdout
    assert "resumed from" in result.stdout
    assert_same_parameters(resumed, tmp_path / "old")


def test_resume_with_another_amp_mode(tmp_path):
    """A checkpoint without loss-scaler state (trained with --amp none or bf16) resumes under
    fp16 with a fresh loss scale, said once; an fp16 checkpoint resumes under bf16, its scale
    unused. One run, three amp modes, of short epochs (amp on a CPU is slow; what is checked is
    what each resume reads and says)."""
    short = ["--train_samples", "256"]  # 8 steps an epoch
    run_training(tmp_path, *short, "--amp", "none", "--epochs", "1")
    as_fp16 = run_training(tmp_path, *short, "--amp", "fp16", "--epochs", "2")
    note = "was trained without loss scaling (--amp none): the fp16 loss scale starts afresh"
    assert as_fp16.stdout.count(note) == 1, as_fp16.stdout
    as_bf16 = run_training(tmp_path, *short, "--amp", "bf16", "--epochs", "3")
    assert "resumed from" in as_bf16.stdout and "loss scale" not in as_bf16.stdout
    assert [m["epoch"] for m in read_metrics(tmp_path)] == [1, 2, 3]
