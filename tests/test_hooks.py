"""The answer validation, imported as plain Python from the unrendered hook."""

import importlib.util

import pytest
from conftest import TEMPLATE

spec = importlib.util.spec_from_file_location("pre_gen_project", TEMPLATE / "hooks" / "pre_gen_project.py")
hook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hook)

VALID = {
    "project_slug": "my_project",
    "num_nodes": "1",
    "gpus_per_node": "8",
    "amp": "bf16",
    "slurm": "yes",
    "task": "language",
    "kubernetes": "no",
    "skypilot": "no",
}


def test_valid_answers_pass():
    assert hook.first_error(VALID) is None
    assert hook.first_error({**VALID, "project_slug": "a-b_3", "num_nodes": 4, "amp": "none"}) is None


@pytest.mark.parametrize("slug", ["", "My_Project", "1project", "my project", "a/b", "_x", "é", "x.y", None])
def test_bad_slugs(slug):
    error = hook.first_error({**VALID, "project_slug": slug})
    assert error.startswith("project_slug") and "lowercase letters" in error


@pytest.mark.parametrize("name", ["num_nodes", "gpus_per_node"])
@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", "", " ", "٣"])
def test_bad_counts(name, value):
    error = hook.first_error({**VALID, name: value})
    assert error.startswith(name) and "positive integer" in error


def test_bad_amp():
    assert hook.first_error({**VALID, "amp": "fp8"}).startswith("amp 'fp8' is not one of: bf16, fp16, none")


def test_bad_slurm_answer():
    assert hook.first_error({**VALID, "slurm": "maybe"}) == "slurm 'maybe' is not one of: yes, no"


def test_bad_task():
    assert hook.first_error({**VALID, "task": "audio"}) == "task 'audio' is not one of: language, vision, tabular"


def test_bad_skypilot_answer():
    assert hook.first_error({**VALID, "skypilot": "maybe"}) == "skypilot 'maybe' is not one of: yes, no"


def test_bad_kubernetes_answer():
    assert hook.first_error({**VALID, "kubernetes": "maybe"}) == "kubernetes 'maybe' is not one of: yes, no"


@pytest.mark.parametrize("slug", ["a" * 41, "trailing_", "trailing-"])
def test_kubernetes_needs_a_slug_that_names_kubernetes_objects(slug):
    assert hook.first_error({**VALID, "project_slug": slug}) is None  # fine without k8s/
    error = hook.first_error({**VALID, "project_slug": slug, "kubernetes": "yes"})
    assert error.startswith(f"project_slug {slug!r} cannot name Kubernetes objects (kubernetes=yes)")


def test_kubernetes_accepts_underscores_and_40_characters():
    assert hook.first_error({**VALID, "project_slug": "my_project", "kubernetes": "yes"}) is None
    assert hook.first_error({**VALID, "project_slug": "a" * 40, "kubernetes": "yes"}) is None
