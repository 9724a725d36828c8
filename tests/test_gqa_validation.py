"""CPU tests of the GQA surface: accumulator geometry and allocation, the validators of
gqa_accumulate / gqa_postprocess / gqa_accum_to_dense / gqa_reduce (every message), the wrappers'
own checks and argument passing, and the fake kernels under FakeTensorMode.

The device checks are reached by monkeypatching the validation module's device hooks; the
wrappers' calls into torch.ops are intercepted where a test gets that far.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_epilogue as fe
import flash_epilogue.validation as V
from flash_epilogue._config import gqa_accum_shape, gqa_semaphore_numel, tile_config
from flash_epilogue.reference import gqa_accumulate_reference, gqa_reduce_reference
from flash_epilogue.validation import (
    FlashEpilogueBuildError,
    FlashEpilogueInputError,
    GQAProblem,
    validate_gqa_accum_to_dense,
    validate_gqa_accumulate,
    validate_gqa_postprocess,
    validate_gqa_reduce,
)

F16, BF16, F32, I32 = torch.float16, torch.bfloat16, torch.float32, torch.int32
ROOT = Path(__file__).resolve().parent.parent
GQA_OPS = ("gqa_accumulate", "gqa_postprocess", "gqa_accum_to_dense", "gqa_reduce")
_HAVE_GQA_OPS = all(hasattr(torch.ops.flash_epilogue, n) for n in GQA_OPS)
_STALE_BUILD = pytest.mark.skipif(not _HAVE_GQA_OPS, reason="the loaded extension was built before the GQA ops")


def _raises(op, arg, expected, got):
    msg = f"flash_epilogue.{op}: {arg}: expected {expected}, got {got}"
    return pytest.raises(FlashEpilogueInputError, match="^" + re.escape(msg) + "$")


def _raises_re(pattern):
    return pytest.raises(FlashEpilogueInputError, match=pattern)


@pytest.fixture
def sm86(monkeypatch):
    """An Ampere GPU with an "80;90a" build: arch 0 resolves to the sm_80 path."""
    monkeypatch.setattr(V, "_is_cuda_device", lambda device: True)
    monkeypatch.setattr(V, "_device_capability", lambda device: (8, 6))
    monkeypatch.setattr(V, "_compiled_archs", lambda: ("sm_80", "sm_90a"))


class OpRecorder:
    """Stands in for torch.ops.flash_epilogue.<name> and records each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))


@pytest.fixture
def ops(monkeypatch):
    """Intercept the four GQA ops (the loaded extension may not have them)."""
    recorders = {}
    for name in GQA_OPS:
        recorders[name] = OpRecorder()
        monkeypatch.setattr(torch.ops.flash_epilogue, name, recorders[name], raising=False)
    return recorders


def cu(*vals):
    return torch.tensor(vals, dtype=I32)


# ---------------------------------------------------------------------------------------------
# accumulator geometry


