"""CPU tests of flash_epilogue/validation.py: every message, with CPU or meta tensors.

The device checks are reached by monkeypatching the three module-level device hooks.
"""
import re

import pytest
import torch

import flash_epilogue.validation as V
from flash_epilogue._config import tile_config
from flash_epilogue.validation import (
    FlashEpilogueBuildError,
    FlashEpilogueInputError,
    StoreProblem,
    check_seqlens_contents,
    normalized_strides,
    validate_store,
)

F16, BF16, F32, I32 = torch.float16, torch.bfloat16, torch.float32, torch.int32


def _raises(arg, expected, got, op="store"):
    """pytest.raises on the whole message: op, argument, expected and actual value."""
    msg = f"flash_epilogue.{op}: {arg}: expected {expected}, got {got}"
    return pytest.raises(FlashEpilogueInputError, match="^" + re.escape(msg) + "$")


def _raises_re(pattern):
    return pytest.raises(FlashEpilogueInputError, match=pattern)


def make(b=2, s=16, h=4, d=64, dv=None, dtype=F16, device="cpu", varlen=False):
    dv = d if dv is None else dv
    lead = (b * s, h) if varlen else (b, s, h)
    return (torch.zeros(*lead, d, dtype=F32, device=device), torch.zeros(*lead, dv, dtype=F32, device=device),
            torch.zeros(*lead, d, dtype=dtype, device=device), torch.zeros(*lead, dv, dtype=dtype, device=device))


def cu(*vals):
    return torch.tensor(vals, dtype=I32)


# ---------------------------------------------------------------------------------------------
# valid problems


def test_valid_batched(sm90):
    args = make(b=3, s=10, h=5, d=64)
    p = validate_store(*args)
    assert isinstance(p, StoreProblem)
    assert p == StoreProblem(batch=3, seqlen=10, num_heads=5, head_dim=64, head_dim_v=64, dtype=F16,
                             varlen=False, has_seqused=False, config=tile_config(64), device=torch.device("cpu"))
    with pytest.raises(Exception):
        p.batch = 4  # frozen


def test_valid_varlen_seqused_dv(sm90):
    args = make(b=2, s=8, h=3, d=192, dv=128, dtype=BF16, varlen=True)
    p = validate_store(*args, cu_seqlens=cu(0, 5, 9, 16), seqused=cu(3, 4, 7), op="my_op")
    assert (p.batch, p.seqlen, p.num_heads, p.head_dim, p.head_dim_v) == (3, 16, 3, 192, 128)
    assert p.dtype == BF16 and p.varlen and p.has_seqused
    assert p.config == tile_config(192, 128) and p.config.head_dim == 192
    # uncompiled head dims run on the next compiled config
    p = validate_store(*make(d=72, dv=40))
    assert p.config.head_dim == 96


def test_valid_batched_seqused_and_strided(sm90):
    # (batch, heads, seqlen, d) storage seen as (batch, seqlen, heads, d); padded row pitch
    dk = torch.zeros(2, 4, 16, 72, dtype=F16)[..., :64].transpose(1, 2)
    dv = torch.zeros(2, 4, 16, 64, dtype=F16).transpose(1, 2)
    dk_accum = torch.zeros(2, 16, 4, 64)
    dv_accum = torch.zeros(2, 16, 4, 68)[..., :64]
    p = validate_store(dk_accum, dv_accum, dk, dv, seqused=cu(16, 3))
    assert p.has_seqused and not p.varlen and p.batch == 2 and p.seqlen == 16


def test_size_one_dims_with_odd_strides_accepted(sm90):
    # batch 1 and heads 1 with strides that are not multiples of 16 bytes: ignored
    dk = torch.zeros(16 * 64, dtype=F16).as_strided((1, 16, 1, 64), (7, 64, 3, 1))
    dv = torch.zeros(16 * 64, dtype=F16).as_strided((1, 16, 1, 64), (5, 64, 1, 1))
    dk_accum = torch.zeros(16 * 64).as_strided((1, 16, 1, 64), (3, 64, 9, 1))
    dv_accum = torch.zeros(16 * 64).as_strided((1, 16, 1, 64), (1, 64, 1, 1))
    p = validate_store(dk_accum, dv_accum, dk, dv)
    assert p.batch == 1 and p.num_heads == 1
    # seqlen 1 with an odd row stride, varlen too
    dk = torch.zeros(64 * 2, dtype=F16).as_strided((1, 2, 64), (3, 64, 1))
    dv = torch.zeros(64 * 2, dtype=F16).as_strided((1, 2, 64), (1, 64, 1))
    validate_store(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), dk, dv, cu_seqlens=cu(0, 1))
    # the normalized strides are valid TMA strides and address the same elements
    for t in (dk, dk_accum):
        ns = normalized_strides(t)
        mult = 16 // t.element_size()
        assert all(s % mult == 0 for s, n in zip(ns[:-1], t.shape[:-1]))
        assert torch.equal(t.as_strided(t.shape, ns), t)
        assert [s for s, n in zip(ns, t.shape) if n > 1] == [s for s, n in zip(t.stride(), t.shape) if n > 1]


def test_empty_tensors_accepted(sm90):
    # no elements: stride, alignment and overlap checks do not apply
    e32 = torch.zeros(0, 4, 64)
    e16 = torch.zeros(0, 4, 64, dtype=F16)
    p = validate_store(e32, e32.clone(), e16, e16.clone(), cu_seqlens=cu(0, 0))
    assert p.seqlen == 0 and p.batch == 1
    p = validate_store(*make(b=0))
    assert p.batch == 0


def test_meta_tensors_accepted(sm90):
    p = validate_store(*make(device="meta", dtype=BF16))
    assert p.device == torch.device("meta")
    # separately allocated meta tensors never count as overlapping
    dk_accum, dv_accum, dk, dv = make(device="meta")
    validate_store(dk_accum, dv_accum, dk, dv, seqused=torch.zeros(2, dtype=I32, device="meta"))


