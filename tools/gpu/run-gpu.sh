#!/usr/bin/env bash
# The GPU tier of the conformance suite on the GPU machine, from the checkout root:
#
#   bash tools/gpu/run-gpu.sh [--install-only] [extra gpu_tier options, e.g. --check 'pause_*']
#
# Needs in /tmp/site (PYTHONPATH) the SGLang stack, Dynamo and smg: the .gpu-wheels/part{1,2,3}
# chunks of the shared GPU recipe. Chunks present in this checkout are unpacked here first
# (idempotent, same stamps as install-on-device.sh), so one call can carry part1
# (`--install-only`) and the next one part2 + part3 + our wheel, while the machine stays warm.
# Our wheel: .gpu-wheels/rb/rollout_backends-*.whl, built on the CPU machine with
#   pip wheel --no-deps -w .gpu-wheels/rb .
# Extra wheels in .gpu-wheels/rb/extra/*.whl (packages the image lacks) are installed too.
#
# Environment: OUT (results; default /tmp/gpu-tier-out), GPUS (default: 0,1 with 2+ GPUs, else 0),
# ENGINE (sglang | reference; default sglang), BUDGET (seconds for gpu_tier; default what is left
# of 575 s since this script started, at most 540), SITE (default /tmp/site).
# Results: $OUT/conformance-results.{md,json}, $OUT/logs-tail.txt; a summary on stdout.
set -uo pipefail
T0=$(date +%s)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)   # the checkout, wherever this is started from
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/gpu-tier-out}
ENGINE=${ENGINE:-sglang}
log() { echo "[run-gpu +$(( $(date +%s) - T0 ))s] $*"; }

install_only=0
if [ "${1:-}" = "--install-only" ]; then install_only=1; shift; fi

mkdir -p "$SITE" "$OUT"
OUT=$(cd "$OUT" && pwd)   # absolute: the run itself happens in another folder
# The GPU tier runs from the checkout's bench/ (rb_bench, not part of the wheel).
export PYTHONPATH=$SITE:$ROOT/bench${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
# ninja (the JIT kernel builds call it) sits next to python3; nvcc in CUDA_HOME.
export PATH=$PATH:$CUDA_HOME/bin:$(dirname "$(command -v python3)")
# NVLink multicast stays off (shared hosts), also in every process we start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# 1. the chunks of the SGLang / Dynamo / smg wheelhouse that travelled with this call
for t in "$ROOT"/.gpu-wheels/part*/*.tar.xz; do
  [ -e "$t" ] || continue
  stamp="$SITE/.installed-$(sha256sum "$t" | cut -c1-16)-$(basename "$t")"
  if [ -e "$stamp" ]; then log "$(basename "$t") already in $SITE"; continue; fi
  if command -v xz >/dev/null; then tar -xJf "$t" -C "$SITE"
  else python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$t" "$SITE"; fi
  touch "$stamp"; log "unpacked $(basename "$t") into $SITE"
done
for t in "$ROOT"/.gpu-wheels/jitcache/*.tar.xz; do   # optional kernel caches of an earlier run
  [ -e "$t" ] && tar -xJf "$t" -C "$HOME" && log "unpacked $(basename "$t") into $HOME"
done
ls "$SITE"/.installed-* 2>/dev/null | sed 's/^/present: /'

# 2. our wheel (and any extra wheels)
whl=$(ls "$ROOT"/.gpu-wheels/rb/rollout_backends-*.whl 2>/dev/null | tail -1)
if [ -n "$whl" ]; then
  python3 -m pip install --quiet --no-deps --no-index --upgrade --target "$SITE" "$whl" 2>&1 | grep -v -i "warning" \
    || true
  log "installed $(basename "$whl") into $SITE"
elif [ "$install_only" = 0 ] && ! ls "$SITE"/rollout_backends-*.dist-info >/dev/null 2>&1; then
  echo "run-gpu: no .gpu-wheels/rb/rollout_backends-*.whl here (pip wheel --no-deps -w .gpu-wheels/rb .)" >&2
  exit 2
elif [ "$install_only" = 0 ]; then
  log "using $(ls -d "$SITE"/rollout_backends-*.dist-info | xargs -n1 basename), installed by an earlier call"
fi
for w in "$ROOT"/.gpu-wheels/rb/extra/*.whl; do
  [ -e "$w" ] && python3 -m pip install --quiet --no-deps --no-index --upgrade --target "$SITE" "$w" && log "installed $(basename "$w")"
done
[ "$install_only" = 1 ] && { log "install only: done"; exit 0; }

# 3. run from a neutral folder: the checkout's rollout_backends/ must not shadow the wheel
RUN=$(mktemp -d /tmp/gpu-tier-run.XXXXXX)
cd "$RUN" || exit 2
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
python3 - "$ENGINE" <<'EOF' || { echo "run-gpu: a package is missing (see above); nothing was started" >&2; exit 3; }
import importlib, importlib.metadata as md, sys
engine = sys.argv[1]
need = ["attrs", "orjson", "aiohttp", "safetensors", "tokenizers", "transformers", "torch", "rb_bench.gpu_tier"]
if engine == "sglang":
    need += ["sglang", "sglang.srt.entrypoints.http_server", "dynamo.frontend", "dynamo.sglang", "smg"]
else:
    need += ["dynamo.frontend", "smg"]
missing = []
for mod in need:
    try:
        importlib.import_module(mod)
    except Exception as exc:  # noqa: BLE001 - report every missing piece at once
        missing.append(f"{mod}: {type(exc).__name__}: {exc}")
vers = {}
for dist in ("rollout-backends", "sglang", "ai-dynamo", "smg", "torch", "transformers", "attrs", "orjson", "aiohttp"):
    try:
        vers[dist] = md.version(dist)
    except md.PackageNotFoundError:
        vers[dist] = None
print("versions:", vers, flush=True)
for m in missing:
    print("MISSING", m, flush=True)
sys.exit(1 if missing else 0)
EOF
if [ -z "${GPUS:-}" ]; then
  n=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
  if [ "${n:-0}" -ge 2 ]; then GPUS=0,1; else GPUS=0; fi
fi
left=$(( 575 - ($(date +%s) - T0) ))
BUDGET=${BUDGET:-$(( left < 540 ? left : 540 ))}
log "gpu_tier: engine $ENGINE, GPUs $GPUS, budget ${BUDGET}s, results in $OUT"
python3 -m rb_bench.gpu_tier --out "$OUT" --engine "$ENGINE" --gpus "$GPUS" \
  --budget-s "$BUDGET" "$@"
rc=$?
cd / && rm -rf "$RUN"
ls -la "$OUT"
log "done (exit $rc)"
exit $rc
