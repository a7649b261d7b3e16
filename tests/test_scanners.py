"""The baked project through three security scanners, offline, each reporting nothing.

- hadolint: the Dockerfile.
- checkov (no network: --skip-download, no API key): the Dockerfile, and the pods of
  k8s/jobset.yaml and k8s/trainjob.yaml. checkov has checks for Kubernetes' own kinds only and
  passes a JobSet or a TrainJob unread, so each is scanned as the batch/v1 Job its controller
  makes of it: the JobSet's replicated Job; the TrainJob's runtime patch with the trainer's
  image, command, arguments, env and resources in its container (the runtime's own pod template
  is the cluster's, not in this file). The manifest's annotations go with it: checkov reads its
  skips there.
- bandit: every task's Python, less tests/ (test code, asserts being its point), at medium
  severity and above. Below that bandit notes every subprocess import and call (B404, B603, B607:
  each passes an argument list, no shell) and token-named strings (B105 in the language task's
  hf_gpt2.py, no secrets).

What stays is justified where it is: `# hadolint ignore=` and `# checkov:skip=` in the Dockerfile,
`checkov.io/skipN` annotations in the manifests, `# nosec` in the code. Each scanner is also
shown to find what those hide, and every checkov skip to be in use, so that none of this passes
because a scanner read nothing.
"""

import copy
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from conftest import BIN, TASKS, bake_ok, run

pytestmark = pytest.mark.xdist_group("scanners")  # one worker bakes the projects once

# checkov's pins (older networkx, packaging, ...) clash with what torch and the rest need, so
# dev/setup.sh installs it in a virtual environment of its own inside this one.
CHECKOV = Path(sys.prefix) / "scanners" / "bin" / "checkov"
# Checks that each pod must pass, not skip: a security context, not root, a high uid, no added
# capability (nor NET_RAW), no privilege escalation, a read-only root filesystem, a seccomp profile.
LEAST_PRIVILEGE = {"CKV_K8S_20", "CKV_K8S_22", "CKV_K8S_23", "CKV_K8S_25", "CKV_K8S_28", "CKV_K8S_29",
                   "CKV_K8S_31", "CKV_K8S_37", "CKV_K8S_40"}  # fmt: skip


@pytest.fixture(scope="module")
def projects(cookies_session):
    """Every task's project; the tabular one with k8s/ and the Dockerfile (they are the same for all)."""
    return {task: bake_ok(cookies_session, task=task, project_name=f"Scanned {task}",
                          kubernetes="yes" if task == "tabular" else "no") for task in TASKS}  # fmt: skip


def tool(name):
    path = CHECKOV if name == "checkov" else BIN / name
    assert path.exists(), f"{path} is missing: bash dev/setup.sh installs it"
    return str(path)


def offline_env():
    """This environment less anything that would let checkov reach Prisma Cloud's platform."""
    return {k: v for k, v in os.environ.items() if k not in ("BC_API_KEY", "PRISMA_API_URL", "BC_SOURCE")}


# --- hadolint -------------------------------------------------------------------------------


def hadolint(dockerfile):
    result = run([tool("hadolint"), "--no-color", "--format", "json", dockerfile.name], cwd=dockerfile.parent)
    assert result.returncode in (0, 1) and result.stdout.strip(), result.stderr
    return [(finding["code"], finding["line"]) for finding in json.loads(result.stdout)]


def test_hadolint_finds_nothing_in_the_dockerfile(projects, tmp_path):
    dockerfile = projects["tabular"] / "Dockerfile"
    assert hadolint(dockerfile) == []
    # The one rule it ignores (DL3008, apt versions unpinned: the Dockerfile says why) is one it
    # would report there, on the apt-get RUN.
    text = dockerfile.read_text()
    assert text.count("# hadolint ignore=") == 1 and "# hadolint ignore=DL3008\n" in text
    bare = tmp_path / "Dockerfile"
    bare.write_text(text.replace("# hadolint ignore=DL3008\n", ""))
    ((code, line),) = hadolint(bare)
    assert code == "DL3008" and "apt-get update" in bare.read_text().splitlines()[line - 1]


# --- checkov --------------------------------------------------------------------------------


def job(name, annotations, job_spec):
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "annotations": annotations},
            "spec": job_spec}  # fmt: skip


def jobs_of(project):
    """k8s/jobset.yaml and k8s/trainjob.yaml as the Jobs their controllers make: {file: Job}."""
    jobset = yaml.safe_load((project / "k8s" / "jobset.yaml").read_text())
    (replicated,) = jobset["spec"]["replicatedJobs"]
    name, annotations = jobset["metadata"]["name"], jobset["metadata"]["annotations"]
    made = {"jobset.yaml": job(f"{name}-{replicated['name']}", annotations, replicated["template"]["spec"])}
    trainjob = yaml.safe_load((project / "k8s" / "trainjob.yaml").read_text())
    (patch,) = trainjob["spec"]["runtimePatches"]
    (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    job_spec = copy.deepcopy(replicated["template"]["spec"])
    (container,) = job_spec["template"]["spec"]["containers"]
    trainer = trainjob["spec"]["trainer"]
    container.update(image=trainer["image"], command=trainer["command"], args=trainer["args"],
                     env=trainer["env"] + container.get("env", []), resources=trainer["resourcesPerNode"])  # fmt: skip
    made["trainjob.yaml"] = job(trainjob["metadata"]["name"], trainjob["metadata"]["annotations"], job_spec)
    return made


def checkov(folder):
    """checkov's reports on `folder`, by framework: {framework: results}."""
    command = [tool("checkov"), "--directory", ".", "--framework", "dockerfile", "kubernetes", "--skip-download",
               "--output", "json", "--compact"]  # fmt: skip
    result = run(command, cwd=folder, timeout=300, env_override=offline_env())
    assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-3000:]
    reports = json.loads(result.stdout)
    return {report["check_type"]: report["results"] for report in (reports if isinstance(reports, list) else [reports])}


