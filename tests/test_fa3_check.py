"""FlashAttention-3 with the compatibility header against FA3's own build (scripts/fa3_check.py), on the user's
FA3 checkout: set FLASH_EPILOGUE_FA3_DIR to it (needs an sm_90 GPU, nvcc, triton; builds FA3 twice, minutes).
Skipped otherwise, CI included; scripts/gpu_check.sh runs the script itself as its `fa3` stage."""
import os
import sys
from pathlib import Path

import pytest

from conftest import run_checked

FA3_DIR = os.environ.get("FLASH_EPILOGUE_FA3_DIR")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fa3_check.py"


@pytest.mark.skipif(not FA3_DIR, reason="FLASH_EPILOGUE_FA3_DIR (a FlashAttention checkout) not set")
def test_fa3_backward_with_the_compat_header(tmp_path):
    run_checked([sys.executable, str(SCRIPT), "--fa3", FA3_DIR, "--work", str(tmp_path)])  # writes WORK/fa3_check.json
