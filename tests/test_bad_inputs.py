"""The bad-input table: every class of bad argument to the public API (one (op, argument, condition) with
its own message), each raising its error class with a message naming the op, the argument, what was
expected and what was given; and the accepted inputs next to them.

Each row: the op's baseline call is accepted, then the row's change of the arguments is rejected. The
ops check every argument once, in C++; the wrappers re-raise an op's ValueError as
fe.FlashEpilogueInputError, its TypeError (a dtype, None, a wrong Python type) as fe.FlashEpilogueTypeError;
rows named ..._op call torch.ops.flash_epilogue directly. The ops run every metadata check on CPU tensors
too, then refuse the device: such rows also run on the CPU (CI). On an sm_90 GPU every row runs with CUDA
tensors and the process must be healthy afterwards. GPU time: a few seconds.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import flash_epilogue as fe
from conftest import bits, deterministic_algorithms, rand
from flash_epilogue import reference as ref

BF16, F16, F32, F64, I32 = torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32
B, S, H_K, G, D = 2, 40, 2, 2, 64  # the baseline problem: batch 2, seqlen 40, 2 KV heads of 2 query heads, d 64
H_Q, TOTAL = H_K * G, 80  # varlen baselines: cu_seqlens [0, 30, 80]
OPS = torch.ops.flash_epilogue
ROOT = Path(__file__).resolve().parent.parent

INPUT = fe.FlashEpilogueInputError  # a ValueError (and not a TypeError)
TYPE = fe.FlashEpilogueTypeError
PY = (INPUT,)  # a wrong Python scalar type seen by the wrapper: INPUT or its subclass TYPE
RAW = (RuntimeError,)  # the dispatcher's own schema error (an op called directly): not our message format
SELF = (r"memory: expected no two elements at one address \(no stride 0 or overlapping strides on a dim of size "
        r"> 1\), got shape {}, strides {}")
CONTIGUOUS_OR_SELF = r"(strides: expected \(.*\) \(contiguous\), got \(.*\)|" + SELF.format(".*", ".*") + ")"
FP32_RANGE = r"expected a float in fp32's range \(\|scale\| <= 3\.4028234663852886e\+38; inf and nan pass\), got "
TENSOR = r"expected a torch\.Tensor, got "


# ---------------------------------------------------------------------------------------------
# baselines: valid keyword arguments of each op on a device


def z(d, *shape, dtype=F32):
    return torch.zeros(shape, dtype=dtype, device=d)


def i32(d, *vals):
    return torch.tensor(vals, dtype=I32, device=d)


def accumulator(d, deterministic=True, varlen=False, **kw):
    layout = {"cu_seqlens": i32(d, 0, 30, TOTAL), "total_tokens": TOTAL} if varlen else {"batch": B, "seqlen": S}
    return fe.gqa_accumulator(kw.pop("h_k", H_K), kw.pop("hd", D), deterministic=deterministic, device=d,
                              **{**layout, **kw})


def tensors(d, varlen, heads, dtype, *names):
    lead = (TOTAL,) if varlen else (B, S)
    return {n: z(d, *lead, heads, D, dtype=dtype) for n in names} | (
        {"cu_seqlens": i32(d, 0, 30, TOTAL)} if varlen else {})


def zero_args(d, varlen=False):
    return tensors(d, varlen, H_K, BF16, "dk", "dv")


def store_args(d, varlen=False):
    return tensors(d, varlen, H_K, F32, "dk_accum", "dv_accum") | zero_args(d, varlen)


def partials(d, varlen=False):
    return tensors(d, varlen, H_Q, F32, "dk_partial", "dv_partial")


def accumulate_args(d, varlen=False, op=False):
    acc = accumulator(d, varlen=varlen)
    if op:
        return partials(d, varlen) | {"dk_accum": acc.dk_accum, "dv_accum": acc.dv_accum, "semaphores": acc.semaphores,
                                      "deterministic": True}
    return partials(d, varlen) | {"acc": acc}


def with_deterministic_algorithms(fn):
    def call(**kw):
        with deterministic_algorithms():
            return fn(**kw)
    return call


def raw(op):
    """torch.ops.flash_epilogue.<op>, looked up when called (a build without the ops still collects)."""
    return lambda **kw: getattr(OPS, op)(**kw)


def to_dense(acc, **kw):
    return acc.to_dense(**kw)


# fn(**build(device)) is a valid call; name: the op named in messages (None: a reference function, messages of
# its own); cpu_runs: the valid call runs on CPU tensors (else it stops at the device check)
Op = collections.namedtuple("Op", "fn build name cpu_runs", defaults=(False,))


OP = {
    "store": Op(fe.store, store_args, "store"),
    "store_varlen": Op(fe.store, lambda d: store_args(d, True), "store"),
    "store_op": Op(raw("store"), store_args, "store"),
    "store_zero": Op(fe.store_zero, zero_args, "store_zero"),
    "store_zero_varlen": Op(fe.store_zero, lambda d: zero_args(d, True), "store_zero"),
    "store_zero_op": Op(raw("store_zero"), zero_args, "store_zero"),
    "gqa_accumulator": Op(fe.gqa_accumulator, lambda d: {"num_heads_kv": H_K, "head_dim": D, "batch": B, "seqlen": S,
                                                         "device": d}, "gqa_accumulator", cpu_runs=True),
    "gqa_accumulate": Op(fe.gqa_accumulate, accumulate_args, "gqa_accumulate"),
    "gqa_accumulate_varlen": Op(fe.gqa_accumulate, lambda d: accumulate_args(d, True), "gqa_accumulate"),
    "gqa_accumulate_det": Op(with_deterministic_algorithms(fe.gqa_accumulate), accumulate_args, "gqa_accumulate"),
    "gqa_accumulate_op": Op(raw("gqa_accumulate"), lambda d: accumulate_args(d, op=True), "gqa_accumulate"),
    "gqa_accumulate_varlen_op": Op(raw("gqa_accumulate"), lambda d: accumulate_args(d, True, True), "gqa_accumulate"),
    "gqa_postprocess": Op(fe.gqa_postprocess, lambda d: zero_args(d) | {"acc": accumulator(d, False)},
                          "gqa_postprocess"),
    "gqa_postprocess_op": Op(raw("gqa_postprocess"), lambda d: zero_args(d) | {
        k: getattr(accumulator(d, False), k) for k in ("dk_accum", "dv_accum")}, "gqa_postprocess"),
    "to_dense": Op(to_dense, lambda d: {"acc": accumulator(d, False)}, "gqa_accum_to_dense"),
    "to_dense_varlen": Op(to_dense, lambda d: {"acc": accumulator(d, False, True), "cu_seqlens": i32(d, 0, 30, TOTAL)},
                          "gqa_accum_to_dense"),
    "gqa_accum_to_dense_op": Op(raw("gqa_accum_to_dense"), lambda d: {"accum": accumulator(d).dk_accum,
                                                                   "out": z(d, B, S, H_K, D), "head_dim": D},
                                "gqa_accum_to_dense"),
    "gqa_reduce": Op(fe.gqa_reduce, lambda d: {**partials(d), "num_heads_kv": H_K}, "gqa_reduce"),
    "gqa_reduce_varlen": Op(fe.gqa_reduce, lambda d: partials(d, True) | {"num_heads_kv": H_K}, "gqa_reduce"),
    "gqa_reduce_out": Op(fe.gqa_reduce, lambda d: partials(d) | {"num_heads_kv": H_K, "out": tuple(zero_args(
        d).values())}, "gqa_reduce"),
    "gqa_reduce_op": Op(raw("gqa_reduce"), lambda d: partials(d) | zero_args(d), "gqa_reduce"),
    "gqa_reduce_varlen_op": Op(raw("gqa_reduce"), lambda d: partials(d, True) | zero_args(d, True), "gqa_reduce"),
    "repeat_kv": Op(fe.repeat_kv, lambda d: {"x": z(d, B, H_K, S, D, dtype=BF16), "n_rep": 2}, "repeat_kv", True),
    "repeat_kv_op": Op(raw("repeat_kv"), lambda d: {"x": z(d, B, H_K, S, D, dtype=BF16), "n_rep": 2, "dim": 1},
                       "repeat_kv", True),
    "repeat_kv_backward_op": Op(raw("repeat_kv_backward"), lambda d: {"grad": z(d, 1, 4, 2, 8), "n_rep": 2, "dim": 1,
                                                                   "layout": [0, 1, 2]}, "repeat_kv_backward", True),
    "store_reference": Op(ref.store_reference, store_args, None, True),
    "gqa_reduce_reference": Op(ref.gqa_reduce_reference, lambda d: {"dk_partial": z(d, 1, 2, 6, 8), "num_heads_kv": 3,
                                                                    "out_dtype": F16}, None, True),
    "gqa_reduce_sequential_fp32": Op(ref.gqa_reduce_sequential_fp32, lambda d: {"partial": z(d, 1, 2, 6, 8),
                                                                                "num_heads_kv": 3}, None, True),
    "gqa_accumulate_reference": Op(ref.gqa_accumulate_reference, lambda d: {
        "dk_partial": z(d, 10, 6, 8), "dv_partial": None, "dk_dense": z(d, 10, 3, 8), "dv_dense": None,
        "num_heads_kv": 3, "cu_seqlens": i32(d, 0, 10)}, None, True),
}


# ---------------------------------------------------------------------------------------------
# changes of the arguments: a value, on(f) = f(the baseline's value), or a callable (args, device)


class on:
    def __init__(self, fn):
        self.fn = fn


def new(fn):
    """A new value built on the row's device."""
    return lambda a, d: fn(d)


def widened(t):
    """t's values in a view whose last dim has stride 2."""
    return torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)[..., ::2]


def padded(extra):
    """t in a view whose row pitch (stride(-2)) is t.shape[-1] + extra elements."""
    return on(lambda t: torch.zeros(*t.shape[:-1], t.shape[-1] + extra, dtype=t.dtype, device=t.device)[
        ..., : t.shape[-1]])


