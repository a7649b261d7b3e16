"""A model the generated project's tests have never seen, dropped into its model.py and task.py
(as a user would: tests/own_model/, nn.TransformerEncoder with a zero-initialised head, no
sharding hints, no resolve_model): it keeps its initial weights under ddp and fsdp, fsdp
trains what ddp trains, training is the same on 1 and 2 processes, a SIGTERM'd run resumes
exactly, the doctor finds nothing to fail, and the project's own tests of these guarantees
pass with it."""

import shutil
from pathlib import Path

import pytest
from conftest import bake_ok, run

OWN = Path(__file__).resolve().parent / "own_model"

# The project's own tests of the guarantees that depend on the model.
GUARANTEES = [
    "tests/test_fsdp.py::test_both_strategies_start_from_the_weights_the_model_makes",
    "tests/test_fsdp.py::test_fsdp_trains_the_same_parameters_as_ddp",
    "tests/test_fsdp.py::test_sigterm_under_fsdp_saves_shards_and_resume_is_exact",
    "tests/test_correctness.py::test_world_size_and_accumulation_give_the_same_parameters",
    "tests/test_preemption.py::test_sigterm_to_torchrun_saves_mid_epoch_and_resume_is_exact",
    "tests/test_resilience.py::test_checkpoint_of_another_model_shape_is_refused",
    "tests/test_doctor.py::test_the_shipped_task_passes_the_doctor",
]


@pytest.fixture(scope="module")
def own_model_project(cookies_session):
    project = bake_ok(cookies_session, task="tabular", project_name="Own Model")
    shutil.copy(OWN / "model.py", project / "model.py")
    shutil.copy(OWN / "task.py", project / "task.py")
    shutil.copy(OWN / "tiny.toml", project / "experiments" / "tiny.toml")
    return project


def test_the_project_guarantees_hold_for_a_model_it_has_never_seen(own_model_project):
    result = run(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *GUARANTEES], cwd=own_model_project)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "failed" not in result.stdout and "skipped" not in result.stdout and " passed" in result.stdout
