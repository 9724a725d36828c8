#!/usr/bin/env bash
# Set up flash_epilogue in the current Python environment and build it in place (editable install), keeping what is
# there: an installed torch is used as it is (one is installed only when none is: TORCH_SPEC, default "torch"); then
# only what building and testing need: ninja, pytest, hypothesis, numpy, the CUTLASS headers (the nvidia-cutlass wheel,
# headers only) and, where the CUDA toolkit lacks them, cuobjdump/nvdisasm for the SASS test. Before building it checks
# that nvcc's CUDA major version is torch's, and stops saying what to install otherwise. Idempotent.
# Knobs: PYTHON, TORCH_SPEC, CUDA_HOME (default /usr/local/cuda), MAX_JOBS, FLASH_EPILOGUE_SKIP_CUDA_BUILD=1 and the
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

skip=${FLASH_EPILOGUE_SKIP_CUDA_BUILD:-0}
if [ "$skip" = "0" ] || [ -z "$skip" ]; then
  export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  nvcc="$CUDA_HOME/bin/nvcc"
  [ -x "$nvcc" ] || { echo "install.sh: no nvcc at $nvcc: install the CUDA toolkit or set CUDA_HOME" >&2; exit 1; }
  nvcc_cuda=$("$nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
  torch_cuda=$($PY -c "import torch; print(torch.version.cuda or '')")
  if [ -z "$torch_cuda" ]; then
    echo "install.sh: the installed torch is a CPU-only build; install a CUDA $nvcc_cuda build of torch" \
         "(https://pytorch.org/get-started/locally/), or set FLASH_EPILOGUE_SKIP_CUDA_BUILD=1 for the" \
         "pure-Python install" >&2
    exit 1
  fi
  if [ "${nvcc_cuda%%.*}" != "${torch_cuda%%.*}" ]; then
    echo "install.sh: nvcc is CUDA $nvcc_cuda but torch was built with CUDA $torch_cuda: the extension must be built" \
         "with the CUDA major version torch uses. Install a CUDA ${torch_cuda%%.*}.x toolkit and point CUDA_HOME at" \
         "it, or a torch built for CUDA ${nvcc_cuda%%.*} (https://pytorch.org/get-started/locally/)" >&2
    exit 1
  fi
  if [ ! -x "$CUDA_HOME/bin/cuobjdump" ] && ! command -v cuobjdump > /dev/null && [ "${nvcc_cuda%%.*}" = "13" ]; then
    pip_install nvidia-cuda-cuobjdump==13.2.86 nvidia-cuda-nvdisasm==13.2.86
  fi
fi
start=$(date +%s)
MAX_JOBS=${MAX_JOBS:-$(nproc)} $PY -m pip install -q --no-build-isolation --no-deps -e .
echo "flash_epilogue build: $(( $(date +%s) - start )) s"