# ---------------------------------------------------------------------------------------------
# a. tensors


@pytest.mark.parametrize("pos,name", [(0, "dk_accum"), (1, "dv_accum"), (2, "dk"), (3, "dv")])
def test_not_a_tensor(pos, name):
    args = list(make())
    args[pos] = [1.0, 2.0]
    with _raises(name, "a torch.Tensor", "list"):
        validate_store(*args)


def test_none_tensor():
    args = list(make())
    args[2] = None
    with _raises("dk", "a torch.Tensor", "NoneType"):
        validate_store(*args)


# ---------------------------------------------------------------------------------------------
# b. dtypes


@pytest.mark.parametrize("pos,name", [(0, "dk_accum"), (1, "dv_accum")])
def test_accum_dtype(pos, name):
    args = list(make())
    args[pos] = args[pos].to(BF16)
    with _raises(f"{name}: dtype", "torch.float32", "torch.bfloat16"):
        validate_store(*args)


def test_dk_dtype():
    dk_accum, dv_accum, dk, dv = make()
    with _raises("dk: dtype", "torch.float16 or torch.bfloat16", "torch.float32"):
        validate_store(dk_accum, dv_accum, dk.float(), dv)
    with _raises("dk: dtype", "torch.float16 or torch.bfloat16", "torch.int8"):
        validate_store(dk_accum, dv_accum, dk.to(torch.int8), dv)


def test_dv_dtype_differs():
    dk_accum, dv_accum, dk, dv = make()
    with _raises("dv: dtype", "torch.float16 (the dtype of dk)", "torch.bfloat16"):
        validate_store(dk_accum, dv_accum, dk, dv.to(BF16))


# ---------------------------------------------------------------------------------------------
# c. rank


def test_rank_batched():
    dk_accum, dv_accum, dk, dv = make()
    with _raises("dk_accum: rank", "4 dims (batch, seqlen, heads, headdim) because cu_seqlens is None",
                 "3 dims, shape (32, 4, 64)"):
        validate_store(dk_accum.flatten(0, 1), dv_accum, dk, dv)


def test_rank_varlen():
    dk_accum, dv_accum, dk, dv = make(b=1, s=8)
    with _raises("dk_accum: rank", "3 dims (total_tokens, heads, headdim) because cu_seqlens is given",
                 "4 dims, shape (1, 8, 4, 64)"):
        validate_store(dk_accum, dv_accum, dk, dv, cu_seqlens=cu(0, 8))
    with _raises("dv: rank", "3 dims (total_tokens, heads, headdim) because cu_seqlens is given",
                 "4 dims, shape (1, 8, 4, 64)"):
        validate_store(dk_accum[0], dv_accum[0], dk[0], dv, cu_seqlens=cu(0, 8))


# ---------------------------------------------------------------------------------------------
# d. shapes


def test_accum_shapes():
    dk_accum, dv_accum, dk, dv = make(s=16)
    with _raises("dk_accum: shape", "(2, 16, 4, 64) (the shape of dk)", "(2, 15, 4, 64)"):
        validate_store(dk_accum[:, :15], dv_accum, dk, dv)
    with _raises("dv_accum: shape", "(2, 16, 4, 64) (the shape of dv)", "(2, 16, 4, 32)"):
        validate_store(dk_accum, dv_accum[..., :32], dk, dv)


def test_dv_leading_shape():
    dk_accum, dv_accum, dk, dv = make(h=4, dv=32)
    with _raises("dv: shape", "(2, 16, 4, '*') (dk's shape but the last dim)", "(2, 16, 3, 32)"):
        validate_store(dk_accum, dv_accum[:, :, :3], dk, dv[:, :, :3])


# ---------------------------------------------------------------------------------------------
# e. head dims


@pytest.mark.parametrize("d", [0, 4, 60, 65, 264, 512])
def test_dk_head_dim(d):
    with _raises("dk: head dim", "a multiple of 8 in [8, 256]", str(d)):
        validate_store(*make(d=d, dv=64))


@pytest.mark.parametrize("dv", [0, 12, 257, 272])
def test_dv_head_dim(dv):
    with _raises("dv: head dim", "a multiple of 8 in [8, 256]", str(dv)):
        validate_store(*make(d=64, dv=dv))


# ---------------------------------------------------------------------------------------------
# f. last-dim stride


@pytest.mark.parametrize("pos,name", [(0, "dk_accum"), (1, "dv_accum"), (2, "dk"), (3, "dv")])
def test_last_stride(pos, name):
    args = list(make(s=4, h=2, d=64))
    t = args[pos]
    args[pos] = torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype)[..., ::2]
    with _raises(f"{name}: stride(-1)", "1 (last dim contiguous)", "2 (strides (1024, 256, 128, 2))"):
        validate_store(*args)


def test_last_stride_transposed():
    dk_accum, dv_accum, dk, dv = make(b=1, s=64, h=1, d=64)
    dk = torch.zeros(1, 64, 1, 64, dtype=F16).transpose(1, 3)
    with _raises("dk: stride(-1)", "1 (last dim contiguous)", "64 (strides (4096, 1, 64, 64))"):
        validate_store(dk_accum, dv_accum, dk, dv)


# ---------------------------------------------------------------------------------------------
# g. other strides


def test_stride_multiple_16bit():
    dk_accum, dv_accum, dk, dv = make(s=4, h=2)
    dv = torch.zeros(2, 4, 2, 68, dtype=F16)[..., :64]
    with _raises("dv: stride(2)", "a non-negative multiple of 8 elements (16 bytes)",
                 "68 (shape (2, 4, 2, 64), strides (544, 136, 68, 1))"):
        validate_store(dk_accum, dv_accum, dk, dv)


