"""Every valid combination of the choice prompts, with a spread of counts, renders clean."""

import itertools
import os
import re

import pytest
from conftest import TASKS, bake_ok, project_files, run, template_files

pytestmark = pytest.mark.xdist_group("combinations")  # one worker bakes them all once

AMPS = ("bf16", "fp16", "none")
SLURM = ("yes", "no")
COUNTS = (("1", "1"), ("2", "8"), ("4", "2"))  # (num_nodes, gpus_per_node): a spread of free-form counts
COMBINATIONS = list(itertools.product(TASKS, AMPS, SLURM, COUNTS))
OPTIONAL = {"scripts/slurm.sbatch": ("slurm", "yes")}  # as in hooks/post_gen_project.py


@pytest.fixture(scope="module")
def bakes(cookies_session):
    projects = {}
    for task, amp, slurm, (nodes, gpus) in COMBINATIONS:
        answers = {"task": task, "amp": amp, "slurm": slurm, "num_nodes": nodes, "gpus_per_node": gpus}
        name = f"p_{task}_{amp}_{slurm}_{nodes}_{gpus}"
        projects[task, amp, slurm, nodes, gpus] = bake_ok(cookies_session, project_name=name, **answers)
    return projects


def test_exact_file_set(bakes):
    """The chosen task's files and no other's; the optional files the answers asked for."""
    for (task, amp, slurm, nodes, gpus), project in bakes.items():
        files = {str(p.relative_to(project)) for p in project_files(project)}
        answers = {"slurm": slurm}
        removed = {path for path, (prompt, keep) in OPTIONAL.items() if answers[prompt] != keep}
        assert files == template_files(task) - removed, project


def test_no_template_syntax_and_lf_only(bakes):
    for project in bakes.values():
        for path in project_files(project):
            text = path.read_bytes().decode()
            assert "\r" not in text, path
            if path.name != "ci.yml":  # GitHub expressions ${{ }} belong there
                assert not re.search(r"\{\{|\{%|\{#", text), path


def test_scripts_are_executable_and_parse(bakes):
    for project in bakes.values():
        for script in [*project.glob("scripts/*.sh"), *project.glob("scripts/*.sbatch")]:
            assert os.access(script, os.X_OK), script
            result = run(["bash", "-n", str(script)], cwd=project)
            assert result.returncode == 0, (script, result.stderr)


def test_ruff_clean_in_every_combination(bakes):
    roots = [str(project) for project in bakes.values()]
    for command in (["ruff", "check", "--no-cache"], ["ruff", "format", "--check", "--no-cache"]):
        for project in roots:  # each project with its own pyproject's settings
            result = run([*command, "."], cwd=project)
            assert result.returncode == 0, (project, result.stdout)


def test_prompt_values_reach_their_places(bakes):
    for (task, amp, slurm, nodes, gpus), project in bakes.items():
        launch = (project / "scripts" / "launch.sh").read_text()
        assert f"NNODES=${{NNODES:-{nodes}}}" in launch
        assert f"NPROC_PER_NODE=${{NPROC_PER_NODE:-{gpus}}}" in launch
        config = (project / "config.py").read_text()
        assert re.search(rf'amp: str = knob\(\s*"{amp}",', config), project
        if slurm == "yes":
            sbatch = (project / "scripts" / "slurm.sbatch").read_text()
            assert f"#SBATCH --nodes={nodes}\n" in sbatch
            assert f"#SBATCH --gpus-per-node={gpus}\n" in sbatch
            assert "#SBATCH --requeue\n" in sbatch
