#!/usr/bin/env bash
# The newer engines on the GPU machine (issue 30; vLLM for issue 31), from the checkout root, after
# the bundles of tools/gpu/build-bundles.sh travelled (see docs/versions.md, "GPU calls"):
#
#   OUT=... bash tools/gpu/newer-engines.sh stash              # install what came (a chunk), nothing else
#   OUT=... bash tools/gpu/newer-engines.sh dyn16 [0.5.16|0.5.17|both]
#       ai-dynamo 1.6.1 frontend + stock dynamo.sglang over SGLang 0.5.16 (and/or 0.5.17): starts?
#       greedy ids equal to SGLang direct of the same version, and disk weight updates, through the
#       library (tools/gpu/library_check.py: sglang:// vs dynamo://)
#   OUT=... bash tools/gpu/newer-engines.sh tier16 [run-gpu.sh args, e.g. --dynamo16-shim]
#       the GPU tier (tools/gpu/run-gpu.sh) with a 1.6.1 Dynamo fleet (dynamo16-rr, stock
#       dynamo.sglang over SGLang 0.5.16; through our shim with --dynamo16-shim) next to the 1.4.2
#       one; results in $OUT/tier16/
#   OUT=... bash tools/gpu/newer-engines.sh vllm [dynamo-only]
#       vLLM 0.26.0 OpenAI server (VLLM_SERVER_DEV_MODE=1), then ai-dynamo 1.4.2's dynamo.vllm
#       behind a 1.4.2 frontend; $VLLM_CAPTURE / $DYNAMO_VLLM_CAPTURE (issue 31's capture commands)
#       run against each with VLLM_URL / DYNAMO_URL, DYNAMO_SYSTEM_URL, MODEL, OUT set; without
#       them one greedy token-prompt request per server is saved.
#
# Every stage writes $OUT/<stage>.log (also on stdout) and $OUT/<stage>-logs.tgz (every server's log,
# the tracebacks first), so a server that does not start leaves its evidence. Stages exit 3 at once
# when a bundle they need is not installed (a chunk or part was not sent, or the machine was
# released between calls). Servers run in their own sessions and are stopped at the end.
set -uo pipefail
stage=${1:?usage: newer-engines.sh stash|dyn16 [0.5.16|0.5.17|both]|tier16|vllm [dynamo-only]}
: "${OUT:?set OUT}"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
W=/tmp/newer-engines
mkdir -p "$W/logs"
exec > >(tee -a "$OUT/$stage.log") 2>&1
T0=$(date +%s)
log() { echo "[newer-engines $stage +$(( $(date +%s) - T0 ))s] $*"; }

# NVLink multicast stays off (shared hosts), in every process started from here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH=$PATH:$CUDA_HOME/bin:$(dirname "$(command -v python3)")   # nvcc, ninja for JIT kernels
DYN_PLANES=(--discovery-backend file --request-plane tcp --event-plane zmq)
# The GPU tier's SGLang flags (bench/rb_bench/gpu_tier.py): two engines share the GPU here.
SGL_FLAGS=(--attention-backend triton --sampling-backend pytorch --disable-cuda-graph --page-size 16
           --mem-fraction-static 0.2 --max-total-tokens 65536)
# The allowlist the library's launcher gives 1.6.x workers (adapters/dynamo/_commands.py SGLANG_ENGINE_ROUTES_ENV).
ENGINE_ROUTES="flush_cache init_weights_update_group destroy_weights_update_group abort_request:tm"
M0=/tmp/m/tiny M1=/tmp/m/tiny-s1

bash "$ROOT/tools/gpu/run-gpu.sh" --install-only > "$W/install-rb.log" 2>&1 || { tail -20 "$W/install-rb.log"; exit 2; }
bash "$ROOT/tools/gpu/install-bundles.sh" || log "some bundle failed its import check (above)"
[ "$stage" = stash ] && exit 0
# Every process from here starts in a neutral folder: from the checkout root, Python puts the
# checkout's rollout_backends/ (adapters/ sits beside it; only the wheel maps it in) ahead of the
# installed wheel for `python3 -m` and `-c` ("No module named 'rollout_backends.adapters'", H100
# call 7, 2026-12-05). Scripts are named by $ROOT; VLLM_CAPTURE / DYNAMO_VLLM_CAPTURE get ROOT.
cd "$W" || exit 2
export ROOT

