"""--optimizer muon keeps the guarantees AdamW's runs are held to, and is torch.optim.Muon's
update computed faster: the update is torch's to the bit (float64), each rank orthogonalises
only its share of the matrices, Muon's matrices follow the schedule at --muon_lr and the rest
at --lr; 1 vs 2 processes and accumulation give the same parameters, fsdp and hsdp give DDP's (Newton-Schulz on whole
matrices, never on a shard), resume after SIGTERM and after a SIGKILL of the whole job is exact
(both optimizers' state in the checkpoint), resume on another world size stays on course, fp16
skips an overflowing step, the doctor passes, and a checkpoint of one optimizer is refused by
the other; compiled (on GPUs), Newton-Schulz takes a model of any number of matrix shapes.
In float64, as the reference runs of the other tests (conftest.ReferenceRuns):
Newton-Schulz then runs in float64 too (ddp_utils/optim/muon.py newton_schulz)."""

import copy
import functools
import json
import math
import signal
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from conftest import (
    ARGS,
    ONE,
    PROJECT,
    TINY,
    TINY_CONFIG,
    TWO,
    checkpoint,
    compared_metrics,
    kill_tree,
    probe_output,
    read_metrics,
    relative_difference,
    run_tolerance,
    run_training,
    start_from,
    training_command,
    training_env,
    wait_for,
)
from test_fsdp import final_weights

from ddp_utils.optim import muon as muon_module
from ddp_utils.optim.lr_schedule import Plan, lr_at
from ddp_utils.optim.optimizer import build_optimizer
from task import TASK

pytestmark = pytest.mark.fixed_amp  # exact comparisons need --amp none

MUON = ["--optimizer", "muon"]