def test_stride_multiple_fp32():
    dk_accum, dv_accum, dk, dv = make(s=4, h=2)
    dk_accum = torch.zeros(2, 4, 2, 66)[..., :64]
    with _raises("dk_accum: stride(2)", "a non-negative multiple of 4 elements (16 bytes)",
                 "66 (shape (2, 4, 2, 64), strides (528, 132, 66, 1))"):
        validate_store(dk_accum, dv_accum, dk, dv)
    # a stride of 68 floats (272 bytes) is fine for fp32 but 68 halves (136 bytes) is not for fp16
    V._check_strides("store", "dk_accum", torch.zeros(2, 4, 2, 68)[..., :64])


def test_stride_outer_dim_varlen():
    dk_accum, dv_accum, dk, dv = make(b=1, s=6, h=2, varlen=True)
    dk = torch.zeros(6, 2 * 64 + 4, dtype=F16)[:, :128].unflatten(1, (2, 64))
    with _raises("dk: stride(0)", "a non-negative multiple of 8 elements (16 bytes)",
                 "132 (shape (6, 2, 64), strides (132, 64, 1))"):
        validate_store(dk_accum, dv_accum, dk, dv, cu_seqlens=cu(0, 6))


def test_negative_stride():
    # torch cannot build negative strides; the shared helper rejects them all the same
    with _raises("dk: stride(1)", "a non-negative multiple of 8 elements (16 bytes)",
                 "-64 (shape (2, 4, 2, 64), strides (512, -64, 128, 1))"):
        V._check_stride_values("store", "dk", (2, 4, 2, 64), (512, -64, 128, 1), 2)
    V._check_stride_values("store", "dk", (2, 1, 2, 64), (512, -3, 128, 1), 2)  # size 1: ignored


# ---------------------------------------------------------------------------------------------
# h. alignment


def test_misaligned_data_ptr():
    dk_accum, dv_accum, dk, dv = make(s=4, h=2)
    buf = torch.zeros(dk.numel() + 8, dtype=F16)
    dk = buf[1:1 + dk.numel()].view(dk.shape)
    ptr = dk.data_ptr()
    with _raises("dk: data_ptr", "a 16-byte aligned address", f"{ptr:#x} (address % 16 = {ptr % 16})"):
        validate_store(dk_accum, dv_accum, dk, dv)


def test_misaligned_data_ptr_fp32():
    dk_accum, dv_accum, dk, dv = make(s=4, h=2)
    buf = torch.zeros(dv_accum.numel() + 4)
    dv_accum = buf[2:2 + dv_accum.numel()].view(dv_accum.shape)
    with _raises_re(r"^flash_epilogue\.store: dv_accum: data_ptr: expected a 16-byte aligned address, "
                    r"got 0x[0-9a-f]+ \(address % 16 = 8\)$"):
        validate_store(dk_accum, dv_accum, dk, dv)


def test_misaligned_meta_storage_offset():
    dk_accum, dv_accum, dk, dv = make(s=4, h=2, device="meta")
    dv = torch.zeros(dv.numel() + 8, dtype=F16, device="meta")[3:3 + dv.numel()].view(dv.shape)
    with _raises("dv: storage_offset", "a multiple of 16 bytes", "3 elements = 6 bytes"):
        validate_store(dk_accum, dv_accum, dk, dv)
    # aligned offsets pass (a multiple of 8 halves)
    V._check_alignment("store", "dv", torch.zeros(100, dtype=F16, device="meta")[8:])


# ---------------------------------------------------------------------------------------------
# i. aliasing


def test_dk_dv_overlap():
    dk_accum, dv_accum, dk, dv = make(s=4, h=2, d=64)
    base = torch.zeros(2, 4, 2, 128, dtype=F16)
    with _raises_re(r"^flash_epilogue\.store: dv: memory: expected no overlap with dk, "
                    r"got bytes \[0x[0-9a-f]+, 0x[0-9a-f]+\) overlapping dk's \[0x[0-9a-f]+, 0x[0-9a-f]+\)$"):
        validate_store(dk_accum, dv_accum, base[..., :64], base[..., 32:96])
    with _raises_re(r"dv: memory: expected no overlap with dk, got bytes"):
        validate_store(dk_accum, dv_accum, dk, dk)


def test_dk_dv_overlap_meta():
    dk_accum, dv_accum, dk, dv = make(s=4, h=2, device="meta")
    with _raises("dv: memory", "no overlap with dk", "bytes [0x0, 0x800) overlapping dk's [0x0, 0x800)"):
        validate_store(dk_accum, dv_accum, dk, dk)
    base = torch.empty(2 * dk.numel(), dtype=F16, device="meta")
    # adjacent halves of one storage: disjoint
    V._check_no_overlap("store", "dv", base[dk.numel():], "dk", base[:dk.numel()])


@pytest.mark.parametrize("out_name,in_name", [("dk", "dk_accum"), ("dk", "dv_accum"), ("dv", "dk_accum"),
                                              ("dv", "dv_accum")])
def test_output_overlaps_input(out_name, in_name):
    args = dict(zip(["dk_accum", "dv_accum", "dk", "dv"], make(s=4, h=2)))
    raw = torch.zeros(args[in_name].numel() * 4, dtype=torch.uint8)
    args[in_name] = raw.view(F32).view(args[in_name].shape)
    args[out_name] = raw.view(F16)[:args[out_name].numel()].view(args[out_name].shape)
    with _raises_re(rf"^flash_epilogue\.store: {out_name}: memory: expected no overlap with {in_name}, "
                    rf"got bytes \[0x[0-9a-f]+, 0x[0-9a-f]+\) overlapping {in_name}'s"):
        validate_store(**args)


