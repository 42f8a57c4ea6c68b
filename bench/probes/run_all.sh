#!/usr/bin/env bash
# Every probe, one after another (about 75-90 min on the 2-core VM); logs and JSON in bench/probes/out/.
#   bench/probes/run_all.sh [TAG]      # ai-dynamo 1.4.2 (.venv) and, if built, 1.6.1 (.venv-dynamo16)
# Run it on a quiet machine: other load on the 2 cores widens every spread (see docs/data/dynamo-cpu-profile-2026-12-02.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
D16=.venv-dynamo16/bin/python
OUT=bench/probes/out
TAG=${1:-}
mkdir -p $OUT
run() { echo "=== $* ($(date +%T), load $(cut -d' ' -f1 /proc/loadavg))"; "$@"; }
{
run $PY bench/probes/q34_worker.py --rounds 7 --tag="$TAG" --variants on/1,off/1,on/50,off/50,on/1/pertokendetok,on/50/pertokendetok
run $PY bench/probes/q1_client.py --kind mocker --rounds 9 --tag="$TAG"
run $PY bench/probes/q1_client.py --kind nocompute --rounds 7 --tag="$TAG"
run $PY bench/probes/q2_knobs.py --kind nocompute --rounds 7 --tag="$TAG"
run $PY bench/probes/q2_knobs.py --kind mocker --rounds 7 --tag="$TAG"
run $PY bench/probes/q2_fields.py --kind mocker --rounds 9 --tag="$TAG"
run $PY bench/probes/q2_fields.py --kind nocompute --rounds 9 --tag="$TAG"
run $PY bench/probes/detok_bench.py
run $PY bench/probes/q5_shim.py --rounds 7
run $PY bench/probes/q_len.py --kind mocker --rounds 5 --tag="$TAG"
run $PY bench/probes/idle.py --seconds 60 --tag="$TAG"
run $PY bench/probes/prof.py --kind nocompute --seconds 10 --tag="$TAG"
run $PY bench/probes/prof.py --kind nocompute --tokens-per-chunk 50 --seconds 10 --tag="$TAG"
run $PY bench/probes/prof.py --kind mocker --seconds 10 --tag="$TAG"
if [[ -x $D16 ]]; then
  run $PY bench/probes/q34_worker.py --rounds 7 --python $D16 --tag="$TAG" --variants on/1,on/1/push,off/1,on/50,on/50/push
  run $PY bench/probes/q1_client.py --kind mocker --rounds 7 --python $D16 --tag="$TAG"
  run $PY bench/probes/q1_client.py --kind nocompute --rounds 7 --python $D16 --tag="$TAG"
  run $PY bench/probes/q2_knobs.py --kind nocompute --rounds 5 --python $D16 --tag="$TAG"
  run $PY bench/probes/q2_fields.py --kind mocker --rounds 9 --python $D16 --tag="$TAG"
  run $PY bench/probes/q2_fields.py --kind nocompute --rounds 9 --python $D16 --tag="$TAG"
  run $PY bench/probes/check_equal.py --python $D16 --push
  run $PY bench/probes/idle.py --seconds 60 --python $D16 --tag="$TAG"
fi
} 2>&1 | tee $OUT/run_all$TAG.log
