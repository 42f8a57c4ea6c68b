#!/usr/bin/env bash
# Build the wheel bundles that GPU calls carry (the GPU image has torch 2.11.0+cu130 and no package
# registry). Run on the CPU machine from the checkout root that the device calls send (the lead's:
# /work/main), with PyPI reachable:
#
#   bash tools/gpu/build-bundles.sh [BUNDLE...]     # default: all of them
#
# Each bundle is a folder of .gpu-wheels/ (ignored by git) holding one xz tarball, or its chunks,
# and a BUNDLE file (sourced by tools/gpu/install-bundles.sh on the GPU machine) naming the site it
# unpacks into, its sha256 and the modules that must import there. Every chunk folder fits one call
# (64 MiB with the ~8.3 MB checkout of 2026-12-06; CHUNK_MIB, default 52).
#
#   part1    SGLang 0.5.16 stack -> /tmp/site          } the pins of shared/gpu/build-wheelhouse.sh
#   part2    ai-dynamo 1.4.2     -> /tmp/site          } (2026-11-30), the same stamp scheme, so
#   part3    smg 1.13.0          -> /tmp/site          } run-gpu.sh / install-on-device.sh unpack them too
#   dyn161   ai-dynamo 1.6.1 + runtime 1.6.1 (--no-deps) -> /tmp/site-dyn161, layered before /tmp/site
#   sgl0517  what SGLang 0.5.17 changes over part1       -> /tmp/site-sgl0517, layered before /tmp/site
#   vllm     vLLM 0.26.0 (Hopper, FA3 + Triton attention) and what the image lacks -> /tmp/site-vllm,
#            chunks vllm-1, vllm-2, ... (one call each)
#
# Provenance: the download / install --target / prune / strip / tar steps and the part1-3 pins are
# those of shared/gpu/build-wheelhouse.sh; the other bundles' contents were found with
# tools/gpu/cpu-import-check.sh (docs/versions.md, "GPU bundles"). Needs: pip, tar, xz, strip, split.
set -euo pipefail

DEST=${DEST:-.gpu-wheels}
WHEEL_CACHE=${WHEEL_CACHE:-$HOME/.cache/gpu-wheels}
WORK=${WORK:-$(mktemp -d /tmp/gpu-bundles.XXXXXX)}
CHUNK_MIB=${CHUNK_MIB:-52}
PY=${PY:-python3}