def misaligned(nbytes=8):
    """t in a new tensor whose data starts `nbytes` past a 16-byte boundary."""
    def make(t):
        flat = torch.zeros(t.numel() + 16, dtype=t.dtype, device=t.device)
        return flat[nbytes // t.element_size():][: t.numel()].view(t.shape)
    return on(make)


def expanded():
    """t's shape with stride 0 on the first dim (an expand of its first row)."""
    return on(lambda t: t[:1].expand(t.shape))


def overlapping():
    """t's shape with dim 1 stepping half the last dim (overlapping strides, all multiples of 16 bytes)."""
    return on(lambda t: torch.zeros(t.numel(), dtype=t.dtype, device=t.device).as_strided(
        t.shape, (t.stride(0), t.shape[-1] // 2, t.stride(2), 1)))


def alias(of, view=lambda t: t):
    """`of`'s memory, seen through `view`."""
    return lambda a, d: view(a[of])


def int32_view(of, n):
    return alias(of, lambda t: t.view(I32).reshape(-1)[:n])


def like(of, dtype, shape=None):
    """A tensor of `shape` (default: `of`'s) viewing `of`'s memory as `dtype`."""
    return alias(of, lambda t: t.view(dtype).reshape(-1)[: torch.Size(shape or t.shape).numel()].view(shape or t.shape))


def on_cuda1(t):
    return t.to("cuda:1")


def replace_acc(**fields):
    return on(lambda acc: dataclasses.replace(acc, **{k: v(acc) if callable(v) else v for k, v in fields.items()}))


@dataclasses.dataclass
class Row:
    op: str
    match: str  # regex, searched after "flash_epilogue.<op>: ": argument, expected and got
    cls: object = INPUT
    cpu: bool = True  # the error comes before the device check: the row also runs with CPU tensors
    gpus: int = 1
    changes: dict = dataclasses.field(default_factory=dict)
    id: str = ""


def R(op, match, cls=INPUT, cpu=True, gpus=1, **changes):
    if op.endswith("_op"):  # the op itself raises a plain ValueError / TypeError
        cls = {INPUT: ValueError, TYPE: TypeError}.get(cls, cls)
    return Row(op, match, cls, cpu and gpus == 1, gpus, changes)


STORE4 = ("dk_accum", "dv_accum", "dk", "dv")
PARTIALS = ("dk_partial", "dv_partial")


def sh(*dims):
    """A shape as the messages print it, as a regex."""
    return re.escape(str(tuple(dims)))


# message fragments (regexes): types and shapes
DT, HALF = r"dtype: expected torch\.{}, got torch\.{}", r"float16 or torch\.bfloat16"
HD, NUMEL = r"head dim: expected a multiple of 8 in \[8, 256\], got ", r"numel: expected 2 \(batch = {}\), got {}"
RANK_B, RANK_V, RANK_A = (
    r"rank: expected 4 dims \(batch, seqlen, heads, headdim\) because cu_seqlens is None, got 3 dims, shape ",
    r"rank: expected 3 dims \(total_tokens, heads, headdim\) because cu_seqlens is given, got 4 dims, shape ",
    r"rank: expected 4 dims \(batch_extent, heads_kv, num_tiles, tile_elems\), got ")
B_S_H_D, WIDE = sh(2, 40, 2, 64), sh(10240, 256, 128, 2)  # the baseline shape, the strides of widened() of it
# strides, alignment, memory, devices
LAST = r"stride\(-1\): expected 1 \(last dim contiguous\), got 2 \(strides {}\)"
PITCH = r"stride\({}\): expected a non-negative multiple of {} elements \(16 bytes\), got {} \(shape {}, strides {}\)"
ALIGN, CONTIG = r"data_ptr: expected a 16-byte aligned address, got 0x[0-9a-f]+ \(address % 16 = {}\)", \
    r"strides: expected {} \(contiguous\), got {}"
OVER, CPU = r"memory: expected no overlap with {}, got bytes", r"device: expected a CUDA tensor, got a tensor on cpu"
DEV1 = r"device: expected cuda:0 \(the device of {}\), got cuda:1"
# the GQA accumulator
ACC = (r"shape: expected {} \(the accumulator of {}, {} KV heads and head dim {d} in the tile of head dim {c} on the "
       r"sm_{a} path: allocate "
       r"it with flash_epilogue\.gqa_accumulator\), got {}")
OF_B = "batch 2, seqlen 40"
HEADS = (r"heads: expected a positive multiple of the {} KV heads \({}\): every KV head serves h_q / h_k query heads, "
         r"got {} query heads \(dk_partial\.shape\[-2\]\)")
SEMAPHORES = r"semaphores: expected an int32 tensor of >= 9 entries because deterministic=True \(allocate the "
SEMS = (r"acc\.semaphores: expected an int32 workspace because {}: allocate .*, got None \(allocated with "
        r"deterministic=False\)")
NOT_ACC = r"acc: expected a flash_epilogue\.GQAAccumulator \(from flash_epilogue\.gqa_accumulator\), got "
# scalars and selections
DIM, ARCH = (r"dim: expected 1 \(or -3\) or 2 \(or -2\): the KV-head dim of a 4-D tensor, got ",
             r"_arch: expected 0 \(the device's path\), 80 or 90, got ")
ROW_END = r"row_end: expected None or an int in \[row_start = {}, 2147483647\], got {}"
INT64, INT32 = (r"expected an int64 \(the op's integer type\), got 1180591620717411303424",
                r"expected an int32 value in \[-2147483648, 2147483647\], got ")
VALUES = r"expected None, an int, a sequence of ints or an int32 tensor, got "
# contents
IN_RANGE = r"expected a value in \[0, 2\) \(the {}\), got {}"
SEG1 = r"seqused\[1\]: expected <= 50 \(the length of segment 1, cu_seqlens\[2\] - cu_seqlens\[1\]\), got 51"
NONDECREASING = r"cu_seqlens\[2\]: expected >= cu_seqlens\[1\] = 50 \(non-decreasing\), got 30"
CHECKED = {"check_inputs": True}  # the contents (a host sync), checked by the wrapper before the op


def bf16(d, *shape):
    return z(d, *shape, dtype=BF16)


FIRST, UNSQUEEZED = on(lambda t: t[0]), on(lambda t: t[None])  # t[0], t[None]


def acc_on(dev, det=False):
    return new(lambda d: accumulator(dev, det))


ROWS = [
    # ---- store: Python types, dtypes, ranks, shapes, head dims
    *[R("store", rf"{k}: {TENSOR}list", TYPE, **{k: on(lambda t: t.tolist())}) for k in STORE4],
    R("store", rf"dk: {TENSOR}NoneType", TYPE, dk=None),
    R("store_op", rf"dk: {TENSOR}NoneType", TypeError, dk=None),
    R("store", r"expected torch\.Tensor arguments, got None for all of them", TYPE,  # the dispatcher has no device
      dk_accum=None, dv_accum=None, dk=None, dv=None),
    *[R("store", f"{k}: " + DT.format("float32", "float64"), TYPE,
                                                **{k: on(torch.Tensor.double)}) for k in ("dk_accum", "dv_accum")],
    R("store_op", "dk_accum: " + DT.format("float32", "float64"), TypeError, dk_accum=on(torch.Tensor.double)),
    R("store", "dk: " + DT.format(HALF, "int8"), TYPE, dk=on(lambda t: t.to(torch.int8)), dv=on(lambda t: t.char())),
    R("store", r"dv: dtype: expected torch\.bfloat16 \(the dtype of dk\), got torch\.float16", TYPE,
      dv=on(torch.Tensor.half)),
    R("store", "dk_accum: " + RANK_B + sh(40, 2, 64), **{k: FIRST for k in STORE4}),
    R("store_varlen", "dk_accum: " + RANK_V + sh(1, 80, 2, 64), **{k: UNSQUEEZED for k in STORE4}),
    R("store_varlen", "dv: " + RANK_V + sh(1, 80, 2, 64), dv=UNSQUEEZED),
    R("store", r"dk_accum: shape: expected \(2, 40, 2, 64\) \(the shape of dk\), got \(2, 41, 2, 64\)",
      dk_accum=new(lambda d: z(d, B, S + 1, H_K, D))),
    R("store", r"dv_accum: shape: expected \(2, 40, 2, 64\) \(the shape of dv\), got \(2, 40, 2, 32\)",
      dv_accum=on(lambda t: t[..., :32])),
    R("store", r"dv: shape: expected \(2, 40, 2, '\*'\) \(dk's shape but the last dim\), got \(2, 40, 3, 64\)",
      dv_accum=new(lambda d: z(d, B, S, 3, D)), dv=new(lambda d: bf16(d, B, S, 3, D))),
    R("store", "dk: " + HD + "60", dk_accum=on(lambda t: t[..., :60]), dk=on(lambda t: t[..., :60])),
    R("store", "dv: " + HD + "264", dv_accum=new(lambda d: z(d, B, S, H_K, 264)), dv=new(lambda d: bf16(d, B, S, H_K,
                                                                                                        264))),
    R("store_op", "dk: " + HD + "12", ValueError, dk_accum=on(lambda t: t[..., :12]), dk=on(lambda t: t[..., :12])),
    # ---- store: strides, alignment, memory
    *[R("store", f"{k}: " + LAST.format(WIDE), **{k: on(widened)}) for k in STORE4],
    *[R("store", f"{k}: " + PITCH.format(2, 8, 68, B_S_H_D, sh(5440, 136, 68, 1)),
                                    **{k: padded(4)}) for k in ("dk", "dv")],
    R("store_varlen", "dk: " + PITCH.format(0, 8, 132, sh(80, 2, 64), sh(132, 64, 1)),
      dk=new(lambda d: bf16(d, TOTAL, 132)[:, :128].unflatten(1, (2, 64)))),
    R("store_op", "dk: " + PITCH.format(1, 8, 68, sh(2, 40, 1, 64), sh(2720, 68, 68, 1)), ValueError,
      dk=new(lambda d: bf16(d, B, S, 1, 68)[..., :64]), **{k: on(lambda t: t[:, :, :1]) for k in STORE4[:2] + ("dv",)}),
    *[R(
        "store", f"{k}: " + PITCH.format(2, 4, 66, B_S_H_D, sh(5280, 132, 66, 1)), **{k: padded(2)})
      for k in ("dk_accum", "dv_accum")],
    R("store", "dk: " + ALIGN.format(8), dk=misaligned()),
    R("store", "dv_accum: " + ALIGN.format(8), dv_accum=misaligned()),
    R("store", "dk: " + SELF.format(B_S_H_D, sh(0, 128, 64, 1)), dk=expanded()),
    R("store", "dv: " + SELF.format(B_S_H_D, sh(5120, 32, 64, 1)), dv=overlapping()),
    R("store", "dv: " + OVER.format("dk") + r" \[0x[0-9a-f]+, 0x[0-9a-f]+\) overlapping dk's \[0x[0-9a-f]+, "
      r"0x[0-9a-f]+\)$", _=lambda a, d: a.update(dk=(w := bf16(d, B, S, H_K, 128))[..., :64], dv=w[..., 32:96])),
    R("store_op", "dv: " + OVER.format("dk"), ValueError, dv=alias("dk")),
    *[R("store", f"{o}: " + OVER.format(i), **{o: like(i, BF16)}) for o in ("dk", "dv") for i in STORE4[:2]],
    *[R("store_varlen", "dv: " + OVER.format(k), **{
        "seqused": new(lambda d: i32(d, 30, 50)), k: int32_view("dv", 3 if k == "cu_seqlens" else 2)})
      for k in ("cu_seqlens", "seqused")],
    # ---- store: cu_seqlens / seqused metadata
    R("store_varlen", rf"cu_seqlens: {TENSOR}list", TYPE, cu_seqlens=[0, 30, 80]),
    R("store_varlen", "cu_seqlens: " + DT.format("int32", "int64"), TYPE, cu_seqlens=on(torch.Tensor.long)),
    R("store_varlen", r"cu_seqlens: rank: expected 1 dim \(batch \+ 1,\), got 2 dims, shape \(1, 3\)",
      cu_seqlens=UNSQUEEZED),
    R("store_varlen", r"cu_seqlens: stride\(0\): expected 1 \(contiguous\), got 2",
      cu_seqlens=new(lambda d: i32(d, 0, 9, 30, 9, 80, 9)[::2])),
    R("store_varlen", r"cu_seqlens: numel: expected batch \+ 1 >= 2 \(at least one sequence\), got 1",
      cu_seqlens=on(lambda t: t[:1])),
    R("store", rf"seqused: {TENSOR}tuple", TYPE, seqused=(1, 2)),
    R("store", "seqused: " + DT.format("int32", "float32"), TYPE, seqused=new(lambda d: z(d, 2))),
    R("store", r"seqused: rank: expected 1 dim, got 2 dims, shape \(2, 1\)",
      seqused=new(lambda d: i32(d, 1, 2)[:, None])),
    R("store", r"seqused: stride\(0\): expected 1 \(contiguous\), got 3", seqused=new(lambda d: i32(d, 1, 0, 0, 2, 0,
                                                                                                    0)[::3])),
    R("store", "seqused: " + NUMEL.format(r"dk\.shape\[0\]", 3), seqused=new(lambda d: i32(d, 1, 2, 3))),
    R("store_varlen", "seqused: " + NUMEL.format(r"cu_seqlens\.numel\(\) - 1", 1), seqused=new(lambda d: i32(d, 3))),
    # ---- store: devices (the other-GPU rows need two GPUs) and contents (check_inputs=True)
    R("store", "dk_accum: " + CPU, **{k: on(torch.Tensor.cpu) for k in STORE4}),
    R("store", "dk_accum: " + DT.format("float32", "float16"), TYPE, dk_accum=on(lambda t: t.cpu().half())),
    R("store", "seqused: " + CPU, cpu=False, seqused=new(lambda d: i32("cpu", S, 3))),
    *[R("store", f"{k}: " + DEV1.format("dk_accum"), gpus=2,
                                                **{k: on(on_cuda1)}) for k in ("dv_accum", "dk", "dv")],
    R("store_varlen", "cu_seqlens: " + DEV1.format("dk_accum"), gpus=2, cu_seqlens=on(on_cuda1)),
    R("store", "seqused: " + DEV1.format("dk_accum"), gpus=2, seqused=new(lambda d: i32("cuda:1", S, 3))),
    R("store_varlen", NONDECREASING, cu_seqlens=new(lambda d: i32(d, 0, 50, 30)), **CHECKED),
    R("store_varlen", r"cu_seqlens\[2\]: expected <= 80 \(the tensors' token count\), got 81",
      cu_seqlens=new(lambda d: i32(d, 0, 30, 81)), **CHECKED),
    R("store_varlen", r"cu_seqlens\[0\]: expected >= 0, got -4", cu_seqlens=new(lambda d: i32(d, -4, 30, 80)),
      **CHECKED),
    R("store_varlen", SEG1, seqused=new(lambda d: i32(d, 30, 51)), **CHECKED),
    R("store", r"seqused\[1\]: expected <= 40 \(the static seqlen\), got 41", seqused=new(lambda d: i32(d, S, S + 1)),
      **CHECKED),
    R("store", r"seqused\[0\]: expected >= 0, got -5", seqused=new(lambda d: i32(d, -5, 3)), **CHECKED),
    # ---- store_zero
    R("store_zero", rf"dk: {TENSOR}NoneType", TYPE, dk=None),
    R("store_zero", rf"dv: {TENSOR}list", TYPE, dv=[1.0]),
    R("store_zero", "dk: " + DT.format(HALF, "float32"), TYPE, dk=on(torch.Tensor.float), dv=on(torch.Tensor.float)),
    R("store_zero", r"dv: dtype: expected torch\.bfloat16 \(the dtype of dk\), got torch\.float16", TYPE,
      dv=on(torch.Tensor.half)),
    R("store_zero", "dk: " + RANK_B + sh(40, 2, 64), dk=FIRST, dv=FIRST),
    R("store_zero_varlen", "dv: " + RANK_V + sh(1, 80, 2, 64), dv=UNSQUEEZED),
    R("store_zero", r"dv: shape: expected \(2, 40, 2, '\*'\) \(dk's shape but the last dim\), got \(2, 39, 2, 64\)",
      dv=on(lambda t: t[:, :39])),
    R("store_zero", "dk: " + HD + "60", dk=on(lambda t: t[..., :60])),
    R("store_zero", "dv: " + HD + "264", dv=new(lambda d: bf16(d, B, S, H_K, 264))),
    R("store_zero", "dv: " + LAST.format(WIDE), dv=on(widened)),
    R("store_zero", "dk: " + PITCH.format(2, 8, 68, B_S_H_D, sh(5440, 136, 68, 1)), dk=padded(4)),
    R("store_zero", "dv: " + ALIGN.format(8), dv=misaligned()),
    R("store_zero", "dk: " + SELF.format(B_S_H_D, sh(0, 128, 64, 1)), dk=expanded()),
    R("store_zero", "dv: " + SELF.format(B_S_H_D, sh(5120, 32, 64, 1)), dv=overlapping()),
    R("store_zero", "dv: " + OVER.format("dk"), dv=alias("dk")),
    *[R(
        "store_zero_varlen", "dk: " + OVER.format(k),
        **{"seqused": new(lambda d: i32(d, 30, 50)), k: int32_view("dk", 3 if k == "cu_seqlens" else 2)})
      for k in ("cu_seqlens", "seqused", "batch_idx", "head_idx")],
    R("store_zero_varlen", "cu_seqlens: " + DT.format("int32", "int64"), TYPE, cu_seqlens=on(torch.Tensor.long)),
    R("store_zero_varlen", "seqused: " + NUMEL.format(r"cu_seqlens\.numel\(\) - 1", 3),
      seqused=new(lambda d: i32(d, 1, 2, 3))),
    R("store_zero", "seqused: " + NUMEL.format(r"dk\.shape\[0\]", 1), seqused=new(lambda d: i32(d, 1))),
    R("store_zero_op", r"Expected a value of type 'Optional\[Tensor\]' for argument 'batch_idx'", RAW,
      batch_idx=[0, 1]),
    R("store_zero", "batch_idx: " + DT.format("int32", "int64"), TYPE, batch_idx=new(lambda d: torch.tensor([0, 1],
                                                                                                          device=d))),
    R("store_zero", "head_idx: " + DT.format("int32", "int16"), TYPE, head_idx=new(lambda d: i32(d, 0).short())),
    R("store_zero", r"batch_idx: rank: expected 1 dim, got 0 dims, shape \(\)", batch_idx=new(lambda d: i32(d, 1)[0])),
    R("store_zero", r"head_idx: rank: expected 1 dim, got 2 dims, shape \(1, 2\)", head_idx=new(lambda d: i32(d, 0,
                                                                                                            1)[None])),
    *[R("store_zero", rf"{k}: stride\(0\): expected 1 \(contiguous\), got 2",
                                                 **{k: new(lambda d: i32(d, 0, 9, 1, 9)[::2])})
      for k in ("batch_idx", "head_idx")],
    R("store_zero", r"batch_idx: numel: expected fewer than 65536 entries, got 65536",
      batch_idx=new(lambda d: torch.zeros(65536, dtype=I32, device=d))),
    R("store_zero", r"dk: shape: expected rows < 2\^31 and heads, batch < 65536, got \(1, 8, 65536, 8\)",
      dk=new(lambda d: bf16(d, 1, 8, 65536, 8)), dv=new(lambda d: bf16(d, 1, 8, 65536, 8))),
    # row ranges: int32s (checked by the op); a Python int past int64 (the wrapper); a wrong Python type
    *[R("store_zero", rf"row_start: expected an int in \[0, 2147483647\], got {v}", row_start=v) for v in (-1, 2**40)],
    R("store_zero", "row_start: " + INT64, PY, row_start=2**70),
    R("store_zero", ROW_END.format(10, 5), row_start=10, row_end=5),
    R("store_zero", ROW_END.format(0, 2**31), row_end=2**31),
    R("store_zero", "row_end: " + INT64, PY, row_end=2**70),
    *[R("store_zero", rf"row_start: expected an int, got {t}", PY, row_start=v)
      for v, t in ((1.5, "float"), (True, "bool"), (None, "NoneType"))],
    R("store_zero", r"row_end: expected (None or )?an int, got float", PY, row_end=3.0),
    R("store_zero", "dk: " + CPU, dk=on(torch.Tensor.cpu), dv=on(torch.Tensor.cpu)),
    *[R(
        "store_zero", f"{k}: " + DEV1.format("dk"), gpus=2, **{k: on(on_cuda1) if k == "dv" else new(
            lambda d: i32("cuda:1", 0))}) for k in ("dv", "batch_idx", "head_idx")],
    # selections: Python values the wrapper converts to int32 tensors; contents (check_inputs=True)
    *[R("store_zero", "batch_idx: " + VALUES + t, PY, batch_idx=v) for v, t in ((1.0, "float"), (True, "bool"),
                                                                                ("01", "str"))],
    *[R("store_zero", rf"head_idx\[{i}\]: expected an int, got {t}", PY, head_idx=v)
      for v, i, t in (([0, 1.5], 1, "float"), ([False], 0, "bool"), (["a"], 0, "str"))],
    R("store_zero", r"head_idx\[1\]: " + INT32 + "1099511627776", head_idx=[0, 2**40]),
    R("store_zero", "batch_idx: " + INT32 + "-2147483649", batch_idx=-(2**31) - 1),
    R("store_zero", r"batch_idx\[1\]: " + IN_RANGE.format("batch size", 5), batch_idx=[0, 5], **CHECKED),
    R("store_zero", r"head_idx\[0\]: " + IN_RANGE.format("number of heads", -1), head_idx=-1, **CHECKED),
    R("store_zero", r"seqused\[1\]: expected <= 40 \(the static seqlen\), got 41",
      seqused=new(lambda d: i32(d, 1, S + 1)), batch_idx=[0], **CHECKED),
    R("store_zero_varlen", r"batch_idx\[0\]: " + IN_RANGE.format("batch size", 7), batch_idx=7, **CHECKED),
    R("store_zero_varlen", NONDECREASING, cu_seqlens=new(lambda d: i32(d, 0, 50, 30)), **CHECKED),
    # ---- gqa_accumulator (allocation; runs on any device)
    R("gqa_accumulator", r"num_heads_kv: expected (a positive int|an int in \[1, 65535\]), got 0", num_heads_kv=0),
    R("gqa_accumulator", r"num_heads_kv: expected an int in \[1, 65535\], got 65536", num_heads_kv=65536),
    R("gqa_accumulator", r"num_heads_kv: expected a positive int, got (True|bool)", PY, num_heads_kv=True),
    R("gqa_accumulator", r"head_dim: (head dim: )?expected a multiple of 8 in \[8, 256\], got 260", head_dim=260),
    R("gqa_accumulator", r"head_dim_v: (head dim: )?expected a multiple of 8 in \[8, 256\], got 60", head_dim_v=60),
    R("gqa_accumulator", r"arch: expected 0 \(the device's path\), 80 or 90, got 86", arch=86),
    R("gqa_accumulator", r"deterministic: expected None or a bool, got int", PY, deterministic=1),
    R("gqa_accumulator", r"seqlen: expected an int >= 0 \(or cu_seqlens and total_tokens for the varlen layout\), "
      r"got None", seqlen=None),
    R("gqa_accumulator", r"batch: expected an int >= 0, got None", batch=None),
    R("gqa_accumulator", r"total_tokens: expected an int >= 0 \(the partials' row count\) in the varlen layout, "
      r"got None", seqlen=None, batch=None, cu_seqlens=new(lambda d: i32(d, 0, 30, TOTAL))),
    R("gqa_accumulator", r"seqlen: expected None in the varlen layout \(cu_seqlens/total_tokens given\), got 40",
      batch=None, total_tokens=TOTAL),
    R("gqa_accumulator", r"batch: expected None or 2 \(cu_seqlens\.numel\(\) - 1\), got 3", seqlen=None, batch=3,
      total_tokens=TOTAL, cu_seqlens=new(lambda d: i32(d, 0, 30, TOTAL))),
    R("gqa_accumulator", r"batch: expected an int >= 1 \(the number of sequences\) or cu_seqlens, got None",
      seqlen=None, batch=None, total_tokens=TOTAL),
    R("gqa_accumulator", "cu_seqlens: " + DT.format("int32", "int64"), PY, seqlen=None, batch=None,
      total_tokens=TOTAL, cu_seqlens=new(lambda d: torch.tensor([0, 30, TOTAL], device=d))),
    # ---- gqa_accumulate: the wrapper (the accumulator object, Python types)
    R("gqa_accumulate", NOT_ACC + "Tensor", PY, acc=on(lambda acc: acc.dk_accum)),
    R("gqa_accumulate", NOT_ACC + "tuple", PY, acc=on(lambda acc: (acc.dk_accum, acc.dv_accum))),
    *[R("gqa_accumulate", rf"{k}: {TENSOR}list", TYPE, **{k: [0.0]}) for k in PARTIALS],
    *[R("gqa_accumulate", rf"{k}: {TENSOR}list", TYPE,
                                                              acc=replace_acc(**{k: [0.0]}))
      for k in ("dk_accum", "dv_accum", "semaphores")],
    *[R("gqa_accumulate", rf"deterministic: expected a bool, got {t}", PY, deterministic=v) for v, t in ((1, "int"),
                                                                                                   ("yes", "str"))],
    R("gqa_accumulate", "dk_partial: " + DT.format("float32", "bfloat16"), TYPE, dk_partial=on(torch.Tensor.bfloat16)),
    R("gqa_accumulate", "dk_partial: " + HEADS.format(3, r"dk_accum\.shape\[1\]", 4),
      acc=new(lambda d: accumulator(d, h_k=3))),
    # an accumulator sized for another problem: named by its field (the wrapper) or its shape (the op)
    R("gqa_accumulate", r"(acc\.head_dim: expected 64 \(dk_partial\.shape\[-1\]\), got 128|dk_accum: "
      + ACC.format(sh(2, 2, 1, 8192), OF_B, 2, sh(2, 2, 1, 16384), d=64, c=64, a=90) + ")",
      acc=new(lambda d: accumulator(d, hd=128))),
    R("gqa_accumulate", r"(acc\.rows: expected 40 \(dk_partial\.shape\[1\], the seqlen\), got 300|dk_accum: "
      + ACC.format(sh(2, 2, 1, 8192), OF_B, 2, sh(2, 2, 3, 8192), d=64, c=64, a=90) + ")",
      acc=new(lambda d: accumulator(d, seqlen=300))),
    R("gqa_accumulate", SEMS.format("deterministic=True"), acc=new(lambda d: accumulator(d, False)),
      deterministic=True),
    R("gqa_accumulate_det", SEMS.format(r"torch\.are_deterministic_algorithms_enabled\(\) is True"),
      acc=new(lambda d: accumulator(d, False))),
    *[R("gqa_accumulate", rf"acc\.{f}: expected {want}, got {v}", acc=replace_acc(**{f: v}))
      for f, want, v in (("head_dim", r"64 \(dk_partial\.shape\[-1\]\)", 56), ("head_dim_v", r"64 \(dv_partial\.shape"
                                                                                       r"\[-1\]\)", 56),
                         ("rows", r"40 \(dk_partial\.shape\[1\], the seqlen\)", 41),
                         ("varlen", r"False: the call's layout is batched \(cu_seqlens None\)", True))],
    R("gqa_accumulate_varlen", r"acc\.batch: expected 2 \(cu_seqlens\.numel\(\) - 1\), got 3",
      acc=replace_acc(batch=3)),
    R("gqa_accumulate", "dv_partial: " + LAST.format(".*"), dv_partial=on(widened)),
    R("gqa_accumulate", "dk_partial: " + CPU, dk_partial=on(torch.Tensor.cpu), dv_partial=on(torch.Tensor.cpu),
      acc=acc_on("cpu", True)),
    R("gqa_accumulate", "dk_accum: " + DEV1.format("dk_partial"), gpus=2, acc=acc_on("cuda:1", True)),
    R("gqa_accumulate", "dv_partial: " + DEV1.format("dk_partial"), gpus=2, dv_partial=on(on_cuda1)),
    R("gqa_accumulate_varlen", NONDECREASING, cu_seqlens=new(lambda d: i32(d, 0, 50, 30)), **CHECKED),
    R("gqa_accumulate_varlen", SEG1, seqused=new(lambda d: i32(d, 30, 51)), **CHECKED),
    # ---- gqa_accumulate: the op's checks
    R("gqa_accumulate_op", ARCH + "70", _arch=70),
    *[R("gqa_accumulate_op", f"{k}: " + DT.format("float32", t), TypeError,
        **{k: on(lambda x, t=t: x.to(getattr(torch, t)))})
      for k, t in (("dv_partial", "float16"), ("dk_accum", "bfloat16"), ("dv_accum", "float64"))],
    R("gqa_accumulate_op", "dk_partial: " + RANK_B + sh(40, 4, 64), dk_partial=FIRST),
    R("gqa_accumulate_varlen_op", "dv_partial: " + RANK_V + sh(1, 80, 4, 64), dv_partial=UNSQUEEZED),
    R("gqa_accumulate_op", "dv_accum: " + RANK_A + r"3 dims, shape \(2, 1, 8192\)", dv_accum=FIRST),
    R("gqa_accumulate_op", r"dv_partial: shape: expected \(2, 40, 4, '\*'\) \(dk_partial's shape but the last dim\), "
      r"got \(2, 40, 2, 64\)", dv_partial=on(lambda t: t[:, :, :2])),
    R("gqa_accumulate_op", "dk_partial: " + HD + "60", dk_partial=on(lambda t: t[..., :60])),
    R("gqa_accumulate_op", "dv_partial: " + HD + "264", dv_partial=new(lambda d: z(d, B, S, H_Q, 264))),
    R("gqa_accumulate_op", "dk_partial: " + HEADS.format(2, r"dk_accum\.shape\[1\]", 3),
      **{k: on(lambda t: t[:, :, :3]) for k in PARTIALS}),
    R("gqa_accumulate_op", r"dk_accum: heads: expected >= 1 \(dk_accum\.shape\[1\], the number of KV heads\), got 0",
      dk_accum=on(lambda t: t[:, :0]), dv_accum=on(lambda t: t[:, :0])),
    R("gqa_accumulate_op", "dv_accum: " + ACC.format(sh(2, 2, 1, 8192), OF_B, 2, sh(2, 2, 2, 8192), d=64, c=64, a=90),
      dv_accum=new(lambda d: z(d, B, H_K, 2, 8192))),
    R("gqa_accumulate_op", "dk_accum: " + ACC.format(sh(2, 2, 1, 16384), OF_B, 2, sh(2, 2, 1, 20480),
                                                     d=256, c=256, a=80),
      _arch=80, dk_partial=new(lambda d: z(d, B, S, H_Q, 256)), dv_partial=new(lambda d: z(d, B, S, H_Q, 256)),
      dk_accum=new(lambda d: accumulator(d, hd=256).dk_accum), dv_accum=new(lambda d: accumulator(d, hd=256).dv_accum)),
    R("gqa_accumulate_varlen_op", "dk_accum: " + ACC.format(sh(1, 2, 3, 8192), "3 sequences of 80 total tokens", 2,
                                                            sh(1, 2, 2, 8192), d=64, c=64, a=90),
      cu_seqlens=new(lambda d: i32(d, 0, 30, 50, 80))),
    R("gqa_accumulate_op", "dv_partial: " + LAST.format(sh(20480, 512, 128, 2)), dv_partial=on(widened)),
    R("gqa_accumulate_op", "dk_partial: " + PITCH.format(2, 4, 66, sh(2, 40, 4, 64), sh(10560, 264, 66, 1)),
      dk_partial=padded(2)),
    R("gqa_accumulate_op", "dk_accum: " + CONTIG.format(sh(16384, 8192, 8192, 1), sh(32768, 16384, 16384, 2)),
      dk_accum=on(widened)),
    R("gqa_accumulate_op", "dv_accum: " + CONTIG.format(sh(16384, 8192, 8192, 1), sh(16392, 8196, 8196, 1)),
      dv_accum=padded(4)),
    R("gqa_accumulate_op", "dk_partial: " + ALIGN.format(4), dk_partial=misaligned(4)),
    R("gqa_accumulate_op", "dk_accum: " + CONTIGUOUS_OR_SELF, dk_accum=expanded()),
    R("gqa_accumulate_op", "dv_accum: " + CONTIGUOUS_OR_SELF, dv_accum=overlapping()),
    R("gqa_accumulate_op", r"semaphores: (stride\(0\): expected 1 \(contiguous\), got 0|"
      + SELF.format(sh(9), sh(0)) + ")", semaphores=new(lambda d: i32(d, 0).expand(9))),
    R("gqa_accumulate_op", SEMAPHORES + r"accumulator with flash_epilogue\.gqa_accumulator\(\.\.\., "
      r"deterministic=True\)\), got None", semaphores=None),
    R("gqa_accumulate_op", "semaphores: " + DT.format("int32", "int64"), TypeError, semaphores=on(torch.Tensor.long)),
    R("gqa_accumulate_op", r"semaphores: rank: expected 1 dim, got 2 dims, shape \(3, 3\)",
      semaphores=on(lambda t: t.view(3, 3))),
    R("gqa_accumulate_op", r"semaphores: stride\(0\): expected 1 \(contiguous\), got 2",
      semaphores=new(lambda d: torch.zeros(20, dtype=I32, device=d)[::2])),
    *[R("gqa_accumulate_op", r"semaphores: numel: expected >= 9 \(2 \* batch_extent \* num_tiles \* heads_kv \+ 1 for "
        r"dk_accum of shape \(2, 2, 1, 8192\)\), got 8", semaphores=on(lambda t: t[:8]), deterministic=det)
      for det in (True, False)],
    R("gqa_accumulate_op", "dv_accum: " + OVER.format("dk_accum"), dv_accum=alias("dk_accum")),
    R("gqa_accumulate_op", "semaphores: " + OVER.format("dk_accum"), semaphores=int32_view("dk_accum", 9)),
    R("gqa_accumulate_op", "dk_accum: " + OVER.format("dv_partial"), dv_partial=alias(
        "dk_accum", lambda t: t.reshape(-1)[: B * S * H_Q * D].view(B, S, H_Q, D))),
    R("gqa_accumulate_varlen_op", "dv_accum: " + OVER.format("cu_seqlens"), cu_seqlens=int32_view("dv_accum", 3)),
    R("gqa_accumulate_op", "seqused: " + NUMEL.format(r"dk_partial\.shape\[0\]", 3),
      seqused=new(lambda d: i32(d, 1, 2, 3))),
    R("gqa_accumulate_varlen_op", "seqused: " + NUMEL.format(r"cu_seqlens\.numel\(\) - 1", 1),
      seqused=new(lambda d: i32(d, 1))),
    R("gqa_accumulate_varlen_op", r"cu_seqlens: numel: expected batch \+ 1 >= 2 \(at least one sequence\), got 1",
      cu_seqlens=new(lambda d: i32(d, 0))),
    # ---- gqa_postprocess
    *[R("gqa_postprocess", rf"{k}: expected a float, got {t}", PY, **{k: v})
      for k, v, t in (("scale_dk", "0.5", "str"), ("scale_dv", True, "bool"),
                      ("scale_dk", torch.tensor(1.0), "Tensor"))],
    R("gqa_postprocess", "scale_dk: " + FP32_RANGE + r"1e\+300", scale_dk=1e300),
    R("gqa_postprocess", "scale_dv: " + FP32_RANGE + "1" + "0" * 400 + "$", PY, scale_dv=10**400),
    R("gqa_postprocess_op", "scale_dv: " + FP32_RANGE + r"-1e\+300", ValueError, scale_dv=-1e300),
    R("gqa_postprocess", NOT_ACC + "Tensor", PY, acc=on(lambda acc: acc.dk_accum)),
    R("gqa_postprocess", r"acc\.head_dim_v: expected 64 \(dv\.shape\[-1\]\), got 56", acc=replace_acc(head_dim_v=56)),
    R("gqa_postprocess", "dk: " + DT.format(HALF, "float32"), TYPE, dk=on(torch.Tensor.float),
      dv=on(torch.Tensor.float)),
    R("gqa_postprocess", "dv: " + OVER.format("dk"), dv=alias("dk")),
    R("gqa_postprocess", "dk: " + SELF.format(B_S_H_D, sh(0, 128, 64, 1)), dk=expanded()),
    R("gqa_postprocess", r"dk: device: expected cuda:1 \(the device of dk_accum\), got cuda:0", gpus=2,
      acc=acc_on("cuda:1")),
    R("gqa_postprocess", r"dv: device: expected cuda:1 \(the device of dk_accum\), got cuda:0", gpus=2,
      acc=acc_on("cuda:1"), dk=on(on_cuda1)),
    R("gqa_postprocess", r"seqused\[0\]: expected <= 40 \(the static seqlen\), got 41",
      seqused=new(lambda d: i32(d, S + 1, 0)), **CHECKED),
    R("gqa_postprocess_op", ARCH + "1", _arch=1),
    R("gqa_postprocess_op", "dk_accum: " + DT.format("float32", "float16"), TypeError, dk_accum=on(torch.Tensor.half)),
    R("gqa_postprocess_op", r"dv: dtype: expected torch\.bfloat16 \(the dtype of dk\), got torch\.float16", TypeError,
      dv=on(torch.Tensor.half)),
    R("gqa_postprocess_op", "dv_accum: " + RANK_A + r"5 dims, shape \(1, 2, 2, 1, 8192\)", dv_accum=UNSQUEEZED),
    R("gqa_postprocess_op", "dk: " + RANK_V + B_S_H_D, cu_seqlens=new(lambda d: i32(d, 0, S))),
    R("gqa_postprocess_op", r"dv: shape: expected \(2, 40, 2, '\*'\) \(dk's shape but the last dim\), got "
      r"\(2, 40, 1, 64\)", dv=on(lambda t: t[:, :, :1])),
    R("gqa_postprocess_op", "dv: " + HD + "12", dv=on(lambda t: t[..., :12])),
    R("gqa_postprocess_op", "dk_accum: " + ACC.format(sh(2, 1, 1, 8192), OF_B, 1, sh(2, 2, 1, 8192), d=64, c=64, a=90),
      dk=on(lambda t: t[:, :, :1]), dv=on(lambda t: t[:, :, :1])),
    R("gqa_postprocess_op", "dk: " + PITCH.format(2, 8, 68, B_S_H_D, sh(5440, 136, 68, 1)), dk=padded(4)),
    R("gqa_postprocess_op", "dk_accum: " + CONTIG.format(sh(16384, 8192, 8192, 1), sh(16392, 8196, 8196, 1)),
      dk_accum=padded(4)),
    R("gqa_postprocess_op", "dv: " + ALIGN.format(8), dv=misaligned()),
    R("gqa_postprocess_op", "dk: " + OVER.format("dk_accum"), dk=like("dk_accum", BF16, (B, S, H_K, D))),
    R("gqa_postprocess_op", "seqused: " + NUMEL.format(r"dk\.shape\[0\]", 1), seqused=new(lambda d: i32(d, 3))),
    R("gqa_postprocess_op", "dk_accum: " + CPU, **{k: on(torch.Tensor.cpu) for k in STORE4}),
    # ---- gqa_accum_to_dense (GQAAccumulator.to_dense and the op)
    R("to_dense_varlen", r"cu_seqlens: expected the int32 cu_seqlens the varlen accumulator was filled with, got None",
      cu_seqlens=None),
    R("to_dense", r"cu_seqlens: expected None for an accumulator of the batched layout, got a tensor",
      cu_seqlens=new(lambda d: i32(d, 0, 30, TOTAL))),
    R("to_dense_varlen", r"acc\.batch: expected 3 \(cu_seqlens\.numel\(\) - 1\), got 2",
      cu_seqlens=new(lambda d: i32(d, 0, 30, 50, TOTAL))),
    R("to_dense", r"seqused: device: expected cuda:1 \(the device of accum\), got cuda:0", gpus=2,
      acc=acc_on("cuda:1"), seqused=new(lambda d: i32("cuda:0", 1, 2))),
    R("gqa_accum_to_dense_op", r"Expected a value of type 'int' for argument 'head_dim'", RAW, head_dim=None),
    R("gqa_accum_to_dense_op", "head_dim: " + HD + "12", head_dim=12),
    R("gqa_accum_to_dense_op", "out: " + DT.format("float32", "bfloat16"), TypeError, out=on(torch.Tensor.bfloat16)),
    R("gqa_accum_to_dense_op", "accum: " + RANK_A + r"3 dims, shape \(2, 2, 8192\)", accum=on(lambda t: t[:, :, 0])),
    R("gqa_accum_to_dense_op", r"out: head dim: expected <= head_dim = 64, got 128",
      out=new(lambda d: z(d, B, S, H_K, 128))),
    R("gqa_accum_to_dense_op", "out: " + LAST.format(WIDE), out=on(widened)),
    R("gqa_accum_to_dense_op", "out: " + SELF.format(B_S_H_D, sh(0, 128, 64, 1)), out=expanded()),
    R("gqa_accum_to_dense_op", "out: " + OVER.format("accum"), out=alias(
        "accum", lambda t: t.reshape(-1)[: B * S * H_K * D].view(B, S, H_K, D))),
    R("gqa_accum_to_dense_op", "accum: " + CPU, accum=on(torch.Tensor.cpu), out=on(torch.Tensor.cpu)),
    R("gqa_accum_to_dense_op", "accum: " + ACC.format(sh(2, 2, 1, 16384), OF_B, 2, sh(2, 2, 1, 8192), d=64, c=128,
                                                      a=90),
      head_dim=128),
    # ---- gqa_reduce: the wrapper
    R("gqa_reduce", r"num_heads_kv: expected a divisor of the 4 query heads \(dk_partial\.shape\[-2\]\), got 3",
      num_heads_kv=3),
    R("gqa_reduce", r"num_heads_kv: expected a positive int, got 0", num_heads_kv=0),
    *[R("gqa_reduce", rf"num_heads_kv: expected a positive int, got {t}", PY, num_heads_kv=v)
      for v, t in ((2.0, r"2\.0"), (True, "(True|bool)"))],
    R("gqa_reduce", r"out_dtype: expected None, torch\.float16 or torch\.bfloat16, got torch\.float32", out_dtype=F32),
    R("gqa_reduce", r"dk_partial: dtype: expected torch\.float32 or torch\.bfloat16 \(the dtype of dk\), got "
      r"torch\.float64", TYPE, **{k: on(torch.Tensor.double) for k in PARTIALS}),
    R("gqa_reduce", rf"dk_partial: {TENSOR}list", TYPE, dk_partial=[1.0], dv_partial=None),
    R("gqa_reduce", r"scale_dv: expected a float, got NoneType", PY, scale_dv=None),
    R("gqa_reduce", r"expected torch\.Tensor arguments, got None for all of them", TYPE, dk_partial=None,
      dv_partial=None, cu_seqlens=None, seqused=None),
    R("gqa_reduce", "scale_dk: " + FP32_RANGE + r"1e\+300", scale_dk=1e300),
    R("gqa_reduce", "scale_dk: " + FP32_RANGE + "1" + "0" * 400 + "$", PY, scale_dk=10**400),
    R("gqa_reduce", "dk_partial: " + RANK_V + sh(2, 40, 4, 64), cu_seqlens=new(lambda d: i32(d, 0, S))),
    R("gqa_reduce_varlen", r"cu_seqlens\[2\]: expected <= 80 \(the tensors' token count\), got 81",
      cu_seqlens=new(lambda d: i32(d, 0, 30, 81)), **CHECKED),
    R("gqa_reduce_out", r"out: expected a \(dk, dv\) pair because dv_partial is given, got a torch\.Tensor", PY,
      out=on(lambda o: o[0])),
    R("gqa_reduce_out", r"out: expected None, a tensor \(dk\) or a \(dk, dv\) pair, got a tuple of length 3", PY,
      out=on(lambda o: o + o[:1])),
    R("gqa_reduce_out", r"out_dtype: expected None or torch\.bfloat16 \(the dtype of out\), got torch\.float16",
      out_dtype=F16),
    R("gqa_reduce_out", r"num_heads_kv: expected 2 \(the heads of out: dk\.shape\[-2\]\), got 1", num_heads_kv=1),
    R("gqa_reduce_out", r"dv: expected None because dv_partial is None, got Tensor", dv_partial=None),
    R("gqa_reduce_out", rf"dv_partial: {TENSOR}list", TYPE, dv_partial=[1.0]),
    R("gqa_reduce_out", "dk: " + SELF.format(B_S_H_D, sh(0, 128, 64, 1)),
      out=on(lambda o: (expanded().fn(o[0]), o[1]))),
    R("gqa_reduce_out", "dv: " + SELF.format(B_S_H_D, sh(5120, 32, 64, 1)), out=on(lambda o: (o[0], overlapping().fn(
        o[1])))),
    R("gqa_reduce", "dv_partial: " + DEV1.format("dk_partial"), gpus=2, dv_partial=on(on_cuda1)),
    R("gqa_reduce_out", "dk: " + DEV1.format("dk_partial"), gpus=2, out=on(lambda o: (on_cuda1(o[0]), o[1]))),
    R("gqa_reduce", "seqused: " + DEV1.format("dk_partial"), gpus=2, seqused=new(lambda d: i32("cuda:1", 1, 2))),
    # ---- gqa_reduce: the op's checks
    R("gqa_reduce_op", r"dv: expected a torch\.Tensor because dv_partial is given, got NoneType", dv=None),
    R("gqa_reduce_op", "dk: " + DT.format(HALF, "float32"), TypeError, dk=on(torch.Tensor.float),
      dv=on(torch.Tensor.float)),
    R("gqa_reduce_op", r"dk_partial: dtype: expected torch\.float32 or torch\.bfloat16 \(the dtype of dk\), got "
      r"torch\.float16", TypeError, **{k: on(torch.Tensor.half) for k in PARTIALS}),
    R("gqa_reduce_op", r"dv_partial: dtype: expected torch\.float32 \(the dtype of dk_partial\), got torch\.bfloat16",
      TypeError, dv_partial=on(torch.Tensor.bfloat16)),
    R("gqa_reduce_op", r"dv: dtype: expected torch\.bfloat16 \(the dtype of dk\), got torch\.float16", TypeError,
      dv=on(torch.Tensor.half)),
    R("gqa_reduce_op", r"dk: shape: expected \(2, 40, '\*', 64\) \(dk_partial's shape but the heads dim\), got "
      r"\(2, 39, 2, 64\)", dk=on(lambda t: t[:, :39])),
    R("gqa_reduce_op", r"dv: shape: expected \(2, 40, '\*', 64\) \(dv_partial's shape but the heads dim\), got "
      r"\(2, 40, 2, 32\)", dv=on(lambda t: t[..., :32])),
    R("gqa_reduce_op", r"dv_partial: shape: expected \(2, 40, 4, '\*'\) \(dk_partial's shape but the last dim\), got "
      r"\(2, 40, 3, 64\)", dv_partial=on(lambda t: t[:, :, :3])),
    R("gqa_reduce_op", r"dv: shape: expected \(2, 40, 2, '\*'\) \(dk's shape but the last dim\), got \(2, 40, 1, 64\)",
      dv=on(lambda t: t[:, :, :1])),
    R("gqa_reduce_op", "dk_partial: " + HEADS.format(3, r"dk\.shape\[-2\]", 4), dv_partial=None, dv=None,
      dk=new(lambda d: bf16(d, B, S, 3, D))),
    R("gqa_reduce_op", "dk: " + HD + "20", dv_partial=None, dv=None, dk_partial=on(lambda t: t[..., :20]),
      dk=on(lambda t: t[..., :20])),
    R("gqa_reduce_op", "dk_partial: " + RANK_B + sh(40, 4, 64), dk_partial=FIRST, dv_partial=None, dv=None),
    R("gqa_reduce_op", "dk_partial: " + PITCH.format(2, 8, 68, sh(2, 40, 4, 64), sh(10880, 272, 68, 1)),
      dv_partial=on(torch.Tensor.bfloat16), dk_partial=lambda a, d: padded(4).fn(a["dk_partial"].bfloat16())),
    R("gqa_reduce_op", "dv: " + LAST.format(WIDE), dv=on(widened)),
    R("gqa_reduce_op", "dk_partial: " + ALIGN.format(8), dk_partial=misaligned()),
    R("gqa_reduce_op", "dk: " + OVER.format("dk_partial"), dk=alias("dk_partial", lambda t: t.view(BF16)[:, :, :H_K,
                                                                                                      :D])),
    R("gqa_reduce_op", "dv: " + OVER.format("dk"), dv=alias("dk")),
    R("gqa_reduce_op", "seqused: " + NUMEL.format(r"dk_partial\.shape\[0\]", 3),
      seqused=new(lambda d: i32(d, 1, 2, 3))),
    R("gqa_reduce_varlen_op", "cu_seqlens: " + DT.format("int32", "int64"), TypeError,
      cu_seqlens=on(torch.Tensor.long)),
    R("gqa_reduce_op", "dk_partial: " + CPU, **{k: on(torch.Tensor.cpu) for k in PARTIALS + ("dk", "dv")}),
    R("gqa_reduce_op", "scale_dk: " + FP32_RANGE + r"1e\+300", ValueError, scale_dk=1e300),
    R("gqa_reduce_op", "dk: " + DEV1.format("dk_partial"), ValueError, gpus=2, dk=on(on_cuda1)),
    # ---- repeat_kv: the wrapper and the two ops
    R("repeat_kv", r"x: rank: expected 4 dims: \(batch, kv_heads, seqlen, head_dim\) for dim=1, \(batch, seqlen, "
      r"kv_heads, head_dim\) for dim=2, got 3 dims, shape \(2, 40, 64\)", x=FIRST),
    R("repeat_kv", rf"x: {TENSOR}list", PY, x=[1.0]),
    *[R("repeat_kv", rf"n_rep: expected a positive int, got {v}", n_rep=v) for v in (0, -2)],
    *[R("repeat_kv", rf"n_rep: expected a positive int, got {t}", PY, n_rep=v) for v, t in ((True, "bool"),
                                                                                             (2.0, "float"))],
    *[R("repeat_kv", DIM + str(v), dim=v) for v in (0, 3)],
    R("repeat_kv", r"dim: expected .*, got float", PY, dim=1.0),
    R("repeat_kv_op", r"x: rank: expected 4 dims: .*, got 3 dims, shape \(2, 40, 64\)$", ValueError, x=FIRST),
    R("repeat_kv_op", r"n_rep: expected a positive int, got -1$", ValueError, n_rep=-1),
    R("repeat_kv_op", DIM + "0$", ValueError, dim=0),
    R("repeat_kv_backward_op", r"grad: heads: expected a multiple of n_rep = 3 in dim 1, got 4 \(shape \(1, 4, 2, "
      r"8\)\)$", ValueError, n_rep=3),
    *[R("repeat_kv_backward_op", rf"layout: expected a permutation of \[0, 1, 2\], got {re.escape(str(v))}$",
        ValueError, layout=v) for v in ([0, 1, 1], [0, 1])],
    R("repeat_kv_backward_op", r"grad: rank: expected 4 dims: \(batch, heads, seqlen, head_dim\) for dim=1, \(batch, "
      r"seqlen, heads, head_dim\) for dim=2, got 3 dims, shape \(4, 2, 8\)$", ValueError, grad=FIRST),
    R("repeat_kv_backward_op", r"n_rep: expected a positive int, got 0$", ValueError, n_rep=0),
    R("repeat_kv_backward_op", DIM + "3$", ValueError, dim=3),
    # ---- the references (CPU or GPU tensors; messages of their own)
    R("store_reference", r"accumulator shapes \(2, 40, 2, 64\)/\(2, 40, 2, 64\) differ from dk/dv \(2, 41, 2, 64\)",
      ValueError, dk=new(lambda d: bf16(d, B, S + 1, H_K, D))),
    R("store_reference", r"dk \(2, 40, 2, 64\) and dv \(2, 40, 3, 64\) differ before the last dim", ValueError,
      dv_accum=new(lambda d: z(d, B, S, 3, D)), dv=new(lambda d: bf16(d, B, S, 3, D))),
    R("gqa_reduce_reference", r"num_heads_kv=4 must divide the 6 query heads of partial", ValueError, num_heads_kv=4),
    R("gqa_reduce_reference", r"out has dtype torch\.float32, out_dtype is torch\.float16", ValueError,
      out=new(lambda d: z(d, 1, 2, 3, 8))),
    R("gqa_reduce_reference", r"out has shape \(1, 2, 2, 8\), expected \(1, 2, 3, 8\)", ValueError,
      out=new(lambda d: z(d, 1, 2, 2, 8, dtype=F16))),
    R("gqa_reduce_sequential_fp32", r"num_heads_kv=0 must divide the 6 query heads", ValueError, num_heads_kv=0),
    R("gqa_accumulate_reference", r"sequential=True adds in fp32: dk_dense must be float32, got torch\.float64",
      ValueError, dk_dense=on(torch.Tensor.double)),
    R("gqa_accumulate_reference", r"dk_dense has shape \(10, 2, 8\), expected \(10, 3, 8\)", ValueError,
      dk_dense=on(lambda t: t[:, :2])),
    R("gqa_accumulate_reference", r"dv_partial and dv_dense: give both or neither", ValueError,
      dv_partial=alias("dk_partial")),
]


_seen = collections.Counter()
for _r in ROWS:  # ids: the op and the start of the message, numbered when they repeat
    _r.id = _r.op + "-" + re.sub(r"[^A-Za-z0-9_]+", "-", _r.match[:48]).strip("-")
    _seen[_r.id] += 1
    _r.id += f"-{_seen[_r.id]}" * (_seen[_r.id] > 1)
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def _params(rows):
    out = []
    for r in rows:
        # the references and fe.repeat_kv run without the ops
        ops = [pytest.mark.ops] * (OP[r.op].name is not None and r.op != "repeat_kv")
        if r.cpu:
            out.append(pytest.param(r, "cpu", id=f"cpu-{r.id}", marks=ops))
        out.append(pytest.param(r, "cuda", id=f"cuda-{r.id}", marks=[pytest.mark.gpu] + [two_gpus] * (r.gpus > 1)))
    return out


def apply(changes, a, d):
    for k, v in changes.items():
        if k == "_":
            v(a, d)
        elif isinstance(v, on):
            a[k] = v.fn(a[k])
        elif callable(v) and not isinstance(v, (torch.Tensor, torch.dtype)):
            a[k] = v(a, d)
        else:
            a[k] = v


def call(op, d, changes=()):
    a = op.build(d)
    apply(dict(changes), a, d)
    return op.fn(**a)


def check_accepted(op, d, changes=(), runs=False):
    """The call is accepted: it runs on the GPU (and on CPU when it can: allocation, repeat_kv, the references,
    meta tensors); on CPU tensors the op stops at its last check, the device check."""
    if d == "cuda" or op.cpu_runs or runs:
        call(op, d, changes)
        if d == "cuda":
            torch.cuda.synchronize()
        return
    with pytest.raises(ValueError, match=r"device: expected a CUDA tensor, got a tensor on cpu"):
        call(op, d, changes)


def check_error(err, row):
    msg, name = str(err), OP[row.op].name
    if row.cls is INPUT:
        assert isinstance(err, INPUT) and not isinstance(err, TypeError), f"{type(err).__name__}: {msg}"
    elif row.cls in (ValueError, TypeError):  # the op itself (c10::ValueError / TypeError)
        assert type(err) is row.cls, f"{type(err).__name__} is not {row.cls.__name__}: {msg}"
    else:
        assert isinstance(err, row.cls), f"{type(err).__name__} is not one of {row.cls}: {msg}"
    if row.cls is RAW or name is None:
        assert re.search(row.match, msg), f"message does not match {row.match!r}:\n{msg}"
    else:
        assert re.search(rf"^flash_epilogue\.{name}: " + row.match, msg), f"does not match {row.match!r}:\n{msg}"
        assert "expected" in msg and ", got " in msg, msg


def assert_healthy():
    """A valid store, gqa_reduce and deterministic accumulate + postprocess give bitwise-right results and the
    device synchronizes without a (sticky) error."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    acc_k, acc_v = rand((B, S, H_K, D), gen), rand((B, S, H_K, D), gen)
    dk, dv = (torch.full((B, S, H_K, D), float("nan"), dtype=BF16, device="cuda") for _ in range(2))
    fe.store(acc_k, acc_v, dk, dv)
    pk, pv = rand((B, S, H_Q, D), gen), rand((B, S, H_Q, D), gen)
    rk = fe.gqa_reduce(pk, num_heads_kv=H_K, out_dtype=BF16)
    acc = accumulator("cuda")
    fe.gqa_accumulate(pk, pv, acc)
    ok, ov = (torch.full((B, S, H_K, D), float("nan"), dtype=BF16, device="cuda") for _ in range(2))
    fe.gqa_postprocess(acc, ok, ov)
    torch.cuda.synchronize()
    assert torch.equal(bits(dk), bits(acc_k.to(BF16))) and torch.equal(bits(dv), bits(acc_v.to(BF16)))
    assert torch.equal(bits(rk), bits(ref.gqa_reduce_reference(pk, num_heads_kv=H_K, out_dtype=BF16, sequential=True)))
    dense = [z("cuda", B, S, H_K, D) for _ in range(2)]
    ref.gqa_accumulate_reference(pk, pv, *dense, num_heads_kv=H_K)
    assert torch.equal(bits(ok), bits(dense[0].to(BF16))) and torch.equal(bits(ov), bits(dense[1].to(BF16)))


@pytest.mark.parametrize("row,dev", _params(ROWS))
def test_bad_input(row, dev):
    op = OP[row.op]
    check_accepted(op, dev)  # the baseline: the error comes from the row's change
    with pytest.raises(Exception) as info:
        call(op, dev, row.changes)
    check_error(info.value, row)
    if dev == "cuda":
        assert_healthy()


# ---------------------------------------------------------------------------------------------
# accepted inputs (what the checks must not refuse)


def kv_packed(a, d):
    kv = z(d, B, S, H_K, 2, D, dtype=BF16)  # FlashAttention's packed dkv: no element shared
    a.update(dk=kv[:, :, :, 0], dv=kv[:, :, :, 1])


def split_along_d(a, d):
    both = z(d, B, S, H_K, 2 * D, dtype=BF16)
    a.update(dk=both[..., :D], dv=both[..., D:])


def size_one_dims(a, d):
    # batch 1 and heads 1 with strides that are not multiples of 16 bytes: ignored
    odd = lambda dtype, strides: torch.zeros(16 * 64, dtype=dtype, device=d).as_strided((1, 16, 1, 64), strides)  # noqa
    a.update(dk=odd(BF16, (7, 64, 3, 1)), dv=odd(BF16, (5, 64, 1, 1)), dk_accum=odd(F32, (3, 64, 9, 1)),
             dv_accum=odd(F32, (1, 64, 1, 1)))


def every(**makers):
    return lambda a, d: a.update({k: m(d) for k, m in makers.items()})


GOOD = [  # (op, changes, runs on any device)
    ("store", {"_": kv_packed}, False),
    ("store", {"_": split_along_d}, False),
    ("store", {"dk": new(lambda d: z(d, B, H_K, S, D, dtype=BF16).transpose(1, 2)), "dk_accum": padded(4)}, False),
    ("store", {"_": size_one_dims}, False),
    ("store", {"_": every(**{k: (lambda d, k=k: z(d, 0, S, H_K, D, dtype=F32 if "accum" in k else BF16))
                             for k in STORE4})}, False),
    ("store", {"_": every(**{k: (lambda d, k=k: z(d, 0, H_K, D, dtype=F32 if "accum" in k else BF16))
                             for k in STORE4}, cu_seqlens=lambda d: i32(d, 0, 0))}, False),
    ("store", {k: on(lambda t: t.to("meta")) for k in STORE4}, True),  # meta tensors: shape inference only
    ("store", {"_": every(dk_accum=lambda d: z(d, B, S, H_K, 72), dk=lambda d: z(d, B, S, H_K, 72, dtype=BF16),
                          dv_accum=lambda d: z(d, B, S, H_K, 40), dv=lambda d: bf16(d, B, S, H_K, 40))}, False),
    ("store_varlen", {"seqused": new(lambda d: i32(d, 3, 50)), "dv_accum": new(lambda d: z(d, TOTAL, H_K, 128)),
                      "dv": new(lambda d: z(d, TOTAL, H_K, 128, dtype=BF16))}, False),
    ("store_zero", {"_": kv_packed}, False),
    ("store_zero", {"_": split_along_d}, False),
    ("store_zero", {"batch_idx": [0, 0, 7, -1], "head_idx": new(i32), "row_start": 4, "row_end": 4}, False),
    ("store_zero", {"batch_idx": (1,), "head_idx": range(2), "row_start": 2**31 - 1, "row_end": 2**31 - 1}, False),
    ("store_zero", {"batch_idx": np.int64(1), "head_idx": np.array([1, 0])}, False),
    ("gqa_accumulate_op", {"deterministic": False}, False),  # semaphores given, unused
    ("gqa_accumulate_op", {"semaphores": new(lambda d: torch.zeros(19, dtype=I32, device=d))}, False),  # larger
    ("gqa_accumulate_op", {"dk_partial": new(lambda d: z(d, B, H_Q, S, D).transpose(1, 2)),
                           "dv_partial": padded(4)}, False),
    ("gqa_accumulate", {"acc": new(lambda d: accumulator(d, batch=0)), "dk_partial": new(lambda d: z(d, 0, S, H_Q, D)),
                        "dv_partial": new(lambda d: z(d, 0, S, H_Q, D))}, False),
    ("gqa_postprocess", {"dk": new(lambda d: z(d, B, H_K, S, D, dtype=BF16).transpose(1, 2)), "dv": padded(8)}, False),
    ("gqa_postprocess", {"scale_dk": float("inf"), "scale_dv": float("nan")}, False),  # inf and nan pass
    ("gqa_postprocess", {"scale_dk": np.float32(0.5), "scale_dv": 3}, False),
    ("gqa_reduce", {"dk_partial": on(torch.Tensor.bfloat16), "dv_partial": None}, False),
    ("gqa_reduce", {"dk_partial": new(lambda d: z(d, B, H_Q, S, D).transpose(1, 2))}, False),
    ("gqa_reduce", {"num_heads_kv": np.int64(2)}, False),  # integer-likes (operator.index)
    ("gqa_reduce", {"num_heads_kv": torch.tensor(2)}, False),
    ("gqa_reduce", {"scale_dk": float("inf")}, False),
    ("gqa_accumulator", {"num_heads_kv": np.int32(2)}, True),
    ("gqa_accumulator", {"num_heads_kv": torch.tensor(2), "head_dim": np.int64(64)}, True),
    ("to_dense_varlen", {"seqused": new(lambda d: i32(d, 3, 4))}, False),
    ("gqa_accum_to_dense_op", {"accum": new(lambda d: accumulator(d, h_k=1, hd=128, batch=1, seqlen=300,
                                                                  arch=80).dk_accum),
                               "out": new(lambda d: z(d, 1, 300, 1, 128)), "head_dim": 128, "_arch": 80}, False),
    ("repeat_kv", {"dim": -3}, True),
    ("repeat_kv", {"n_rep": np.int64(3), "dim": torch.tensor(2)}, True),
]


@pytest.mark.parametrize("op,changes,runs,dev", [
    pytest.param(*g, dev, id=f"{dev}-{g[0]}-{i}", marks=[pytest.mark.gpu] * (dev == "cuda") +
                 [pytest.mark.ops] * (g[0] != "repeat_kv"))
    for i, g in enumerate(GOOD) for dev in ("cpu", "cuda")])
def test_accepted(op, changes, runs, dev):
    check_accepted(OP[op], dev, changes, runs)


@pytest.mark.ops
def test_deterministic_accumulate_past_its_work_items():
    # the sm_80 deterministic mode's 1-D grid and int tickets hold (row tiles x batch x 2 x h_q) < 2^31 work items:
    # varlen, 16385 sequences over 128 tokens, 65535 query heads of one KV head (partials expanded, accumulators
    # untouched). The sm_90 path has no such limit (it reaches the device check).
    batch, h_q, rows = 16385, 65535, 128
    layout = fe._extension._C.gqa_accum_layout(1, D, D, batch, rows, True, 80, torch.device("cpu"))
    part = torch.zeros(rows, 1, D).expand(rows, h_q, D)
    acc = [torch.empty(shape) for shape in layout["shapes"]]
    sem, cu = torch.zeros(layout["semaphore_numel"], dtype=I32), torch.zeros(batch + 1, dtype=I32)
    with pytest.raises(ValueError, match=r"flash_epilogue\.gqa_accumulate: dk_partial: shape: expected at most "
                       r"2\^31 - 1 \(row tiles x batch x 2 x h_q\) work items in deterministic mode, got 2147713020"):
        OPS.gqa_accumulate(part, part, *acc, sem, cu_seqlens=cu, deterministic=True, _arch=80)
    with pytest.raises(ValueError, match=r"dk_partial: device: expected a CUDA tensor"):  # atomic mode: no such limit
        OPS.gqa_accumulate(part, part, *acc, None, cu_seqlens=cu, deterministic=False, _arch=80)


@pytest.mark.ops
def test_accumulators_of_two_head_dims_are_checked_each_against_its_own():
    # (192, 128) on sm_90: dV's tiles hold two of hdim 192's three slabs, so a dV accumulator of whole tiles (or of
    # dK's shape) is another problem's, in gqa_accumulate, gqa_postprocess and to_dense alike
    acc = fe.gqa_accumulator(2, 192, 128, batch=2, seqlen=40, device="cpu", arch=90)
    pk, pv, whole = torch.zeros(2, 40, 4, 192), torch.zeros(2, 40, 4, 128), torch.zeros(acc.dk_accum.shape)
    want = (r"dv_accum: shape: expected \(2, 2, 1, 12288\) \(the accumulator of batch 2, seqlen 40, 2 KV heads and "
            r"head dim 128 in the tile of head dim 192 on the sm_90 path: allocate it with "
            r"flash_epilogue\.gqa_accumulator\), got \(2, 2, 1, 18432\)")
    with pytest.raises(ValueError, match=r"flash_epilogue\.gqa_accumulate: " + want):
        OPS.gqa_accumulate(pk, pv, acc.dk_accum, whole, None, deterministic=False, _arch=90)
    with pytest.raises(ValueError, match=r"flash_epilogue\.gqa_postprocess: " + want):
        OPS.gqa_postprocess(acc.dk_accum, whole, pk[:, :, :2].to(BF16), pv[:, :, :2].to(BF16), _arch=90)
    with pytest.raises(ValueError, match=r"flash_epilogue\.gqa_accum_to_dense: accum: shape: expected \(2, 2, 1, "
                       r"12288\) \(the accumulator of batch 2, seqlen 40, 2 KV heads and head dim 128 in the tile of "
                       r"head dim 192 on the sm_90 path"):
        OPS.gqa_accum_to_dense(whole, pv[:, :, :2].clone(), head_dim=192, _arch=90)
    with pytest.raises(ValueError, match=r"dv_accum: shape: expected \(2, 2, 1, 12288\)"):  # and through the wrapper
        fe.gqa_accumulate(pk, pv, dataclasses.replace(acc, dv_accum=whole))


@pytest.mark.gpu
@pytest.mark.parametrize("env", ["FLASH_EPILOGUE_CHECK_INPUTS", "FLASH_EPILOGUE_DEBUG"])
def test_env_switches_turn_on_the_content_checks(env, monkeypatch):
    fe.store_zero(**zero_args("cuda"), batch_idx=4)  # unchecked by default: an out-of-range entry is skipped
    monkeypatch.setenv(env, "1")
    fe.refresh_env_flags()  # read at import (host time); conftest re-reads them before each test
    with pytest.raises(INPUT, match=r"batch_idx\[0\]: expected a value in \[0, 2\) \(the batch size\), got 4"):
        fe.store_zero(**zero_args("cuda"), batch_idx=4)
    fe.store_zero(**zero_args("cuda"), batch_idx=4, check_inputs=False)  # an explicit argument wins
    assert_healthy()


# ---------------------------------------------------------------------------------------------
# without the extension: every op raises FlashEpilogueBuildError naming the reason; the references work


def _run(code, cwd=ROOT, **env):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_without_the_extension_every_op_names_the_reason():
    out = _run("""
import importlib.abc, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "flash_epilogue._C":
            raise ImportError("blocked by the test")
sys.meta_path.insert(0, Blocked())
import torch, flash_epilogue as fe
assert not fe.kernels_available() and fe.UNAVAILABLE_REASON
a, o = torch.zeros(1, 8, 2, 64), torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
p = torch.zeros(1, 8, 4, 64)
calls = {"store": lambda: fe.store(a, a.clone(), o, o.clone()), "store_zero": lambda: fe.store_zero(o, o.clone()),
         "gqa_accumulator": lambda: fe.gqa_accumulator(2, 64, batch=1, seqlen=8, device="cpu"),
         "gqa_reduce": lambda: fe.gqa_reduce(p, num_heads_kv=2)}
for name, f in calls.items():
    try:
        f()
        print("ACCEPTED", name)
    except fe.FlashEpilogueBuildError as e:
        assert isinstance(e, RuntimeError)
        print("RAISED", e)
fe.reference.store_reference(a, a, o, o.clone())
x = torch.randn(1, 2, 8, 64, requires_grad=True)  # repeat_kv: the same arithmetic in plain torch
y = fe.repeat_kv(x, 3)
assert torch.equal(y, x.repeat_interleave(3, 1))
assert torch.equal(torch.autograd.grad(y, x, y)[0], fe.reference.group_sum_reference(y.detach(), 3))
print("REFERENCE OK")
""")
    for name in ("store", "store_zero", "gqa_accumulator", "gqa_reduce"):
        assert f"RAISED flash_epilogue.{name}: the CUDA kernels are not available: " in out, out
    assert "REFERENCE OK" in out


def test_a_build_for_another_torch_is_named(tmp_path):
    src = Path(fe.__file__).parent
    info = src / "_build_info.py"
    if not info.exists() or "TORCH_VERSION" not in info.read_text():
        pytest.skip("not built here")
    shutil.copytree(src, tmp_path / "flash_epilogue", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    copy = tmp_path / "flash_epilogue" / "_build_info.py"
    copy.write_text(re.sub(r"TORCH_VERSION\s*=.*", 'TORCH_VERSION = "1.0.0+other"', copy.read_text()))
    out = _run("import flash_epilogue as fe; print(fe.__file__, fe.UNAVAILABLE_REASON)", cwd=tmp_path,
               PYTHONPATH=str(tmp_path), FLASH_EPILOGUE_DISABLE_KERNELS="0")
    assert str(tmp_path) in out and "built against torch 1.0.0+other" in out, out
    assert f"torch {torch.__version__} is running" in out, out
