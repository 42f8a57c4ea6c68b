#!/usr/bin/env bash
# One GPU session of the routing benchmark as three device calls made back to back (a machine
# stays warm only ~30 s, so prepare all three before the first; ~1,500 s of device time with
# start-up on one H200):
#
#   1. carry .gpu-wheels/part1 .gpu-wheels/part3 .gpu-wheels/rb   bash tools/gpu/session.sh client
#   2. carry .gpu-wheels/part2 .gpu-wheels/pyspy .gpu-wheels/rb   bash tools/gpu/session.sh main
#   3. carry .gpu-wheels/rb                                        bash tools/gpu/session.sh layers
#
# (part1 + part3 + our wheel + the checkout are ~66 MB, just under a call's 64 MiB.)
# Before: the shared recipe's wheelhouse (.gpu-wheels/part1..3), our wheel
# (`pip wheel --no-deps -w .gpu-wheels/rb .`) and py-spy's wheel in .gpu-wheels/pyspy
# (`pip download --no-deps --only-binary=:all: --platform manylinux1_x86_64 -d .gpu-wheels/pyspy py-spy`).
# Each stage unpacks what it was sent (run-gpu.sh --install-only), exits at once if a part sent
# earlier is missing (the machine was released in between: start again from stage 1), makes the
# Qwen2.5-0.5B-shaped model once, and writes into $OUT/<stage>/ (benchmarks.md, results.json,
# fanout.png, fanout-logs.tar.gz) plus $OUT/<stage>.log.
#
# Stages (`python -m rb_bench.fanout` from bench/, both workers of every fleet on GPU 0 with one GPU):
#   client  our adapter vs raw aiohttp on the SGLang fleet (gsm8k)             BUDGET 300 s
#   main    sglang rr, smg cache_aware, dynamo rr / kv / kv+predict, gsm8k and
#           agentic; py-spy on the Dynamo fleet's hottest processes             BUDGET 520 s
#   layers  where the Dynamo path's time goes (stock worker, worker text, stream
#           interval, KV events, adapter vs raw), gsm8k at <= 256 new tokens    BUDGET 480 s
#   weightsync  tensors (flat buckets, per tensor, SGLang API, bare floors),
#           disk, nccl with two GPUs; needs part1 only                          BUDGET 240 s
#   grpo    issue 28: examples/grpo/grpo.py colocated, interleaved over sglang
#           direct / smg / dynamo rr / dynamo kv, one worker each on GPU 0;
#           needs part1, part2, part3 (send part1+part3 with weightsync first,
#           then part2 with this)                                               BUDGET 300 s
set -uo pipefail
stage=${1:?usage: session.sh client|main|layers|weightsync|grpo|tier|capture|miles-chat}
: "${OUT:?set OUT}"
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
export PYTHONUNBUFFERED=1
bash tools/gpu/run-gpu.sh --install-only >"$OUT/install-$stage.log" 2>&1 || { tail -20 "$OUT/install-$stage.log"; exit 2; }
tail -3 "$OUT/install-$stage.log"
export SITE=${SITE:-/tmp/site}
for w in .gpu-wheels/pyspy/*.whl; do
  [ -e "$w" ] && python3 -m pip install -q --no-deps --no-index --upgrade --target "$SITE" "$w" && echo "installed $(basename "$w")"
done
# The benchmarks run from the checkout's bench/ (not part of the wheel).
export PYTHONPATH=$SITE:$root/bench CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TOKENIZERS_PARALLELISM=false
export PATH=$PATH:$CUDA_HOME/bin:$(dirname "$(command -v python3)"):$SITE/bin
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
gpus=0,0; ws_gpus=0; [ "${ngpus:-0}" -ge 2 ] && { gpus=0,1; ws_gpus=0,1; }
fanout() {  # fanout NAME BUDGET ARGS...
  local name=$1 budget=$2; shift 2
  python3 -m rb_bench.fanout --engine sglang --model-size qwen2.5-0.5b --model-path "$MODEL" \
    --workers 2 --gpus "$gpus" --budget-s "$budget" --out "$OUT/$name" "$@" 2>&1 | tee "$OUT/$name.log" | tail -45
}

case "$stage" in
  client)
    need sglang; need smg; need rb_bench.fanout; model
    fanout client "${BUDGET:-300}" --rows "sglang rr raw" "sglang rr" --workloads gsm8k "${@:2}"
    ;;
  main)
    need sglang; need dynamo.frontend; need smg; model
    fanout main "${BUDGET:-520}" --preset main --args-differ warn --profile "dynamo rr" "${@:2}"
    ;;
  layers)
    need sglang; need dynamo.frontend; need smg; model
    fanout layers "${BUDGET:-480}" --preset layers --workloads gsm8k --max-new-tokens 256 --length-median 125 \
      --args-differ warn --profile "dynamo rr raw, stock worker" "${@:2}"
    ;;
  weightsync)
    need sglang; need rb_bench.weightsync; model
    python3 -m rb_bench.weightsync --engine sglang --model-size qwen2.5-0.5b --model-path "$MODEL" \
      --gpus "$ws_gpus" --budget-s "${BUDGET:-240}" --out "$OUT/weightsync" "${@:2}" 2>&1 | tee "$OUT/weightsync.log" | tail -40
    ;;
  grpo)
    need sglang; need dynamo.frontend; need smg; need transformers; model
    python3 -m rb_bench.grpo --engine sglang --model-path "$MODEL" --gpu 0 --budget-s "${BUDGET:-300}" \
      --out "$OUT/grpo" "${@:2}" 2>&1 | tee "$OUT/grpo.log" | tail -40
    ;;
  capture)  # raw SGLang /generate and Dynamo /v1/completions answers (the codec's fixtures), ~270 s
    need sglang; need dynamo.frontend
    python3 -m rb_bench.capture "$OUT/capture" --budget-s "${BUDGET:-260}" >"$OUT/capture.log" 2>&1
    tail -30 "$OUT/capture.log"; rm -rf "$OUT/capture/model"
    ;;
  miles-chat)  # issue 27: Miles' session through the facade over SGLang and Dynamo vs stock SGLang, ~300 s
    # Every worker on GPU 0 with one GPU (stock one worker, each facade two; rb_bench.miles_chat
    # repeats --gpus as needed). Rerun a subset: --targets facade-dynamo --baseline /abs/results.json
    need sglang; need dynamo.frontend; need smg; need rb_bench.miles_chat
    python3 -m rb_bench.miles_chat --out "$OUT/miles-chat" --gpus "$gpus" --budget-s "${BUDGET:-420}" "${@:2}" 2>&1 \
      | tee "$OUT/miles-chat.log" | tail -30
    ;;
  tier)
    need sglang; need dynamo.frontend; need smg
    cd "$root" && BUDGET=${BUDGET:-420} OUT="$OUT/tier" bash tools/gpu/run-gpu.sh 2>&1 | tail -60
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
