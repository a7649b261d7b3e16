"""Every valid combination of the choice prompts, with a spread of counts, renders clean."""

import itertools
import os
import re

import pytest
import yaml
from conftest import TASKS, bake_ok, project_files, run, template_files

pytestmark = pytest.mark.xdist_group("combinations")  # one worker bakes them all once

AMPS = ("bf16", "fp16", "none")
# (slurm, kubernetes, skypilot): each launcher's files kept and left out, without doubling the bakes.
PLATFORMS = (("yes", "no", "no"), ("no", "yes", "yes"))
COUNTS = (("1", "1"), ("2", "8"), ("4", "2"))  # (num_nodes, gpus_per_node): a spread of free-form counts
COMBINATIONS = [(task, amp, slurm, kubernetes, skypilot, counts) for task, amp, (slurm, kubernetes, skypilot), counts
                in itertools.product(TASKS, AMPS, PLATFORMS, COUNTS)]  # fmt: skip


def test_one_worker_bakes_them_all(request):
    """Under dev/test.sh (xdist, --dist loadgroup) these tests are one unit of work. A pytest or
    pytest-xdist that drops the group passes everything, slowly: each worker bakes them all."""
    if request.config.getoption("loadgroup", False):  # set in xdist's workers by --dist loadgroup
        assert request.node.nodeid.endswith("@combinations"), "xdist_group ignored: see requirements-dev.txt"


@pytest.fixture(scope="module")
def bakes(cookies_session):
    projects = {}
    for task, amp, slurm, kubernetes, skypilot, (nodes, gpus) in COMBINATIONS:
        answers = {"task": task, "amp": amp, "slurm": slurm, "kubernetes": kubernetes, "skypilot": skypilot,
                   "num_nodes": nodes, "gpus_per_node": gpus}  # fmt: skip
        name = f"p_{task}_{amp}_{slurm}_{kubernetes}_{nodes}_{gpus}"
        projects[task, amp, slurm, kubernetes, skypilot, nodes, gpus] = bake_ok(
            cookies_session, project_name=name, **answers
        )
    return projects


def test_exact_file_set(bakes):
    """The chosen task's files and no other's; the optional files the answers asked for."""
    for (task, amp, slurm, kubernetes, skypilot, nodes, gpus), project in bakes.items():
        files = {str(p.relative_to(project)) for p in project_files(project)}
        assert files == template_files(task, slurm, kubernetes, skypilot), project
        assert (project / "k8s").is_dir() == (kubernetes == "yes"), project


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
    for (task, amp, slurm, kubernetes, skypilot, nodes, gpus), project in bakes.items():
        launch = (project / "scripts" / "launch.sh").read_text()
        assert f"NNODES=${{NNODES:-${{PET_NNODES:-{nodes}}}}}" in launch
        assert f"NPROC_PER_NODE=${{NPROC_PER_NODE:-${{PET_NPROC_PER_NODE:-{gpus}}}}}" in launch
        config = (project / "config.py").read_text()
        assert re.search(rf'amp: str = knob\(\s*"{amp}",', config), project
        if slurm == "yes":
            sbatch = (project / "scripts" / "slurm.sbatch").read_text()
            assert f"#SBATCH --nodes={nodes}\n" in sbatch
            assert f"#SBATCH --gpus-per-node={gpus}\n" in sbatch
            assert "#SBATCH --requeue\n" in sbatch
        if kubernetes == "yes":
            name = project.name.replace("_", "-")
            job = yaml.safe_load((project / "k8s" / "trainjob.yaml").read_text())
            trainer = job["spec"]["trainer"]
            assert job["metadata"]["name"] == name and trainer["image"] == f"{name}:latest"
            assert (trainer["numNodes"], trainer["numProcPerNode"]) == (int(nodes), int(gpus))
            assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == int(gpus)
            (patch,) = job["spec"]["runtimePatches"]  # Trainer v2.3: the pods' volumes are a runtime patch
            (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
            volumes = node["template"]["spec"]["template"]["spec"]["volumes"]
            assert volumes[0]["persistentVolumeClaim"]["claimName"] == f"{name}-checkpoints"
            jobset = yaml.safe_load((project / "k8s" / "jobset.yaml").read_text())
            job_spec = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
            (container,) = job_spec["template"]["spec"]["containers"]
            assert job_spec["completions"] == job_spec["parallelism"] == int(nodes)
            assert container["resources"]["limits"]["nvidia.com/gpu"] == int(gpus)
            env = {entry["name"]: entry.get("value") for entry in container["env"]}
            assert (env["NNODES"], env["NPROC_PER_NODE"]) == (nodes, gpus)
            assert env["MASTER_ADDR"] == f"{name}-node-0-0.{name}"
        if skypilot == "yes":
            task_file = yaml.safe_load((project / "sky.yaml").read_text())
            assert task_file["num_nodes"] == int(nodes) and task_file["resources"]["accelerators"] == f"H100:{gpus}"