@pytest.mark.parametrize("which", ["cu_seqlens", "seqused"])
def test_output_overlaps_seqlens(which):
    dk_accum, dv_accum, dk, dv = make(b=2, s=4, h=2, varlen=True)
    view = dv.view(I32).reshape(-1)
    kw = {"cu_seqlens": cu(0, 4, 8), "seqused": cu(4, 4)}
    kw[which] = view[:3] if which == "cu_seqlens" else view[:2]
    with _raises_re(rf"^flash_epilogue\.store: dv: memory: expected no overlap with {which}, got bytes"):
        validate_store(dk_accum, dv_accum, dk, dv, **kw)


# ---------------------------------------------------------------------------------------------
# j. cu_seqlens / seqused metadata


def _varlen():
    return make(b=2, s=4, h=2, varlen=True)


def test_cu_seqlens_not_tensor():
    with _raises("cu_seqlens", "a torch.Tensor", "list"):
        validate_store(*_varlen(), cu_seqlens=[0, 4, 8])


def test_cu_seqlens_dtype():
    with _raises("cu_seqlens: dtype", "torch.int32", "torch.int64"):
        validate_store(*_varlen(), cu_seqlens=torch.tensor([0, 4, 8]))


def test_cu_seqlens_rank():
    with _raises("cu_seqlens: rank", "1 dim (batch + 1,)", "2 dims, shape (1, 3)"):
        validate_store(*_varlen(), cu_seqlens=cu(0, 4, 8)[None])


def test_cu_seqlens_contiguous():
    with _raises("cu_seqlens: stride(0)", "1 (contiguous)", "2"):
        validate_store(*_varlen(), cu_seqlens=cu(0, 9, 4, 9, 8)[::2])


@pytest.mark.parametrize("vals", [(0,), ()])
def test_cu_seqlens_numel(vals):
    with _raises("cu_seqlens: numel", "batch + 1 >= 2 (at least one sequence)", str(len(vals))):
        validate_store(*_varlen(), cu_seqlens=cu(*vals))


def test_seqused_not_tensor():
    with _raises("seqused", "a torch.Tensor", "tuple"):
        validate_store(*make(), seqused=(1, 2))


def test_seqused_dtype():
    with _raises("seqused: dtype", "torch.int32", "torch.float32"):
        validate_store(*make(), seqused=torch.tensor([1.0, 2.0]))


def test_seqused_rank():
    with _raises("seqused: rank", "1 dim", "2 dims, shape (2, 1)"):
        validate_store(*make(), seqused=cu(1, 2)[:, None])


def test_seqused_contiguous():
    with _raises("seqused: stride(0)", "1 (contiguous)", "3"):
        validate_store(*make(), seqused=cu(1, 0, 0, 2, 0, 0)[::3])


def test_seqused_numel_batched():
    with _raises("seqused: numel", "2 (batch = dk.shape[0])", "3"):
        validate_store(*make(b=2), seqused=cu(1, 2, 3))


def test_seqused_numel_varlen():
    with _raises("seqused: numel", "2 (batch = cu_seqlens.numel() - 1)", "1"):
        validate_store(*_varlen(), cu_seqlens=cu(0, 4, 8), seqused=cu(3))


# ---------------------------------------------------------------------------------------------
# k. devices, build, arch


def test_cpu_tensor_rejected_by_default():
    with _raises("dk_accum: device", "a CUDA tensor", "a tensor on cpu"):
        validate_store(*make())


def test_meta_tensor_rejected(monkeypatch):
    monkeypatch.setattr(V, "_is_cuda_device", lambda device: device.type == "cpu")
    dk_accum, dv_accum, dk, _ = make()
    dv = torch.zeros(dk.shape, dtype=F16, device="meta")
    with _raises("dv: device", "a CUDA tensor", "a tensor on meta"):
        validate_store(dk_accum, dv_accum, dk, dv)
    with _raises("seqused: device", "a CUDA tensor", "a tensor on meta"):
        validate_store(*make(), seqused=torch.zeros(2, dtype=I32, device="meta"))


def test_mixed_devices(sm90):
    dk_accum, dv_accum, dk, _ = make()
    dv = torch.zeros(dk.shape, dtype=F16, device="meta")
    with _raises("dv: device", "cpu (the device of dk_accum)", "meta"):
        validate_store(dk_accum, dv_accum, dk, dv)
    cs = torch.tensor([0, 4, 8], dtype=I32, device="meta")
    with _raises("cu_seqlens: device", "cpu (the device of dk_accum)", "meta"):
        validate_store(*_varlen(), cu_seqlens=cs)


def test_no_kernels_compiled(monkeypatch):
    monkeypatch.setattr(V, "_is_cuda_device", lambda device: True)
    monkeypatch.setattr(V, "_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(V, "_compiled_archs", lambda: ())
    with pytest.raises(FlashEpilogueBuildError,
                       match=r"flash_epilogue\.store: the package was installed without its CUDA kernels "
                             r"\(FLASH_EPILOGUE_SKIP_CUDA_BUILD.*pip install --no-build-isolation \.") as e:
        validate_store(*make())
    assert isinstance(e.value, RuntimeError) and not isinstance(e.value, ValueError)


def test_default_compiled_archs_without_extension(monkeypatch):
    # on this CPU machine the extension is absent (or was built): either way a tuple of str
    archs = V._compiled_archs()
    assert isinstance(archs, tuple) and all(isinstance(a, str) for a in archs)
    from flash_epilogue import _extension
    monkeypatch.setattr(_extension, "_C", None)  # as when the extension failed to load
    assert V._compiled_archs() == ()


def test_default_is_cuda_device():
    assert V._is_cuda_device(torch.device("cuda", 0))
    assert not V._is_cuda_device(torch.device("cpu"))
    assert not V._is_cuda_device(torch.device("meta"))


@pytest.mark.parametrize("cap,archs,got", [
    ((8, 0), ("sm_90a",), "sm_80"),
    ((8, 9), ("sm_90a",), "sm_89"),
    ((10, 0), ("sm_90a",), "sm_100"),
    ((9, 0), ("sm_80",), "sm_90"),
])
def test_wrong_capability(monkeypatch, cap, archs, got):
    monkeypatch.setattr(V, "_is_cuda_device", lambda device: True)
    monkeypatch.setattr(V, "_device_capability", lambda device: cap)
    monkeypatch.setattr(V, "_compiled_archs", lambda: archs)
    with _raises("device", f"a GPU of compute capability sm_90 (compiled for {', '.join(archs)})",
                 f"cpu with compute capability {got}"):
        validate_store(*make())


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (9, 0)])
def test_sm80_build_runs_on_ampere_and_hopper(monkeypatch, cap):
    # an "80;90a" build: sm_8x devices take the sm_80 path, sm_90 the sm_90a kernels
    monkeypatch.setattr(V, "_is_cuda_device", lambda device: True)
    monkeypatch.setattr(V, "_device_capability", lambda device: cap)
    monkeypatch.setattr(V, "_compiled_archs", lambda: ("sm_80", "sm_90a"))
    validate_store(*make())


