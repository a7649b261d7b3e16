"""Two "hosts" on one machine, for multi-node tests: network namespaces joined by a veth pair.

    with TwoHosts() as hosts:
        node0 = hosts.popen(0, ["scripts/launch.sh", ...], env={"NODE_RANK": "0"}, stdout=log)
        hosts.run(1, ["hostname"])  # "node1"

Each host is a network namespace with loopback and one link, named IFNAME ("ddp0") in both,
so one GLOO_SOCKET_IFNAME fits every node. The link addresses are ADDRESSES (10.213.7.1/24 and
10.213.7.2/24); no other non-loopback address is configured (IPv6 link-local is switched off).
Commands run inside with a hostname of their own (a UTS namespace), which the host's
/etc/netns/<namespace>/hosts (bind-mounted over /etc/hosts by `ip netns exec`) maps to its link
address, and the other host's hostname to the other's. The file system and process table are
shared with the machine, so output folders in /tmp work as a shared file system.

`limit_link("100mbit")` limits the link to that rate in each direction (a token bucket filter,
`tc ... tbf`, on both ends; `limit_link(None)` lifts it). Only the rate: `netem`, which adds
delay, is not available in this kernel. `aliases={"name": host}` adds names (a headless
service's, say) that resolve to that host's link address on both hosts.

`own_hostname_address={0: "127.0.1.1", 1: "127.0.1.1"}` makes each host's hostname resolve, on
that host, to 127.0.1.1 instead (as Debian's /etc/hosts does), and gloo (without
GLOO_SOCKET_IFNAME) then listens on loopback. Seen with torch 2.13 and 2 ranks: with both hosts
so, the rank that dials gets "Connection refused" and exits while its peer hangs in
connectFullMesh; with only one host so, training still works, because the rank whose address
sorts higher (127.0.1.1 > 10.213.7.x) is the one that dials, so nobody dials the loopback one.

Needs root, `ip` and `tc` (iproute2) and `unshare` (util-linux); `unavailable_reason()` says why not.
Namespace names carry the pid, so several test sessions can run at once. Teardown kills every
process left in the namespaces, deletes them (which removes the veth pair) and their
/etc/netns folders; namespaces left by a session that died are removed by the next one.
"""

import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

IFNAME = "ddp0"
ADDRESSES = ("10.213.7.1", "10.213.7.2")
PREFIX_LENGTH = 24
HOSTNAMES = ("node0", "node1")
NETNS_RUN = Path("/run/netns")
NETNS_ETC = Path("/etc/netns")
_NAME = re.compile(r"^ddpt-(\d+)-\d+-[01]$")  # ddpt-<pid>-<instance>-<host>
_instances = itertools.count()


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be used here (not root, tools missing, or creation failed)."""


def unavailable_reason():
    """Why this machine cannot host the namespaces, or None when it (probably) can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc", "unshare", "hostname") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (iproute2, util-linux)"
    return None


