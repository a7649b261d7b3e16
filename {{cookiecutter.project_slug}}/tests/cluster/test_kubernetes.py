"""Kubernetes (k8s/, Dockerfile): what can be checked without a cluster.

No image is built and no cluster is used here. The manifests are parsed and checked for what
a multi-node job needs (the TrainJob in Kubeflow Trainer v2.3's structure, the JobSet's
preemption policy, RDMA's IPC_LOCK); then the container's command, as the manifests give it,
runs on two hosts (network namespaces, tests/cluster/netns.py) under exactly the environment each
controller injects, and must train bit for bit like one node with two processes:
- Kubeflow Trainer v2: PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and
  PET_MASTER_PORT, the master being node 0's pod name (<trainjob>-node-0-0.<trainjob>);
- the JobSet: the manifest's own env, plus JOB_COMPLETION_INDEX, with the headless service's
  name for node 0 resolving to host 0.
"""

import re

import nodes
import pytest
import torch
import yaml
from conftest import PROJECT, TINY, training_env

pytestmark = pytest.mark.fixed_amp  # bit-exact comparisons need --amp none

ARGS = ["--amp", "none"]
# What launch.sh reads; none may leak in from the test's own environment.
LAUNCH_VARIABLES = ("NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_ENDPOINT")


def manifest(name):
    return yaml.safe_load((PROJECT / "k8s" / name).read_text())


def trainjob():
    return manifest("trainjob.yaml")


def trainjob_pod_patch():
    """The pod spec that the TrainJob's runtime patch (Trainer v2.3) gives the `node` job."""
    (patch,) = trainjob()["spec"]["runtimePatches"]
    (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert job["name"] == "node"  # the torch-distributed runtime's trainer job
    return job["template"]["spec"]["template"]["spec"]


def jobset_container():
    job = manifest("jobset.yaml")["spec"]["replicatedJobs"][0]["template"]["spec"]
    return job, job["template"]["spec"]


def env_values(entries):
    return {entry["name"]: entry["value"] for entry in entries if "value" in entry}


def test_trainjob_runs_on_the_torch_runtime_with_gpus_shm_and_the_checkpoint_volume():
    job = trainjob()
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    spec = job["spec"]
    assert spec["runtimeRef"]["name"] == "torch-distributed"
    trainer = spec["trainer"]
    assert trainer["numNodes"] >= 1 and trainer["numProcPerNode"] >= 1
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == trainer["numProcPerNode"]
    pod = trainjob_pod_patch()
    (container,) = pod["containers"]
    assert container["name"] == "node"  # the runtime's trainer container
    assert_shm_and_checkpoints(pod, container, trainer["args"])
    assert_least_privilege(container)
    assert env_values(trainer["env"])["STOP_GRACE_SECONDS"] == str(pod["terminationGracePeriodSeconds"])


def test_jobset_is_one_indexed_job_with_node_0_at_a_stable_name():
    name = manifest("jobset.yaml")["metadata"]["name"]
    spec = manifest("jobset.yaml")["spec"]
    assert spec["network"] == {"enableDNSHostnames": True, "subdomain": name}
    job, pod = jobset_container()
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"] >= 1
    (container,) = pod["containers"]
    env = env_values(container["env"])
    assert env["NNODES"] == str(job["completions"])
    assert env["NPROC_PER_NODE"] == str(container["resources"]["limits"]["nvidia.com/gpu"])
    assert env["MASTER_ADDR"] == f"{name}-node-0-0.{name}"  # <jobset>-<job>-<job index>-<pod index>.<subdomain>
    assert env["STOP_GRACE_SECONDS"] == str(pod["terminationGracePeriodSeconds"])
    assert pod["restartPolicy"] == "Never"
    assert_shm_and_checkpoints(pod, container, container["args"])
    assert_least_privilege(container)


def test_jobset_restarts_after_a_preemption_without_counting_it():
    """launch.sh exits 143 (128 + SIGTERM) once the workers have checkpointed: the Job fails by
    its podFailurePolicy, and JobSet restarts the set without counting toward maxRestarts."""
    job, pod = jobset_container()
    (container,) = pod["containers"]
    rules = job["podFailurePolicy"]["rules"]
    on_exit = {"containerName": container["name"], "operator": "In", "values": [143]}
    assert {"action": "FailJob", "onExitCodes": on_exit} in rules
    assert job["backoffLimit"] == 0  # any other failure fails the Job: BackoffLimitExceeded
    policy = manifest("jobset.yaml")["spec"]["failurePolicy"]
    (rule,) = [rule for rule in policy["rules"] if "PodFailurePolicy" in rule.get("onJobFailureReasons", [])]
    assert rule["action"] == "RestartJobSetAndIgnoreMaxRestarts"
    assert all(rule.get("onJobFailureReasons") for rule in policy["rules"])  # BackoffLimitExceeded: counted
    assert policy["maxRestarts"] >= 1


def assert_least_privilege(container):
    """No capability and no escalation: the image's non-root user could not use an added one
    (NCCL's pinned memory comes from the nodes' memlock limit instead, docs/kubernetes.md)."""
    context = container["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"]} and context["allowPrivilegeEscalation"] is False