@pytest.mark.parametrize("d,arch,block,elems", [
    (64, 90, 128, 8192), (80, 90, 128, 12288), (96, 90, 128, 12288), (128, 90, 128, 16384),
    (192, 90, 96, 18432), (256, 90, 80, 20480),
    (64, 80, 128, 8192), (128, 80, 128, 16384), (192, 80, 80, 96 * 192), (256, 80, 64, 16384),
])
def test_accum_shape_batched(d, arch, block, elems):
    for seqlen in (0, 1, block - 1, block, block + 1, 1000):
        shape = gqa_accum_shape(3, seqlen, 2, d, arch=arch)
        assert shape == (3, 2, -(-seqlen // block), elems)
        assert gqa_semaphore_numel(shape) == 2 * 3 * shape[2] * 2 + 1
    assert gqa_accum_shape(0, 50, 2, d, arch=arch)[0] == 0


@pytest.mark.parametrize("arch", (90, 80))
@pytest.mark.parametrize("d", (64, 192, 256))
def test_accum_shape_varlen_holds_every_padded_sequence(d, arch):
    # (total + batch * kBlockN) // kBlockN tiles hold every sequence at its kBlockN-aligned
    # offset_padded, whatever the lengths (sized from shapes alone: no max_seqlen)
    n = tile_config(d, arch=arch).block_n
    gen = torch.Generator().manual_seed(d + arch)
    for trial in range(200):
        batch = int(torch.randint(1, 9, (1,), generator=gen))
        lens = torch.randint(0, 3 * n, (batch,), generator=gen)
        lens[torch.rand(batch, generator=gen) < 0.2] = 0
        cu_list = [0] + torch.cumsum(lens, 0).tolist()
        total = cu_list[-1] + int(torch.randint(0, 5, (1,), generator=gen))
        shape = gqa_accum_shape(batch, total, 3, d, arch=arch, varlen=True)
        assert shape[:2] == (1, 3) and shape[3] == tile_config(d, arch=arch).accum_tile_elems
        end = 0
        for b in range(batch):
            padded = ((cu_list[b] + b * n) // n) * n
            assert padded >= end  # sequences never share a tile
            end = padded + -(-int(lens[b]) // n) * n
        assert end <= shape[2] * n
    assert gqa_accum_shape(2, 1000, 4, 64, varlen=True) == (1, 4, (1000 + 256) // 128, 8192)


def test_accum_shape_dv_differs():
    # one tile serves max(d, dv): dK's and dV's accumulators have the same shape
    assert gqa_accum_shape(1, 200, 1, 192, 128) == (1, 1, 3, 18432)
    assert gqa_accum_shape(1, 200, 1, 64, 256) == (1, 1, 3, 20480)
    assert gqa_accum_shape(1, 200, 1, 64, 256, arch=80) == (1, 1, 4, 16384)


# ---------------------------------------------------------------------------------------------
# gqa_accumulator: allocation


def test_allocate_batched():
    acc = fe.gqa_accumulator(2, 128, batch=3, seqlen=300, device="meta")
    assert isinstance(acc, fe.GQAAccumulator)
    assert acc.dk_accum.shape == acc.dv_accum.shape == (3, 2, 3, 16384)
    assert acc.dk_accum.dtype == F32 and acc.dk_accum.is_contiguous() and acc.dv_accum.is_contiguous()
    assert acc.semaphores is None and not acc.deterministic
    assert (acc.head_dim, acc.head_dim_v, acc.block_n, acc.tile_elems, acc.arch) == (128, 128, 128, 16384, 90)
    assert (acc.num_heads_kv, acc.batch, acc.rows, acc.varlen) == (2, 3, 300, False)
    assert (acc.batch_extent, acc.num_tiles) == (3, 3)
    assert acc.config == tile_config(128) and acc.device.type == "meta"
    assert acc.dense_shape(128) == (3, 300, 2, 128)
    assert "GQAAccumulator(dk_accum/dv_accum=float32[3, 2, 3, 16384], semaphores=None" in repr(acc)


def test_allocate_batched_deterministic_dv_and_uncompiled_head_dim():
    acc = fe.gqa_accumulator(4, 192, 128, batch=2, seqlen=200, deterministic=True, device="cpu")
    assert acc.dk_accum.shape == (2, 4, 3, 18432) and acc.block_n == 96
    assert acc.semaphores.dtype == I32 and acc.semaphores.shape == (2 * 2 * 3 * 4 + 1,)
    assert acc.deterministic and (acc.semaphores == 0).all() and (acc.dk_accum == 0).all()
    assert "semaphores=int32[49]" in repr(acc)
    acc = fe.gqa_accumulator(1, 80, batch=1, seqlen=5, device="meta")
    assert acc.config.head_dim == 96 and acc.tile_elems == 128 * 96 and acc.head_dim == 80


def test_allocate_varlen():
    cs = cu(0, 100, 100, 700)
    acc = fe.gqa_accumulator(2, 64, cu_seqlens=cs, total_tokens=710, deterministic=True)
    assert acc.device == cs.device  # cu_seqlens' device by default
    assert acc.varlen and acc.batch == 3 and acc.rows == 710
    assert acc.dk_accum.shape == (1, 2, (710 + 3 * 128) // 128, 8192)
    assert acc.semaphores.numel() == 2 * 1 * acc.num_tiles * 2 + 1
    assert acc.dense_shape(64) == (710, 2, 64)
    # batch instead of cu_seqlens (no tensor needed to allocate)
    acc2 = fe.gqa_accumulator(2, 64, batch=3, total_tokens=710, device="meta")
    assert acc2.dk_accum.shape == acc.dk_accum.shape and acc2.varlen


def test_allocate_sm80_path():
    acc = fe.gqa_accumulator(2, 256, batch=2, seqlen=300, device="meta", arch=80)
    assert acc.arch == 80 and acc.block_n == 64 and acc.dk_accum.shape == (2, 2, 5, 16384)
    acc = fe.gqa_accumulator(1, 192, cu_seqlens=cu(0, 50, 90), total_tokens=90, device="meta", arch=80)
    assert acc.dk_accum.shape == (1, 1, (90 + 2 * 80) // 80, 96 * 192) and acc.block_n == 80
    acc = fe.gqa_accumulator(1, 128, batch=1, seqlen=10, device="meta", arch=90)
    assert acc.arch == 90


def test_allocate_arch_follows_the_device(sm86):
    acc = fe.gqa_accumulator(2, 256, batch=1, seqlen=100, device="meta")
    assert acc.arch == 80 and acc.block_n == 64


def test_reset_and_pytree():
    acc = fe.gqa_accumulator(1, 64, batch=1, seqlen=10, deterministic=True, device="cpu")
    acc.dk_accum.fill_(3.0)
    acc.dv_accum.fill_(-1.0)
    assert acc.reset() is acc
    assert (acc.dk_accum == 0).all() and (acc.dv_accum == 0).all()
    leaves, spec = pytree.tree_flatten(acc)
    assert len(leaves) == 3 and leaves[0] is acc.dk_accum and leaves[2] is acc.semaphores
    back = pytree.tree_unflatten(leaves, spec)
    assert isinstance(back, fe.GQAAccumulator) and back.dk_accum is acc.dk_accum and back.rows == 10
    plain = fe.gqa_accumulator(1, 64, batch=1, seqlen=10, device="cpu")
    leaves, spec = pytree.tree_flatten(plain)
    assert leaves[2] is None and pytree.tree_unflatten(leaves, spec).semaphores is None


def _aop(arg, expected, got):
    return _raises("gqa_accumulator", arg, expected, got)


def test_allocate_errors():
    with _aop("num_heads_kv", "a positive int", "0"):
        fe.gqa_accumulator(0, 64, batch=1, seqlen=1, device="meta")
    with _aop("head_dim", "a multiple of 8 in [8, 256]", "60"):
        fe.gqa_accumulator(1, 60, batch=1, seqlen=1, device="meta")
    with _aop("head_dim_v", "a multiple of 8 in [8, 256]", "264"):
        fe.gqa_accumulator(1, 64, 264, batch=1, seqlen=1, device="meta")
    with _aop("arch", "0 (the device's path), 80 or 90", "86"):
        fe.gqa_accumulator(1, 64, batch=1, seqlen=1, device="meta", arch=86)
    with _aop("deterministic", "a bool", "int"):
        fe.gqa_accumulator(1, 64, batch=1, seqlen=1, device="meta", deterministic=1)
    with _aop("seqlen", "an int >= 0 (or cu_seqlens and total_tokens for the varlen layout)", "None"):
        fe.gqa_accumulator(1, 64, batch=1, device="meta")
    with _aop("batch", "an int >= 0", "None"):
        fe.gqa_accumulator(1, 64, seqlen=5, device="meta")
    with _aop("total_tokens", "an int >= 0 (the partials' row count) in the varlen layout", "None"):
        fe.gqa_accumulator(1, 64, cu_seqlens=cu(0, 4), device="meta")
    with _aop("seqlen", "None in the varlen layout (cu_seqlens/total_tokens given)", "8"):
        fe.gqa_accumulator(1, 64, cu_seqlens=cu(0, 4), total_tokens=8, seqlen=8, device="meta")
    with _aop("batch", "None or 1 (cu_seqlens.numel() - 1)", "2"):
        fe.gqa_accumulator(1, 64, cu_seqlens=cu(0, 4), total_tokens=8, batch=2, device="meta")
    with _aop("batch", "an int >= 1 (the number of sequences) or cu_seqlens", "None"):
        fe.gqa_accumulator(1, 64, total_tokens=8, device="meta")
    with _aop("cu_seqlens: dtype", "torch.int32", "torch.int64"):
        fe.gqa_accumulator(1, 64, cu_seqlens=torch.tensor([0, 4]), total_tokens=8, device="meta")


# ---------------------------------------------------------------------------------------------
# validate_gqa_accumulate


def acc_args(b=2, s=16, h_k=2, g=2, d=64, dv=None, varlen=False, arch=90, deterministic=False, device="cpu",
             nseq=None):
    """(dk_partial, dv_partial, dk_accum, dv_accum, semaphores) of a valid problem; varlen: b * s
    tokens in `nseq` sequences (default b)."""
    dv = d if dv is None else dv
    lead = (b * s,) if varlen else (b, s)
    shape = gqa_accum_shape(nseq or b, lead[0] if varlen else s, h_k, d, dv, arch=arch, varlen=varlen)
    sem = torch.zeros(gqa_semaphore_numel(shape), dtype=I32, device=device) if deterministic else None
    return (torch.zeros(lead + (h_k * g, d), device=device), torch.zeros(lead + (h_k * g, dv), device=device),
            torch.zeros(shape, device=device), torch.zeros(shape, device=device), sem)


def _acc(arg, expected, got):
    return _raises("gqa_accumulate", arg, expected, got)


def test_accumulate_valid(sm90):
    p = validate_gqa_accumulate(*acc_args(b=3, s=300, h_k=2, g=3, d=192, dv=128, deterministic=True),
                                deterministic=True)
    assert isinstance(p, GQAProblem)
    assert p == GQAProblem(batch=3, seqlen=300, num_heads_kv=2, num_heads_q=6, head_dim=192, head_dim_v=128,
                           dtype=F32, varlen=False, has_seqused=False, arch=90, config=tile_config(192, 128),
                           accum_shape=(3, 2, 4, 18432), device=torch.device("cpu"))
    assert p.group == 3
    cs = cu(0, 5, 5, 16)
    p = validate_gqa_accumulate(*acc_args(b=1, s=16, varlen=True, h_k=1, g=16, arch=80, nseq=3)[:4], cu_seqlens=cs,
                                seqused=cu(4, 0, 9), _arch=80)
    assert p.varlen and p.arch == 80 and p.batch == 3 and p.group == 16 and p.has_seqused
    # a bigger semaphore workspace is fine (the op needs at least its size)
    dk_p, dv_p, dk_a, dv_a, sem = acc_args(deterministic=True)
    validate_gqa_accumulate(dk_p, dv_p, dk_a, dv_a, torch.zeros(sem.numel() + 10, dtype=I32), deterministic=True)
    # semaphores may be given without deterministic mode (unused)
    validate_gqa_accumulate(dk_p, dv_p, dk_a, dv_a, sem)


def test_accumulate_meta_and_empty(sm90):
    p = validate_gqa_accumulate(*acc_args(device="meta", deterministic=True), deterministic=True)
    assert p.device.type == "meta"
    p = validate_gqa_accumulate(*acc_args(b=0, deterministic=True), deterministic=True)
    assert p.batch == 0 and p.accum_shape == (0, 2, 1, 8192)
    assert validate_gqa_accumulate(*acc_args(s=0)[:4]).accum_shape == (2, 2, 0, 8192)


def test_accumulate_arch_resolution(sm86):
    # on an sm_86 GPU the accumulator must have the sm_80 layout; _arch=90 is refused
    args = acc_args(d=256, s=100, arch=80)[:4]
    assert validate_gqa_accumulate(*args).arch == 80
    with _acc("dk_accum: shape", "(2, 2, 2, 20480) (the accumulator of batch 2, seqlen 100, 2 KV heads, head dims "
                                 "(256, 256) on the sm_90 path: allocate it with flash_epilogue.gqa_accumulator)",
              "(2, 2, 2, 16384)"):
        validate_gqa_accumulate(*args, _arch=90)
    args = acc_args(d=256, s=100, arch=90)[:4]
    with _acc("_arch", "0 or 80 on cpu (compute capability sm_86)", "90"):
        validate_gqa_accumulate(*args, _arch=90)


@pytest.mark.parametrize("pos,name", [(0, "dk_partial"), (1, "dv_partial"), (2, "dk_accum"), (3, "dv_accum"),
                                      (4, "semaphores")])
def test_accumulate_not_a_tensor(pos, name):
    args = list(acc_args(deterministic=True))
    args[pos] = [0.0]
    with _acc(name, "a torch.Tensor", "list"):
        validate_gqa_accumulate(*args)


def test_accumulate_flags():
    with _acc("deterministic", "a bool", "int"):
        validate_gqa_accumulate(*acc_args(), deterministic=1)
    with _acc("_arch", "0 (the device's path), 80 or 90", "70"):
        validate_gqa_accumulate(*acc_args(), _arch=70)


@pytest.mark.parametrize("pos,name", [(0, "dk_partial"), (1, "dv_partial"), (2, "dk_accum"), (3, "dv_accum")])
def test_accumulate_dtypes(pos, name):
    args = list(acc_args())
    args[pos] = args[pos].to(BF16)
    with _acc(f"{name}: dtype", "torch.float32", "torch.bfloat16"):
        validate_gqa_accumulate(*args)


def test_accumulate_ranks():
    dk_p, dv_p, dk_a, dv_a, _ = acc_args(b=1, s=16)
    with _acc("dk_partial: rank", "4 dims (batch, seqlen, heads, headdim) because cu_seqlens is None",
              "3 dims, shape (16, 4, 64)"):
        validate_gqa_accumulate(dk_p[0], dv_p, dk_a, dv_a)
    with _acc("dv_partial: rank", "3 dims (total_tokens, heads, headdim) because cu_seqlens is given",
              "4 dims, shape (1, 16, 4, 64)"):
        validate_gqa_accumulate(dk_p[0], dv_p, dk_a, dv_a, cu_seqlens=cu(0, 16))
    with _acc("dv_accum: rank", "4 dims (batch_extent, heads_kv, num_tiles, tile_elems)", "3 dims, shape (2, 1, 8192)"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a, dv_a[0])


def test_accumulate_partial_shapes_and_head_dims():
    dk_p, dv_p, dk_a, dv_a, _ = acc_args(b=2, s=16, h_k=2, g=2)
    with _acc("dv_partial: shape", "(2, 16, 4, '*') (dk_partial's shape but the last dim)", "(2, 16, 2, 64)"):
        validate_gqa_accumulate(dk_p, dv_p[:, :, :2], dk_a, dv_a)
    with _acc("dk_partial: head dim", "a multiple of 8 in [8, 256]", "60"):
        validate_gqa_accumulate(dk_p[..., :60], dv_p, dk_a, dv_a)
    with _acc("dv_partial: head dim", "a multiple of 8 in [8, 256]", "264"):
        validate_gqa_accumulate(dk_p, torch.zeros(2, 16, 4, 264), dk_a, dv_a)


@pytest.mark.parametrize("h_q,h_k", [(4, 3), (3, 2), (1, 2), (0, 2)])
def test_accumulate_heads_not_divisible(h_q, h_k):
    dk_p, dv_p, dk_a, dv_a, _ = acc_args(h_k=h_k, g=1)
    dk_p, dv_p = torch.zeros(2, 16, h_q, 64), torch.zeros(2, 16, h_q, 64)
    with _acc("dk_partial: heads", f"a positive multiple of the {h_k} KV heads (dk_accum.shape[1]): every KV head "
                                   "serves h_q / h_k query heads", f"{h_q} query heads (dk_partial.shape[-2])"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a, dv_a)


def test_accumulate_no_kv_heads():
    dk_p, dv_p, dk_a, dv_a, _ = acc_args(h_k=1, g=2)
    with _acc("dk_accum: heads", ">= 1 (dk_accum.shape[1], the number of KV heads)", "0"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a[:, :0], dv_a[:, :0])


def test_accumulate_accum_shape():
    dk_p, dv_p, dk_a, dv_a, _ = acc_args(b=2, s=300, h_k=2, d=128)
    why = ("the accumulator of batch 2, seqlen 300, 2 KV heads, head dims (128, 128) on the sm_90 path: "
           "allocate it with flash_epilogue.gqa_accumulator")
    with _acc("dk_accum: shape", f"(2, 2, 3, 16384) ({why})", "(2, 2, 2, 16384)"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a[:, :, :2], dv_a)
    with _acc("dv_accum: shape", f"(2, 2, 3, 16384) ({why})", "(2, 2, 3, 8192)"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a, dv_a[..., :8192])
    # an accumulator of another head dim (tile) or of the sm_80 path
    with _acc("dk_accum: shape", f"(2, 2, 3, 16384) ({why})", "(2, 2, 3, 8192)"):
        validate_gqa_accumulate(dk_p, dv_p, *acc_args(b=2, s=300, h_k=2, d=64)[2:4])
    with _acc("dk_accum: shape", "(2, 2, 5, 16384) (the accumulator of batch 2, seqlen 300, 2 KV heads, head dims "
                                 "(256, 256) on the sm_80 path: allocate it with flash_epilogue.gqa_accumulator)",
              "(2, 2, 4, 20480)"):
        validate_gqa_accumulate(*acc_args(b=2, s=300, d=256)[:4], _arch=80)
    # varlen: (total + batch * kBlockN) // kBlockN tiles
    dk_p, dv_p, dk_a, dv_a, _ = acc_args(b=1, s=100, varlen=True)
    with _acc("dk_accum: shape", "(1, 2, 3, 8192) (the accumulator of 3 sequences of 100 total tokens, 2 KV heads, "
                                 "head dims (64, 64) on the sm_90 path: allocate it with "
                                 "flash_epilogue.gqa_accumulator)", "(1, 2, 1, 8192)"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a, dv_a, cu_seqlens=cu(0, 50, 60, 100))


def test_accumulate_strides():
    dk_p, dv_p, dk_a, dv_a, _ = acc_args(b=2, s=4, h_k=1, g=2)
    with _acc("dv_partial: stride(-1)", "1 (last dim contiguous)", "2 (strides (1024, 256, 128, 2))"):
        validate_gqa_accumulate(dk_p, torch.zeros(2, 4, 2, 128)[..., ::2], dk_a, dv_a)
    # fp32 partials: other strides multiples of 4 elements (16 bytes)
    with _acc("dk_partial: stride(2)", "a non-negative multiple of 4 elements (16 bytes)",
              "66 (shape (2, 4, 2, 64), strides (528, 132, 66, 1))"):
        validate_gqa_accumulate(torch.zeros(2, 4, 2, 66)[..., :64], dv_p, dk_a, dv_a)
    # accumulators: contiguous only
    nc = torch.zeros(dk_a.shape[:-1] + (2 * dk_a.shape[-1],))[..., ::2]
    with _acc("dk_accum: strides", "(8192, 8192, 8192, 1) (contiguous)", "(16384, 16384, 16384, 2)"):
        validate_gqa_accumulate(dk_p, dv_p, nc, dv_a)
    big = torch.zeros(2, 1, 1, 8192 + 4)
    with _acc("dv_accum: strides", "(8192, 8192, 8192, 1) (contiguous)", "(8196, 8196, 8196, 1)"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a, big[..., :8192])


def test_accumulate_strided_partials_accepted(sm90):
    # (batch, heads, seqlen, d) partials seen as (batch, seqlen, heads, d), padded rows
    dk_a, dv_a = acc_args(b=2, s=20, h_k=2, g=2)[2:4]
    dk_p = torch.zeros(2, 4, 20, 64).transpose(1, 2)
    dv_p = torch.zeros(2, 20, 4, 68)[..., :64]
    validate_gqa_accumulate(dk_p, dv_p, dk_a, dv_a)


def test_accumulate_alignment():
    dk_p, dv_p, dk_a, dv_a, _ = acc_args(s=4, h_k=1, g=2)
    raw = torch.zeros(dk_p.numel() + 4)
    mis = raw[1:1 + dk_p.numel()].view(dk_p.shape)
    with _raises_re(r"^flash_epilogue\.gqa_accumulate: dk_partial: data_ptr: expected a 16-byte aligned address, "
                    r"got 0x[0-9a-f]+ \(address % 16 = 4\)$"):
        validate_gqa_accumulate(mis, dv_p, dk_a, dv_a)
    raw = torch.zeros(dv_a.numel() + 4, device="meta")
    mis = raw[2:2 + dv_a.numel()].view(dv_a.shape)
    with _acc("dv_accum: storage_offset", "a multiple of 16 bytes", "2 elements = 8 bytes"):
        validate_gqa_accumulate(dk_p.to("meta"), dv_p.to("meta"), dk_a.to("meta"), mis)


def test_accumulate_semaphores():
    dk_p, dv_p, dk_a, dv_a, sem = acc_args(b=2, s=300, h_k=2, d=128, deterministic=True)
    with _acc("semaphores", "an int32 tensor of >= 25 entries because deterministic=True (allocate the accumulator "
                            "with flash_epilogue.gqa_accumulator(..., deterministic=True))", "None"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a, dv_a, None, deterministic=True)
    with _acc("semaphores: dtype", "torch.int32", "torch.int64"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a, dv_a, sem.long(), deterministic=True)
    with _acc("semaphores: rank", "1 dim", "2 dims, shape (5, 5)"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a, dv_a, sem[:25].view(5, 5), deterministic=True)
    with _acc("semaphores: stride(0)", "1 (contiguous)", "2"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a, dv_a, torch.zeros(60, dtype=I32)[::2], deterministic=True)
    with _acc("semaphores: numel", ">= 25 (2 * batch_extent * num_tiles * heads_kv + 1 for accumulators of shape "
                                   "(2, 2, 3, 16384))", "24"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a, dv_a, sem[:24], deterministic=True)


def test_accumulate_overlap():
    dk_p, dv_p, dk_a, dv_a, sem = acc_args(s=4, h_k=1, g=2, deterministic=True)
    with _raises_re(r"^flash_epilogue\.gqa_accumulate: dv_accum: memory: expected no overlap with dk_accum, got bytes"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a, dk_a)
    with _raises_re(r"^flash_epilogue\.gqa_accumulate: semaphores: memory: expected no overlap with dk_accum"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a, dv_a, dk_a.view(I32).reshape(-1)[:sem.numel()],
                                deterministic=True)
    flat = dk_a.reshape(-1)
    with _raises_re(r"^flash_epilogue\.gqa_accumulate: dk_accum: memory: expected no overlap with dv_partial"):
        validate_gqa_accumulate(dk_p, flat[:dv_p.numel()].view(dv_p.shape), dk_a, dv_a)
    dk_p, dv_p, dk_a, dv_a, _ = acc_args(b=1, s=8, h_k=1, g=2, varlen=True)  # 1 sequence: 1 + 1 tiles
    with _raises_re(r"^flash_epilogue\.gqa_accumulate: dv_accum: memory: expected no overlap with cu_seqlens"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a, dv_a, cu_seqlens=dv_a.view(I32).reshape(-1)[:2])


def test_accumulate_seqlens_meta():
    with _acc("seqused: numel", "2 (batch = dk_partial.shape[0])", "3"):
        validate_gqa_accumulate(*acc_args(b=2)[:4], seqused=cu(1, 2, 3))
    with _acc("cu_seqlens: numel", "batch + 1 >= 2 (at least one sequence)", "1"):
        validate_gqa_accumulate(*acc_args(b=1, varlen=True)[:4], cu_seqlens=cu(0))
    with _acc("seqused: numel", "2 (batch = cu_seqlens.numel() - 1)", "1"):
        validate_gqa_accumulate(*acc_args(b=1, s=16, varlen=True)[:4], cu_seqlens=cu(0, 8, 16), seqused=cu(1))


def test_accumulate_devices(monkeypatch):
    with _acc("dk_partial: device", "a CUDA tensor", "a tensor on cpu"):
        validate_gqa_accumulate(*acc_args())
    monkeypatch.setattr(V, "_is_cuda_device", lambda device: True)
    monkeypatch.setattr(V, "_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(V, "_compiled_archs", lambda: ("sm_90a",))
    dk_p, dv_p, dk_a, dv_a, sem = acc_args(deterministic=True)
    with _acc("semaphores: device", "cpu (the device of dk_partial)", "meta"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a, dv_a, sem.to("meta"), deterministic=True)
    monkeypatch.setattr(V, "_compiled_archs", lambda: ())
    with pytest.raises(FlashEpilogueBuildError, match=r"^flash_epilogue\.gqa_accumulate: the package was installed"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a, dv_a)


def test_accumulate_check_order():
    # dtype before rank, rank before heads, heads before the accumulator shape, shape before devices
    dk_p, dv_p, dk_a, dv_a, _ = acc_args()
    with _acc("dk_partial: dtype", "torch.float32", "torch.float16"):
        validate_gqa_accumulate(dk_p.half()[0], dv_p, dk_a, dv_a)
    with _raises_re(r"dk_partial: heads: expected a positive multiple"):
        validate_gqa_accumulate(dk_p[:, :, :3], dv_p[:, :, :3], dk_a[:, :, :, :5], dv_a)
    with _raises_re(r"dk_accum: shape"):
        validate_gqa_accumulate(dk_p, dv_p, dk_a[:, :, :, :5], dv_a)


# ---------------------------------------------------------------------------------------------
# validate_gqa_postprocess


def post_args(b=2, s=16, h_k=2, d=64, dv=None, dtype=BF16, varlen=False, arch=90, device="cpu", nseq=None):
    dv = d if dv is None else dv
    lead = (b * s,) if varlen else (b, s)
    shape = gqa_accum_shape(nseq or b, lead[0] if varlen else s, h_k, d, dv, arch=arch, varlen=varlen)
    return (torch.zeros(shape, device=device), torch.zeros(shape, device=device),
            torch.zeros(lead + (h_k, d), dtype=dtype, device=device),
            torch.zeros(lead + (h_k, dv), dtype=dtype, device=device))


def _post(arg, expected, got):
    return _raises("gqa_postprocess", arg, expected, got)


def test_postprocess_valid(sm90):
    p = validate_gqa_postprocess(*post_args(b=3, s=300, h_k=4, d=192, dv=128), scale_dk=0.5, scale_dv=2)
    assert p == GQAProblem(batch=3, seqlen=300, num_heads_kv=4, num_heads_q=None, head_dim=192, head_dim_v=128,
                           dtype=BF16, varlen=False, has_seqused=False, arch=90, config=tile_config(192, 128),
                           accum_shape=(3, 4, 4, 18432), device=torch.device("cpu"))
    assert p.group is None
    p = validate_gqa_postprocess(*post_args(b=1, s=40, varlen=True, dtype=F16, arch=80, nseq=2), cu_seqlens=cu(0, 10, 40),
                                 seqused=cu(3, 30), _arch=80)
    assert p.varlen and p.batch == 2 and p.arch == 80 and p.dtype == F16
    # outputs with strides like store's
    dk_a, dv_a, _, _ = post_args(b=2, s=16, h_k=2)
    validate_gqa_postprocess(dk_a, dv_a, torch.zeros(2, 2, 16, 64, dtype=BF16).transpose(1, 2),
                             torch.zeros(2, 16, 2, 72, dtype=BF16)[..., :64])
    validate_gqa_postprocess(*post_args(device="meta"))


def test_postprocess_scalars():
    with _post("scale_dk", "a float", "str"):
        validate_gqa_postprocess(*post_args(), scale_dk="1")
    with _post("scale_dv", "a float", "bool"):
        validate_gqa_postprocess(*post_args(), scale_dv=True)
    with _post("scale_dk", "a float", "Tensor"):
        validate_gqa_postprocess(*post_args(), scale_dk=torch.tensor(1.0))
    with _post("_arch", "0 (the device's path), 80 or 90", "1"):
        validate_gqa_postprocess(*post_args(), _arch=1)


def test_postprocess_dtypes_ranks_shapes():
    dk_a, dv_a, dk, dv = post_args(b=2, s=16, h_k=2)
    with _post("dk_accum: dtype", "torch.float32", "torch.float16"):
        validate_gqa_postprocess(dk_a.half(), dv_a, dk, dv)
    with _post("dk: dtype", "torch.float16 or torch.bfloat16", "torch.float32"):
        validate_gqa_postprocess(dk_a, dv_a, dk.float(), dv)
    with _post("dv: dtype", "torch.bfloat16 (the dtype of dk)", "torch.float16"):
        validate_gqa_postprocess(dk_a, dv_a, dk, dv.half())
    with _post("dv_accum: rank", "4 dims (batch_extent, heads_kv, num_tiles, tile_elems)",
               "5 dims, shape (1, 2, 2, 1, 8192)"):
        validate_gqa_postprocess(dk_a, dv_a[None], dk, dv)
    with _post("dk: rank", "3 dims (total_tokens, heads, headdim) because cu_seqlens is given",
               "4 dims, shape (2, 16, 2, 64)"):
        validate_gqa_postprocess(dk_a, dv_a, dk, dv, cu_seqlens=cu(0, 16))
    with _post("dv: shape", "(2, 16, 2, '*') (dk's shape but the last dim)", "(2, 16, 1, 64)"):
        validate_gqa_postprocess(dk_a, dv_a, dk, dv[:, :, :1])
    with _post("dv: head dim", "a multiple of 8 in [8, 256]", "12"):
        validate_gqa_postprocess(dk_a, dv_a, dk, dv[..., :12])
    # dk with other heads than the accumulator
    why = ("the accumulator of batch 2, seqlen 16, 1 KV heads, head dims (64, 64) on the sm_90 path: allocate it "
           "with flash_epilogue.gqa_accumulator")
    with _post("dk_accum: shape", f"(2, 1, 1, 8192) ({why})", "(2, 2, 1, 8192)"):
        validate_gqa_postprocess(dk_a, dv_a, dk[:, :, :1], dv[:, :, :1])


def test_postprocess_strides_alignment_overlap():
    dk_a, dv_a, dk, dv = post_args(b=2, s=4, h_k=2)
    with _post("dk: stride(2)", "a non-negative multiple of 8 elements (16 bytes)",
               "68 (shape (2, 4, 2, 64), strides (544, 136, 68, 1))"):
        validate_gqa_postprocess(dk_a, dv_a, torch.zeros(2, 4, 2, 68, dtype=BF16)[..., :64], dv)
    with _post("dk_accum: strides", "(16384, 8192, 8192, 1) (contiguous)", "(16392, 8196, 8196, 1)"):
        validate_gqa_postprocess(torch.zeros(2, 2, 1, 8196)[..., :8192], dv_a, dk, dv)
    mis = torch.zeros(dv.numel() + 8, dtype=BF16)[1:1 + dv.numel()].view(dv.shape)
    with _raises_re(r"^flash_epilogue\.gqa_postprocess: dv: data_ptr: expected a 16-byte aligned address"):
        validate_gqa_postprocess(dk_a, dv_a, dk, mis)
    with _raises_re(r"^flash_epilogue\.gqa_postprocess: dv: memory: expected no overlap with dk, got bytes"):
        validate_gqa_postprocess(dk_a, dv_a, dk, dk)
    over = dk_a.view(BF16).reshape(-1)[:dk.numel()].view(dk.shape)
    with _raises_re(r"^flash_epilogue\.gqa_postprocess: dk: memory: expected no overlap with dk_accum, got bytes"):
        validate_gqa_postprocess(dk_a, dv_a, over, dv)


def test_postprocess_seqlens_and_devices(monkeypatch):
    with _post("seqused: numel", "2 (batch = dk.shape[0])", "1"):
        validate_gqa_postprocess(*post_args(b=2), seqused=cu(3))
    with _post("dk_accum: device", "a CUDA tensor", "a tensor on cpu"):
        validate_gqa_postprocess(*post_args())
    monkeypatch.setattr(V, "_is_cuda_device", lambda device: True)
    monkeypatch.setattr(V, "_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(V, "_compiled_archs", lambda: ("sm_90a",))
    dk_a, dv_a, dk, dv = post_args()
    with _post("dv: device", "cpu (the device of dk_accum)", "meta"):
        validate_gqa_postprocess(dk_a, dv_a, dk, dv.to("meta"))


# ---------------------------------------------------------------------------------------------
# validate_gqa_accum_to_dense


def _dense(arg, expected, got):
    return _raises("gqa_accum_to_dense", arg, expected, got)


def test_accum_to_dense_valid(sm90):
    accum = torch.zeros(gqa_accum_shape(2, 300, 3, 192, 128))
    p = validate_gqa_accum_to_dense(accum, torch.zeros(2, 300, 3, 128), head_dim=192)
    assert (p.head_dim, p.num_heads_kv, p.batch, p.seqlen, p.arch) == (128, 3, 2, 300, 90)
    assert p.config == tile_config(192) and p.accum_shape == accum.shape
    # sm_80: head dims 128 and 256 have tiles of equal size; head_dim tells them apart
    a128 = torch.zeros(gqa_accum_shape(1, 300, 1, 128, arch=80))
    a256 = torch.zeros(gqa_accum_shape(1, 300, 1, 256, arch=80))
    assert a128.shape[-1] == a256.shape[-1]
    out = torch.zeros(1, 300, 1, 128)
    assert validate_gqa_accum_to_dense(a128, out, head_dim=128, _arch=80).config.block_n == 128
    assert validate_gqa_accum_to_dense(a256, out, head_dim=256, _arch=80).config.block_n == 64
    with _dense("accum: shape", "(1, 1, 5, 16384) (the accumulator of batch 1, seqlen 300, 1 KV heads, head dims "
                                "(256, 256) on the sm_80 path: allocate it with flash_epilogue.gqa_accumulator)",
                "(1, 1, 3, 16384)"):
        validate_gqa_accum_to_dense(a128, out, head_dim=256, _arch=80)
    cs = cu(0, 100, 250)
    p = validate_gqa_accum_to_dense(torch.zeros(gqa_accum_shape(2, 256, 2, 64, varlen=True)), torch.zeros(256, 2, 64),
                                    cs, cu(3, 4), head_dim=64)
    assert p.varlen and p.has_seqused and p.batch == 2


def test_accum_to_dense_errors():
    accum = torch.zeros(gqa_accum_shape(2, 30, 2, 128))
    out = torch.zeros(2, 30, 2, 128)
    with _dense("head_dim", "an int", "NoneType"):
        validate_gqa_accum_to_dense(accum, out, head_dim=None)
    with _dense("head_dim: head dim", "a multiple of 8 in [8, 256]", "12"):
        validate_gqa_accum_to_dense(accum, out, head_dim=12)
    with _dense("out: dtype", "torch.float32", "torch.bfloat16"):
        validate_gqa_accum_to_dense(accum, out.bfloat16(), head_dim=128)
    with _dense("accum: rank", "4 dims (batch_extent, heads_kv, num_tiles, tile_elems)", "3 dims, shape (2, 2, 2)"):
        validate_gqa_accum_to_dense(accum[:, :, 0, :2], out, head_dim=128)
    with _dense("out: head dim", "<= head_dim = 64", "128"):
        validate_gqa_accum_to_dense(accum, out, head_dim=64)
    with _dense("out: stride(-1)", "1 (last dim contiguous)", "2 (strides (15360, 512, 256, 2))"):
        validate_gqa_accum_to_dense(accum, torch.zeros(2, 30, 2, 256)[..., ::2], head_dim=128)
    with _raises_re(r"^flash_epilogue\.gqa_accum_to_dense: out: memory: expected no overlap with accum"):
        validate_gqa_accum_to_dense(accum, accum.reshape(-1)[:out.numel()].view(out.shape), head_dim=128)
    with _dense("accum: device", "a CUDA tensor", "a tensor on cpu"):
        validate_gqa_accum_to_dense(accum, out, head_dim=128)


# ---------------------------------------------------------------------------------------------
# validate_gqa_reduce


def red_args(b=2, s=16, h_k=2, g=2, d=64, dv=None, pdtype=F32, dtype=BF16, varlen=False, device="cpu"):
    dv = d if dv is None else dv
    lead = (b * s,) if varlen else (b, s)
    return (torch.zeros(lead + (h_k * g, d), dtype=pdtype, device=device),
            torch.zeros(lead + (h_k * g, dv), dtype=pdtype, device=device),
            torch.zeros(lead + (h_k, d), dtype=dtype, device=device),
            torch.zeros(lead + (h_k, dv), dtype=dtype, device=device))


def _red(arg, expected, got):
    return _raises("gqa_reduce", arg, expected, got)


def test_reduce_valid(sm90):
    p = validate_gqa_reduce(*red_args(b=3, s=100, h_k=2, g=4, d=192, dv=128), scale_dk=0.1)
    assert p == GQAProblem(batch=3, seqlen=100, num_heads_kv=2, num_heads_q=8, head_dim=192, head_dim_v=128,
                           dtype=BF16, varlen=False, has_seqused=False, arch=90, config=tile_config(192, 128),
                           accum_shape=None, device=torch.device("cpu"))
    # 16-bit partials of the outputs' dtype; dv None; varlen
    dk_p, _, dk, _ = red_args(pdtype=F16, dtype=F16, varlen=True, b=1, s=40, h_k=1, g=16)
    p = validate_gqa_reduce(dk_p, None, dk, None, cu(0, 10, 40), cu(5, 30))
    assert p.varlen and p.group == 16 and p.head_dim_v == 64
    # (batch, h_q, seqlen, d) partials seen as (batch, seqlen, h_q, d)
    validate_gqa_reduce(torch.zeros(2, 4, 16, 64, dtype=BF16).transpose(1, 2), None, red_args()[2], None)


def test_reduce_dv_pairing():
    dk_p, dv_p, dk, dv = red_args()
    with _red("dv", "None because dv_partial is None", "Tensor"):
        validate_gqa_reduce(dk_p, None, dk, dv)
    with _red("dv", "a torch.Tensor because dv_partial is given", "NoneType"):
        validate_gqa_reduce(dk_p, dv_p, dk, None)
    with _red("dv_partial", "a torch.Tensor", "list"):
        validate_gqa_reduce(dk_p, [1.0], dk, dv)


def test_reduce_dtypes():
    dk_p, dv_p, dk, dv = red_args()
    with _red("dk: dtype", "torch.float16 or torch.bfloat16", "torch.float32"):
        validate_gqa_reduce(dk_p, dv_p, dk.float(), dv.float())
    with _red("dk_partial: dtype", "torch.float32 or torch.bfloat16 (the dtype of dk)", "torch.float16"):
        validate_gqa_reduce(dk_p.half(), dv_p.half(), dk, dv)
    with _red("dv_partial: dtype", "torch.float32 (the dtype of dk_partial)", "torch.bfloat16"):
        validate_gqa_reduce(dk_p, dv_p.bfloat16(), dk, dv)
    with _red("dv: dtype", "torch.bfloat16 (the dtype of dk)", "torch.float16"):
        validate_gqa_reduce(dk_p, dv_p, dk, dv.half())
    with _red("scale_dv", "a float", "NoneType"):
        validate_gqa_reduce(dk_p, dv_p, dk, dv, scale_dv=None)


def test_reduce_shapes_and_heads():
    dk_p, dv_p, dk, dv = red_args(b=2, s=16, h_k=2, g=2)
    with _red("dk: shape", "(2, 16, '*', 64) (dk_partial's shape but the heads dim)", "(2, 15, 2, 64)"):
        validate_gqa_reduce(dk_p, dv_p, dk[:, :15], dv)
    with _red("dv: shape", "(2, 16, '*', 64) (dv_partial's shape but the heads dim)", "(2, 16, 2, 32)"):
        validate_gqa_reduce(dk_p, dv_p, dk, dv[..., :32])
    with _red("dv_partial: shape", "(2, 16, 4, '*') (dk_partial's shape but the last dim)", "(2, 16, 3, 64)"):
        validate_gqa_reduce(dk_p, dv_p[:, :, :3], dk, dv)
    with _red("dv: shape", "(2, 16, 2, '*') (dk's shape but the last dim)", "(2, 16, 1, 64)"):
        validate_gqa_reduce(dk_p, dv_p, dk, dv[:, :, :1])  # dv's KV heads must be dk's
    with _red("dk_partial: heads", "a positive multiple of the 3 KV heads (dk.shape[-2]): every KV head serves "
                                   "h_q / h_k query heads", "4 query heads (dk_partial.shape[-2])"):
        validate_gqa_reduce(dk_p, None, torch.zeros(2, 16, 3, 64, dtype=BF16), None)
    with _red("dk: head dim", "a multiple of 8 in [8, 256]", "20"):
        validate_gqa_reduce(dk_p[..., :20], None, dk[..., :20], None)
    with _red("dk_partial: rank", "4 dims (batch, seqlen, heads, headdim) because cu_seqlens is None",
              "3 dims, shape (16, 4, 64)"):
        validate_gqa_reduce(dk_p[0], None, dk, None)


def test_reduce_strides_alignment_overlap():
    dk_p, dv_p, dk, dv = red_args(b=2, s=4, h_k=1, g=2, pdtype=BF16)
    # 16-bit partials: strides in multiples of 8 elements (16 bytes), like the outputs
    with _red("dk_partial: stride(2)", "a non-negative multiple of 8 elements (16 bytes)",
              "68 (shape (2, 4, 2, 64), strides (544, 136, 68, 1))"):
        validate_gqa_reduce(torch.zeros(2, 4, 2, 68, dtype=BF16)[..., :64], dv_p, dk, dv)
    with _red("dv: stride(-1)", "1 (last dim contiguous)", "2 (strides (512, 128, 128, 2))"):
        validate_gqa_reduce(dk_p, dv_p, dk, torch.zeros(2, 4, 1, 128, dtype=BF16)[..., ::2])
    mis = torch.zeros(dk_p.numel() + 8, dtype=BF16)[3:3 + dk_p.numel()].view(dk_p.shape)
    with _raises_re(r"^flash_epilogue\.gqa_reduce: dk_partial: data_ptr: expected a 16-byte aligned address"):
        validate_gqa_reduce(mis, dv_p, dk, dv)
    with _raises_re(r"^flash_epilogue\.gqa_reduce: dk: memory: expected no overlap with dk_partial, got bytes"):
        validate_gqa_reduce(dk_p, dv_p, dk_p[:, :, :1], dv)
    with _raises_re(r"^flash_epilogue\.gqa_reduce: dv: memory: expected no overlap with dk, got bytes"):
        validate_gqa_reduce(dk_p, dv_p, dk, dk)


def test_reduce_seqlens_and_devices(monkeypatch):
    with _red("seqused: numel", "2 (batch = dk_partial.shape[0])", "3"):
        validate_gqa_reduce(*red_args(b=2), seqused=cu(1, 2, 3))
    with _red("cu_seqlens: dtype", "torch.int32", "torch.int64"):
        validate_gqa_reduce(*red_args(b=1, varlen=True), cu_seqlens=torch.tensor([0, 16]))
    with _red("dk_partial: device", "a CUDA tensor", "a tensor on cpu"):
        validate_gqa_reduce(*red_args())
    monkeypatch.setattr(V, "_is_cuda_device", lambda device: True)
    monkeypatch.setattr(V, "_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(V, "_compiled_archs", lambda: ("sm_80", "sm_90a"))
    assert validate_gqa_reduce(*red_args()).arch == 80
    with _red("_arch", "0 or 80 on cpu (compute capability sm_80)", "90"):
        validate_gqa_reduce(*red_args(), _arch=90)


# ---------------------------------------------------------------------------------------------
# the wrappers


def test_accumulate_wrapper(sm90, ops):
    acc = fe.gqa_accumulator(2, 64, batch=2, seqlen=16, device="cpu", deterministic=True)
    pk, pv = torch.zeros(2, 16, 4, 64), torch.zeros(2, 16, 4, 64)
    fe.gqa_accumulate(pk, pv, acc, deterministic=False)
    fe.gqa_accumulate(pk, pv, acc, deterministic=True, seqused=cu(3, 4))
    fe.gqa_accumulate(pk, pv, acc)  # an accumulator with semaphores: deterministic by default
    (a0, k0), (a1, k1), (a2, k2) = ops["gqa_accumulate"].calls
    assert a0[2] is acc.dk_accum and a0[3] is acc.dv_accum and a0[4] is None  # no semaphores when not deterministic
    assert k0 == {"cu_seqlens": None, "seqused": None, "deterministic": False, "_arch": 90}
    assert a1[4] is acc.semaphores and k1["deterministic"] is True and k1["seqused"] is not None
    assert a2[4] is acc.semaphores and k2["deterministic"] is True
    del ops["gqa_accumulate"].calls[:]
    # an accumulator without semaphores: torch's setting decides
    plain = fe.gqa_accumulator(2, 64, batch=2, seqlen=16, device="cpu")
    fe.gqa_accumulate(pk, pv, plain)
    assert ops["gqa_accumulate"].calls[0][1]["deterministic"] is False
    del ops["gqa_accumulate"].calls[:]
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        fe.gqa_accumulate(pk, pv, acc)
        with _raises("gqa_accumulate", "acc.semaphores",
                     "an int32 workspace because torch.are_deterministic_algorithms_enabled() is True: allocate the "
                     "accumulator with flash_epilogue.gqa_accumulator(..., deterministic=True) (or pass "
                     "deterministic=False)", "None (allocated with deterministic=False)"):
            fe.gqa_accumulate(pk, pv, plain)
        fe.gqa_accumulate(pk, pv, plain, deterministic=False)
    finally:
        torch.use_deterministic_algorithms(before)
    assert ops["gqa_accumulate"].calls[0][1]["deterministic"] is True
    assert ops["gqa_accumulate"].calls[1][1]["deterministic"] is False
    with _raises("gqa_accumulate", "acc.semaphores",
                 "an int32 workspace because deterministic=True: allocate the accumulator with "
                 "flash_epilogue.gqa_accumulator(..., deterministic=True) (or pass deterministic=False)",
                 "None (allocated with deterministic=False)"):
        fe.gqa_accumulate(pk, pv, plain, deterministic=True)
    # the sm_80 path's accumulator goes with _arch=80
    acc80 = fe.gqa_accumulator(2, 64, batch=2, seqlen=16, device="cpu", arch=80)
    fe.gqa_accumulate(pk, pv, acc80)
    assert ops["gqa_accumulate"].calls[-1][1]["_arch"] == 80


def test_accumulate_wrapper_checks_the_accumulator(sm90, ops):
    pk = torch.zeros(2, 16, 4, 64)
    with _raises("gqa_accumulate", "acc", "a flash_epilogue.GQAAccumulator (from flash_epilogue.gqa_accumulator)",
                 "tuple"):
        fe.gqa_accumulate(pk, pk.clone(), (torch.zeros(1), torch.zeros(1)))
    # same tile shape, other problem: named by the accumulator's field
    acc = fe.gqa_accumulator(2, 72, batch=2, seqlen=16, device="cpu")  # a 96 tile too
    with _raises("gqa_accumulate", "acc.head_dim", "80 (dk_partial.shape[-1])", "72"):
        fe.gqa_accumulate(torch.zeros(2, 16, 4, 80), torch.zeros(2, 16, 4, 72), acc)
    with _raises("gqa_accumulate", "acc.head_dim_v", "80 (dv_partial.shape[-1])", "72"):
        fe.gqa_accumulate(torch.zeros(2, 16, 4, 72), torch.zeros(2, 16, 4, 80), acc)
    acc = fe.gqa_accumulator(2, 64, batch=2, seqlen=20, device="cpu")
    with _raises("gqa_accumulate", "acc.rows", "16 (dk_partial.shape[1], the seqlen)", "20"):
        fe.gqa_accumulate(pk, pk.clone(), acc)
    acc = fe.gqa_accumulator(2, 64, batch=2, total_tokens=32, device="cpu")  # varlen, 1 tile + 2 * 128 rows
    cs = cu(0, 16, 32)
    with _raises("gqa_accumulate", "acc.varlen", "False: the call's layout is batched (cu_seqlens None)", "True"):
        fe.gqa_accumulate(torch.zeros(2, 16, 4, 64), torch.zeros(2, 16, 4, 64),
                          fe.GQAAccumulator(torch.zeros(2, 2, 1, 8192), torch.zeros(2, 2, 1, 8192), None, 64, 64,
                                            128, 8192, 90, 2, 2, 16, True))
    fe.gqa_accumulate(torch.zeros(32, 4, 64), torch.zeros(32, 4, 64), acc, cu_seqlens=cs)
    with _raises("gqa_accumulate", "acc.batch", "2 (cu_seqlens.numel() - 1)", "3"):
        fe.gqa_accumulate(torch.zeros(32, 4, 64), torch.zeros(32, 4, 64),
                          fe.GQAAccumulator(acc.dk_accum, acc.dv_accum, None, 64, 64, 128, 8192, 90, 2, 3, 32, True),
                          cu_seqlens=cs)
    assert len(ops["gqa_accumulate"].calls) == 1


def test_accumulate_wrapper_content_checks(sm90, ops):
    acc = fe.gqa_accumulator(1, 64, batch=2, total_tokens=32, device="cpu")
    p = torch.zeros(32, 2, 64)
    with _raises("gqa_accumulate", "cu_seqlens[2]", ">= cu_seqlens[1] = 20 (non-decreasing)", "10"):
        fe.gqa_accumulate(p, p.clone(), acc, cu_seqlens=cu(0, 20, 10), check_inputs=True)
    with _raises("gqa_accumulate", "seqused[1]", "<= 12 (the length of segment 1, cu_seqlens[2] - cu_seqlens[1])", "13"):
        fe.gqa_accumulate(p, p.clone(), acc, cu_seqlens=cu(0, 20, 32), seqused=cu(1, 13), check_inputs=True)
    fe.gqa_accumulate(p, p.clone(), acc, cu_seqlens=cu(0, 20, 10))  # unchecked by default: the kernel clamps
    assert len(ops["gqa_accumulate"].calls) == 1


def test_postprocess_wrapper(sm90, ops):
    acc = fe.gqa_accumulator(2, 192, 128, batch=2, seqlen=50, device="cpu", arch=80)
    dk, dv = torch.zeros(2, 50, 2, 192, dtype=BF16), torch.zeros(2, 50, 2, 128, dtype=BF16)
    fe.gqa_postprocess(acc, dk, dv, scale_dk=0.5, scale_dv=2)
    (args, kw), = ops["gqa_postprocess"].calls
    assert args == (acc.dk_accum, acc.dv_accum, dk, dv)
    assert kw == {"scale_dk": 0.5, "scale_dv": 2.0, "cu_seqlens": None, "seqused": None, "_arch": 80}
    assert isinstance(kw["scale_dv"], float)
    with _raises("gqa_postprocess", "acc.head_dim_v", "120 (dv.shape[-1])", "128"):
        fe.gqa_postprocess(acc, dk, torch.zeros(2, 50, 2, 120, dtype=BF16))
    with _raises("gqa_postprocess", "acc", "a flash_epilogue.GQAAccumulator (from flash_epilogue.gqa_accumulator)",
                 "Tensor"):
        fe.gqa_postprocess(acc.dk_accum, dk, dv)
    with _raises_re(r"^flash_epilogue\.gqa_postprocess: dk_accum: shape: expected \(2, 3, 1, 18432\)"):
        fe.gqa_postprocess(acc, torch.zeros(2, 50, 3, 192, dtype=BF16), torch.zeros(2, 50, 3, 128, dtype=BF16))
    with _raises("gqa_postprocess", "seqused[0]", "<= 50 (the static seqlen)", "51"):
        fe.gqa_postprocess(acc, dk, dv, seqused=cu(51, 0), check_inputs=True)


def test_to_dense_wrapper(sm90, ops):
    acc = fe.gqa_accumulator(2, 192, 128, batch=2, seqlen=50, device="cpu")
    dk_d, dv_d = acc.to_dense()
    assert dk_d.shape == (2, 50, 2, 192) and dv_d.shape == (2, 50, 2, 128) and dk_d.dtype == F32
    assert (dk_d == 0).all() and dv_d.is_contiguous()
    (a0, k0), (a1, k1) = ops["gqa_accum_to_dense"].calls
    assert a0 == (acc.dk_accum, dk_d) and a1 == (acc.dv_accum, dv_d)
    assert k0 == {"head_dim": 192, "cu_seqlens": None, "seqused": None, "_arch": 90} and k1["head_dim"] == 192
    cs = cu(0, 10, 10, 40)
    accv = fe.gqa_accumulator(1, 256, cu_seqlens=cs, total_tokens=41, device="cpu", arch=80)
    dk_d, dv_d = accv.to_dense(cu_seqlens=cs, seqused=cu(1, 0, 3))
    assert dk_d.shape == dv_d.shape == (41, 1, 256)
    assert ops["gqa_accum_to_dense"].calls[-1][1]["_arch"] == 80
    with _raises("gqa_accum_to_dense", "cu_seqlens", "the int32 cu_seqlens the varlen accumulator was filled with",
                 "None"):
        accv.to_dense()
    with _raises("gqa_accum_to_dense", "cu_seqlens", "None for an accumulator of the batched layout", "a tensor"):
        acc.to_dense(cu_seqlens=cs)
    with _raises("gqa_accum_to_dense", "acc.batch", "2 (cu_seqlens.numel() - 1)", "3"):
        accv.to_dense(cu_seqlens=cu(0, 10, 41))


def test_reduce_wrapper_allocates(sm90, ops):
    pk, pv = torch.zeros(2, 16, 6, 64), torch.zeros(2, 16, 6, 32)
    dk, dv = fe.gqa_reduce(pk, pv, num_heads_kv=2, scale_dk=0.25)
    assert dk.shape == (2, 16, 2, 64) and dv.shape == (2, 16, 2, 32)
    assert dk.dtype == dv.dtype == BF16 and dk.is_contiguous() and dv.is_contiguous()
    (args, kw), = ops["gqa_reduce"].calls
    assert args == (pk, pv, dk, dv)
    assert kw == {"cu_seqlens": None, "seqused": None, "scale_dk": 0.25, "scale_dv": 1.0, "_arch": 0}
    # dK only; 16-bit partials give their dtype; out_dtype; varlen; _arch
    dk = fe.gqa_reduce(pk.half(), num_heads_kv=3)
    assert isinstance(dk, torch.Tensor) and dk.dtype == F16 and dk.shape == (2, 16, 3, 64)
    assert ops["gqa_reduce"].calls[-1][0][1] is None and ops["gqa_reduce"].calls[-1][0][3] is None
    assert fe.gqa_reduce(pk, num_heads_kv=6, out_dtype=F16).dtype == F16
    dk = fe.gqa_reduce(torch.zeros(30, 4, 64), num_heads_kv=1, cu_seqlens=cu(0, 10, 30), _arch=80)
    assert dk.shape == (30, 1, 64) and ops["gqa_reduce"].calls[-1][1]["_arch"] == 80
    # (batch, h_q, seqlen, d) storage seen as (batch, seqlen, h_q, d): the output is (b, s, h_k, d) contiguous
    dk = fe.gqa_reduce(torch.zeros(2, 6, 16, 64).transpose(1, 2), num_heads_kv=2)
    assert dk.shape == (2, 16, 2, 64) and dk.is_contiguous()


def test_reduce_wrapper_out(sm90, ops):
    pk, pv = torch.zeros(2, 16, 4, 64), torch.zeros(2, 16, 4, 64)
    dk, dv = torch.zeros(2, 16, 2, 64, dtype=F16), torch.zeros(2, 16, 2, 64, dtype=F16)
    ret = fe.gqa_reduce(pk, pv, num_heads_kv=2, out=(dk, dv))
    assert ret[0] is dk and ret[1] is dv
    assert fe.gqa_reduce(pk, num_heads_kv=2, out=dk) is dk
    assert fe.gqa_reduce(pk, num_heads_kv=2, out=[dk, None]) is dk
    assert fe.gqa_reduce(pk, num_heads_kv=2, out=dk, out_dtype=F16) is dk
    with _raises("gqa_reduce", "out", "a (dk, dv) pair because dv_partial is given", "a torch.Tensor"):
        fe.gqa_reduce(pk, pv, num_heads_kv=2, out=dk)
    with _raises("gqa_reduce", "out", "None, a tensor (dk) or a (dk, dv) pair", "a tuple of length 3"):
        fe.gqa_reduce(pk, pv, num_heads_kv=2, out=(dk, dv, dv))
    with _raises("gqa_reduce", "out_dtype", "None or torch.float16 (the dtype of out)", "torch.bfloat16"):
        fe.gqa_reduce(pk, num_heads_kv=2, out=dk, out_dtype=BF16)
    with _raises("gqa_reduce", "num_heads_kv", "2 (the heads of out: dk.shape[-2])", "4"):
        fe.gqa_reduce(pk, num_heads_kv=4, out=dk)
    with _raises("gqa_reduce", "dv", "None because dv_partial is None", "Tensor"):
        fe.gqa_reduce(pk, num_heads_kv=2, out=(dk, dv))
    assert len(ops["gqa_reduce"].calls) == 4


def test_reduce_wrapper_errors(sm90, ops):
    pk = torch.zeros(2, 16, 4, 64)
    with _raises("gqa_reduce", "num_heads_kv", "a divisor of the 4 query heads (dk_partial.shape[-2])", "3"):
        fe.gqa_reduce(pk, num_heads_kv=3)
    with _raises("gqa_reduce", "num_heads_kv", "a positive int", "0"):
        fe.gqa_reduce(pk, num_heads_kv=0)
    with _raises("gqa_reduce", "num_heads_kv", "a positive int", "2.0"):
        fe.gqa_reduce(pk, num_heads_kv=2.0)
    with _raises("gqa_reduce", "out_dtype", "None, torch.float16 or torch.bfloat16", "torch.float32"):
        fe.gqa_reduce(pk, num_heads_kv=2, out_dtype=F32)
    with _raises("gqa_reduce", "dk_partial", "a torch.Tensor", "list"):
        fe.gqa_reduce([1.0], num_heads_kv=2)
    with _raises("gqa_reduce", "dk_partial: rank", "3 dims (total_tokens, heads, headdim) because cu_seqlens is given",
                 "4 dims, shape (2, 16, 4, 64)"):
        fe.gqa_reduce(pk, num_heads_kv=2, cu_seqlens=cu(0, 16))
    with _raises("gqa_reduce", "dk_partial: dtype", "torch.float32 or torch.bfloat16 (the dtype of dk)",
                 "torch.float64"):
        fe.gqa_reduce(pk.double(), num_heads_kv=2)
    with _raises("gqa_reduce", "cu_seqlens[1]", "<= 16 (the tensors' token count)", "17"):
        fe.gqa_reduce(torch.zeros(16, 4, 64), num_heads_kv=2, cu_seqlens=cu(0, 17), check_inputs=True)
    assert not ops["gqa_reduce"].calls


# ---------------------------------------------------------------------------------------------
# references


def test_accumulate_reference_orders_and_rows():
    # sequential: ((acc + p0) + p1) + p2 in fp32, head order; fp64 mode: exact
    p = torch.tensor([1e8, 1.0, -1e8], dtype=F32).reshape(1, 1, 3, 1).expand(1, 1, 3, 8).contiguous()
    dk = torch.zeros(1, 1, 1, 8)
    gqa_accumulate_reference(p, None, dk, None, num_heads_kv=1)
    assert dk[0, 0, 0, 0].item() == 0.0
    dk64 = torch.zeros(1, 1, 1, 8, dtype=torch.float64)
    gqa_accumulate_reference(p, None, dk64, None, num_heads_kv=1, sequential=False)
    assert dk64[0, 0, 0, 0].item() == 1.0
    # accumulates across calls, only over valid rows
    pk = torch.randn(2, 5, 4, 8)
    acc = torch.zeros(2, 5, 2, 8)
    used = cu(5, 2)
    gqa_accumulate_reference(pk, pk, acc, acc.clone(), num_heads_kv=2, seqused=used)
    gqa_accumulate_reference(pk, pk, acc, acc.clone(), num_heads_kv=2, seqused=used)
    one = (torch.zeros(2, 5, 2, 8) + pk[:, :, 0::2]) + pk[:, :, 1::2]
    assert torch.equal(acc[0], (one[0] + pk[0, :, 0::2]) + pk[0, :, 1::2])
    assert (acc[1, 2:] == 0).all()
    # varlen
    pv = torch.randn(10, 6, 8)
    dense = torch.zeros(10, 3, 8)
    gqa_accumulate_reference(pv, None, dense, None, num_heads_kv=3, cu_seqlens=cu(0, 4, 9))
    assert torch.equal(dense[:9], (torch.zeros(9, 3, 8) + pv[:9, 0::2]) + pv[:9, 1::2])
    assert (dense[9] == 0).all()
    with pytest.raises(ValueError):
        gqa_accumulate_reference(pv, None, dense.double(), None, num_heads_kv=3, cu_seqlens=cu(0, 10))
    with pytest.raises(ValueError):
        gqa_accumulate_reference(pv, None, dense[:, :2], None, num_heads_kv=3, cu_seqlens=cu(0, 10))
    with pytest.raises(ValueError):
        gqa_accumulate_reference(pv, pv, dense, None, num_heads_kv=3, cu_seqlens=cu(0, 10))


def test_reduce_reference_sequential():
    torch.manual_seed(0)
    p = torch.randn(2, 7, 8, 16) * 100
    seq = gqa_reduce_reference(p, 2, out_dtype=BF16, scale=0.3, sequential=True)
    g = p.unflatten(2, (2, 4))  # q head j -> kv head j // 4
    acc = torch.zeros(2, 7, 2, 16)
    for j in range(4):
        acc = acc + g[:, :, :, j]
    assert torch.equal(seq, (acc * torch.tensor(0.3, dtype=F32)).to(BF16))


# ---------------------------------------------------------------------------------------------
# fake kernels


def _fake_calls(device):
    """Every GQA op and wrapper on fake tensors: the fakes return nothing, the wrappers' outputs
    have the right metadata."""
    out = []
    cs = torch.tensor([0, 40, 100], dtype=I32, device=device)
    for varlen in (False, True):
        lead = (100,) if varlen else (2, 50)
        seq = {"cu_seqlens": cs} if varlen else {}
        alloc = {"cu_seqlens": cs, "total_tokens": 100} if varlen else {"batch": 2, "seqlen": 50}
        acc = fe.gqa_accumulator(2, 128, 64, deterministic=True, device=device, **alloc)
        pk, pv = torch.empty(lead + (8, 128), device=device), torch.empty(lead + (8, 64), device=device)
        dk = torch.empty(lead + (2, 128), dtype=BF16, device=device)
        dv = torch.empty(lead + (2, 64), dtype=BF16, device=device)
        ops = torch.ops.flash_epilogue
        out.append(ops.gqa_accumulate(pk, pv, acc.dk_accum, acc.dv_accum, acc.semaphores, deterministic=True, **seq))
        out.append(ops.gqa_postprocess(acc.dk_accum, acc.dv_accum, dk, dv, scale_dk=0.5, **seq))
        out.append(ops.gqa_accum_to_dense(acc.dk_accum, torch.empty(lead + (2, 128), device=device), head_dim=128,
                                          **seq))
        out.append(ops.gqa_reduce(pk, None, dk, None, **seq))
        assert all(o is None for o in out)
        fe.gqa_accumulate(pk, pv, acc, deterministic=True, **seq)
        fe.gqa_postprocess(acc, dk, dv, **seq)
        k, v = acc.to_dense(**seq)
        assert k.shape == lead + (2, 128) and v.shape == lead + (2, 64)
        rk, rv = fe.gqa_reduce(pk, pv, num_heads_kv=4, **seq)
        assert rk.shape == lead + (4, 128) and rv.shape == lead + (4, 64) and rk.dtype == BF16
    return out


@_STALE_BUILD
def test_gqa_fake_kernels(sm90):
    with FakeTensorMode():
        _fake_calls("cuda" if torch.cuda.is_available() else "cpu")


@_STALE_BUILD
def test_gqa_fakes_are_registered():
    from torch._library.simple_registry import singleton

    for name in GQA_OPS:
        assert singleton.find(f"flash_epilogue::{name}").fake_impl.kernel is not None


def test_gqa_fake_kernels_without_the_extension():
    # the fallback schemas (no CUDA kernels in the process) get the same fakes: tracing works anyway
    code = (
        "import torch\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "import flash_epilogue as fe, flash_epilogue.validation as V\n"
        "assert not fe.kernels_available()\n"
        "V._is_cuda_device = lambda d: True\n"
        "V._device_capability = lambda d: (9, 0)\n"
        "V._compiled_archs = lambda: ('sm_90a',)\n"
        "import test_gqa_validation as T\n"
        "with FakeTensorMode():\n"
        "    T._fake_calls('cpu')\n"
        "a = torch.zeros(1, 1, 1, 8192); p = torch.zeros(1, 8, 1, 64)\n"
        "try:\n"
        "    torch.ops.flash_epilogue.gqa_accumulate(p, p, a, a.clone())\n"
        "except fe.FlashEpilogueBuildError as e:\n"
        "    print('RAISED', e)\n"
    )
    env = dict(os.environ, FLASH_EPILOGUE_DISABLE_KERNELS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "RAISED flash_epilogue.gqa_accumulate: the CUDA kernels are not available" in out.stdout
