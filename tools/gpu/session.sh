#!/usr/bin/env bash
# One GPU session as three device calls made back to back (a machine stays warm only ~30 s, so
# prepare all three before the first; about 1,400 s of device time with start-up):
#
#   1. carry .gpu-wheels/part1 .gpu-wheels/rb                 bash tools/gpu/session.sh weightsync
#   2. carry .gpu-wheels/part2 .gpu-wheels/part3 .gpu-wheels/rb  bash tools/gpu/session.sh fanout
#   3. carry .gpu-wheels/rb                                   bash tools/gpu/session.sh tier
#
# Before: the shared recipe's wheelhouse (.gpu-wheels/part1..3) and our wheel
# (`pip wheel --no-deps -w .gpu-wheels/rb .`). Each stage unpacks the parts it was sent
# (run-gpu.sh --install-only), exits at once if a part sent earlier is missing (the machine was
# released in between: start again from stage 1), makes the Qwen2.5-0.5B-shaped model once, and
# writes into $OUT (at most 8 files come back). Budgets (seconds, start-up included) leave room
# under the 600 s limit of one call: WS_BUDGET 270, FANOUT_BUDGET 510, TIER_BUDGET 420.
#
# One GPU: weight sync runs tensors and disk against their raw baselines (nccl needs a second GPU);
# the fan-out puts both workers on GPU 0 and runs the gsm8k rows, Dynamo at stream interval 50 only
# (FANOUT_WORKLOADS / FANOUT_EXTRA to change). Two GPUs: the 2-GPU plans of each benchmark.
set -uo pipefail
stage=${1:?usage: session.sh weightsync|fanout|tier}
: "${OUT:?set OUT}"
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
export PYTHONUNBUFFERED=1
bash tools/gpu/run-gpu.sh --install-only >"$OUT/install-$stage.log" 2>&1 || { tail -20 "$OUT/install-$stage.log"; exit 2; }
tail -3 "$OUT/install-$stage.log"
export PYTHONPATH=${SITE:-/tmp/site} CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TOKENIZERS_PARALLELISM=false
export PATH=$PATH:$CUDA_HOME/bin:$(dirname "$(command -v python3)")
unset CUDA_VISIBLE_DEVICES
ngpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c . || true)
nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv,noheader || true
cd /tmp   # a neutral folder: the checkout's rollout_backends/ must not shadow the installed wheel

need() { python3 -c "import $1" 2>/dev/null || { echo "session.sh: $1 is missing: was the machine released? start again from stage 1" >&2; exit 3; }; }
MODEL=/tmp/rb-bench/qwen2.5-0.5b
model() {
  [ -f "$MODEL/model.safetensors" ] && return 0
  python3 -m rollout_backends.adapters.reference.make_model "$MODEL" --size qwen2.5-0.5b --seed 0 >"$OUT/model.log" 2>&1 \
    || { tail -20 "$OUT/model.log"; exit 4; }
}

case "$stage" in
  weightsync)
    need sglang; need rollout_backends._bench.weightsync; model
    gpus=0; [ "${ngpus:-0}" -ge 2 ] && gpus=0,1
    python3 -m rollout_backends._bench.weightsync --engine sglang --model-size qwen2.5-0.5b --model-path "$MODEL" \
      --gpus "$gpus" --budget-s "${WS_BUDGET:-270}" --out "$OUT/weightsync" 2>&1 | tee "$OUT/weightsync.log" | tail -40
    ;;
  fanout)
    need sglang; need dynamo.frontend; need smg; need rollout_backends._bench.fanout; model
    if [ "${ngpus:-0}" -ge 2 ]; then gpus=0,1; extra=(); else gpus=0,0; extra=(--no-default-interval); fi
    # Priority order (a tight budget drops the tail): baseline, smg, Dynamo KV rows, adapter vs direct, Dynamo rr.
    python3 -m rollout_backends._bench.fanout --engine sglang --model-size qwen2.5-0.5b --model-path "$MODEL" \
      --workers 2 --gpus "$gpus" "${extra[@]}" --workloads ${FANOUT_WORKLOADS:-gsm8k} \
      --backends "sglang rr" "smg cache_aware" "dynamo kv" "dynamo kv+predict" "dynamo rr" ${FANOUT_EXTRA:-} \
      --budget-s "${FANOUT_BUDGET:-510}" --out "$OUT/fanout" 2>&1 | tee "$OUT/fanout.log" | tail -50
    ;;
  tier)
    need sglang; need dynamo.frontend; need smg
    cd "$root" && BUDGET=${TIER_BUDGET:-420} OUT="$OUT/tier" bash tools/gpu/run-gpu.sh 2>&1 | tail -60
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