def assert_shm_and_checkpoints(pod, container, args):
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}
    output_dir = args[args.index("--output_dir") + 1]
    (mount,) = [path for path in mounts if output_dir.startswith(path.rstrip("/") + "/")]
    claim = volumes[mounts[mount]]["persistentVolumeClaim"]["claimName"]
    assert claim == manifest("pvc.yaml")["metadata"]["name"]
    assert "ReadWriteMany" in manifest("pvc.yaml")["spec"]["accessModes"]


def test_dockerfile_has_a_slim_base_torch_for_one_cuda_the_rdma_libraries_a_compiler_and_the_project():
    """The torch wheel brings its CUDA libraries: a slim base, and torch from PyTorch's index of
    the CUDA version the build argument names; the C compiler torch.compile needs."""
    text = (PROJECT / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM (\S+)", text, re.MULTILINE)
    assert base.startswith("python:") and "slim" in base, base
    (cuda,) = re.findall(r"^ARG CUDA=(cu\d+)$", text, re.MULTILINE)
    (install,) = [line for line in text.splitlines() if re.search(r"pip install .*\btorch==", line)]
    (pinned,) = re.findall(r"torch==([\d.]+)\s", install)
    assert pinned == torch.__version__.split("+")[0]  # the torch these tests run on
    assert "--index-url https://download.pytorch.org/whl/${CUDA}" in install, (install, cuda)
    (apt,) = [line for line in text.splitlines() if "apt-get install" in line]
    assert {"iproute2", "libibverbs1", "ibverbs-providers", "librdmacm1"} <= set(apt.split())
    # --compile: Triton compiles its kernel launchers with a C compiler at run time.
    assert {"gcc", "libc6-dev"} <= set(apt.split())
    assert "COPY . ." in text and "pip install --no-cache-dir .\n" in text
    assert trainjob()["spec"]["trainer"]["command"] == ["scripts/launch.sh"]


# --- the container command under each controller's environment, on two hosts -------------


def pod_env(injected):
    """The container's environment: none of launch.sh's settings (they would win over what
    the controller injects), then what the pod gets."""
    unset = {name: "" for name in LAUNCH_VARIABLES}  # launch.sh takes an empty value as unset
    return training_env({**unset, **{name: str(value) for name, value in injected.items()}})


def run_pods(command, envs, master_name, output_dir, logs_dir):
    """The container command once per pod, pod N on host N; `master_name` resolves to host 0."""
    hosts = nodes.two_hosts(aliases={master_name: 0})
    try:
        full = [*command, *TINY, *ARGS, "--output_dir", str(output_dir)]  # later flags win
        return nodes.run_nodes(nodes.start_on(hosts), envs, full, logs_dir)
    finally:
        hosts.teardown()


def test_trainjob_command_under_kubeflow_trainer_environment_equals_one_node(one_node_run, tmp_path):
    job = trainjob()
    trainer, name = job["spec"]["trainer"], job["metadata"]["name"]
    master = f"{name}-node-0-0.{name}"  # the torch plugin's PET_MASTER_ADDR: node 0's pod
    injected = {"PET_NNODES": 2, "PET_NPROC_PER_NODE": 1, "PET_MASTER_ADDR": master, "PET_MASTER_PORT": nodes.PORT}
    envs = [pod_env({**env_values(trainer["env"]), **injected, "PET_NODE_RANK": rank}) for rank in (0, 1)]
    output = run_pods([*trainer["command"], *trainer["args"]], envs, master, tmp_path / "run", tmp_path)
    assert f"static rendezvous at {master}:{nodes.PORT}, node 1" in output[1]
    nodes.assert_same_as(one_node_run, tmp_path / "run")


def test_jobset_command_under_indexed_job_environment_equals_one_node(one_node_run, tmp_path):
    _, pod = jobset_container()
    (container,) = pod["containers"]
    # This rig's job: 2 nodes of 1 process (the manifest asks for the generated counts of GPUs).
    own = {**env_values(container["env"]), "NNODES": 2, "NPROC_PER_NODE": 1}
    envs = [pod_env({**own, "JOB_COMPLETION_INDEX": index}) for index in (0, 1)]
    master, port = own["MASTER_ADDR"], own["MASTER_PORT"]
    output = run_pods([*container["command"], *container["args"]], envs, master, tmp_path / "run", tmp_path)
    assert f"static rendezvous at {master}:{port}, node 1" in output[1]
    nodes.assert_same_as(one_node_run, tmp_path / "run")