def _ip(*args, check=True):
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _tc(namespace, *args, check=True):
    result = subprocess.run(["tc", "-n", namespace, *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetnsUnavailable(f"tc {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")


def rate_bits(rate):
    """Bits per second of a tc rate such as "100mbit"."""
    match = _RATE.match(rate)
    if not match:
        raise ValueError(f"link rate {rate!r}: expected a number and bit, kbit, mbit or gbit (e.g. 100mbit)")
    return int(float(match.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[match.group(2)])


def pid_alive(pid):
    """Whether process `pid` exists (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_processes_in(namespace):
    """SIGKILL every process in `namespace`; True when none is left."""
    for _ in range(50):
        result = _ip("netns", "pids", namespace, check=False)
        pids = [int(pid) for pid in result.stdout.split()] if result.returncode == 0 else []
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return False


def _delete_namespace(namespace):
    _kill_processes_in(namespace)
    if (NETNS_RUN / namespace).exists():
        _ip("netns", "delete", namespace, check=False)
    shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)


def remove_stale_namespaces():
    """Delete namespaces this harness made in sessions whose process no longer exists."""
    names = {p.name for p in NETNS_RUN.iterdir()} if NETNS_RUN.is_dir() else set()
    names |= {p.name for p in NETNS_ETC.iterdir()} if NETNS_ETC.is_dir() else set()
    for name in sorted(names):
        match = _NAME.match(name)
        if match and not pid_alive(int(match.group(1))):
            _delete_namespace(name)


class TwoHosts:
    """Context manager: two network namespaces ("hosts") joined by one veth pair."""

    def __init__(self, own_hostname_address=None, aliases=None):
        """`own_hostname_address`: {host index: address its own hostname resolves to there};
        `aliases`: {extra name: host index}."""
        instance = next(_instances)
        self.namespaces = tuple(f"ddpt-{os.getpid()}-{instance}-{host}" for host in (0, 1))
        self.hostnames = HOSTNAMES
        self.addresses = ADDRESSES
        self.ifname = IFNAME
        self.own_hostname_address = dict(own_hostname_address or {})
        self.aliases = dict(aliases or {})
        self._processes = []

    def __enter__(self):
        self.setup()
        return self

    def __exit__(self, *exc_info):
        self.teardown()

    def setup(self):
        """Create both namespaces and the link; raises NetnsUnavailable (after cleaning up) on failure."""
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        remove_stale_namespaces()
        try:
            self._create()
        except BaseException:
            self.teardown()
            raise

    def _create(self):
        ns0, ns1 = self.namespaces
        for namespace in self.namespaces:
            _ip("netns", "add", namespace)
        # Created directly inside the namespaces: the name never exists on the machine itself.
        _ip("link", "add", IFNAME, "netns", ns0, "type", "veth", "peer", "name", IFNAME, "netns", ns1)
        for host, namespace in enumerate(self.namespaces):
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "link", "set", IFNAME, "addrgenmode", "none")  # no IPv6 link-local
            _ip("-n", namespace, "addr", "add", f"{ADDRESSES[host]}/{PREFIX_LENGTH}", "dev", IFNAME)
            _ip("-n", namespace, "link", "set", IFNAME, "up")
            self._write_hosts_file(namespace, self.hosts_file(host))
        # A command in each namespace proves that `ip netns exec` + `unshare --uts` work here.
        for host in (0, 1):
            result = self.run(host, ["hostname"], timeout=30)
            if result.returncode != 0 or result.stdout.strip() != self.hostnames[host]:
                raise NetnsUnavailable(f"cannot run a command on host {host}: {result.stdout}{result.stderr}")

    @staticmethod
    def _write_hosts_file(namespace, text):
        for _ in range(3):  # another session's teardown may remove an empty /etc/netns meanwhile
            try:
                (NETNS_ETC / namespace).mkdir(parents=True, exist_ok=True)
                (NETNS_ETC / namespace / "hosts").write_text(text)
                return
            except FileNotFoundError:
                continue
        raise NetnsUnavailable(f"cannot write {NETNS_ETC / namespace / 'hosts'}")

    def hosts_file(self, host):
        """The /etc/hosts that processes on `host` see."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        for other in (0, 1):
            address = ADDRESSES[other]
            if other == host:
                address = self.own_hostname_address.get(host, address)
            lines.append(f"{address}\t{self.hostnames[other]}")
        lines += [f"{ADDRESSES[target]}\t{name}" for name, target in self.aliases.items()]
        return "\n".join(lines) + "\n"

    def teardown(self):
        """Kill everything left on the hosts, delete the namespaces, the link and /etc/netns entries."""
        for process in self._processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for namespace in self.namespaces:
            _delete_namespace(namespace)
        for process in self._processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._processes.clear()
        try:
            NETNS_ETC.rmdir()  # only when no other session still uses it
        except OSError:
            pass

    def limit_link(self, rate):
        """Limit the link to `rate` each way (tc units: "1gbit", "100mbit", "20mbit"); None: no limit."""
        for namespace in self.namespaces:
            if rate is None:
                _tc(namespace, "qdisc", "del", "dev", IFNAME, "root", check=False)  # none set: fine
                continue
            # The bucket holds 10 ms of traffic (at least 64 KiB): the kernel refills it once a
            # tick, and a bucket smaller than a tick's worth would cap the rate below `rate`.
            burst = max(64 * 1024, rate_bits(rate) // 8 // 100)
            _tc(namespace, "qdisc", "replace", "dev", IFNAME, "root", "tbf", "rate", rate, "burst", str(burst),
                "latency", "100ms")  # fmt: skip

    def kill_host(self, host):
        """SIGKILL every process on `host`, as if the machine had gone (the link stays up)."""
        if not _kill_processes_in(self.namespaces[host]):
            raise RuntimeError(f"processes on host {host} survived SIGKILL")

    def command(self, host, args):
        """`args` wrapped to run on `host`: in its network namespace, with its hostname."""
        set_hostname = 'hostname "$0" && exec "$@"'
        wrapper = ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "sh", "-c", set_hostname]
        return [*wrapper, self.hostnames[host], *map(str, args)]

    def popen(self, host, args, env=None, **kwargs):
        """Start `args` on `host` (os.environ plus `env`) in a session of its own; killed at teardown."""
        kwargs.setdefault("start_new_session", True)
        process = subprocess.Popen(self.command(host, args), env={**os.environ, **(env or {})}, **kwargs)
        self._processes.append(process)
        return process

    def run(self, host, args, env=None, timeout=60, **kwargs):
        """Run `args` on `host` to the end (text output captured); a hang past `timeout` raises."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        command = self.command(host, args)
        return subprocess.run(command, env={**os.environ, **(env or {})}, timeout=timeout, **kwargs)