def test_checkov_finds_nothing_in_the_dockerfile_and_the_pods(projects, tmp_path):
    """In one run: the files as they are, and each without its skips ("bare"), where checkov
    must find exactly what the skips name (none stale)."""
    project = projects["tabular"]
    dockerfile = (project / "Dockerfile").read_text()
    (skip_line,) = [line for line in dockerfile.splitlines(keepends=True) if line.startswith("# checkov:skip=")]
    (tmp_path / "bare").mkdir()
    (tmp_path / "Dockerfile").write_text(dockerfile)
    (tmp_path / "bare" / "Dockerfile").write_text(dockerfile.replace(skip_line, ""))
    shutil.copy(project / "k8s" / "pvc.yaml", tmp_path / "pvc.yaml")
    made = jobs_of(project)
    for file, manifest in made.items():
        (tmp_path / file).write_text(yaml.safe_dump(manifest, sort_keys=False))
        bare = {**manifest, "metadata": {"name": f"{manifest['metadata']['name']}-bare"}}
        (tmp_path / f"bare-{file}").write_text(yaml.safe_dump(bare, sort_keys=False))
    reports = checkov(tmp_path)
    assert set(reports) == {"dockerfile", "kubernetes"}, reports

    def found(framework, where, outcome):
        """The checks of an outcome on a Dockerfile (by its path) or a Kubernetes resource (by its id)."""
        key = "file_path" if framework == "dockerfile" else "resource"
        return {c["check_id"] for c in reports[framework][f"{outcome}_checks"] if c[key] == where}

    for results in reports.values():
        for skipped in results["skipped_checks"]:  # each with its reason
            assert skipped["check_result"].get("suppress_comment", "").strip(), skipped["check_id"]
    failed = [(c["check_id"], c["resource"], c["check_name"]) for framework in reports
              for c in reports[framework]["failed_checks"] if "bare" not in c["file_path"]]  # fmt: skip
    assert failed == [], failed

    skips = {skip_line.removeprefix("# checkov:skip=").split(":", 1)[0]}
    assert skips == {"CKV_DOCKER_2"}, skips  # a batch job, no HEALTHCHECK: the Dockerfile says why
    assert found("dockerfile", "/bare/Dockerfile", "failed") == skips
    assert found("dockerfile", "/Dockerfile", "skipped") == skips
    assert {"CKV_DOCKER_3", "CKV_DOCKER_8"} <= found("dockerfile", "/Dockerfile", "passed")  # a user, not root

    for file, manifest in made.items():
        resource = f"Job.default.{manifest['metadata']['name']}"
        skips = {value.split("=", 1)[0] for key, value in manifest["metadata"]["annotations"].items()
                 if key.startswith("checkov.io/skip")}  # fmt: skip
        assert found("kubernetes", f"{resource}-bare", "failed") == skips, file
        assert found("kubernetes", resource, "skipped") == skips, file
        missing = LEAST_PRIVILEGE - found("kubernetes", resource, "passed")
        assert not missing, (file, missing)


# --- bandit ---------------------------------------------------------------------------------


def bandit(project, *options):
    command = [tool("bandit"), "--recursive", ".", "--exclude", "./tests", "--severity-level", "medium",
               "--format", "json", "--quiet", *options]  # fmt: skip
    result = run(command, cwd=project)
    assert result.returncode in (0, 1) and result.stdout.strip(), result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["errors"] == [], report["errors"]  # a file it could not parse would go unscanned
    assert "./train.py" in report["metrics"] and "./ddp_utils/doctor/processes.py" in report["metrics"]
    return [(r["filename"], r["test_id"], r["line_range"][0]) for r in report["results"]]


@pytest.mark.parametrize("task", TASKS)
def test_bandit_finds_nothing_in_the_code(projects, task):
    assert bandit(projects[task]) == []


def test_bandit_would_find_the_doctors_pickle_its_nosec_justifies(projects):
    """Its one `# nosec` at this severity (the doctor's 2 processes load the job their parent
    pickled, the comment above it says why) hides what bandit finds there, and nothing else."""
    found = bandit(projects["tabular"], "--ignore-nosec")
    ((filename, test_id, line),) = found
    source = (projects["tabular"] / filename).read_text().splitlines()[line - 1]
    assert (filename, test_id) == ("./ddp_utils/doctor/processes.py", "B301") and "pickle.load(" in source