def test_check_order_earlier_errors_win():
    # a bad dtype and a CPU device: the dtype message comes first
    dk_accum, dv_accum, dk, dv = make()
    with _raises("dk_accum: dtype", "torch.float32", "torch.float16"):
        validate_store(dk_accum.half(), dv_accum, dk.float(), dv)
    # bad head dim and bad strides: head dim first
    with _raises("dk: head dim", "a multiple of 8 in [8, 256]", "12"):
        validate_store(*make(d=12))


def test_op_name_in_message():
    with _raises("dk", "a torch.Tensor", "int", op="store_zero"):
        validate_store(*make()[:2], 3, make()[3], op="store_zero")


def test_error_is_value_error():
    assert issubclass(FlashEpilogueInputError, ValueError)
    assert issubclass(FlashEpilogueBuildError, RuntimeError)


# ---------------------------------------------------------------------------------------------
# check_seqlens_contents


def test_contents_valid():
    check_seqlens_contents(cu(0, 4, 4, 9), cu(4, 0, 3), total=10, op="store")
    check_seqlens_contents(None, cu(3, 8), total=16, seqlen_static=8, op="store")
    check_seqlens_contents(cu(0, 0), None, total=0, op="store")


def test_contents_first_negative():
    with _raises("cu_seqlens[0]", ">= 0", "-1"):
        check_seqlens_contents(cu(-1, 4), None, total=8, op="store")


def test_contents_non_monotonic():
    with _raises("cu_seqlens[2]", ">= cu_seqlens[1] = 5 (non-decreasing)", "3"):
        check_seqlens_contents(cu(0, 5, 3, 8), None, total=8, op="store")


def test_contents_past_total():
    with _raises("cu_seqlens[2]", "<= 8 (the tensors' token count)", "9", op="gqa_reduce"):
        check_seqlens_contents(cu(0, 5, 9), None, total=8, op="gqa_reduce")


def test_contents_seqused_negative():
    with _raises("seqused[1]", ">= 0", "-2"):
        check_seqlens_contents(cu(0, 4, 8), cu(4, -2), total=8, op="store")


def test_contents_seqused_too_long_varlen():
    with _raises("seqused[1]", "<= 3 (the length of segment 1, cu_seqlens[2] - cu_seqlens[1])", "4"):
        check_seqlens_contents(cu(0, 5, 8), cu(5, 4), total=8, op="store")


def test_contents_seqused_too_long_batched():
    with _raises("seqused[0]", "<= 6 (the static seqlen)", "7"):
        check_seqlens_contents(None, cu(7, 1), total=12, seqlen_static=6, op="store")
    with _raises("seqused[1]", "<= 12 (the static seqlen)", "13"):
        check_seqlens_contents(None, cu(7, 13), total=12, op="store")


def test_packed_outputs_that_share_no_element_are_accepted():
    # dk/dv interleaved in one buffer (FlashAttention's packed dkv, or one tensor split along d):
    # the byte ranges overlap but no element is shared
    kv = torch.empty(2, 5, 2, 3, 64, dtype=F16)
    V._check_no_overlap("store", "dv", kv[:, :, 1], "dk", kv[:, :, 0])
    both = torch.empty(2, 5, 3, 128, dtype=F16)
    V._check_no_overlap("store", "dv", both[..., 64:], "dk", both[..., :64])
    rows = torch.empty(2, 10, 3, 64, dtype=F16)
    V._check_no_overlap("store", "dv", rows[:, 5:], "dk", rows[:, :5])
    with _raises_re(r"dv: memory: expected no overlap with dk"):
        V._check_no_overlap("store", "dv", rows[:, 4:], "dk", rows[:, :5])


# ---------------------------------------------------------------------------------------------
# store_zero: validate_store_zero, check_index_contents, the wrapper's index conversion

from flash_epilogue import ops as fe_ops  # noqa: E402
from flash_epilogue.validation import check_index_contents, validate_store_zero  # noqa: E402


def _zraises(arg, expected, got):
    return _raises(arg, expected, got, op="store_zero")


def zmake(b=2, s=16, h=4, d=64, dv=None, dtype=F16, device="cpu", varlen=False):
    return make(b=b, s=s, h=h, d=d, dv=dv, dtype=dtype, device=device, varlen=varlen)[2:]


def test_zero_valid_batched(sm90):
    dk, dv = zmake(b=3, s=10, h=5, d=64, dv=32)
    p = validate_store_zero(dk, dv)
    assert p == StoreProblem(batch=3, seqlen=10, num_heads=5, head_dim=64, head_dim_v=32, dtype=F16,
                             varlen=False, has_seqused=False, config=tile_config(64, 32), device=torch.device("cpu"))
    # selections of any length, empty ones too; row_end == row_start (empty range) is fine
    p = validate_store_zero(dk, dv, seqused=cu(1, 2, 3), batch_idx=cu(0, 0, 7, -1), head_idx=cu(),
                            row_start=4, row_end=4)
    assert p.has_seqused
    validate_store_zero(dk, dv, batch_idx=cu(), head_idx=cu(3), row_start=0, row_end=0)
    validate_store_zero(dk, dv, batch_idx=cu(1), row_start=5, row_end=None)


