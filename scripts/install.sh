#!/usr/bin/env bash
# Set up flash_epilogue in the current Python environment and build it in place (editable install), keeping what is
# there: an installed torch is used as it is (one is installed only when none is: TORCH_SPEC, default "torch"); then
# only what building and testing need: ninja, pytest, hypothesis, numpy, the CUTLASS headers (the nvidia-cutlass wheel,
# headers only) and, where the CUDA toolkit lacks them, cuobjdump/nvdisasm for the SASS test; the build (setup.py)
# checks that nvcc's CUDA major version is torch's, and stops saying what to install otherwise. Idempotent.
# Knobs: PYTHON, TORCH_SPEC, CUDA_HOME, MAX_JOBS, FLASH_EPILOGUE_SKIP_CUDA_BUILD=1 and the
# build knobs of setup.py (FLASH_EPILOGUE_HEAD_DIMS, FLASH_EPILOGUE_CUDA_ARCHS or TORCH_CUDA_ARCH_LIST).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { $PY -m pip install -q "$@"; }

if $PY -c "import torch" 2>/dev/null; then
  echo "install.sh: using the installed torch $($PY -c 'import torch; print(torch.__version__)')"
else
  echo "install.sh: no torch in this environment: installing ${TORCH_SPEC:-torch}"
  pip_install "${TORCH_SPEC:-torch}"
fi
pip_install ninja pytest hypothesis numpy
pip_install --no-deps nvidia-cutlass==4.2.0.0

# cuobjdump and nvdisasm for the SASS test, where the CUDA 13 toolkit lacks them (pip wheels)
if [ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/cuobjdump" ] && ! command -v cuobjdump > /dev/null &&
   [ "$($PY -c 'import torch; print((torch.version.cuda or "").split(".")[0])')" = "13" ]; then
  pip_install nvidia-cuda-cuobjdump==13.2.86 nvidia-cuda-nvdisasm==13.2.86
fi
# setup.py finds the toolkit (CUDA_HOME, else nvcc's where its headers are, else /usr/local/cuda) and checks that its
# CUDA major is torch's. Of pip's verbose output only the build's summary line shows (units, head dims, archs, jobs,
# a time estimate); the whole of it goes to a log, whose end shows if the build fails.
start=$(date +%s)
log=$(mktemp /tmp/flash_epilogue_build.XXXXXX)
set +e
MAX_JOBS=${MAX_JOBS:-$(nproc)} $PY -m pip install -v --no-build-isolation --no-deps -e . 2>&1 | tee "$log" |
  { grep --line-buffered -o "flash_epilogue: building .*" || true; }
status=${PIPESTATUS[0]}
set -e
if [ "$status" != 0 ]; then
  tail -40 "$log"
  echo "install.sh: the build failed (exit $status); the whole log: $log"
  exit "$status"
fi
echo "flash_epilogue build: $(( $(date +%s) - start )) s (log: $log)"