class MuonRuns:
    """Uninterrupted float64 runs under Muon, each made the first time a test asks for it."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory

    def run(self, name, *args, nproc):
        output_dir = self.tmp_path_factory.mktemp(name)
        result = run_training(output_dir, *ARGS, *MUON, *args, nproc=nproc, probe="float64,count_orthogonalised")
        return output_dir, result

    @functools.cached_property
    def two(self):
        return self.run("muon_two", *TWO, nproc=2)

    @functools.cached_property
    def one(self):
        return self.run("muon_one", *ONE, nproc=1)

    @functools.cached_property
    def accumulated(self):
        return self.run("muon_accumulated", "--batch_size", "16", "--grad_accum_steps", "2", nproc=2)

    @functools.cached_property
    def fsdp(self):
        return self.run("muon_fsdp", *TWO, "--strategy", "fsdp", nproc=2)


@pytest.fixture(scope="module")
def muon(tmp_path_factory):
    return MuonRuns(tmp_path_factory)


def assert_close(output_dir, reference_dir):
    """Equal up to the order of the sums (float64; run_tolerance)."""
    ours, theirs = final_weights(output_dir), final_weights(reference_dir)
    assert ours.keys() == theirs.keys()
    worst = max(relative_difference(ours[key], theirs[key]) for key in theirs)
    assert worst < run_tolerance(), f"parameters differ by {worst:.2e} (relative)"


def assert_identical(output_dir, reference_dir):
    ours, theirs = final_weights(output_dir), final_weights(reference_dir)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs), "parameters differ from the uninterrupted run"
    lines = [compared_metrics(line) for line in read_metrics(output_dir)]
    assert lines == [compared_metrics(line) for line in read_metrics(reference_dir)]


def test_muon_takes_weight_matrices_and_adamw_the_rest(muon):
    """One line at start says what each optimizer holds; together, every parameter."""
    _, result = muon.two
    (line,) = [line for line in result.stdout.splitlines() if "--optimizer muon: Muon takes" in line]
    numbers = [
        int(word.strip("(,").replace(",", "")) for word in line.split() if word.strip("(,").replace(",", "").isdigit()
    ]
    matrices, muon_numel, tensors, adamw_numel = numbers
    with torch.device("meta"):
        model = TASK.build_model(TINY_CONFIG.resolved())  # its sizes read from the data
    assert matrices >= 1 and tensors >= 1, line
    assert muon_numel + adamw_numel == sum(p.numel() for p in model.parameters()), line


def tiny_model_in_float64(cfg):
    torch.set_default_dtype(torch.float64)
    try:
        return TASK.build_model(cfg)
    finally:
        torch.set_default_dtype(torch.float32)


def test_the_update_is_torch_optim_muons_to_the_bit(monkeypatch):
    """Three steps of build_optimizer's Muon on the task's model (float64, random gradients)
    give the parameters torch.optim.Muon (match_rms_adamw, at --muon_lr) and torch.optim.AdamW
    (its two groups, at --lr) give: equal to the bit, with torch's Newton-Schulz run in the
    input's dtype rather than bf16 (its only cast). Batched by shape, a matrix still gets the
    matmuls it gets alone; one thread, as a batched matmul split over threads may sum in
    another order than a single one."""
    cfg = replace(TINY_CONFIG.resolved(), optimizer="muon", muon_lr=0.02, lr=0.003, weight_decay=0.1)
    ours_model = tiny_model_in_float64(cfg)
    ours = build_optimizer(ours_model, cfg, torch.device("cpu"))
    names = {id(p): name for name, p in ours_model.named_parameters()}
    theirs_model = {name: p.detach().clone() for name, p in ours_model.named_parameters()}
    muon_names = {names[id(p)] for group in ours.param_groups if group["muon"] for p in group["params"]}
    assert muon_names, "Muon takes no parameter of this model"
    # torch.optim.Muon takes 2-D parameters: a convolution kernel as output channels x the rest.
    matrices = {name: torch.nn.Parameter(theirs_model[name].reshape(len(theirs_model[name]), -1))
                for name in sorted(muon_names)}  # fmt: skip
    rest = {name: torch.nn.Parameter(value) for name, value in theirs_model.items() if name not in muon_names}
    reference_muon = torch.optim.Muon(list(matrices.values()), lr=cfg.muon_lr, weight_decay=cfg.weight_decay,
                                      momentum=cfg.muon_momentum, ns_steps=cfg.muon_ns_steps,
                                      adjust_lr_fn="match_rms_adamw")  # fmt: skip
    groups = [{"params": [p for p in rest.values() if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in rest.values() if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    reference_adamw = torch.optim.AdamW(groups, lr=cfg.lr, fused=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    try:
        for _ in range(3):
            for name, p in ours_model.named_parameters():
                p.grad = torch.randn(p.shape, dtype=torch.float64, generator=generator)
                theirs = matrices.get(name, rest.get(name))
                theirs.grad = p.grad.reshape(theirs.shape).clone()
            ours.step()
            reference_adamw.step()
            with monkeypatch.context() as patch:
                patch.setattr(torch.Tensor, "bfloat16", lambda tensor: tensor.clone())
                reference_muon.step()
    finally:
        torch.set_num_threads(threads)
    for name, p in ours_model.named_parameters():
        theirs = matrices.get(name, rest.get(name))
        assert torch.equal(p.detach(), theirs.detach().reshape(p.shape)), f"{name} differs from torch's update"


def test_compiled_newton_schulz_takes_more_shapes_than_dynamos_recompile_limit(monkeypatch):
    """A model of many widths (a ConvNet's, say) has as many matrix shapes: each one a graph of
    the compiled Newton-Schulz (static shapes), more than Dynamo's recompile limit of 8 per
    function, which under fullgraph=True raises at the ninth. Compiled on the CPU here (the
    limit is the same there; the graphs run as traced, not by inductor: a second each), the
    model of eleven layers (nine hidden matrices, each of its own shape) trains 2 steps, one
    graph a shape, and ends with the parameters eager Newton-Schulz gives."""
    graphs = []

    def traced(graph, inputs):  # a torch.compile backend: the graph, run as traced
        graphs.append(graph)
        return graph.forward

    cfg = replace(TINY_CONFIG.resolved(), optimizer="muon")
    widths = range(4, 16)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(i, o) for i, o in zip(widths, widths[1:])]
    eager = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())][:-1])
    compiled = copy.deepcopy(eager)
    inputs, targets = torch.randn(16, widths[0]), torch.randn(16, widths[-1])
    torch._dynamo.reset()
    try:
        for model, on_cpu in ((eager, None), (compiled, traced)):
            with monkeypatch.context() as patch:
                if on_cpu:
                    patch.setitem(muon_module.COMPILED_ON, "cpu", on_cpu)
                optimizer = build_optimizer(model, cfg, torch.device("cpu"))
                for _ in range(2):
                    torch.nn.functional.mse_loss(model(inputs), targets).backward()
                    optimizer.step()
                    optimizer.zero_grad()
    finally:
        torch._dynamo.reset()
    assert len(graphs) == len(layers) - 2 == 9, len(graphs)  # the hidden ones, a graph each
    for (name, ours), theirs in zip(compiled.named_parameters(), eager.parameters()):
        assert torch.equal(ours, theirs), f"{name}: compiled Newton-Schulz gives another update"


def test_each_rank_orthogonalises_its_share_of_the_matrices(muon):
    """Not every rank all of them: with 2 processes (ddp and fsdp) each optimizer step's
    matrices are orthogonalised once in all, at most half of them (rounded up) by each rank."""
    matrices = None
    for result in (muon.one[1], muon.two[1], muon.fsdp[1]):
        (line,) = [line for line in result.stdout.splitlines() if "--optimizer muon: Muon takes" in line]
        matrices = int(line.split("Muon takes ")[1].split()[0])
        counts = {line["rank"]: line["orthogonalised_per_step"] for line in probe_output(result)}
        per_step = list(zip(*(counts[rank] for rank in sorted(counts))))
        assert per_step and all(sum(step) == matrices for step in per_step), (counts, matrices)
        assert all(max(step) <= math.ceil(matrices / len(counts)) for step in per_step), (counts, matrices)
    assert len(probe_output(muon.two[1])) == 2


def test_muons_matrices_follow_the_schedule_at_muon_lr_and_the_rest_at_lr(tmp_path):
    """Warmup and cosine decay act on both optimizers, each from its own peak."""
    flags = ["--max_steps", "6", "--warmup_steps", "2", "--lr", "0.002", "--muon_lr", "0.03"]
    result = run_training(tmp_path, *MUON, *flags, probe="record_group_lrs")
    (seen,) = [line["group_lrs"] for line in probe_output(result)]
    cfg = replace(TINY_CONFIG, max_steps=6, warmup_steps=2, lr=0.002, muon_lr=0.03)
    batch = cfg.batch_size * cfg.grad_accum_steps  # one process
    plan = Plan(total_samples=6 * batch, warmup_samples=2 * batch)
    assert len(seen) == 6
    for step, groups in enumerate(seen, start=1):
        assert {muon for _, muon in groups} == {True, False}
        for lr, muon_group in groups:
            assert lr == lr_at(step * batch, cfg, plan, cfg.muon_lr if muon_group else cfg.lr), (step, groups)


def test_world_size_and_accumulation_give_the_same_parameters_under_muon(muon):
    from test_correctness import compared_runs

    assert_close(muon.one[0], muon.two[0])
    if "2x16_accum2" in compared_runs():  # not with BatchNorm, whose statistics are each micro-batch's
        assert_close(muon.accumulated[0], muon.two[0])


def test_fsdp_orthogonalises_whole_matrices_and_trains_ddps_parameters_under_muon(muon):
    """A shard holds rows of a matrix: orthogonalising each shard on its own would be another
    update (no error would say so); the whole matrix's update, cut to each shard, is DDP's."""
    assert_close(muon.fsdp[0], muon.two[0])


def test_hsdp_trains_ddps_parameters_under_muon(muon, tmp_path):
    output_dir = tmp_path / "hsdp"
    run_training(output_dir, *ARGS, *MUON, "--batch_size", "16", "--strategy", "fsdp", "--replicate_degree", "2",
                 nproc=4, probe="float64", timeout=300)  # fmt: skip
    assert_close(output_dir, muon.two[0])


def test_resume_after_sigterm_and_after_a_sigkill_of_the_job_is_exact_under_muon(muon, tmp_path):
    """Both optimizers' state (AdamW's moments, Muon's momentum) is in the checkpoint: a run
    stopped by SIGTERM, resumed, killed with SIGKILL, resumed again ends as the uninterrupted one."""
    output_dir = tmp_path / "run"
    command = training_command(output_dir, *ARGS, *MUON, *TWO, nproc=2, probe="float64,slow_until_stopped")
    for stop, at_step in ((signal.SIGTERM, 8), (signal.SIGKILL, 28)):
        with open(tmp_path / f"{stop.name}.log", "w") as log:
            process = subprocess.Popen(command, cwd=PROJECT, env=training_env(), stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            wait_for(checkpoint(output_dir, at_step), process)
            if stop == signal.SIGTERM:
                process.send_signal(signal.SIGTERM)
                assert process.wait(timeout=60) != 0
            else:
                kill_tree(process.pid)
                process.wait()
        finally:
            kill_tree(process.pid)
    assert "stopped by SIGTERM" in (tmp_path / "SIGTERM.log").read_text()
    run_training(output_dir, *ARGS, *MUON, *TWO, nproc=2, probe="float64")  # the same command
    assert_identical(output_dir, muon.two[0])


def test_a_checkpoint_resumes_on_another_world_size_under_muon(muon, tmp_path):
    """2 processes' epoch-end checkpoint continued by 1: as the 1-process run, to the order of the sums."""
    output_dir = start_from(checkpoint(muon.two[0], 16), tmp_path / "one")
    run_training(output_dir, *ARGS, *MUON, *ONE, probe="float64")
    assert_close(output_dir, muon.one[0])


def test_a_checkpoint_of_one_optimizer_is_refused_by_the_other(muon, tmp_path):
    output_dir = start_from(checkpoint(muon.two[0], 4), tmp_path / "adamw")
    result = run_training(output_dir, *ARGS, *TWO, "--optimizer", "adamw", nproc=2, check=False)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "holds the state of" in line]
    assert result.returncode != 0 and errors, result.stdout + result.stderr
    assert "--optimizer muon, not of --optimizer adamw: resume with --optimizer muon" in errors[0]


def test_fp16_skips_an_overflowing_step_under_muon(tmp_path):
    """One loss scaler over both optimizers: unscaled once, the step skipped for both, one update."""
    run_training(tmp_path, *MUON, "--amp", "fp16", probe="overflow_once")
    state = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert state["scaler"]["scale"] == 2.0**15  # halved once from 2**16 by the skipped step
    assert all(torch.isfinite(value).all() for value in state["model"].values())
    assert all(math.isfinite(m["train_loss"]) for m in read_metrics(tmp_path))


def test_the_doctor_passes_under_muon(tmp_path):
    """Its 1 vs 2 processes, exact resume, fsdp = ddp and sharded steps with the configured optimizer."""
    flags = ["--output_dir", str(tmp_path), *MUON]
    done = subprocess.run([sys.executable, "doctor.py", *TINY, *flags], cwd=PROJECT, capture_output=True, text=True,
                          env=training_env(), timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "doctor.json").read_text())
    failed = [row for row in report["checks"] if row["status"] == "FAIL"]
    assert not failed, failed