def test_zero_valid_varlen_meta_and_empty(sm90):
    dk, dv = zmake(b=2, s=8, h=3, d=192, dv=128, dtype=BF16, varlen=True)
    p = validate_store_zero(dk, dv, cu_seqlens=cu(0, 5, 9, 16), seqused=cu(3, 4, 7), batch_idx=cu(2, 0))
    assert (p.batch, p.seqlen, p.num_heads, p.head_dim, p.head_dim_v, p.varlen) == (3, 16, 3, 192, 128, True)
    assert p.config == tile_config(192, 128)
    dk, dv = zmake(device="meta", dtype=BF16)
    p = validate_store_zero(dk, dv, batch_idx=torch.zeros(3, dtype=I32, device="meta"))
    assert p.device == torch.device("meta")
    e = torch.zeros(0, 4, 64, dtype=F16)
    assert validate_store_zero(e, e.clone(), cu_seqlens=cu(0, 0)).seqlen == 0
    assert validate_store_zero(*zmake(b=0)).batch == 0


# a. tensors / b. dtypes


@pytest.mark.parametrize("pos,name", [(0, "dk"), (1, "dv")])
def test_zero_not_a_tensor(pos, name):
    args = list(zmake())
    args[pos] = None
    with _zraises(name, "a torch.Tensor", "NoneType"):
        validate_store_zero(*args)


def test_zero_dtypes():
    dk, dv = zmake()
    with _zraises("dk: dtype", "torch.float16 or torch.bfloat16", "torch.float32"):
        validate_store_zero(dk.float(), dv.float())
    with _zraises("dv: dtype", "torch.float16 (the dtype of dk)", "torch.bfloat16"):
        validate_store_zero(dk, dv.to(BF16))


# c. rank / d. shapes / e. head dims


def test_zero_rank():
    dk, dv = zmake(b=1, s=8)
    with _zraises("dk: rank", "4 dims (batch, seqlen, heads, headdim) because cu_seqlens is None",
                  "3 dims, shape (8, 4, 64)"):
        validate_store_zero(dk[0], dv[0])
    with _zraises("dv: rank", "3 dims (total_tokens, heads, headdim) because cu_seqlens is given",
                  "4 dims, shape (1, 8, 4, 64)"):
        validate_store_zero(dk[0], dv, cu_seqlens=cu(0, 8))


def test_zero_dv_leading_shape():
    dk, dv = zmake(h=4, dv=32)
    with _zraises("dv: shape", "(2, 16, 4, '*') (dk's shape but the last dim)", "(2, 15, 4, 32)"):
        validate_store_zero(dk, dv[:, :15])


def test_zero_head_dims():
    with _zraises("dk: head dim", "a multiple of 8 in [8, 256]", "60"):
        validate_store_zero(*zmake(d=60, dv=64))
    with _zraises("dv: head dim", "a multiple of 8 in [8, 256]", "264"):
        validate_store_zero(*zmake(d=64, dv=264))


# f. g. strides / h. alignment / i. overlap


def test_zero_strides():
    dk, dv = zmake(s=4, h=2)
    with _zraises("dv: stride(-1)", "1 (last dim contiguous)", "2 (strides (1024, 256, 128, 2))"):
        validate_store_zero(dk, torch.zeros(2, 4, 2, 128, dtype=F16)[..., ::2])
    with _zraises("dk: stride(2)", "a non-negative multiple of 8 elements (16 bytes)",
                  "68 (shape (2, 4, 2, 64), strides (544, 136, 68, 1))"):
        validate_store_zero(torch.zeros(2, 4, 2, 68, dtype=F16)[..., :64], dv)


def test_zero_alignment():
    dk, dv = zmake(s=4, h=2)
    dv = torch.zeros(dv.numel() + 8, dtype=F16)[1:1 + dv.numel()].view(dv.shape)
    ptr = dv.data_ptr()
    with _zraises("dv: data_ptr", "a 16-byte aligned address", f"{ptr:#x} (address % 16 = {ptr % 16})"):
        validate_store_zero(dk, dv)
    dk, dv = zmake(s=4, h=2, device="meta")
    dk = torch.zeros(dk.numel() + 8, dtype=F16, device="meta")[2:2 + dk.numel()].view(dk.shape)
    with _zraises("dk: storage_offset", "a multiple of 16 bytes", "2 elements = 4 bytes"):
        validate_store_zero(dk, dv)


def test_zero_dk_dv_overlap(sm90):
    base = torch.zeros(2, 4, 2, 128, dtype=F16)
    with _raises_re(r"^flash_epilogue\.store_zero: dv: memory: expected no overlap with dk, "
                    r"got bytes \[0x[0-9a-f]+, 0x[0-9a-f]+\) overlapping dk's \[0x[0-9a-f]+, 0x[0-9a-f]+\)$"):
        validate_store_zero(base[..., :64], base[..., 32:96])
    dk, _ = zmake(s=4, h=2, device="meta")
    with _zraises("dv: memory", "no overlap with dk", "bytes [0x0, 0x800) overlapping dk's [0x0, 0x800)"):
        validate_store_zero(dk, dk)
    # packed dk/dv sharing no element: accepted (exact check)
    validate_store_zero(base[..., :64], base[..., 64:])
    kv = torch.zeros(2, 4, 2, 2, 64, dtype=F16)
    validate_store_zero(kv[:, :, 0], kv[:, :, 1])


