#!/usr/bin/env bash
# Install what the generated project's SLURM tests need: a real SLURM (controller, node daemon,
# client commands) and munge, from Debian/Ubuntu packages, plus iproute2 and util-linux for the
# multi-host tests. The tests start the daemons themselves, without systemd, and skip with a
# reason when these are missing.
#
# Idempotent: quick when everything is there. As a non-root user, or without apt-get, it
# changes nothing: it prints one line and exits 0 (the tests that need root then skip).
set -euo pipefail

packages=(slurmd slurmctld slurm-client munge iproute2 util-linux)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q '^install ok installed$'; }

missing=()
for package in "${packages[@]}"; do
    installed "$package" || missing+=("$package")
done
(( ${#missing[@]} == 0 )) && exit 0
if (( EUID != 0 )) || ! command -v apt-get >/dev/null; then
    why=$( (( EUID != 0 )) && echo "not root" || echo "no apt-get")
    echo "install-cluster-deps.sh: $why, not installing ${missing[*]}; tests that need them will skip" >&2
    exit 0
fi

echo "install-cluster-deps.sh: installing ${missing[*]}" >&2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
export DEBIAN_FRONTEND=noninteractive
# Wait for another apt or dpkg (another job on this machine) rather than fail at once.
apt=(apt-get -q -y -o DPkg::Lock::Timeout=300 -o Dpkg::Use-Pty=0)
# Without systemd the packages' scripts cannot start the services and only say so; the output
# is shown only when something fails.
if ! { "${apt[@]}" update && "${apt[@]}" install --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "install-cluster-deps.sh: apt-get failed (above)" >&2
    exit 1
fi