PART1=(  # SGLang stack (shared/gpu/build-wheelhouse.sh PART1, unchanged)
  sglang==0.5.16 sglang-kernel==0.4.5 flashinfer-python==0.6.14 apache-tvm-ffi==0.1.11
  transformers==5.12.1 tokenizers==0.22.2 xgrammar==0.2.1
  pydantic==2.13.0 pydantic-core==2.46.0 annotated-types==0.8.0 typing-inspection==0.4.5
  fastapi==0.135.4 starlette==0.50.0 uvicorn==0.54.0 python-multipart==0.0.34
  orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 setproctitle==1.3.8 dill==0.4.1
  openai==2.6.1 distro==1.9.0 sniffio==1.3.1 partial-json-parser==0.2.1.1.post7
  compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0
  jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1
  soundfile==0.13.1 cffi==2.1.1 ipython==9.18.1 traitlets==5.16.1
)
PART2=(ai-dynamo==1.4.2 ai-dynamo-runtime==1.4.2 blake3==1.0.11)
PART3=(smg==1.13.0 grpcio-health-checking==1.85.1)
# ai-dynamo 1.6.1 with its runtime; what its frontend / dynamo.sglang import beyond part1 + part2
# (see DYN161_EXTRA) travels with it. Its own requirements are not installed (aisimulate does not
# build from PyPI; the sglang extra pins sglang 0.5.21, torch 2.13).
DYN161=(ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1 blake3==1.0.11)
# redis: dynamo/common/multimodal/shared_image_cache.py imports it at module level, and the decode
# handler imports that (found by tools/gpu/cpu-import-check.sh; 1.6.1 requires redis >= 6.2, < 9).
DYN161_EXTRA=(${DYN161_EXTRA:-redis==8.2.0})
# SGLang 0.5.17 over part1: only the packages whose pins differ from 0.5.16's (read from the wheels'
# METADATA; SGL0517_EXTRA adds more).
SGL0517=(sglang==0.5.17)
SGL0517_EXTRA=(${SGL0517_EXTRA:-})
VLLM=(  # vLLM 0.26.0 (pins torch 2.11.0) and what it imports that the image lacks or has too new/old
  vllm==0.26.0
  # the same versions as part1 where both need one (transformers: SGLang's, so both engines run
  # the same; vLLM wants >= 5.5.3)
  transformers==5.12.1 tokenizers==0.22.2 pydantic==2.13.0 pydantic-core==2.46.0 annotated-types==0.8.0
  typing-inspection==0.4.5 uvicorn==0.54.0 python-multipart==0.0.34 pybase64==1.5.1 msgspec==0.23.0
  pyzmq==27.3.0 setproctitle==1.3.8 distro==1.9.0 sniffio==1.3.1 partial-json-parser==0.2.1.1.post7
  xgrammar==0.2.1 blake3==1.0.11
  # vLLM's own pins / ranges (its METADATA): fastapi <0.137, starlette >= 1.0.1, tvm-ffi 0.1.10
  fastapi==0.136.3 starlette==1.0.1 apache-tvm-ffi==0.1.10 openai==2.54.0 jiter==0.19.0
  openai-harmony==0.0.8 llguidance==1.7.6 outlines-core==0.2.14 lark==1.2.2 lm-format-enforcer==0.11.3
  compressed-tensors==0.17.0 cachetools==8.0.2 cbor2==6.3.0 ijson==3.6.0 python-json-logger==4.2.0
  watchfiles==1.3.0 prometheus-fastapi-instrumentator==8.1.0
  model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0
  # vllm/distributed/weight_transfer/ipc_engine.py imports ray at module level (the ipc weight
  # transfer of issue 31's one-GPU tier); ray imports jsonschema (part1's versions)
  ray==2.60.0 jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1
)

TAGS=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform any --platform manylinux1_x86_64 --platform manylinux2014_x86_64)
for n in 5 17 24 26 27 28 31 34; do TAGS+=(--platform "manylinux_2_${n}_x86_64"); done

stage_of() { echo "$WORK/stage-$1"; }

install_stage() {  # install_stage NAME SPEC...: wheels (cached) unpacked into the bundle's staging tree
  local stage; stage=$(stage_of "$1"); shift
  rm -rf "$stage" && mkdir -p "$stage"
  "$PY" -m pip download -q --no-deps "${TAGS[@]}" -d "$WHEEL_CACHE" "$@"
  "$PY" -m pip install -q --no-deps --no-index --no-compile --find-links "$WHEEL_CACHE" \
      "${TAGS[@]}" --target "$stage" "$@"
}

prune_common() {  # what no run loads: scripts, byte code; debug symbols of the large extensions
  local stage=$1 so
  rm -rf "$stage"/bin
  find "$stage" -name __pycache__ -prune -exec rm -rf {} +
  # shared/gpu/build-wheelhouse.sh: dynamo's Rust core 173 -> 134 MB, xgrammar's bindings 53 -> 2 MB.
  for so in "$stage"/dynamo/_core.abi3.so "$stage"/xgrammar/libxgrammar_bindings.so "$stage"/smg/smg_rs.abi3.so \
            "$stage"/vllm/_C_stable_libtorch.abi3.so "$stage"/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so \
            "$stage"/ray/_raylet.so; do
    if [ -e "$so" ]; then strip --strip-unneeded "$so"; fi
  done
  rm -rf "$stage"/xgrammar/lib
}

prune_sglang() {  # a Hopper (sm90) run with --attention-backend triton (shared/gpu/build-wheelhouse.sh)
  local stage=$1
  rm -rf "$stage"/sgl_kernel/flash_ops*.so "$stage"/sgl_kernel/sm100 "$stage"/sgl_kernel/flashmla_ops*.so \
         "$stage"/sgl_kernel/infllm_ops*.so
}