@pytest.mark.parametrize("which", ["cu_seqlens", "seqused", "batch_idx", "head_idx"])
def test_zero_output_overlaps_metadata(which):
    dk, dv = zmake(b=2, s=4, h=2, varlen=True)
    view = dk.view(I32).reshape(-1)
    kw = {"cu_seqlens": cu(0, 4, 8), "seqused": cu(4, 4), "batch_idx": cu(1), "head_idx": cu(0, 1)}
    kw[which] = view[:kw[which].numel()]
    with _raises_re(rf"^flash_epilogue\.store_zero: dk: memory: expected no overlap with {which}, got bytes"):
        validate_store_zero(dk, dv, **kw)


# j. cu_seqlens / seqused, batch_idx / head_idx


def test_zero_seqlens_meta():
    dk, dv = zmake(b=2, s=4, h=2, varlen=True)
    with _zraises("cu_seqlens: dtype", "torch.int32", "torch.int64"):
        validate_store_zero(dk, dv, cu_seqlens=torch.tensor([0, 4, 8]))
    with _zraises("seqused: numel", "2 (batch = cu_seqlens.numel() - 1)", "3"):
        validate_store_zero(dk, dv, cu_seqlens=cu(0, 4, 8), seqused=cu(1, 2, 3))
    with _zraises("seqused: numel", "2 (batch = dk.shape[0])", "1"):
        validate_store_zero(*zmake(b=2), seqused=cu(1))


@pytest.mark.parametrize("name", ["batch_idx", "head_idx"])
def test_zero_index_not_tensor(name):
    with _zraises(name, "a torch.Tensor", "list"):
        validate_store_zero(*zmake(), **{name: [0, 1]})


@pytest.mark.parametrize("name", ["batch_idx", "head_idx"])
def test_zero_index_dtype(name):
    with _zraises(f"{name}: dtype", "torch.int32", "torch.int64"):
        validate_store_zero(*zmake(), **{name: torch.tensor([0, 1])})
    with _zraises(f"{name}: dtype", "torch.int32", "torch.int16"):
        validate_store_zero(*zmake(), **{name: torch.tensor([0], dtype=torch.int16)})


@pytest.mark.parametrize("name", ["batch_idx", "head_idx"])
def test_zero_index_rank(name):
    with _zraises(f"{name}: rank", "1 dim", "0 dims, shape ()"):
        validate_store_zero(*zmake(), **{name: torch.tensor(1, dtype=I32)})
    with _zraises(f"{name}: rank", "1 dim", "2 dims, shape (1, 2)"):
        validate_store_zero(*zmake(), **{name: cu(0, 1)[None]})


@pytest.mark.parametrize("name", ["batch_idx", "head_idx"])
def test_zero_index_contiguous(name):
    with _zraises(f"{name}: stride(0)", "1 (contiguous)", "2"):
        validate_store_zero(*zmake(), **{name: cu(0, 9, 1, 9)[::2]})
    # a single element with any stride is contiguous enough
    V._check_index_tensor("store_zero", name, cu(0, 9, 1)[::5], None)


# k. row range


def test_zero_row_start():
    with _zraises("row_start", ">= 0", "-1"):
        validate_store_zero(*zmake(), row_start=-1)
    with _zraises("row_start", "an int", "float"):
        validate_store_zero(*zmake(), row_start=1.0)
    with _zraises("row_start", "an int", "bool"):
        validate_store_zero(*zmake(), row_start=True)
    with _zraises("row_start", "an int", "NoneType"):
        validate_store_zero(*zmake(), row_start=None)


def test_zero_row_end():
    with _zraises("row_end", "None or >= row_start = 5", "4"):
        validate_store_zero(*zmake(), row_start=5, row_end=4)
    with _zraises("row_end", "None or >= row_start = 0", "-1"):
        validate_store_zero(*zmake(), row_end=-1)
    with _zraises("row_end", "None or an int", "float"):
        validate_store_zero(*zmake(), row_end=3.0)


# l. devices (last)


def test_zero_devices():
    with _zraises("dk: device", "a CUDA tensor", "a tensor on cpu"):
        validate_store_zero(*zmake(), row_start=3)


def test_zero_index_devices(monkeypatch, sm90):
    meta = torch.zeros(1, dtype=I32, device="meta")
    with _zraises("batch_idx: device", "cpu (the device of dk)", "meta"):
        validate_store_zero(*zmake(), batch_idx=meta)
    with _zraises("head_idx: device", "cpu (the device of dk)", "meta"):
        validate_store_zero(*zmake(), batch_idx=cu(0), head_idx=meta)
    monkeypatch.setattr(V, "_is_cuda_device", lambda device: device.type == "cpu")
    with _zraises("head_idx: device", "a CUDA tensor", "a tensor on meta"):
        validate_store_zero(*zmake(), head_idx=meta)


def test_zero_no_kernels_compiled(monkeypatch):
    monkeypatch.setattr(V, "_is_cuda_device", lambda device: True)
    monkeypatch.setattr(V, "_compiled_archs", lambda: ())
    with pytest.raises(FlashEpilogueBuildError, match=r"^flash_epilogue\.store_zero: the package was installed"):
        validate_store_zero(*zmake())


def test_zero_check_order():
    dk, dv = zmake()
    # dtype before rank; rank before head dim; head dim before strides
    with _zraises("dk: dtype", "torch.float16 or torch.bfloat16", "torch.float32"):
        validate_store_zero(dk.float()[0], dv)
    with _zraises("dk: head dim", "a multiple of 8 in [8, 256]", "12"):
        validate_store_zero(*zmake(d=12), batch_idx=[0])
    # seqlens before selections, selections before the row range, the row range before devices
    with _zraises("seqused: dtype", "torch.int32", "torch.int64"):
        validate_store_zero(dk, dv, seqused=torch.tensor([1, 2]), batch_idx=[0], row_start=-1)
    with _zraises("batch_idx: dtype", "torch.int32", "torch.int64"):
        validate_store_zero(dk, dv, batch_idx=torch.tensor([0]), head_idx=[0], row_start=-1)
    with _zraises("head_idx", "a torch.Tensor", "list"):
        validate_store_zero(dk, dv, batch_idx=cu(0), head_idx=[0], row_start=-1)
    with _zraises("row_start", ">= 0", "-1"):
        validate_store_zero(dk, dv, row_start=-1, row_end=-5)


