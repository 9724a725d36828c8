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


@pytest.fixture
def sm90(monkeypatch):
    """Pretend every tensor is on an sm_90 CUDA device with kernels compiled for sm_90a."""
    monkeypatch.setattr(V, "_is_cuda_device", lambda device: True)
    monkeypatch.setattr(V, "_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(V, "_compiled_archs", lambda: ("sm_90a",))


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