prune_vllm() {
  # A Hopper run with FLASH_ATTN (FA3, the Hopper default; 147 MB stripped, ~11 MB packed) or
  # TRITON_ATTN. vllm/model_executor/layers/attention imports mm_encoder_attention -> fa_utils ->
  # vllm.vllm_flash_attn at import time on CUDA, which raises unless FA2 or FA3 loads, so FA3 stays.
  # Dropped, each optional where vLLM imports it (vllm/platforms/cuda.py import_kernels suppresses
  # ImportError for _moe_C / _qutlass_C): FA2 (305 MB, pre-Hopper), the MoE kernels (dense models
  # only), FlashMLA / QuTLASS (MLA models, FP4), the Rust frontend binary (VLLM_RUST_FRONTEND only),
  # DeepGEMM and the SM100 FMHA sources (FP8 GEMM, Blackwell).
  local v=$1/vllm r=$1/ray
  # ray: only `import ray` is needed (the ipc engine's http mode starts no cluster): its cluster
  # binaries (gcs_server, raylet), Java jars, RLlib / Data / Serve and the dashboard's web client go.
  rm -rf "$r"/jars "$r"/core/src/ray/gcs/gcs_server "$r"/core/src/ray/raylet/raylet "$r"/rllib "$r"/data \
         "$r"/serve "$r"/dashboard/client
  rm -rf "$v"/vllm_flash_attn/_vllm_fa2_C.abi3.so "$v"/_moe_C_stable_libtorch.abi3.so "$v"/_qutlass_C.abi3.so \
         "$v"/_flashmla_C.abi3.so "$v"/_flashmla_extension_C.abi3.so "$v"/vllm-rs \
         "$v"/third_party/deep_gemm "$v"/third_party/fmha_sm100
}

