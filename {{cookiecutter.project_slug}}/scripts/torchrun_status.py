"""torchrun as scripts/launch.sh runs it: the same arguments and behaviour, but a job stopped by
a signal with its checkpoint saved ends with the workers' exit status on every node: 128 + the
signal's number, 143 after SIGTERM (Kubernetes, scancel), 138 after SIGUSR1 (SLURM's --signal).

torchrun itself exits 1 after a signal, and so do the other nodes, whose workers stopped because
the ranks agreed to: a scheduler could not tell a preemption from a crash (k8s/jobset.yaml
restarts the job after a preemption without counting it as a failure). The workers write their
status to STOP_STATUS_FILE (train.py); this process runs torchrun in-process, so it receives
the signals exactly as torchrun does, and exits with that status.

With MAX_RESTARTS > 0 a node whose workers stopped without a signal of its own restarts them
(torchrun takes the stop for a failure), and the restarted workers wait for the nodes that
left: the status holds for jobs without restarts, what a scheduler that restarts jobs uses.
"""

import inspect
import os
import sys
import tempfile
from pathlib import Path

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import PContext, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun


def shutdown_grace_for_older_torchrun(agent=LocalElasticAgent, processes=PContext, environ=os.environ):
    """An older torchrun (2.11) has no --shutdown-timeout (PET_SHUTDOWN_TIMEOUT, which launch.sh sets):
    after forwarding a signal it gives the workers 30 s, then kills them. There the workers
    get PET_SHUTDOWN_TIMEOUT seconds all the same, as the default of the close that torchrun's
    agent calls. Returns whether torchrun needed it."""
    if "timeout" in inspect.signature(agent._shutdown).parameters or not environ.get("PET_SHUTDOWN_TIMEOUT"):
        return False
    grace, close = int(environ["PET_SHUTDOWN_TIMEOUT"]), processes.close

    def close_with_grace(self, death_sig=None, timeout=grace):
        return close(self, death_sig, timeout)

    processes.close = close_with_grace
    return True


def main(argv):
    shutdown_grace_for_older_torchrun()
    fd, path = tempfile.mkstemp(prefix="torchrun-stop-status-")
    os.close(fd)
    os.environ["STOP_STATUS_FILE"] = path  # the workers inherit it
    try:
        torchrun(argv)
    except (SignalException, ChildFailedError):
        status = Path(path).read_text().strip()
        if not status:  # not a stop with a checkpoint: torchrun's own error and status
            raise
        print(f"torchrun_status.py: training stopped with status {status}, its checkpoint saved", file=sys.stderr)
        return int(status)
    finally:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
