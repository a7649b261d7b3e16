#!/usr/bin/env bash
# Create .venv with everything the demo and the tests need; quick when it is up to date.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
stamp=.venv/.requirements-dev.sha256
wanted=$(sha256sum requirements-dev.txt | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$wanted" && -x .venv/scanners/bin/checkov && -x .venv/skypilot/bin/sky ]]; then
    exit 0
fi
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
find_links=()
[[ -d /opt/wheels ]] && find_links=(--find-links /opt/wheels)  # local torch CPU wheel, where present
# uv, at the version requirements-dev.txt pins, installs the rest: the same packages as pip, in
# about half of pip's time on a fresh machine (parallel downloads and unpacking). Bytecode is
# compiled at install, as pip does, so that no test process compiles torch's modules again; files
# are copied from uv's cache, not hard-linked, so that .venv stands alone.
.venv/bin/python -m pip install --quiet --disable-pip-version-check "$(grep '^uv==' requirements-dev.txt)"
# All of requirements-dev.txt but checkov and skypilot, which go into .venv/scanners and .venv/skypilot,
# virtual environments of their own: their pinned dependencies would change some of those here
# (requirements-dev.txt).
.venv/bin/uv pip install --quiet --python .venv/bin/python --compile-bytecode --link-mode copy "${find_links[@]}" \
    -r <(grep -v -e '^checkov==' -e '^skypilot==' requirements-dev.txt)
[[ -x .venv/scanners/bin/python ]] || .venv/bin/uv venv --quiet --python .venv/bin/python .venv/scanners
.venv/bin/uv pip install --quiet --python .venv/scanners/bin/python --compile-bytecode --link-mode copy \
    "$(grep '^checkov==' requirements-dev.txt)"
[[ -x .venv/skypilot/bin/python ]] || .venv/bin/uv venv --quiet --python .venv/bin/python .venv/skypilot
.venv/bin/uv pip install --quiet --python .venv/skypilot/bin/python --compile-bytecode --link-mode copy \
    "$(grep '^skypilot==' requirements-dev.txt)"
echo "$wanted" >"$stamp"
