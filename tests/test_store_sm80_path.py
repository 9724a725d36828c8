"""GPU tests of `store` through the sm_80 code path (`_arch=80`: ArchTag Sm80 collectives and FA3's
Ampere tile configs, run on the sm_90 GPU): the key cases of test_store.py, with the row edges
placed at the sm_80 kBlockN (test_store.py runs its size-independent cases on both paths).
Results must be bitwise what the reference (and the sm_90 path) gives: accum.to(dtype) on every
valid element, nothing else in the surrounding buffer changed.

This checks the sm_80 logic and layouts (always the non-TMA predicated store), not sm_80 code
generation.
"""
import pytest
import torch

import flash_epilogue as fe
from test_store import DTYPES, HEAD_DIMS, canary_buffer, check_store, fresh_accum

pytestmark = pytest.mark.gpu

SM80 = {"_arch": 80}


def block_n80(d, dv=None):
    return fe.tile_config(d, dv, arch=80).block_n


def seqlens_for(d):
    n = block_n80(d)
    return (0, 1, n - 1, n, n + 1, 3 * n + 5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_store_sm80_batched(dtype, d):
    for seqlen in seqlens_for(d):
        shape = (2, seqlen, 3, d)
        dk_buf, dv_buf = canary_buffer(shape, dtype), canary_buffer(shape, dtype)
        check_store(dk_buf, dv_buf, dk_buf, dv_buf, fresh_accum(shape), fresh_accum(shape), store_kw=SM80)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", (64, 128, 192, 256))
def test_store_sm80_bhsd_layout(dtype, d):
    b, h, s = 2, 3, 2 * block_n80(d) + 9
    dk_buf, dv_buf = canary_buffer((b, h, s, d), dtype), canary_buffer((b, h, s, d), dtype)
    accum_k = fresh_accum((b, h, s, d)).transpose(1, 2)
    accum_v = fresh_accum((b, s, h, d))
    check_store(dk_buf, dv_buf, dk_buf.transpose(1, 2), dv_buf.transpose(1, 2), accum_k, accum_v, store_kw=SM80)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", (64, 96, 128, 192, 256))
def test_store_sm80_strided_views(dtype, d):
    b, s, h = 3, block_n80(d) + 37, 2
    dk_buf = canary_buffer((b + 1, s + 5, h + 2, d + 16), dtype)
    dv_buf = canary_buffer((b, s, 2 * h, d + 8), dtype)
    dk = dk_buf[1:, 2 : s + 2, 1 : h + 1, :d]
    dv = dv_buf[:, :, ::2, :d]
    accum_buf = fresh_accum((b, s, h, d + 4))
    check_store(dk_buf, dv_buf, dk, dv, accum_buf[..., :d], fresh_accum((b, s, h, d)), store_kw=SM80)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,dv", [(192, 128), (64, 128), (128, 64), (256, 128), (72, 200)])
def test_store_sm80_dv_differs_from_d(dtype, d, dv):
    b, s, h = 2, 2 * block_n80(d, dv) + 1, 3
    dk_buf, dv_buf = canary_buffer((b, s, h, d), dtype), canary_buffer((b, s, h, dv), dtype)
    check_store(dk_buf, dv_buf, dk_buf, dv_buf, fresh_accum((b, s, h, d)), fresh_accum((b, s, h, dv)),
                store_kw=SM80)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_store_sm80_varlen_and_seqused(dtype, d):
    n = block_n80(d)
    lens = [0, 1, n - 1, n, n + 1, 3 * n + 7, 0, 50]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    total, h = int(cu[-1]) + 9, 2  # slack rows after the last sequence stay untouched
    used = torch.tensor([max(0, x - (i % 3) * 5) for i, x in enumerate(lens)], dtype=torch.int32).cuda()
    for seq in ({"cu_seqlens": cu}, {"cu_seqlens": cu, "seqused": used}):
        dk_buf, dv_buf = canary_buffer((total, h, d), dtype), canary_buffer((total, h, d), dtype)
        check_store(dk_buf, dv_buf, dk_buf, dv_buf, fresh_accum((total, h, d)), fresh_accum((total, h, d)),
                    store_kw=SM80, **seq)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_sm80_seqused_batched(dtype):
    b, s, h, d = 4, 300, 2, 128
    n = block_n80(d)
    used = torch.tensor([0, 1, n + 1, s], dtype=torch.int32, device="cuda")
    dk_buf, dv_buf = canary_buffer((b, s, h, d), dtype), canary_buffer((b, s, h, d), dtype)
    check_store(dk_buf, dv_buf, dk_buf, dv_buf, fresh_accum((b, s, h, d)), fresh_accum((b, s, h, d)),
                store_kw=SM80, seqused=used)


@pytest.mark.parametrize("d", (64, 192, 256))
def test_store_sm80_matches_sm90_path(d):
    # the two paths give the same bits (both are accum.to(dtype) on the valid rows)
    acc_k, acc_v = fresh_accum((2, 333, 3, d)), fresh_accum((2, 333, 3, d))
    outs = []
    for arch in (0, 80):
        dk, dv = canary_buffer(acc_k.shape, torch.bfloat16), canary_buffer(acc_v.shape, torch.bfloat16)
        fe.store(acc_k, acc_v, dk, dv, _arch=arch)
        outs.append((dk, dv))
    torch.cuda.synchronize()
    for a, b in zip(*outs):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
