"""The network, measured: the preflight's prediction against real step times over a limited link.

On two hosts (network namespaces, tests/netns.py) whose link is unlimited or limited to
20 Mbit/s, each test trains this task's NETWORK model (gradients large enough for a slow link
to matter) on 1 host x 1 process and on 2 hosts x 1 process, runs the preflight across the
same two hosts, and checks what it predicted: the 2-host step time within 30% of the measured
one, and `multi_node_pays` as the measurement found (unlimited: 2 hosts train more samples a
second than one; 20 Mbit/s: fewer). These tests time things: the template's CI runs them on
their own, not beside other tests (the `alone` marker).
"""

import nodes
import pytest
import task
from conftest import run_training

pytestmark = [pytest.mark.fixed_amp, pytest.mark.alone]

ARGS = [*task.NETWORK_ARGS, "--amp", "none", *nodes.timed_args(8)]
BATCH = int(dict(zip(task.NETWORK_ARGS[::2], task.NETWORK_ARGS[1::2]))["--batch_size"])


@pytest.fixture(scope="module")
def one_host_step_seconds(tmp_path_factory):
    """1 host x 1 process: no link at all."""
    output_dir = tmp_path_factory.mktemp("one_host")
    run_training(output_dir, *ARGS, timeout=300)
    return nodes.step_seconds(output_dir, BATCH)


@pytest.mark.parametrize("rate", [None, "20mbit"], ids=["unlimited", "20mbit"])
def test_preflight_predicts_the_two_host_step_time_and_whether_it_pays(rate, one_host_step_seconds, tmp_path):
    hosts = nodes.two_hosts()
    try:
        hosts.limit_link(rate)
        report = nodes.preflight_prediction(hosts, ARGS, tmp_path / "preflight")
        measured = nodes.two_host_step_seconds(hosts, ARGS, 2 * BATCH, tmp_path / "run")
    finally:
        hosts.teardown()
    predicted = report["job_step_seconds"]
    summary = f"{rate}: 1 host {one_host_step_seconds:.3f} s, 2 hosts {measured:.3f} s, predicted {predicted:.3f} s"
    assert report["nodes"] == 2 and report["comm_hook"] == "none", report
    assert abs(predicted / measured - 1) <= 0.3, summary
    # Two hosts pay when they train more samples a second: 2 batches a step against 1.
    pays = 2 / measured > 1 / one_host_step_seconds
    assert report["multi_node_pays"] == pays, summary
    assert pays == (rate is None), summary  # the two ends of the range give both answers
