"""The generated README is a short front door, and docs/ holds the rest, rendered for the answers
given: only the pages of the options chosen, no text about what the project does not have, and
every link pointing at a file (and a heading) the project has. Bakes only, no training."""

import re

import pytest
from conftest import bake_ok

LINK = re.compile(r"\]\(([^)\s]+)\)")


def pages(project):
    """README.md and every docs/ page, as {path relative to the project: text}."""
    paths = [project / "README.md", *sorted((project / "docs").glob("*.md"))]
    return {str(path.relative_to(project)): path.read_text() for path in paths}


def slug(heading):
    """The anchor GitHub gives a heading: lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text):
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def check_project(project, task="language", slurm="yes", kubernetes="no", skypilot="no"):
    texts = pages(project)
    readme = texts["README.md"]
    assert len(readme.splitlines()) <= 250, len(readme.splitlines())
    first_screen = "\n".join(readme.splitlines()[:40])
    for name in ("## Quick start", "task.py", "model.py", "dataset.py", "experiments/quick_cpu.toml"):
        assert name in first_screen, name

    assert (project / "docs" / "kubernetes.md").exists() == (kubernetes == "yes")
    assert (project / "docs" / "slurm.md").exists() == (slurm == "yes")
    assert (project / "docs" / "skypilot.md").exists() == (skypilot == "yes")
    everything = "\n".join(texts.values())
    if kubernetes == "no":
        for text in ("k8s/", "Dockerfile", "kubernetes.md"):
            assert text not in everything, text
    if skypilot == "no":
        for text in ("sky.yaml", "skypilot.md", "SkyPilot"):
            assert text not in everything, text
    if slurm == "no":
        assert "sbatch" not in everything and "slurm.md" not in everything
        assert sum("slurm" in line.lower() for line in readme.splitlines()) <= 1
    assert "BENCHMARKS.md" not in everything
    if task == "language":
        assert "predict.py" not in everything
    else:
        assert "sample.py" not in everything and "GPT-2" not in everything
    if task != "tabular":
        assert "--hidden_dim" not in everything and "--dataset regression" not in everything
    for name, text in texts.items():
        assert "{{" not in text and "{%" not in text and "{#" not in text, f"unrendered Jinja in {name}"

    for name, text in texts.items():
        folder = (project / name).parent
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https://..., mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (folder / path) if path else project / name
            assert resolved.exists(), f"{name} links to {target}, which the project does not have"
            if anchor and resolved.suffix == ".md":
                assert anchor in anchors(resolved.read_text()), f"{name} links to {target}: no such heading"


def test_the_default_readme_is_a_front_door_and_docs_hold_the_rest(default_project):
    check_project(default_project)
    expected = {"configuration.md", "your-model.md", "task.md", "preflight-and-doctor.md", "clusters.md",
                "slurm.md", "checkpoints.md", "sharding.md", "memory.md", "performance.md", "guarantees.md", "optimizers.md",
                "sweeps.md", "streaming.md", "streaming-libraries.md"}  # fmt: skip
    assert {p.name for p in (default_project / "docs").iterdir()} == expected
    readme = (default_project / "README.md").read_text()
    for page in expected:  # the README links every page
        assert f"](docs/{page})" in readme, page


@pytest.mark.parametrize(
    "answers",
    [
        {"task": "vision"},
        {"task": "tabular"},
        {"kubernetes": "yes"},
        {"slurm": "no"},
        {"task": "tabular", "slurm": "no", "kubernetes": "yes", "skypilot": "yes"},
    ],
    ids=lambda answers: ",".join(f"{k}={v}" for k, v in answers.items()),
)
def test_readme_and_docs_follow_the_answers(cookies, answers):
    project = bake_ok(cookies, **answers)
    check_project(project, **answers)
    if answers.get("kubernetes") == "yes":
        assert "](docs/kubernetes.md)" in (project / "README.md").read_text()
    if answers.get("skypilot") == "yes":
        readme = (project / "README.md").read_text()
        assert "](docs/skypilot.md)" in readme
        assert "sky launch -c NAME sky.yaml" in readme and "sky jobs launch sky.yaml" in readme
