"""The GitHub Actions workflows, the template's own and the one every generated project gets,
and their Dependabot configs: zizmor finds nothing, every action is pinned to a commit."""

import re

import pytest
import yaml
from conftest import BIN, TEMPLATE, run

WORKFLOW = ".github/workflows/ci.yml"
DEPENDABOT = ".github/dependabot.yml"
# What a step runs is the commit; the tag after it is for people (and Dependabot updates both).
PINNED_USES = re.compile(r"^\s*(?:- )?\s*uses: [\w.-]+/[\w./-]+@[0-9a-f]{40} # v\d+(\.\d+)*$")


@pytest.fixture(params=["template", "project"])
def repository(request):
    """The template repository's root, or the default baked project's."""
    return TEMPLATE if request.param == "template" else request.getfixturevalue("default_project")


def test_zizmor_finds_nothing(repository):
    audit = run([str(BIN / "zizmor"), "--offline", "--no-progress", "--color=never", WORKFLOW, DEPENDABOT],
                cwd=repository, timeout=120)  # fmt: skip
    output = audit.stdout + audit.stderr
    assert audit.returncode == 0, output
    assert "No findings to report" in audit.stdout, output


def steps(workflow):
    return [step for job in workflow["jobs"].values() for step in job["steps"]]


def test_every_action_is_pinned_to_a_commit_and_credentials_stay_off_disk(repository):
    text = (repository / WORKFLOW).read_text()
    workflow = yaml.safe_load(text)
    assert workflow["permissions"] == {"contents": "read"}
    used = [step for step in steps(workflow) if "uses" in step]
    assert {step["uses"].split("@")[0] for step in used} >= {"actions/checkout", "actions/setup-python"}
    lines = [line for line in text.splitlines() if re.match(r"^\s*(- )?\s*uses:", line)]
    assert len(lines) == len(used)
    for line in lines:
        assert PINNED_USES.match(line), line
    for step in used:
        if step["uses"].startswith("actions/checkout@"):
            assert step["with"]["persist-credentials"] is False, step


def test_dependabot_keeps_the_pins_current(repository):
    config = yaml.safe_load((repository / DEPENDABOT).read_text())
    assert config["version"] == 2
    actions = [update for update in config["updates"] if update["package-ecosystem"] == "github-actions"]
    directories = {update["directory"] for update in actions}
    assert "/" in directories
    if repository == TEMPLATE:  # the generated project's workflow is bumped in the template too
        assert "/{{cookiecutter.project_slug}}/.github/workflows" in directories
    for update in actions:
        assert (repository / update["directory"].lstrip("/")).is_dir(), update
        assert update["schedule"]["interval"] == "weekly"


def test_the_project_gets_the_templates_files_unchanged(default_project):
    """The workflow is copied without rendering; dependabot.yml renders to itself (no Jinja in it)."""
    for name in (WORKFLOW, DEPENDABOT):
        template = TEMPLATE / "{{cookiecutter.project_slug}}" / name
        assert (default_project / name).read_bytes() == template.read_bytes(), name
