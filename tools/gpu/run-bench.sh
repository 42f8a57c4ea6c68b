#!/usr/bin/env bash
# Both GPU benchmarks of issue 7 (RL fan-out routing, weight sync) in one command of about nine
# minutes on the 2-GPU H200 machine, writing into $OUT:
#   benchmarks.md (a section per benchmark), results.json, fanout.png, weightsync.png,
#   fanout-logs.tar.gz, weightsync-logs.tar.gz   (6 files, no folders)
#
# On a 1-GPU machine (found with nvidia-smi, or BENCHES / WEIGHTSYNC_GPUS set by hand) only weight
# sync runs, on GPU 0: tensors and disk against their raw baselines, nccl reported as not run:
#   OUT=... tools/gpu/run-bench.sh                                   # picks the 1-GPU defaults
#   OUT=... BENCHES=weightsync WEIGHTSYNC_GPUS=0 WEIGHTSYNC_BUDGET_S=240 tools/gpu/run-bench.sh
#   OUT=... BENCHES=fanout FANOUT_GPUS=0,0 tools/gpu/run-bench.sh    # both fan-out workers on GPU 0
#
# Needs: PYTHONPATH=/tmp/site already set up (SGLang 0.5.16, ai-dynamo 1.4.2, smg 1.13.0 unpacked
# by install-on-device.sh), run from the repository root. Time plan (seconds, --budget-s of each
# benchmark includes its fleets' start-up and teardown):
#   model (Qwen2.5-0.5B shapes, made once, reused by both)  ~25
#   fanout                                                   <= FANOUT_BUDGET_S (default 330)
#   weightsync                                               <= WEIGHTSYNC_BUDGET_S (default 110; 240 on 1 GPU)
# Each benchmark cuts or skips what does not fit its budget and says so in its table.
set -uo pipefail

: "${OUT:?set OUT to the output folder}"
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$root"

# NVLink multicast stays off on these shared hosts, in every process started from here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
# The benchmarks run from the checkout's bench/ (rb_bench, not part of the wheel).
export PYTHONPATH=${PYTHONPATH:-/tmp/site}:$root/bench
unset CUDA_VISIBLE_DEVICES  # the benchmarks place every process themselves (--gpus)
PY=${PYTHON:-python3}

# rollout_backends.adapters is the top-level adapters/ folder (setuptools package-dir); without
# an installed copy, give Python the same view through a tree of symlinks (as tools/typecheck.sh),
# and run from there: the checkout's own rollout_backends/ (no adapters in it) must not come first.
if ! "$PY" -c "import rollout_backends.adapters.sglang, rb_bench.fanout" 2>/dev/null; then
    stage=/tmp/rb-stage
    rm -rf "$stage"; mkdir -p "$stage/rollout_backends"
    for f in "$root"/rollout_backends/*; do ln -s "$f" "$stage/rollout_backends/$(basename "$f")"; done
    ln -s "$root/adapters" "$stage/rollout_backends/adapters"
    ln -s "$root/conformance_tests" "$stage/rollout_backends/conformance"
    export PYTHONPATH="$stage:$PYTHONPATH"
    cd "$stage"
fi
"$PY" -c "import rollout_backends.adapters.sglang, rb_bench.fanout" || exit 1

MODEL=${MODEL:-/tmp/rb-bench/qwen2.5-0.5b}
t0=$(date +%s)
if [ ! -f "$MODEL/model.safetensors" ]; then
    "$PY" -m rollout_backends.adapters.reference.make_model "$MODEL" --size qwen2.5-0.5b --seed 0 || exit 1
fi
echo "model ready: $MODEL ($(( $(date +%s) - t0 )) s)" >&2
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader >&2 || true

# One GPU: the fan-out's two workers need two; weight sync runs without nccl (NCCL refuses two
# ranks on one device) and has the time the fan-out would have used.
ngpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c . || true)
if [ "${ngpus:-0}" -le 1 ]; then
    BENCHES=${BENCHES:-weightsync}
    WEIGHTSYNC_GPUS=${WEIGHTSYNC_GPUS:-0}
    WEIGHTSYNC_BUDGET_S=${WEIGHTSYNC_BUDGET_S:-240}
fi
BENCHES=${BENCHES:-fanout weightsync}
echo "GPUs: ${ngpus:-?}; benchmarks: $BENCHES; weight sync on --gpus ${WEIGHTSYNC_GPUS:-0,1}" >&2

rc=0
if [[ " $BENCHES " == *" fanout "* ]]; then
    "$PY" -m rb_bench.fanout --engine sglang --model-size qwen2.5-0.5b --model-path "$MODEL" \
        --workers 2 --gpus "${FANOUT_GPUS:-0,1}" --budget-s "${FANOUT_BUDGET_S:-330}" --out "$OUT" ${FANOUT_ARGS:-} || rc=1
    echo "fanout done ($(( $(date +%s) - t0 )) s), rc=$rc" >&2
fi

if [[ " $BENCHES " == *" weightsync "* ]]; then
    "$PY" -m rb_bench.weightsync --engine sglang --model-size qwen2.5-0.5b --model-path "$MODEL" \
        --gpus "${WEIGHTSYNC_GPUS:-0,1}" --budget-s "${WEIGHTSYNC_BUDGET_S:-110}" --out "$OUT" \
        ${WEIGHTSYNC_ARGS:-} || rc=1
    echo "weightsync done ($(( $(date +%s) - t0 )) s), rc=$rc" >&2
fi

ls -la "$OUT" >&2
exit $rc
