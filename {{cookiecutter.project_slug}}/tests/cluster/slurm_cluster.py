"""A real SLURM cluster on this machine, for tests: munge, slurmctld and a slurmd per node, no systemd.

    def test_something(slurm):  # the session fixture below
        job_id = slurm.sbatch(["--nodes=1", "scripts/slurm.sbatch"], cwd=PROJECT, env=slurm.env())
        slurm.job(job_id)["JobState"]  # "RUNNING", ...

Or outside pytest: `with SlurmCluster(nodes=2) as cluster: ...`.

Everything lives in a private folder /tmp/slurm-cluster-*: slurm.conf, the munge key and
socket, state, spool folders, pid and log files. Client commands (sbatch, srun, scontrol)
find the cluster through SLURM_CONF, which `env()` sets. Daemon ports are free ports picked
at start and the first job id is random, so several test sessions can run a cluster each.

Nodes are slurmd daemons on this machine (`slurmd -N NAME`, each on its own port). Node names
are host names to jobs (`scontrol show hostnames`, rendezvous endpoints), so they must resolve:
the first node is named after this machine, the second `localhost`.

Needs root (slurmd starts jobs as their owner) and Debian's slurmctld, slurmd, slurm-client and
munge packages; `unavailable_reason()` says what is missing. The daemons run
in the foreground as children of the test session (munged as the munge user); `stop()` cancels
every job, waits for the jobs to end, stops the daemons and deletes the folder. The folder and
daemons of a session that died are removed by the next one.
"""

import json
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from netns import pid_alive

SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")  # the daemons live in sbin, not always on PATH
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue", "sinfo")
PREFIX = "slurm-cluster-"
COMMAND_TIMEOUT = 30  # seconds for any one client command, unless the caller gives more

# Job states after which a job does not run again by itself (a requeued job is PENDING).
FINISHED = frozenset("BOOT_FAIL CANCELLED COMPLETED DEADLINE FAILED NODE_FAIL OUT_OF_MEMORY PREEMPTED TIMEOUT".split())


class ClusterError(RuntimeError):
    pass


def _which(tool):
    return shutil.which(tool) or shutil.which(tool, path=os.pathsep.join(SBIN))


def unavailable_reason():
    """Why this machine cannot run the cluster, or None when it (probably) can."""
    if os.geteuid() != 0:
        return "a private SLURM cluster needs root (slurmd starts jobs as their owner)"
    missing = [tool for tool in TOOLS if _which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)}: apt-get install slurmd slurmctld slurm-client munge"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no 'munge' user (the munge package creates it)"
    return None