def test_zero_op_name_in_message():
    with _raises("dk", "a torch.Tensor", "int", op="my_zero"):
        validate_store_zero(3, None, op="my_zero")


# check_index_contents (host sync, only on request)


def test_index_contents_valid():
    check_index_contents("store_zero", "batch_idx", cu(0, 2, 2, 1), 3)
    check_index_contents("store_zero", "head_idx", cu(), 0)
    check_index_contents("store_zero", "head_idx", None, 4)


def test_index_contents_out_of_range():
    with _zraises("batch_idx[2]", "a value in [0, 3)", "3"):
        check_index_contents("store_zero", "batch_idx", cu(0, 2, 3, -1), 3)
    with _zraises("head_idx[1]", "a value in [0, 4) (the number of heads)", "-1"):
        check_index_contents("store_zero", "head_idx", cu(0, -1), 4, limit_why="the number of heads")
    with _zraises("batch_idx[0]", "a value in [0, 0) (the batch size)", "0"):
        check_index_contents("store_zero", "batch_idx", cu(0), 0, limit_why="the batch size")


# the wrapper: ints / sequences -> int32 tensors on dk's device; content checks on request


def test_index_tensor_conversion():
    conv = fe_ops._index_tensor
    t = cu(1, 2)
    assert conv("store_zero", "batch_idx", t, "cpu") is t  # passed through, no copy
    assert conv("store_zero", "batch_idx", None, "cpu") is None
    for value, want in [(3, [3]), ([0, 2, 2], [0, 2, 2]), ((1,), [1]), (range(3), [0, 1, 2]), ([], []),
                        (-1, [-1]), ([2**31 - 1, -2**31], [2**31 - 1, -2**31])]:
        got = conv("store_zero", "batch_idx", value, torch.device("cpu"))
        assert got.dtype == I32 and got.dim() == 1 and got.device.type == "cpu" and got.tolist() == want
    import numpy as np
    assert conv("store_zero", "head_idx", np.int64(2), "cpu").tolist() == [2]
    assert conv("store_zero", "head_idx", np.array([1, 0]), "cpu").tolist() == [1, 0]
    assert conv("store_zero", "head_idx", [1], "meta").device.type == "meta"


def test_index_conversion_errors():
    conv = fe_ops._index_tensor
    what = "None, an int, a sequence of ints or an int32 tensor"
    with _zraises("batch_idx", what, "float"):
        conv("store_zero", "batch_idx", 1.0, "cpu")
    with _zraises("batch_idx", what, "bool"):
        conv("store_zero", "batch_idx", True, "cpu")
    with _zraises("head_idx", what, "str"):
        conv("store_zero", "head_idx", "01", "cpu")
    with _zraises("head_idx[1]", "an int", "float"):
        conv("store_zero", "head_idx", [0, 1.5], "cpu")
    with _zraises("head_idx[0]", "an int", "bool"):
        conv("store_zero", "head_idx", [False], "cpu")
    with _zraises("batch_idx[1]", "an int32 value in [-2147483648, 2147483647]", str(2**31)):
        conv("store_zero", "batch_idx", [0, 2**31], "cpu")
    with _zraises("batch_idx", "an int32 value in [-2147483648, 2147483647]", str(-2**31 - 1)):
        conv("store_zero", "batch_idx", -2**31 - 1, "cpu")


def test_store_zero_wrapper_checks(sm90):
    import flash_epilogue as fe

    dk, dv = zmake(b=2, s=8, h=3)
    # metadata errors name the argument (ints/lists converted first)
    with _zraises("batch_idx: dtype", "torch.int32", "torch.int64"):
        fe.store_zero(dk, dv, batch_idx=torch.tensor([0]))
    with _zraises("row_end", "None or >= row_start = 2", "1"):
        fe.store_zero(dk, dv, batch_idx=[0, 1], head_idx=2, row_start=2, row_end=1)
    with _zraises("head_idx[0]", "an int", "str"):
        fe.store_zero(dk, dv, head_idx=["a"])
    with _zraises("dk", "a torch.Tensor", "list"):
        fe.store_zero([1], dv, batch_idx=[0])
    # content checks, only on request (they raise before the op is called)
    with _zraises("batch_idx[1]", "a value in [0, 2) (the batch size)", "2"):
        fe.store_zero(dk, dv, batch_idx=[1, 2], check_inputs=True)
    with _zraises("head_idx[0]", "a value in [0, 3) (the number of heads)", "-1"):
        fe.store_zero(dk, dv, batch_idx=cu(0), head_idx=-1, check_inputs=True)
    with _zraises("seqused[1]", "<= 8 (the static seqlen)", "9"):
        fe.store_zero(dk, dv, seqused=cu(1, 9), batch_idx=[5], check_inputs=True)
    dk, dv = zmake(b=2, s=4, h=1, varlen=True)
    with _zraises("cu_seqlens[2]", ">= cu_seqlens[1] = 5 (non-decreasing)", "4"):
        fe.store_zero(dk, dv, cu_seqlens=cu(0, 5, 4), check_inputs=True)
    with _zraises("batch_idx[0]", "a value in [0, 2) (the batch size)", "7"):
        fe.store_zero(dk, dv, cu_seqlens=cu(0, 5, 8), batch_idx=7, check_inputs=True)


def test_store_zero_wrapper_env_switch(sm90, monkeypatch):
    import flash_epilogue as fe

    monkeypatch.setenv("FLASH_EPILOGUE_CHECK_INPUTS", "1")
    fe.refresh_env_flags()  # read once at import; conftest re-reads them before each test
    with _zraises("batch_idx[0]", "a value in [0, 2) (the batch size)", "4"):
        fe.store_zero(*zmake(), batch_idx=4)
