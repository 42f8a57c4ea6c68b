#!/usr/bin/env bash
# vLLM 0.26 on the GPU machine (issue 31), in tools/gpu/session.sh's style: one stage per device call,
# made back to back while the machine stays warm, from the checkout root:
#
#   OUT=... bash tools/gpu/vllm-session.sh capture   # raw answers of vLLM and dynamo.vllm     ~200 s
#   OUT=... bash tools/gpu/vllm-session.sh tier      # the conformance suite + SGLang<->vLLM   ~290 s
#   OUT=... bash tools/gpu/vllm-session.sh fanout    # RL fan-out: sglang rr, vllm rr,         ~360 s
#                                                    # dynamo-vllm rr on GPU 0 (issue 31 item 4)
#
# Before: vLLM's bundle (tools/gpu/build-bundles.sh vllm: chunks vllm-1, vllm-2, ..., one call
# each; tools/gpu/install-bundles.sh joins them once all came), the SGLang / Dynamo / smg parts
# (part1, part2; part1 also for the tier's SGLang server) and our wheel (.gpu-wheels/rb,
# `pip wheel --no-deps -w .gpu-wheels/rb .`). A stage exits 3 at once when vLLM or Dynamo is not
# importable (the machine was released in between: send the chunks again).
#
# Outputs under $OUT:
#   capture: vllm-0.26.0-answers.json, dynamo-vllm-1.4.2-answers.json, capture-logs.txt, capture.log
#            (copy the two answer files to tests/data/: tests/vllm/test_captured_answers.py reads them)
#   tier:    tier/conformance-results.{md,json}, tier/logs-tail.txt, tier/cross-engine-parity.json, tier.log
#   fanout:  fanout-vllm/{benchmarks.md,results.json,fanout.png,fanout-logs.tar.gz}, fanout.log
#            (needs part1-3 too: SGLang and smg for the baseline fleet, Dynamo's frontend)
set -uo pipefail
stage=${1:?usage: vllm-session.sh capture|tier|fanout}
: "${OUT:?set OUT}"
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
export PYTHONUNBUFFERED=1
bash tools/gpu/run-gpu.sh --install-only >"$OUT/install-$stage.log" 2>&1 || { tail -20 "$OUT/install-$stage.log"; exit 2; }
if [ -f tools/gpu/install-bundles.sh ]; then
  bash tools/gpu/install-bundles.sh --need vllm >>"$OUT/install-$stage.log" 2>&1 || { tail -20 "$OUT/install-$stage.log"; exit 3; }
fi
tail -3 "$OUT/install-$stage.log"
SITE=${SITE:-/tmp/site} VSITE=${VSITE:-/tmp/site-vllm}
# vLLM's site first: its pins (fastapi, starlette, openai, compressed-tensors) over SGLang's part1.
export PYTHONPATH=$VSITE:$SITE:$root/bench CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=$PATH:$CUDA_HOME/bin:$(dirname "$(command -v python3)")
unset CUDA_VISIBLE_DEVICES
ngpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c . || true)
nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv,noheader || true
cd /tmp   # a neutral folder: the checkout's rollout_backends/ must not shadow the installed wheel

need() { python3 -c "import $1" 2>/dev/null || { echo "vllm-session.sh: $1 is missing: was the machine released?" >&2; exit 3; }; }
need vllm; need dynamo.vllm; need rollout_backends.adapters.vllm
python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
gpus=0; [ "${ngpus:-0}" -ge 2 ] && gpus=0,1

case "$stage" in
  capture)
    python3 -m rb_bench.vllm_capture --out "$OUT" --budget-s "${BUDGET:-210}" "${@:2}" 2>&1 | tee "$OUT/capture.log" | tail -20
    ;;
  tier)
    python3 -m rb_bench.vllm_tier --out "$OUT/tier" --gpus "$gpus" --budget-s "${BUDGET:-290}" "${@:2}" 2>&1 \
      | tee "$OUT/tier.log" | tail -40
    ;;
  fanout)
    # Every fleet on GPU 0 at once, 2 workers each: 2 SGLang servers behind smg (the baseline), 2
    # vLLM servers (client-side round robin), 2 dynamo.vllm workers behind a frontend; each KV cache
    # holds --kv-tokens tokens (rb_bench.fanout's docstring: how memory is split). gsm8k only,
    # 8 prompts x 8 samples, lengths median 120 (max 256): a few seconds a step, so ~10+ blocks fit
    # after start-up. Only vLLM's processes get vLLM's site first (its web pins differ from SGLang's).
    export PYTHONPATH=$SITE:$root/bench
    python3 -c 'import sglang, smg, dynamo.frontend' \
      || { echo "vllm-session.sh: SGLang, smg or Dynamo is missing from $SITE (part1-3)" >&2; exit 3; }
    model=${MODEL:-/tmp/rb-bench/qwen2.5-0.5b}
    [ -f "$model/model.safetensors" ] || python3 -m rollout_backends.adapters.reference.make_model "$model" \
      --size qwen2.5-0.5b --seed 0 >/dev/null || exit 1
    python3 -m rb_bench.fanout --engine sglang --preset vllm --model-size qwen2.5-0.5b --model-path "$model" \
      --workers 2 --gpus 0,0 --workloads gsm8k --prompts 8 --samples 8 --max-new-tokens 256 --length-median 120 \
      --blocks 15 --kv-tokens 200000 --vllm-pythonpath "$VSITE:$SITE" --budget-s "${BUDGET:-300}" \
      --out "$OUT/fanout-vllm" "${@:2}" 2>&1 | tee "$OUT/fanout.log" | tail -30
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
