"""The generated sky.yaml through SkyPilot's own code, offline: its task schema and Task.from_yaml.

SkyPilot lives in a virtual environment of its own, .venv/skypilot (dev/setup.sh, the pin in
requirements-dev.txt). Nothing reaches a cloud: no credentials, HOME a fresh folder (SkyPilot
keeps its state under ~/.sky), usage collection off. The two-host run of the task's `run:` is
the generated project's own tests/cluster/test_skypilot.py (the tabular bake of test_bake.py).
"""

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from conftest import bake_ok, run

pytestmark = pytest.mark.xdist_group("skypilot")  # one worker bakes the projects once

PYTHON = Path(sys.prefix) / "skypilot" / "bin" / "python"
# Validates each YAML file named on the command line as `sky launch` does (the schema, then the
# Task), printing one JSON line per file: its error, or what SkyPilot read from it.
CHECK = """
import json, sys
import yaml
import sky
from sky.utils import common_utils, schemas
for path in sys.argv[1:]:
    try:
        config = yaml.safe_load(open(path))
        common_utils.validate_schema(config, schemas.get_task_schema(), "Invalid task YAML: ")
        task = sky.Task.from_yaml(path)
        (resources,) = task.resources
        mounts = {path: storage.mode.value for path, storage in task.storage_mounts.items()}
        print(json.dumps({"num_nodes": task.num_nodes, "accelerators": resources.accelerators,
                          "mounts": mounts, "envs": task.envs, "workdir": task.workdir}))
    except Exception as error:
        print(json.dumps({"error": f"{type(error).__name__}: {error}"}))
"""


@pytest.fixture(scope="module")
def projects(cookies_session):
    """skypilot=yes: the default task, and the tabular one with other counts."""
    other = {"task": "tabular", "num_nodes": "2", "gpus_per_node": "4"}
    return [
        bake_ok(cookies_session, project_name="Sky language", skypilot="yes"),
        bake_ok(cookies_session, project_name="Sky tabular", skypilot="yes", **other),
    ]


def sky_check(paths, cwd, tmp_path):
    assert PYTHON.exists(), f"{PYTHON} is missing: bash dev/setup.sh installs it"
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SKYPILOT_", "AWS_", "GOOGLE_"))}
    env.update(HOME=str(home), SKYPILOT_DISABLE_USAGE_COLLECTION="1")
    result = run([str(PYTHON), "-c", CHECK, *map(str, paths)], cwd=cwd, env_override=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_skypilot_accepts_the_task_file_and_refuses_a_misspelled_key(projects, tmp_path):
    misspelled = tmp_path / "misspelled.yaml"
    task = yaml.safe_load((projects[0] / "sky.yaml").read_text())
    task["num_node"] = task.pop("num_nodes")
    misspelled.write_text(yaml.safe_dump(task))
    bad_mode = tmp_path / "bad_mode.yaml"
    task = yaml.safe_load((projects[0] / "sky.yaml").read_text())
    task["file_mounts"]["/checkpoints"]["mode"] = "MOUNT_CACHE"
    bad_mode.write_text(yaml.safe_dump(task))
    files = [project / "sky.yaml" for project in projects] + [misspelled, bad_mode]
    language, tabular, *refused = sky_check(files, projects[0], tmp_path)
    for read, (nodes, gpus) in ((language, (1, 8)), (tabular, (2, 4))):
        assert "error" not in read, read
        assert read["num_nodes"] == nodes and read["accelerators"] == {"H100": gpus}
        assert read["mounts"] == {"/checkpoints": "MOUNT_CACHED"}
        assert read["envs"]["CHECKPOINT_BUCKET"].endswith("-checkpoints")
    assert "num_node" in refused[0]["error"] and "num_nodes" in refused[0]["error"], refused[0]
    assert "MOUNT_CACHE" in refused[1]["error"], refused[1]


def test_the_task_file_sets_up_the_project_and_prepares_its_data(projects):
    language, tabular = (yaml.safe_load((project / "sky.yaml").read_text()) for project in projects)
    assert language["workdir"] == "." and "pip install -e" in language["setup"]
    assert "python prepare_data.py" in language["setup"]
    assert "prepare_data.py" not in tabular["setup"]  # the default table is synthetic
    for task in (language, tabular):
        assert set(task["secrets"]) == {"WANDB_API_KEY", "HF_TOKEN"}
        assert "$SKYPILOT_NODE_IPS" in task["run"] and "scripts/launch.sh --output_dir /checkpoints/" in task["run"]
