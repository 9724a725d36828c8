"""FLASH_EPILOGUE_STAGED_LOADS=1: the sm_90 store and gqa_accumulate drivers read their fp32
input row-major through shared memory (StagedTileSum) instead of straight in fragment order. The
switch is an experiment kept for timing both (benchmarks/NOTES.md); the results must be the same
bits as the default path."""
import pytest
import torch

import flash_epilogue as fe
from test_gqa import HEAD_DIMS as GQA_HEAD_DIMS
from test_gqa import check_accumulate
from test_store import HEAD_DIMS, canary_buffer, check_store, fresh_accum

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def staged_loads(monkeypatch):
    monkeypatch.setenv("FLASH_EPILOGUE_STAGED_LOADS", "1")  # the C++ launcher reads it per launch


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("varlen", (False, True), ids=("batched", "varlen"))
def test_store_staged_loads(d, varlen):
    n = fe.tile_config(d).block_n
    if varlen:
        lens = [n + 1, 0, 37, 1, 2 * n - 1]
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
        used = torch.tensor([x - (i % 2) * (x // 3) for i, x in enumerate(lens)], dtype=torch.int32, device="cuda")
        total = sum(lens) + 3
        shape, seq = (total, 3, d), {"cu_seqlens": cu, "seqused": used}
        dk_buf, dv_buf = canary_buffer((total + 2, 4, d + 8), torch.bfloat16), canary_buffer((total, 3, d), torch.bfloat16)
        dk, dv = dk_buf[1 : total + 1, 1:, 8:], dv_buf
    else:
        shape, seq = (2, 2 * n + 5, 3, d), {}
        dk_buf, dv_buf = canary_buffer((2, 2 * n + 7, 3, d + 16), torch.float16), canary_buffer(shape, torch.float16)
        dk, dv = dk_buf[:, 1 : 2 * n + 6, :, 8 : d + 8], dv_buf
    check_store(dk_buf, dv_buf, dk, dv, fresh_accum(shape), fresh_accum(shape), **seq)


@pytest.mark.parametrize("d", GQA_HEAD_DIMS)
def test_gqa_accumulate_staged_loads(d):
    # deterministic: bitwise the sequential reference; also the non-deterministic bound
    check_accumulate(d, d, 0, 2, 4, "varlen", True, seed=d + 11)
    check_accumulate(d, d, 0, 1, 3, "batched", False, seed=d + 12)
