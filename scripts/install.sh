#!/usr/bin/env bash
# Set up flash_epilogue from nothing on a Linux machine with the CUDA toolkit (nvcc 12.4+):
# torch, the CUTLASS headers (nvidia-cutlass wheel), ninja and pytest, then build the extension
# in place (editable install). Idempotent. Knobs: TORCH_SPEC (default torch==2.14.1),
# MAX_JOBS, CUDA_HOME (default /usr/local/cuda), FLASH_EPILOGUE_SKIP_CUDA_BUILD=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q "${TORCH_SPEC:-torch==2.14.1}" ninja pytest hypothesis nvidia-cuda-cuobjdump==13.2.86 nvidia-cuda-nvdisasm==13.2.86
$PY -m pip install -q --no-deps nvidia-cutlass==4.2.0.0
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
start=$(date +%s)
MAX_JOBS=${MAX_JOBS:-$(nproc)} $PY -m pip install -q --no-build-isolation --no-deps -e .
echo "flash_epilogue build: $(( $(date +%s) - start )) s"