def node_names(count):
    """Up to `count` names that resolve to this machine: its host name, then `localhost`."""
    names = dict.fromkeys([socket.gethostname().split(".")[0], "localhost"])  # one name on a host called localhost
    usable = []
    for name in names:
        try:
            socket.getaddrinfo(name, None)
        except socket.gaierror:
            continue
        usable.append(name)
    return usable[:count]


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _group_members(pgid):
    """Live (not zombie) processes of process group `pgid`."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def _kill_group(pgid, marker, leader=None, grace=10.0):
    """SIGTERM process group `pgid`, then SIGKILL what is left after `grace` seconds.

    Only when the group leader's command line contains `marker` (our folder): never a recycled pid.
    `leader`, the leader's Popen when it is our child, is reaped on the way.
    """
    if marker not in _cmdline(pgid):
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if leader is not None:
                leader.poll()
            if not _group_members(pgid):
                return
            time.sleep(0.05)


def remove_stale_clusters():
    """Stop the daemons and delete the folders of clusters whose test session is gone."""
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            record = json.loads((folder / "daemons.json").read_text())
        except (OSError, ValueError):
            record = None
        try:
            if record is None and time.time() - folder.stat().st_mtime < 600:
                continue  # being set up right now, by another session
        except OSError:
            continue
        if record is not None and pid_alive(record["owner"]):
            continue
        for pgid in reversed((record or {}).get("daemons", [])):
            _kill_group(pgid, str(folder), grace=5.0)
        shutil.rmtree(folder, ignore_errors=True)


class SlurmCluster:
    """munged, slurmctld and a slurmd for each of `nodes` nodes (fewer when fewer names resolve)."""

    partition = "debug"

    def __init__(self, nodes=1, cpus_per_node=2):
        self.names = node_names(nodes)  # the nodes' names, which are also their host names
        if not self.names:
            raise ClusterError("neither this machine's host name nor localhost resolves")
        self.cpus_per_node = cpus_per_node
        self.folder = None
        self.processes = []  # (Popen, name) of each daemon, in start order

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    # --- life cycle ------------------------------------------------------------------------

    def start(self, timeout=60):
        remove_stale_clusters()
        self.folder = Path(tempfile.mkdtemp(prefix=PREFIX))
        try:
            self._write_files()
            self._start_munged()
            self._start("slurmctld", [_which("slurmctld"), "-D", "-c", "-f", self.conf], ready=self._controller_answers)
            for name in self.names:
                self._start(f"slurmd-{name}", [_which("slurmd"), "-D", "-f", self.conf, "-N", name])
            self._wait(self.nodes_idle, timeout, "the nodes did not become idle")
        except BaseException:
            self.stop()
            raise

    def stop(self):
        """Cancel every job, wait for the jobs to end, stop the daemons, delete the folder."""
        if self.folder is None:
            return
        try:
            if any(name == "slurmctld" and process.poll() is None for process, name in self.processes):
                self.run(["scancel", f"--partition={self.partition}"], check=False)
                try:
                    self._wait(lambda: not self.jobs(), 60, "jobs still running at teardown")
                except ClusterError:
                    pass  # stopping slurmd below ends them
        finally:
            for process, _ in reversed(self.processes):
                _kill_group(process.pid, str(self.folder), leader=process)
                process.wait(timeout=10)
            self.processes.clear()
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    # --- for tests -------------------------------------------------------------------------

    @property
    def conf(self):
        return str(self.folder / "slurm.conf")

    def env(self, extra=None, path_first=()):
        """This process's environment for client commands: SLURM_CONF set to this cluster's, no
        SLURM_* settings of an enclosing job, `path_first` folders ahead on PATH, and `extra`."""
        path = os.pathsep.join([*map(str, path_first), os.environ.get("PATH", ""), *SBIN])
        env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        return {**env, "PATH": path, "SLURM_CONF": self.conf, **{k: str(v) for k, v in (extra or {}).items()}}

    def run(self, command, *, timeout=COMMAND_TIMEOUT, check=True, env=None, cwd=None):
        """Run a client command (sbatch, srun, scontrol, ...); raises ClusterError if it fails and `check`."""
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=env or self.env(), cwd=cwd, check=False
        )
        if check and result.returncode != 0:
            raise ClusterError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
        return result

    def sbatch(self, args, **kwargs):
        """Submit a batch job, `sbatch ARGS`; returns its job id. Keywords go to `run`."""
        result = self.run(["sbatch", "--parsable", *map(str, args)], **kwargs)
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id):
        """`scontrol show job` as a dict: JobState, Reason, Restarts, ExitCode, ..."""
        result = self.run(["scontrol", "--oneliner", "show", "job", str(job_id)])
        return dict(field.split("=", 1) for field in result.stdout.split() if "=" in field)

    def jobs(self):
        """{job id: state} of the jobs that are not finished."""
        result = self.run(["squeue", "--noheader", "--format=%i %T"])
        states = dict(line.split() for line in result.stdout.splitlines())
        return {int(job): state for job, state in states.items() if state not in FINISHED}

    def nodes_idle(self):
        """Whether every node is up and runs nothing, the end of a job included."""
        result = self.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], check=False)
        states = dict(line.split() for line in result.stdout.splitlines())
        return set(states) == set(self.names) and all(state == "idle" for state in states.values())

    def logs(self, lines=40):
        """The last lines of each daemon's output, for failure messages."""
        parts = []
        for path in sorted(self.folder.glob("*.out")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # --- set-up ----------------------------------------------------------------------------

    def _write_files(self):
        folder = self.folder
        folder.chmod(0o755)
        munge_dir = folder / "munge"
        munge_dir.mkdir()
        munge_dir.chmod(0o711)  # munged insists that all may search its socket's folder
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        user = pwd.getpwnam("munge")
        for path in (munge_dir, key):
            os.chown(path, user.pw_uid, user.pw_gid)
        (folder / "state").mkdir()
        for name in self.names:
            (folder / "spool" / name).mkdir(parents=True)
        controller_port, *node_ports = _free_ports(1 + len(self.names))
        nodes = "\n".join(
            f"NodeName={name} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus_per_node} State=UNKNOWN"
            for name, port in zip(self.names, node_ports)
        )
        # slurmctld must run on the host SlurmctldHost names. No cgroups, accounting or MPI: the
        # plugins that need none work in containers. config_overrides: the nodes share this
        # machine's CPUs. FirstJobId: random, as job scripts derive ports from job ids.
        # MinJobAge < 8: `sbatch --wait` polls every 2 s (else after 2, 10, 42 s, ...); finished
        # jobs stay visible at least that long.
        (folder / "slurm.conf").write_text(
            f"""\
ClusterName=pytest{os.getpid()}
SlurmctldHost={socket.gethostname().split(".")[0]}(127.0.0.1)
SlurmctldPort={controller_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_dir}/munge.socket
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
FirstJobId={random.randrange(1000, 19000)}
MinJobAge=4
MailProg=/bin/true
InactiveLimit=0
KillWait=10
Waittime=0
{nodes}
PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _start_munged(self):
        munge_dir = self.folder / "munge"
        command = [_which("munged"), "--foreground", f"--socket={munge_dir}/munge.socket"]
        command += [f"--key-file={munge_dir}/munge.key", f"--pid-file={munge_dir}/munged.pid"]
        command += [f"--seed-file={munge_dir}/munged.seed", f"--log-file={munge_dir}/munged.log"]
        self._start("munged", command, ready=(munge_dir / "munge.socket").exists, user="munge")

    def _start(self, name, command, ready=None, timeout=30, user=None):
        """Start a daemon in the foreground, in a session of its own, output to FOLDER/NAME.out."""
        as_user = {"user": user, "group": pwd.getpwnam(user).pw_gid, "extra_groups": []} if user else {}
        with open(self.folder / f"{name}.out", "w") as out:
            # A session of its own: stop() signals the daemon and anything it started, by group.
            options = {"stdout": out, "stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL, **as_user}
            process = subprocess.Popen(command, start_new_session=True, **options)
        self.processes.append((process, name))
        record = {"owner": os.getpid(), "daemons": [p.pid for p, _ in self.processes]}
        (self.folder / "daemons.json").write_text(json.dumps(record))
        if ready:
            self._wait(ready, timeout, f"{name} did not start")

    def _controller_answers(self):
        return self.run(["scontrol", "ping"], check=False).returncode == 0

    def _wait(self, condition, timeout, message, poll=0.25):
        deadline = time.monotonic() + timeout
        while not condition():
            for process, name in self.processes:
                if process.poll() is not None:
                    raise ClusterError(f"{name} exited ({process.returncode}) while waiting: {message}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise ClusterError(f"{message} within {timeout} s\n{self.logs()}")
            time.sleep(poll)


@pytest.fixture(scope="session", name="slurm")
def slurm_fixture():
    """A running cluster of two nodes (one if only one node name resolves) for the session.

    Skips with the reason where root or the SLURM packages are missing; a cluster that should
    start but does not fails the tests that use it, with the daemons' output.
    """
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with SlurmCluster(nodes=2) as cluster:
        yield cluster
