"""SkyPilot (sky.yaml): its `run:` section on two hosts, under the variables SkyPilot injects.

No cloud is used here. The task file's `run:` is executed with bash on two hosts (network
namespaces, tests/cluster/netns.py), node N with what SkyPilot gives node N of a 2-node cluster
without GPUs: SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS (one address a line, node 0 first),
SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE=0 and SKYPILOT_TASK_ID, plus the task's `envs:`.
It must train bit for bit like one node with two processes; stopped by SIGTERM on every node
mid-run (a preemption), the same `run:` again resumes exactly.
"""

import os
import signal

import nodes
import pytest
import yaml
from conftest import PROJECT, TINY, checkpoint, kill_tree, training_env, wait_for

pytestmark = pytest.mark.fixed_amp  # bit-exact comparisons need --amp none

ARGS = ["--amp", "none"]
# What launch.sh reads; none may leak in from the test's own environment.
LAUNCH_VARIABLES = ("NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_ENDPOINT")
TASK_ID = "sky-managed-2026-12-04-16-00-00-000000_train_7-0"  # a managed job's: the same after a recovery


def task_file():
    return yaml.safe_load((PROJECT / "sky.yaml").read_text())


@pytest.fixture(scope="module")
def hosts():
    two_hosts = nodes.two_hosts()
    try:
        yield two_hosts
    finally:
        two_hosts.teardown()


def skypilot_envs(hosts, **extra):
    """Each node's environment as SkyPilot sets it for `run:` on a 2-node cluster without GPUs."""
    ips = "\n".join(hosts.addresses)
    injected = {"SKYPILOT_NUM_NODES": 2, "SKYPILOT_NODE_IPS": ips, "SKYPILOT_NUM_GPUS_PER_NODE": 0,
                "SKYPILOT_TASK_ID": TASK_ID, **task_file().get("envs", {}), **extra}  # fmt: skip
    unset = {name: "" for name in LAUNCH_VARIABLES}  # launch.sh takes an empty value as unset
    envs = [{**unset, **injected, "SKYPILOT_NODE_RANK": rank} for rank in (0, 1)]
    return [training_env({name: str(value) for name, value in env.items()}) for env in envs]


def run_command(output_dir, *args):
    """`run:` with bash; the test's flags after the task's (later flags win), as `"$@"`."""
    return ["bash", "-c", task_file()["run"], "bash", *TINY, *ARGS, *args, "--output_dir", str(output_dir)]


def test_checkpoints_go_to_a_cached_mount_and_the_job_is_named_by_skypilots_task_id():
    task = task_file()
    run = task["run"]
    output_dir = run.split("--output_dir", 1)[1].split()[0]
    (mount,) = [path for path in task["file_mounts"] if output_dir.startswith(path.rstrip("/") + "/")]
    assert task["file_mounts"][mount]["mode"] == "MOUNT_CACHED"  # appends and atomic renames
    assert 'TRAINING_JOB_ID="skypilot $SKYPILOT_TASK_ID"' in run
    assert run.count("scripts/launch.sh") == 1 and "torchrun" not in run  # launch.sh's rendezvous, not a copy
    assert set(task["secrets"]) >= {"WANDB_API_KEY"} and all(v is None for v in task["secrets"].values())


def test_run_section_on_two_hosts_equals_one_node(one_node_run, hosts, tmp_path):
    output = nodes.run_nodes(nodes.start_on(hosts), skypilot_envs(hosts), run_command(tmp_path / "run"), tmp_path)
    assert f"static rendezvous at {hosts.addresses[0]}:29500, node 1" in output[1]
    assert "2 node(s) x 1 process(es)" in output[0]
    nodes.assert_same_as(one_node_run, tmp_path / "run")


def test_run_section_stopped_by_sigterm_on_both_hosts_resumes_exactly(one_node_run, hosts, tmp_path):
    """A preemption: SIGTERM to every process of both nodes (as at a machine's shutdown) after
    step 4; both save and exit 143. The same `run:` again (a managed job's recovery: the same
    SKYPILOT_TASK_ID) resumes and ends as one node does."""
    output_dir = tmp_path / "run"
    slow = skypilot_envs(hosts, PYTHONPATH="tests", DDP_PROBE="slow_loss")  # 200 ms a step (tests/ddp_probe.py)
    command = run_command(output_dir, "--checkpoint_every_steps", "4", "--keep_checkpoints", "100")
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    processes = []
    try:
        for rank, log in enumerate(logs):
            processes.append(nodes.start_on(hosts)(rank, command, slow[rank], open(log, "w")))
        wait_for(checkpoint(output_dir, 4), processes[0])
        for process in processes:
            os.killpg(process.pid, signal.SIGTERM)
        codes = [process.wait(timeout=nodes.TIMEOUT) for process in processes]
    finally:
        for process in processes:
            kill_tree(process.pid)
            process.wait()
    output = "".join(log.read_text() for log in logs)
    assert codes == [128 + signal.SIGTERM] * 2, output
    assert "stopped by SIGTERM at step" in output, output
    again = nodes.run_nodes(nodes.start_on(hosts), skypilot_envs(hosts), command, tmp_path / "again")
    assert "resumed from" in "".join(again)
    nodes.assert_same_as(one_node_run, output_dir)
