"""Several nodes: scripts/launch.sh once per node trains exactly like one node with all the processes.

Two launches with NNODES=2 x NPROC_PER_NODE=1 end with parameters bit-identical to one torchrun
with 2 processes: on this machine over loopback, and on two "hosts" (network namespaces joined
by a veth pair, tests/cluster/netns.py) with the static and the elastic (c10d) rendezvous.
"""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import netns
import nodes
import pytest
import torch
from conftest import LR, PROJECT, TINY, read_metrics
from nodes import LAUNCH, PORT, TIMEOUT, assert_same_as, describe, launch_env, run_nodes, start_here, start_on

from config import Config
from ddp_utils.optim.lr_schedule import Plan, lr_at

pytestmark = pytest.mark.fixed_amp  # bit-exact comparisons need --amp none

ARGS = ["--amp", "none"]


def launch_command(output_dir):
    return [LAUNCH, *TINY, *ARGS, "--output_dir", str(output_dir)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launches_on_this_machine_equal_one_node(one_node_run, tmp_path):
    """Static rendezvous of two launches on this machine: where network namespaces exist, the
    two-host test below makes the same check across a real link instead."""
    if netns.unavailable_reason() is None:
        pytest.skip("test_static_rendezvous_across_two_hosts_equals_one_node checks this across two hosts")
    port = free_port()
    common = {"NNODES": 2, "NPROC_PER_NODE": 1, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    envs = [launch_env(**common, NODE_RANK=rank) for rank in (0, 1)]
    output = run_nodes(start_here, envs, launch_command(tmp_path / "run"), tmp_path)
    assert f"static rendezvous at 127.0.0.1:{port}, node 1" in output[1]
    assert_same_as(one_node_run, tmp_path / "run")


# --- two hosts: network namespaces -------------------------------------------------------


@pytest.fixture
def hosts():
    two_hosts = nodes.two_hosts()
    try:
        yield two_hosts
    finally:
        two_hosts.teardown()


def test_the_hosts_have_their_own_name_and_address_and_are_removed_afterwards(tmp_path):
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"two hosts need network namespaces: {reason}")
    try:
        with netns.TwoHosts(own_hostname_address={1: "127.0.1.1"}) as hosts:
            names = [hosts.run(host, ["sh", "-c", "hostname; getent hosts node0 node1"]).stdout for host in (0, 1)]
            addresses = [hosts.run(host, ["ip", "-o", "addr", "show"]).stdout for host in (0, 1)]
            sleeper = hosts.popen(1, ["sleep", "600"])
    except netns.NetnsUnavailable as error:
        pytest.skip(f"cannot create network namespaces here: {error}")
    names = [[" ".join(line.split()) for line in output.splitlines()] for output in names]
    assert names[0] == ["node0", "10.213.7.1 node0", "10.213.7.2 node1"]
    assert names[1] == ["node1", "10.213.7.1 node0", "127.0.1.1 node1"]  # its own name: loopback
    addresses = [{tuple(line.split()[1:4:2]) for line in output.splitlines()} for output in addresses]
    assert addresses[0] == {("lo", "127.0.0.1/8"), ("lo", "::1/128"), ("ddp0", "10.213.7.1/24")}
    assert addresses[1] == {("lo", "127.0.0.1/8"), ("lo", "::1/128"), ("ddp0", "10.213.7.2/24")}
    assert sleeper.poll() == -signal.SIGKILL
    for namespace in hosts.namespaces:
        assert not (netns.NETNS_RUN / namespace).exists() and not (netns.NETNS_ETC / namespace).exists()


def test_static_rendezvous_across_two_hosts_equals_one_node(one_node_run, hosts, tmp_path):
    """MASTER_ADDR is node 0's link address; gloo finds the link from each node's hostname."""
    output = run_nodes(start_on(hosts), nodes.two_host_envs(hosts), launch_command(tmp_path / "run"), tmp_path)
    assert f"static rendezvous at {hosts.addresses[0]}:{PORT}, node 1" in output[1]
    assert_same_as(one_node_run, tmp_path / "run")


def test_elastic_rendezvous_across_two_hosts_equals_one_node(one_node_run, hosts, tmp_path):
    """c10d rendezvous on node 0 with NNODES=MIN:MAX; GLOO_SOCKET_IFNAME names the same link on both."""
    endpoint = f"{hosts.addresses[0]}:{PORT}"
    env = launch_env(NNODES="2:2", NPROC_PER_NODE=1, RDZV_ENDPOINT=endpoint, RDZV_ID=f"test{os.getpid()}")
    env["GLOO_SOCKET_IFNAME"] = hosts.ifname
    output = run_nodes(start_on(hosts), [env, env], launch_command(tmp_path / "run"), tmp_path)
    assert f"c10d rendezvous at {endpoint}" in output[1]
    assert_same_as(one_node_run, tmp_path / "run")


# --- elastic membership changes: a host joins, a host is lost ----------------------------

# 1024 samples, batch 32 per process, 3 epochs: 32 steps an epoch on one host, 16 on two. A
# checkpoint every 4 steps; each training micro-step sleeps 200 ms (tests/ddp_probe.py
# slow_loss, installed through tests/sitecustomize.py), so the run lasts while hosts change;
# 1 s while one host waits for another to join (slow_until_joined): however long the second
# torchrun takes to start on a busy machine, the first is still training when it joins.
ELASTIC = [*TINY, *ARGS, "--epochs", "3", "--checkpoint_every_steps", "4", "--keep_checkpoints", "100"]
ELASTIC += ["--timeout_seconds", "30"]


def elastic_env(hosts, probe):
    """NNODES=1:2 on a c10d rendezvous at host 0, with short rendezvous waits for the test."""
    endpoint = f"{hosts.addresses[0]}:{PORT}"
    conf = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"  # a lost host is noticed in 3 s
    env = launch_env(NNODES="1:2", NPROC_PER_NODE=1, RDZV_ENDPOINT=endpoint, RDZV_ID=f"elastic{os.getpid()}",
                     MAX_RESTARTS=3, RDZV_CONF=conf)  # fmt: skip
    return {**env, "GLOO_SOCKET_IFNAME": hosts.ifname, "PYTHONPATH": "tests", "DDP_PROBE": probe}


def start_elastic_node(hosts, node, output_dir, logs_dir, workers=0, probe="slow_loss"):
    log = open(Path(logs_dir) / f"node{node}.log", "w")
    command = [LAUNCH, *ELASTIC, "--num_workers", str(workers), "--output_dir", str(output_dir)]
    return hosts.popen(node, command, env=elastic_env(hosts, probe), cwd=PROJECT, stdout=log, stderr=subprocess.STDOUT)


def wait_for_checkpoint(output_dir, step, processes, logs):
    path = Path(output_dir) / "checkpoints" / f"step_{step:09d}.pt"
    deadline = time.monotonic() + TIMEOUT
    while not path.exists():
        assert all(p.poll() is None for p in processes) and time.monotonic() < deadline, describe(processes, logs)
        time.sleep(0.1)


def assert_epochs_once_and_lr_on_course(output_dir):
    """Every epoch logged once; each epoch ends at the lr of its sample count in one
    uninterrupted run (give or take the global batch of 64 samples that a resume at the
    nearest whole global batch may repeat or skip), the last one at the floor."""
    metrics = read_metrics(output_dir)
    assert [m["epoch"] for m in metrics] == [1, 2, 3]
    cfg, plan = Config(lr=LR), Plan(total_samples=3 * 1024, warmup_samples=0)
    for line in metrics:
        samples = 1024 * line["epoch"]
        nearby = [lr_at(samples + delta, cfg, plan) for delta in range(-64, 65, 32) if samples + delta <= 3072]
        assert min(nearby) - 1e-12 <= line["lr"] <= max(nearby) + 1e-12, (line, nearby)
    assert metrics[-1]["lr"] == pytest.approx(LR * 0.1)


def test_elastic_job_takes_in_a_host_that_joins_mid_run(hosts, tmp_path):
    """Host 0 trains alone (world size 1); host 1 joins after step 4. torchrun stops host 0's
    worker (SIGTERM to its process group, DataLoader workers included: a mid-epoch checkpoint)
    and starts both; the group of two resumes it with twice the global batch, and the job
    completes. (The host-lost test below runs without DataLoader workers.)"""
    output_dir, logs = tmp_path / "run", [tmp_path / "node0.log", tmp_path / "node1.log"]
    first = start_elastic_node(hosts, 0, output_dir, tmp_path, workers=2, probe="slow_until_joined")
    wait_for_checkpoint(output_dir, 4, [first], logs[:1])
    second = start_elastic_node(hosts, 1, output_dir, tmp_path, workers=2, probe="slow_until_joined")
    processes = [first, second]
    codes = [p.wait(timeout=TIMEOUT) for p in processes]
    assert codes == [0, 0], describe(processes, logs)
    output = "".join(log.read_text() for log in logs)  # rank 0 of the new group may be on either host
    assert "stopped by SIGTERM" in output and "resumed from" in output, output
    final = torch.load(output_dir / "checkpoints" / "last.pt", weights_only=True)
    assert final["world_size"] == 2 and final["epoch"] == 3
    assert_epochs_once_and_lr_on_course(output_dir)


def test_elastic_job_goes_on_when_a_host_is_lost_mid_run(hosts, tmp_path):
    """Two hosts train; at step 8 every process of host 1 is killed (the host is gone). Host
    0's worker finds its peer gone, torchrun restarts it, the rendezvous forms a group of one,
    which resumes from the newest checkpoint with half the global batch and completes."""
    output_dir, logs = tmp_path / "run", [tmp_path / "node0.log", tmp_path / "node1.log"]
    processes = [start_elastic_node(hosts, node, output_dir, tmp_path) for node in (0, 1)]
    wait_for_checkpoint(output_dir, 8, processes, logs)
    hosts.kill_host(1)
    assert processes[0].wait(timeout=TIMEOUT) == 0, describe(processes, logs)
    final = torch.load(output_dir / "checkpoints" / "last.pt", weights_only=True)
    assert final["world_size"] == 1 and final["epoch"] == 3
    assert "resumed from" in logs[0].read_text()
    assert_epochs_once_and_lr_on_course(output_dir)


# --- the preflight across two hosts -------------------------------------------------------


def preflight_envs(hosts, **extra):
    return nodes.two_host_envs(hosts, PREFLIGHT_MAX_MB=16, **extra)


def start_preflight(hosts, envs, logs_dir):
    Path(logs_dir).mkdir(exist_ok=True)
    logs = [Path(logs_dir) / f"preflight{node}.log" for node in (0, 1)]
    processes = []
    for node, env in enumerate(envs):
        with open(logs[node], "w") as log:
            command = [LAUNCH, "--preflight", *TINY]
            processes.append(hosts.popen(node, command, env=env, cwd=PROJECT, stdout=log, stderr=subprocess.STDOUT))
    return processes, logs


def test_preflight_across_two_hosts_measures_and_gives_a_verdict(hosts, tmp_path):
    processes, logs = start_preflight(hosts, preflight_envs(hosts), tmp_path)
    assert [p.wait(timeout=TIMEOUT) for p in processes] == [0, 0], describe(processes, logs)
    output = logs[0].read_text()
    assert "all-reduce of 2 ranks correct" in output
    assert "  16 MiB" in output and "GB/s" in output
    assert "verdict: per optimizer step: compute" in output
    assert "inter-node traffic a step, each node: ddp " in output and ", hsdp " in output
    assert "node1 resolves to 10.213.7.2; reaches MASTER_ADDR 10.213.7.1 via 10.213.7.2 on ddp0" in logs[1].read_text()


def test_preflight_catches_a_hostname_that_gloo_would_hang_on(tmp_path):
    """Each host's name resolves to 127.0.1.1, not to its link: training would hang in gloo's
    first connection. The preflight says so, names the interface, and fails fast."""
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"two hosts need network namespaces: {reason}")
    try:
        with netns.TwoHosts(own_hostname_address={0: "127.0.1.1", 1: "127.0.1.1"}) as hosts:
            started = time.monotonic()
            processes, logs = start_preflight(hosts, preflight_envs(hosts), tmp_path / "as_is")
            codes = [p.wait(timeout=TIMEOUT) for p in processes]
            elapsed = time.monotonic() - started
            pinned, pinned_logs = start_preflight(
                hosts, preflight_envs(hosts, GLOO_SOCKET_IFNAME="ddp0"), tmp_path / "fixed"
            )
            pinned_codes = [p.wait(timeout=TIMEOUT) for p in pinned]
    except netns.NetnsUnavailable as error:
        pytest.skip(f"cannot create network namespaces here: {error}")
    # Fast: the start-up of 4 processes on a busy machine, not gloo's wait (TIMEOUT, then a failure).
    assert codes == [1, 1] and elapsed < 100, describe(processes, logs)
    for node, log in enumerate(logs):
        text = log.read_text()
        assert f"PROBLEM: hostname 'node{node}' resolves to 127.0.1.1" in text
        assert "Set GLOO_SOCKET_IFNAME=ddp0 NCCL_SOCKET_IFNAME=ddp0 on this node" in text
    assert pinned_codes == [0, 0], describe(pinned, pinned_logs)  # the suggested fix works
