#!/usr/bin/env bash
# Static check of a GPU bundle on the CPU machine: import the server modules of an engine under
# Python 3.12 with the GPU image's torch (2.11.0+cu130) and a stub libcuda / libnvidia-ml, CUDA
# reported present (the method of shared/gpu/README.md "What is carried"; the GPU image list is in
# the device notes, KINDS.md). It finds a package the bundle lacks; it cannot find a kernel that
# fails only on the GPU.
#
#   tools/gpu/cpu-import-check.sh --make-env DIR      # once: a venv like the image (~5.5 GB, ~6 min)
#   CHECK_PY=DIR/bin/python tools/gpu/cpu-import-check.sh SITE[:SITE...] MODULE...
#
# SITE: unpacked bundle folders, first wins (as PYTHONPATH on the GPU machine). Prints one line per
# module (ok / FAIL with the exception) and exits 1 if any failed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

if [ "${1:-}" = "--make-env" ]; then
  dir=${2:?--make-env DIR}
  py=${PYTHON312:-$(command -v python3.12 || echo "$(pyenv root)/versions/3.12.1/bin/python3.12")}
  "$py" -m venv "$dir"
  # The image's versions where the device notes give them (KINDS.md "pip list"), else unpinned.
  "$dir/bin/pip" install -q torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0 transformers==5.17.0 \
    tokenizers==0.23.2 huggingface-hub==1.33.0 numpy==2.5.2 safetensors==0.8.0 triton==3.6.0 \
    sentencepiece tiktoken==0.14.0 aiohttp httpx anyio uvloop pillow psutil requests regex pyyaml tqdm \
    filelock cloudpickle einops msgpack ninja numba py-cpuinfo protobuf prometheus-client six \
    "setuptools<81" opencv-python-headless jinja2 click rich typer scipy grpcio werkzeug accelerate nvidia-ml-py
  exit 0
fi

sites=${1:?usage: CHECK_PY=... $0 SITE[:SITE...] MODULE...}; shift
PY=${CHECK_PY:?set CHECK_PY to a Python 3.12 with torch 2.11.0+cu130 (--make-env)}
stub=$(mktemp -d /tmp/cpu-import-check.XXXXXX)
trap 'rm -rf "$stub"' EXIT

# libcuda.so.1: every cu* symbol the bundle's extension modules import, each answering an error.
{
  echo '/* stub libcuda for import checks: nothing here runs a GPU */'
  { for s in ${sites//:/ }; do find "$s" -name '*.so*' -type f -print0 | xargs -0 -r nm -D --undefined-only 2>/dev/null; done
    printf '%s\n' "U cuInit" "U cuDriverGetVersion" "U cuGetProcAddress" "U cuGetProcAddress_v2" "U cuDeviceGetCount"
  } | awk '{print $NF}' | grep -E '^cu[A-Z][A-Za-z0-9_]*$' | sort -u | sed 's/.*/int &(void) { return 999; }/'
} > "$stub/cuda.c"
gcc -shared -fPIC -o "$stub/libcuda.so.1" -Wl,-soname,libcuda.so.1 "$stub/cuda.c"
gcc -shared -fPIC -o "$stub/libnvidia-ml.so.1" -Wl,-soname,libnvidia-ml.so.1 "$here/stub-nvml.c"
ln -s libcuda.so.1 "$stub/libcuda.so"; ln -s libnvidia-ml.so.1 "$stub/libnvidia-ml.so"
cat > "$stub/sitecustomize.py" <<'PY'
# CUDA reported present (one Hopper GPU) for import checks on a CPU machine.
import torch

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_capability = lambda device=None: (9, 0)
torch.cuda.get_device_name = lambda device=None: "NVIDIA H200 (stub)"
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_properties = lambda device=None: type(
    "Props", (), {"major": 9, "minor": 0, "name": "NVIDIA H200 (stub)", "total_memory": 141 << 30,
                  "multi_processor_count": 132, "L2_cache_size": 60 << 20}
)()
PY

PYTHONPATH="$stub:$sites" LD_LIBRARY_PATH="$stub${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_HOME=/nonexistent \
  "$PY" - "$@" <<'PY'
import importlib, os, sys, traceback

failed = 0
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        print(f"ok    {name}")
    except BaseException as exc:  # noqa: BLE001 - report every module, keep going
        failed += 1
        if os.environ.get("TRACE"):
            traceback.print_exc()
        tb = traceback.extract_tb(exc.__traceback__)
        where = next((f"{f.filename}:{f.lineno}" for f in reversed(tb) if "/importlib/" not in f.filename), "?")
        print(f"FAIL  {name}: {type(exc).__name__}: {exc} (at {where})")
third = sorted({m.split(".")[0] for m in sys.modules} - set(sys.stdlib_module_names))
print("loaded top-level packages:", " ".join(third))
sys.exit(1 if failed else 0)
PY
