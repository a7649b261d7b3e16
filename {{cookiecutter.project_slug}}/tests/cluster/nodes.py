"""Run scripts/launch.sh as several nodes: on this machine, or one per network-namespace host
(tests/cluster/netns.py). Shared by the multi-node, network and Kubernetes tests."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import netns
import pytest
import torch
from conftest import PROJECT, TINY, kill_tree, load_final_model, read_metrics, training_env

LAUNCH = str(PROJECT / "scripts" / "launch.sh")
TIMEOUT = 150  # seconds for a whole multi-node run; a hang fails the test instead of blocking CI
PORT = 29400  # inside fresh namespaces every port is free


def launch_env(**variables):
    """launch.sh's settings (nothing inherited from the caller), torchrun from this interpreter."""
    settings = {"MASTER_ADDR": "", "MASTER_PORT": "29500", "RDZV_ENDPOINT": "", "NODE_RANK": "0"}
    settings |= {"MAX_RESTARTS": "0", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return training_env({**settings, **{name: str(value) for name, value in variables.items()}})


def run_nodes(start, envs, command, logs_dir, timeout=TIMEOUT):
    """Start `command` once per node env with `start(node, command, env, log)`; wait for all to succeed.

    Fails, after killing the rest, as soon as one node fails or when `timeout` passes; returns
    the nodes' output.
    """
    Path(logs_dir).mkdir(parents=True, exist_ok=True)
    logs = [Path(logs_dir) / f"node{node}.log" for node in range(len(envs))]
    processes = []
    try:
        for node, env in enumerate(envs):
            with open(logs[node], "w") as log:
                processes.append(start(node, command, env, log))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in processes):
            failed = [p for p in processes if p.poll() not in (None, 0)]
            assert not failed and time.monotonic() < deadline, describe(processes, logs)
            time.sleep(0.2)
        assert all(p.returncode == 0 for p in processes), describe(processes, logs)
    finally:
        for process in processes:
            kill_tree(process.pid)  # the node's torchrun and its workers (in sessions of their own)
            process.wait()
    return [log.read_text() for log in logs]


def assert_same_as(reference, output_dir):
    """The same parameters, bit for bit, and the same epochs logged."""
    ours, theirs = load_final_model(output_dir), load_final_model(reference)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs), "parameters differ from one node"
    assert [m["epoch"] for m in read_metrics(output_dir)] == [m["epoch"] for m in read_metrics(reference)]


def describe(processes, logs):
    states = ["running" if p.poll() is None else f"exit {p.returncode}" for p in processes]
    parts = [f"--- node {node} ({state}):\n{log.read_text()}" for node, (state, log) in enumerate(zip(states, logs))]
    return "\n".join(parts)


def start_here(node, command, env, log):
    return subprocess.Popen(command, cwd=PROJECT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_on(hosts):
    """`start` for run_nodes: node N runs on host N."""

    def start(node, command, env, log):
        return hosts.popen(node, command, env=env, cwd=PROJECT, stdout=log, stderr=subprocess.STDOUT)

    return start


def two_hosts(**options):
    """The two hosts (netns.TwoHosts(**options)), set up; skips the test where they cannot exist."""
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"two hosts need network namespaces: {reason}")
    hosts = netns.TwoHosts(**options)
    try:
        hosts.setup()
    except netns.NetnsUnavailable as error:
        pytest.skip(f"cannot create network namespaces here: {error}")
    return hosts


# --- step times over a link, and the preflight's prediction of them -----------------------


def step_seconds(output_dir, samples_per_step):
    """Seconds per optimizer step in a run's last metrics line (its steady state: the line's
    throughput leaves out the first step after the previous line)."""
    return samples_per_step / read_metrics(output_dir)[-1]["samples_per_s"]


def timed_args(steps):
    """Train `steps` optimizer steps, half of them timed: the last metrics line covers the second
    half, past start-up and warm-up (PowerSGD's first 10 steps are plain all-reduces)."""
    return ["--max_steps", steps, "--eval_every_steps", steps // 2, "--val_samples", 64, "--resume", "none"]


def two_host_envs(hosts, **extra):
    """launch.sh's settings on each of two hosts: one process each, static rendezvous at host 0."""
    common = {"NNODES": 2, "NPROC_PER_NODE": 1, "MASTER_ADDR": hosts.addresses[0], "MASTER_PORT": PORT}
    return [launch_env(**common, NODE_RANK=rank, **extra) for rank in (0, 1)]


def two_host_step_seconds(hosts, args, samples_per_step, output_dir):
    """Train on both hosts, one process each."""
    command = [LAUNCH, *TINY, *map(str, args), "--output_dir", str(output_dir)]
    logs_dir = output_dir.parent / f"{output_dir.name}_logs"
    run_nodes(start_on(hosts), two_host_envs(hosts), command, logs_dir, timeout=600)
    return step_seconds(output_dir, samples_per_step)


def preflight_prediction(hosts, args, logs_dir):
    """`launch.sh --preflight --json` on both hosts: the object rank 0 prints."""
    envs = two_host_envs(hosts, PREFLIGHT_MAX_MB=16)
    output = run_nodes(start_on(hosts), envs, [LAUNCH, "--preflight", "--json", *TINY, *map(str, args)], logs_dir)
    (report,) = [json.loads(line) for line in "".join(output).splitlines() if line.startswith("{")]
    return report