start() {  # start NAME ENV... -- CMD...: own session, log $W/logs/NAME.log, pid $W/NAME.pid
  local name=$1; shift
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  setsid env "${envs[@]}" "$@" > "$W/logs/$name.log" 2>&1 < /dev/null &
  echo $! > "$W/$name.pid"
  log "started $name (pid $!): ${envs[*]} $*"
}
stop() { local n; for n in "$@"; do [ -e "$W/$n.pid" ] && kill -- -"$(cat "$W/$n.pid")" 2>/dev/null; rm -f "$W/$n.pid"; done; sleep 3; }
up() { python3 -c 'import sys, urllib.request as u
b = u.urlopen(sys.argv[1], timeout=5).read().decode(); sys.exit(0 if len(sys.argv) < 3 or sys.argv[2] in b else 1)' "$@"; }
wait_up() {  # wait_up NAME[,NAME] SECONDS CHECK...: poll until CHECK holds, a process dies, or time runs out
  local names=${1//,/ } limit=$2 t n; t=$(date +%s); shift 2
  until "$@" >/dev/null 2>&1; do
    for n in $names; do
      if ! kill -0 "$(cat "$W/$n.pid" 2>/dev/null)" 2>/dev/null; then
        log "$n died after $(( $(date +%s) - t )) s; its log ends:"; tail -n 60 "$W/logs/$n.log" | cut -c1-400; return 1; fi
    done
    if (( $(date +%s) - t > limit )); then
      log "not up after $limit s; logs end:"; for n in $names; do tail -n 30 "$W/logs/$n.log" | cut -c1-400; done; return 1; fi
    sleep 1
  done
  log "$names up after $(( $(date +%s) - t )) s"
}
collect() {  # every log to $OUT, the tracebacks and error lines first
  { for f in "$W"/logs/*.log; do
      [ -e "$f" ] || continue
      echo "=== $f"; grep -n -E -A12 "Traceback|Error|error:|panicked|FAILED" "$f" | head -n 200
    done; } > "$W/logs/00-errors.txt" 2>/dev/null
  tar -czf "$OUT/$stage-logs.tgz" -C "$W" logs 2>/dev/null
  ls -la "$OUT"
}
trap 'for p in "$W"/*.pid; do [ -e "$p" ] && kill -- -"$(cat "$p")" 2>/dev/null; done; collect' EXIT
need() { bash "$ROOT/tools/gpu/install-bundles.sh" --need "$@" > /dev/null || { log "missing bundle(s): $* (start again from the first call)"; exit 3; }; }
models() {
  [ -f "$M0/model.safetensors" ] || PYTHONPATH=/tmp/site python3 -m rollout_backends.adapters.reference.make_model "$M0" --seed 0 > /dev/null
  [ -f "$M1/model.safetensors" ] || PYTHONPATH=/tmp/site python3 -m rollout_backends.adapters.reference.make_model "$M1" --seed 1 > /dev/null
}

dyn16_over() {  # dyn16_over SGLANG_VERSION SITES: SGLang direct, then 1.6.1 frontend + stock worker
  local v=$1 path=$2 rc=0
  log "== ai-dynamo 1.6.1 over SGLang $v (PYTHONPATH=$path)"
  PYTHONPATH=$path python3 -c 'import importlib.metadata as m, dynamo.sglang as d, dynamo._core as c, sglang
print({p: m.version(p) for p in ("ai-dynamo", "ai-dynamo-runtime", "sglang", "sglang-kernel", "transformers")})
print(d.__file__, c.__file__, sglang.__file__)' || return 1
  start "sglang-$v" PYTHONPATH="$path" -- python3 -m sglang.launch_server --model-path "$M0" --served-model-name tiny \
    "${SGL_FLAGS[@]}" --host 127.0.0.1 --port 30000
  wait_up "sglang-$v" 420 grep -q "ready to roll" "$W/logs/sglang-$v.log" || return 1
  rm -rf "$W/disc-$v"
  start "frontend-$v" PYTHONPATH="$path" DYN_FILE_KV="$W/disc-$v" DYN_SGLANG_ENABLE_GENERATE=1 -- \
    python3 -m dynamo.frontend --http-host 127.0.0.1 --http-port 8000 "${DYN_PLANES[@]}" --router-mode round-robin
  start "worker-$v" PYTHONPATH="$path" DYN_FILE_KV="$W/disc-$v" DYN_SYSTEM_PORT=8081 DYN_SYSTEM_HOST=127.0.0.1 \
    DYN_SGLANG_ENGINE_ROUTES="$ENGINE_ROUTES" CUDA_VISIBLE_DEVICES=0 -- \
    python3 -m dynamo.sglang --model-path "$M0" --served-model-name tiny "${SGL_FLAGS[@]}" \
    "${DYN_PLANES[@]}" --kv-events-config '{"publisher":"zmq","topic":"kv-events","endpoint":"tcp://*:5557"}'
  if wait_up "worker-$v,frontend-$v" 420 up http://127.0.0.1:8000/v1/models '"tiny"'; then
    PYTHONPATH=/tmp/site python3 "$ROOT/tools/gpu/library_check.py" --ref sglang://127.0.0.1:30000 \
      --test "dynamo://127.0.0.1:8000?workers=127.0.0.1:8081" --model "$M0" --alt "$M1" \
      --out "$OUT/dyn16-sglang-$v.json" || rc=1
  else
    rc=1
  fi
  stop "worker-$v" "frontend-$v" "sglang-$v"
  return $rc
}

case "$stage" in
  dyn16)
    need part1 dyn161   # ai-dynamo 1.6.1 brings its own runtime: part2 (1.4.2) is not needed
    models
    rc=0
    which=${2:-both}
    if [ "$which" != 0.5.17 ]; then dyn16_over 0.5.16 /tmp/site-dyn161:/tmp/site || rc=1; fi
    if [ "$which" != 0.5.16 ]; then
      need sgl0517
      dyn16_over 0.5.17 /tmp/site-dyn161:/tmp/site-sgl0517:/tmp/site || rc=1
    fi
    log "done, exit $rc"; exit $rc
    ;;
  tier16)
    need part1 part2 part3 dyn161
    # The 1.6.1 fleet's interpreter: ai-dynamo 1.6.1 first, the rest (SGLang 0.5.16, ours) from /tmp/site.
    wrapper=/tmp/site-dyn161/python-dyn16
    printf '#!/bin/sh\nPYTHONPATH=/tmp/site-dyn161${PYTHONPATH:+:$PYTHONPATH} exec %s "$@"\n' "$(command -v python3)" > "$wrapper"
    chmod +x "$wrapper"
    "$wrapper" -c 'import dynamo.sglang, dynamo._core; print("dynamo16 fleet runs", dynamo.sglang.__file__)' || exit 3
    BUDGET=${BUDGET:-500} OUT="$OUT/tier16" bash "$ROOT/tools/gpu/run-gpu.sh" --dynamo16-python "$wrapper" "${@:2}"
    rc=$?; log "done, exit $rc"; exit $rc
    ;;
  vllm)
    need vllm
    models
    VARGS=(--model "$M0" --served-model-name tiny --dtype bfloat16 --seed 0 --enforce-eager
           --gpu-memory-utilization 0.25 --max-model-len 4096 --attention-backend "${VLLM_ATTN:-FLASH_ATTN}")
    rc=0
    PYTHONPATH=/tmp/site-vllm python3 -c 'import importlib.metadata as m; print({p: m.version(p) for p in ("vllm", "transformers", "torch", "fastapi", "starlette", "pydantic")})'
    if [ "${2:-}" != dynamo-only ]; then
    start vllm PYTHONPATH=/tmp/site-vllm VLLM_SERVER_DEV_MODE=1 CUDA_VISIBLE_DEVICES=0 -- \
      python3 -m vllm.entrypoints.openai.api_server "${VARGS[@]}" --host 127.0.0.1 --port 8100
    if wait_up vllm 420 up http://127.0.0.1:8100/v1/models '"tiny"'; then
      if [ -n "${VLLM_CAPTURE:-}" ]; then
        VLLM_URL=http://127.0.0.1:8100 MODEL=$M0 OUT=$OUT bash -c "$VLLM_CAPTURE" || rc=1
      else
        python3 -c 'import json, sys, urllib.request as u
q = u.Request(sys.argv[1], json.dumps({"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 16, "temperature": 0,
    "logprobs": 1, "return_token_ids": True}).encode(), {"Content-Type": "application/json"})
print(u.urlopen(q, timeout=120).read().decode())' http://127.0.0.1:8100/v1/completions > "$OUT/vllm-greedy.json" || rc=1
      fi
    else
      rc=1
    fi
    stop vllm
    fi
    if bash "$ROOT/tools/gpu/install-bundles.sh" --need part2 > /dev/null; then
      path=/tmp/site-vllm:/tmp/site
      rm -rf "$W/disc-vllm"
      start frontend-vllm PYTHONPATH=$path DYN_FILE_KV="$W/disc-vllm" -- \
        python3 -m dynamo.frontend --http-host 127.0.0.1 --http-port 8000 "${DYN_PLANES[@]}" --router-mode round-robin
      start dynamo-vllm PYTHONPATH=$path DYN_FILE_KV="$W/disc-vllm" DYN_SYSTEM_PORT=8081 DYN_SYSTEM_HOST=127.0.0.1 \
        VLLM_SERVER_DEV_MODE=1 CUDA_VISIBLE_DEVICES=0 -- python3 -m dynamo.vllm "${VARGS[@]}" "${DYN_PLANES[@]}"
      if wait_up dynamo-vllm,frontend-vllm 420 up http://127.0.0.1:8000/v1/models '"tiny"'; then
        if [ -n "${DYNAMO_VLLM_CAPTURE:-}" ]; then
          DYNAMO_URL=http://127.0.0.1:8000 DYNAMO_SYSTEM_URL=http://127.0.0.1:8081 MODEL=$M0 OUT=$OUT \
            bash -c "$DYNAMO_VLLM_CAPTURE" || rc=1
        else
          python3 -c 'import json, sys, urllib.request as u
q = u.Request(sys.argv[1], json.dumps({"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 16, "temperature": 0,
    "logprobs": 0, "nvext": {"extra_fields": ["completion_token_ids", "worker_id"]}}).encode(), {"Content-Type": "application/json"})
print(u.urlopen(q, timeout=120).read().decode())' http://127.0.0.1:8000/v1/completions > "$OUT/dynamo-vllm-greedy.json" || rc=1
        fi
      else
        rc=1
      fi
      stop dynamo-vllm frontend-vllm
    else
      log "part2 (ai-dynamo 1.4.2) not installed here: dynamo.vllm not run"
    fi
    log "done, exit $rc"; exit $rc
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