sgl0517_specs() {  # sglang 0.5.17 plus each of its pinned requirements whose pin differs from part1's
  local meta
  "$PY" -m pip download -q --no-deps "${TAGS[@]}" -d "$WHEEL_CACHE" sglang==0.5.17
  meta=$(unzip -p "$WHEEL_CACHE"/sglang-0.5.17-*.whl 'sglang-0.5.17.dist-info/METADATA')
  echo sglang==0.5.17
  # "Requires-Dist: name[extras]==X" without a marker, where part1 carries the name at another version.
  printf '%s\n' "$meta" | sed -n 's/^Requires-Dist: \([A-Za-z0-9_.-]*\)\(\[[^]]*\]\)\{0,1\}==\([^ ;]*\)$/\1 \3/p' |
  while read -r name ver; do
    for pin in "${PART1[@]}"; do
      local pname=${pin%%==*} pver=${pin#*==}
      if [ "$(echo "$pname" | tr '_A-Z' '-a-z')" = "$(echo "$name" | tr '_A-Z' '-a-z')" ] && [ "$pver" != "$ver" ]; then
        echo "$name==$ver"
      fi
    done
  done
}

pack() {  # pack NAME SITE CHECK PYTHONPATH: tarball (chunks if large), BUNDLE file, sizes
  local name=$1 site=$2 check=$3 pypath=$4 stage archive sha size n i
  stage=$(stage_of "$name")
  archive="$WORK/$name.tar.xz"
  # Fixed order, owners and times: the same pins give the same archive (and the same install stamp).
  tar -C "$stage" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - . | xz -T0 -6 > "$archive"
  sha=$(sha256sum "$archive" | cut -d' ' -f1)
  size=$(stat -c %s "$archive")
  rm -rf "$DEST/$name" "$DEST/$name"-[0-9]*
  local chunks=()
  if [ "$size" -le $((CHUNK_MIB * 1024 * 1024)) ]; then
    mkdir -p "$DEST/$name" && mv "$archive" "$DEST/$name/$name.tar.xz"
    chunks=("$name.tar.xz")
    dirs=("$DEST/$name")
  else
    split -b "${CHUNK_MIB}M" -d -a 2 "$archive" "$WORK/$name.tar.xz."
    rm -f "$archive"
    dirs=()
    i=1
    for c in "$WORK/$name.tar.xz."[0-9][0-9]; do
      mkdir -p "$DEST/$name-$i" && mv "$c" "$DEST/$name-$i/"
      chunks+=("$(basename "$c")"); dirs+=("$DEST/$name-$i"); i=$((i + 1))
    done
  fi
  n=${#chunks[@]}
  for d in "${dirs[@]}"; do
    {
      echo "# $name: made by tools/gpu/build-bundles.sh; read by tools/gpu/install-bundles.sh"
      echo "name=$name"
      echo "site=$site"
      echo "archive=$name.tar.xz"
      echo "sha256=$sha"
      echo "chunks=\"${chunks[*]}\""
      echo "check=\"$check\""
      echo "pythonpath=$pypath"
    } > "$d/BUNDLE"
    printf '%s\n' "${SPECS[@]}" > "$d/PINS.txt"
  done
  printf '%-8s %6.1f MB packed in %d chunk(s), %s unpacked (sha256 %s)\n' "$name" \
    "$(awk "BEGIN{print $size/1e6}")" "$n" "$(du -sh "$stage" | cut -f1)" "${sha:0:16}"
}

build() {
  local name=$1
  case "$name" in
    part1) SPECS=("${PART1[@]}"); install_stage part1 "${SPECS[@]}"; prune_sglang "$(stage_of part1)"
           prune_common "$(stage_of part1)"
           pack part1 /tmp/site "sglang.srt.entrypoints.http_server sgl_kernel flashinfer xgrammar" /tmp/site ;;
    part2) SPECS=("${PART2[@]}"); install_stage part2 "${SPECS[@]}"; prune_common "$(stage_of part2)"
           pack part2 /tmp/site "dynamo._core dynamo.frontend.main" /tmp/site ;;
    part3) SPECS=("${PART3[@]}"); install_stage part3 "${SPECS[@]}"; prune_common "$(stage_of part3)"
           pack part3 /tmp/site "smg.launch_router" /tmp/site ;;
    dyn161) SPECS=("${DYN161[@]}" "${DYN161_EXTRA[@]}"); install_stage dyn161 "${SPECS[@]}"
           prune_common "$(stage_of dyn161)"
           pack dyn161 /tmp/site-dyn161 "dynamo._core dynamo.frontend.main dynamo.sglang.main" /tmp/site-dyn161:/tmp/site ;;
    sgl0517) mapfile -t SPECS < <(sgl0517_specs); SPECS+=("${SGL0517_EXTRA[@]}")
           install_stage sgl0517 "${SPECS[@]}"; prune_sglang "$(stage_of sgl0517)"; prune_common "$(stage_of sgl0517)"
           pack sgl0517 /tmp/site-sgl0517 "sglang.srt.entrypoints.http_server" /tmp/site-sgl0517:/tmp/site ;;
    vllm)  SPECS=("${VLLM[@]}"); install_stage vllm "${SPECS[@]}"; prune_vllm "$(stage_of vllm)"
           prune_common "$(stage_of vllm)"
           pack vllm /tmp/site-vllm "vllm.entrypoints.openai.api_server vllm.v1.worker.gpu_worker vllm.model_executor.models.qwen2 vllm.distributed.weight_transfer.ipc_engine" /tmp/site-vllm ;;
    *) echo "build-bundles: unknown bundle $name (part1 part2 part3 dyn161 sgl0517 vllm)" >&2; exit 2 ;;
  esac
}

mkdir -p "$WHEEL_CACHE" "$DEST"
for b in "${@:-part1 part2 part3 dyn161 sgl0517 vllm}"; do
  for one in $b; do build "$one"; done
done
[ -n "${KEEP_STAGE:-}" ] || rm -rf "$WORK"
if [ -d .git ] || [ -f .git ]; then
  exclude=$(git rev-parse --git-path info/exclude)
  grep -qs '^/.gpu-wheels/' "$exclude" || echo '/.gpu-wheels/' >> "$exclude"
fi
du -sh "$DEST"/*/ | sed 's/^/  /'
