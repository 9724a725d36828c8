"""The bad-input table: each (op, argument, condition) of the public API raises its error class, its message naming the
op, the argument, what was expected and what was given; the accepted inputs below. A row's baseline call is accepted,
its change rejected. Wrappers re-raise an op's ValueError as FlashEpilogueInputError, its TypeError (a dtype, None, a
wrong Python type) as FlashEpilogueTypeError; ..._op rows call torch.ops.flash_epilogue. The ops check all metadata,
then the device: such rows run on CPU (CI) too; on an sm_90 GPU every row runs on CUDA and leaves the process healthy.
"""
import collections
import dataclasses
import re

import numpy as np
import pytest
import torch

import flash_epilogue as fe
from conftest import (B, BF16, D, DKV, F16, F32, H_K, H_Q, I32, INPUT, S, TOTAL, accumulator, acc_shape, assert_healthy,
                      deterministic_algorithms, dense, i32, sh, z)
from flash_epilogue import reference as ref

# ---- the harness: each op's baseline call (OP), the changes of its arguments, the rows (R, each), the checks of a
# call; the baseline problem itself is conftest's (test_bad_inputs_calls.py's bad inputs outside the table share it)
OPS, STORE4, PARTIALS = torch.ops.flash_epilogue, ("dk_accum", "dv_accum", "dk", "dv"), ("dk_partial", "dv_partial")
TYPE = fe.FlashEpilogueTypeError  # a TypeError; INPUT (conftest) is a ValueError and not a TypeError
PY = (INPUT,)  # a wrong Python scalar type seen by the wrapper: INPUT or its subclass TYPE
RAW = (RuntimeError,)  # the dispatcher's own schema error (an op called directly): not our message format
Row = collections.namedtuple("Row", "op match cls cpu gpus changes")  # a row of the table (R below)


def accumulate_args(d, varlen=False, op=False):
    # the op's semaphores: the sm_80 path's workspace (at head dim 64 both paths' accumulators have one shape), given
    # but unused on the sm_90 path
    acc = accumulator(d, varlen=varlen)
    sem = accumulator(d, varlen=varlen, arch=80).semaphores
    return dense(d, *PARTIALS, varlen=varlen) | ({"dk_accum": acc.dk_accum, "dv_accum": acc.dv_accum, "semaphores":
                                                  sem, "deterministic": True} if op else {"acc": acc})


def raw(op):
    return lambda **kw: getattr(OPS, op)(**kw)  # looked up when called: a build without the ops still collects


# fn(**build(device)) is a valid call; name: the op named in messages (None: a reference function, messages of
# its own); cpu_runs: the valid call runs on CPU tensors (else it stops at the device check)
Op = collections.namedtuple("Op", "fn build name cpu_runs", defaults=(False,))
OP = {
    "store": Op(fe.store, lambda d: dense(d, *STORE4), "store"),
    "store_varlen": Op(fe.store, lambda d: dense(d, *STORE4, varlen=True), "store"),
    "store_op": Op(raw("store"), lambda d: dense(d, *STORE4), "store"),
    "store_zero": Op(fe.store_zero, lambda d: dense(d, *DKV), "store_zero"),
    "store_zero_varlen": Op(fe.store_zero, lambda d: dense(d, *DKV, varlen=True), "store_zero"),
    "store_zero_op": Op(raw("store_zero"), lambda d: dense(d, *DKV), "store_zero"),
    "gqa_accumulator": Op(fe.gqa_accumulator, lambda d: dict(num_heads_kv=H_K, head_dim=D, batch=B, seqlen=S, device=d),
                          "gqa_accumulator", True),
    "gqa_accumulate": Op(fe.gqa_accumulate, accumulate_args, "gqa_accumulate"),
    "gqa_accumulate_varlen": Op(fe.gqa_accumulate, lambda d: accumulate_args(d, True), "gqa_accumulate"),
    "gqa_accumulate_det": Op(deterministic_algorithms()(fe.gqa_accumulate), accumulate_args, "gqa_accumulate"),
    "gqa_accumulate_op": Op(raw("gqa_accumulate"), lambda d: accumulate_args(d, op=True), "gqa_accumulate"),
    "gqa_accumulate_varlen_op": Op(raw("gqa_accumulate"), lambda d: accumulate_args(d, True, True), "gqa_accumulate"),
    "gqa_postprocess": Op(fe.gqa_postprocess, lambda d: dense(d, *DKV, acc=accumulator(d, False)), "gqa_postprocess"),
    "gqa_postprocess_op": Op(raw("gqa_postprocess"), lambda d: dense(d, *DKV) | {
        k: getattr(accumulator(d, False), k) for k in ("dk_accum", "dv_accum")}, "gqa_postprocess"),
    "to_dense": Op(lambda acc, **kw: acc.to_dense(**kw), lambda d: {"acc": accumulator(d, False)},
                   "gqa_accum_to_dense"),
    "to_dense_varlen": Op(lambda acc, **kw: acc.to_dense(**kw), lambda d: {"acc": accumulator(d, False, True),
                          "cu_seqlens": i32(d, 0, 30, TOTAL)}, "gqa_accum_to_dense"),
    "gqa_accum_to_dense_op": Op(raw("gqa_accum_to_dense"), lambda d: dict(
        accum=accumulator(d).dk_accum, out=z(d, B, S, H_K, D), head_dim=D), "gqa_accum_to_dense"),
    "gqa_reduce": Op(fe.gqa_reduce, lambda d: dense(d, *PARTIALS, num_heads_kv=H_K), "gqa_reduce"),
    "gqa_reduce_varlen": Op(fe.gqa_reduce, lambda d: dense(d, *PARTIALS, varlen=True, num_heads_kv=H_K), "gqa_reduce"),
    "gqa_reduce_out": Op(fe.gqa_reduce, lambda d: dense(d, *PARTIALS, num_heads_kv=H_K, out=tuple(
        dense(d, *DKV).values())), "gqa_reduce"),
    "gqa_reduce_op": Op(raw("gqa_reduce"), lambda d: dense(d, *PARTIALS, *DKV), "gqa_reduce"),
    "gqa_reduce_varlen_op": Op(raw("gqa_reduce"), lambda d: dense(d, *PARTIALS, *DKV, varlen=True), "gqa_reduce"),
    "repeat_kv": Op(fe.repeat_kv, lambda d: {"x": z(d, B, H_K, S, D, dtype=BF16), "n_rep": 2}, "repeat_kv", True),
    "repeat_kv_op": Op(raw("repeat_kv"), lambda d: {"x": z(d, B, H_K, S, D, dtype=BF16), "n_rep": 2, "dim": 1},
                       "repeat_kv", True),
    "repeat_kv_backward_op": Op(raw("repeat_kv_backward"), lambda d: {"grad": z(d, 1, 4, 2, 8), "n_rep": 2, "dim": 1,
                                                                   "layout": [0, 1, 2]}, "repeat_kv_backward", True),
    "store_reference": Op(ref.store_reference, lambda d: dense(d, *STORE4), None, True),
    "gqa_reduce_reference": Op(ref.gqa_reduce_reference, lambda d: {"dk_partial": z(d, 1, 2, 6, 8), "num_heads_kv": 3,
                                                                    "out_dtype": F16}, None, True),
    "gqa_reduce_sequential_fp32": Op(ref.gqa_reduce_sequential_fp32, lambda d: {"partial": z(d, 1, 2, 6, 8),
                                                                                "num_heads_kv": 3}, None, True),
    "gqa_accumulate_reference": Op(ref.gqa_accumulate_reference, lambda d: dict(
        dk_partial=z(d, 10, 6, 8), dv_partial=None, dk_dense=z(d, 10, 3, 8), dv_dense=None, num_heads_kv=3,
        cu_seqlens=i32(d, 0, 10)), None, True),
}

# changes of the arguments: a value, on(f) = f(the baseline's value), or a callable (args, device) giving the value
on = collections.namedtuple("on", "fn")
WIDENED = on(lambda t: t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])[..., ::2])
EXPANDED = on(lambda t: t[:1].expand(t.shape))  # stride 0 on the first dim
OVERLAPPING = on(lambda t: t.new_zeros(t.numel()).as_strided(t.shape, (t.stride(0), t.shape[-1] // 2, t.stride(2), 1)))
FIRST, UNSQUEEZED, CPU_T, CUDA1 = on(lambda t: t[0]), on(lambda t: t[None]), on(torch.Tensor.cpu), on(
    lambda t: t.to("cuda:1"))


def cut(n, dim=-1):
    return on(lambda t: t.narrow(dim, 0, n))


def padded(extra):
    """t in a view whose row pitch (stride(-2)) is t.shape[-1] + extra elements."""
    return on(lambda t: t.new_zeros(*t.shape[:-1], t.shape[-1] + extra)[..., : t.shape[-1]])


def misaligned(nbytes=8):
    """t in a new tensor whose data starts `nbytes` past a 16-byte boundary."""
    return on(lambda t: t.new_zeros(t.numel() + 16)[nbytes // t.element_size():][: t.numel()].view(t.shape))


def ints(*vals, dev=None, step=1):
    return lambda a, d: i32(dev or d, *vals)[::step]


def zs(*shape, dtype=F32):
    return lambda a, d: z(d, *shape, dtype=dtype)


def alias(of, view=lambda t: t):
    return lambda a, d: view(a[of])


def like(of, dtype, shape=None):
    """A tensor of `shape` (default: `of`'s) viewing `of`'s memory as `dtype`."""
    return alias(of, lambda t: t.view(dtype).reshape(-1)[: torch.Size(shape or t.shape).numel()].view(shape or t.shape))


def replace_acc(**fields):
    return on(lambda acc: dataclasses.replace(acc, **fields))


def R(op, match, cls=INPUT, cpu=True, gpus=1, **changes):
    """match: a regex, searched after "flash_epilogue.<op>: "; cpu: the error comes before the device check."""
    if op.endswith(("_op", "reference", "fp32")):  # the op itself, a reference: a plain ValueError / TypeError
        cls = {INPUT: ValueError, TYPE: TypeError}.get(cls, cls)
    return Row(op, match, cls, cpu and gpus == 1, gpus, changes)


def each(where, match, change, cls=INPUT, **more):
    """A row per "op:arg,arg" of `where`: the change of arg (and `more`) raises "arg: " + match."""
    return [R(op, f"{k}: " + match, cls, **{k: change}, **more)
            for op, ks in (w.split(":") for w in where.split()) for k in ks.split(",")]


def call(op, d, changes=()):
    a = op.build(d)
    for k, v in dict(changes).items():
        if k == "_":
            v(a, d)
        elif isinstance(v, on):
            a[k] = v.fn(a[k])
        else:
            a[k] = v(a, d) if callable(v) and not isinstance(v, (torch.Tensor, torch.dtype)) else v
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


# ---- the table
# message fragments (regexes): types and shapes
TENSOR, DT, HALF = (r"expected a torch\.Tensor, got ", r"dtype: expected torch\.{}, got torch\.{}",
                    r"float16 or torch\.bfloat16")
HD, NUMEL = r"head dim: expected a multiple of 8 in \[8, 256\], got ", r"numel: expected 2 \(batch = {}\), got {}"
RANK_B, RANK_V, RANK_A = (
    r"rank: expected 4 dims \(batch, seqlen, heads, headdim\) because cu_seqlens is None, got 3 dims, shape ",
    r"rank: expected 3 dims \(total_tokens, heads, headdim\) because cu_seqlens is given, got 4 dims, shape ",
    r"rank: expected 4 dims \(batch_extent, heads_kv, num_tiles, tile_elems\), got ")
B_S_H_D, WIDE = sh(2, 40, 2, 64), sh(10240, 256, 128, 2)  # the baseline shape, the strides of WIDENED of it
BUT = r"shape: expected \({}\) \({}'s shape but the {}\), got "
DKS = BUT.format(r"2, 40, 2, '\*'", "dk", "last dim")
LAST = r"stride\(-1\): expected 1 \(last dim contiguous\), got 2 \(strides {}\)"
PITCH = r"stride\({}\): expected a non-negative multiple of {} elements \(16 bytes\), got {} \(shape {}, strides {}\)"
ALIGN, CONTIG = (r"data_ptr: expected a 16-byte aligned address, got 0x[0-9a-f]+ \(address % 16 = {}\)",
                 r"strides: expected {} \(contiguous\), got {}")
SELF = (r"memory: expected no two elements at one address \(no stride 0 or overlapping strides on a dim of size "
        r"> 1\), got shape {}, strides {}")
CONTIGUOUS_OR_SELF = r"(strides: expected \(.*\) \(contiguous\), got \(.*\)|" + SELF.format(".*", ".*") + ")"
OVER, CPU = r"memory: expected no overlap with {}, got bytes", r"device: expected a CUDA tensor, got a tensor on cpu"
DEV0 = r"device: expected cuda:0 \(the device of {}\), got {}"  # a tensor on another device than the first
DEV1 = DEV0.format("{}", "cuda:1")
HEADS = (r"heads: expected a positive multiple of the {} KV heads \({}\): every KV head serves h_q / h_k query heads, "
         r"got {} query heads \(dk_partial\.shape\[-2\]\)")
SEMS = (r"semaphores: expected an int32 tensor of >= 9 entries because deterministic=True on the sm_80 path \(allocate"
        r" the accumulator with flash_epilogue\.gqa_accumulator\(\.\.\., deterministic=True\)\), got None")
NOT_ACC = r"expected a flash_epilogue\.GQAAccumulator \(from flash_epilogue\.gqa_accumulator\), got "
DIM, ARCH = (r"dim: expected 1 \(or -3\) or 2 \(or -2\): the KV-head dim of a 4-D tensor, got ",
             r"_arch: expected 0 \(the device's path\), 80 or 90, got ")
ROW_END = r"row_end: expected None or an int in \[row_start = {}, 2147483647\], got {}"
INT64, INT32 = (r"expected an int64 \(the op's integer type\), got 1180591620717411303424",
                r"expected an int32 value in \[-2147483648, 2147483647\], got ")
FP32_RANGE = r"expected a float in fp32's range \(\|scale\| <= 3\.4028234663852886e\+38; inf and nan pass\), got "
# contents (check_inputs=True: a host sync, checked by the wrapper before the op)
IN_RANGE = r"expected a value in \[0, 2\) \(the {}\), got {}"
STATIC = r"seqused\[{}\]: expected <= 40 \(the static seqlen\), got 41"
CHECKED = {"check_inputs": True}


ROWS = [
    # ---- conditions checked for several (op, argument) cells: each listed once with its cells
    *each("store:dk_accum,dv_accum,dk,dv", TENSOR + "list", on(lambda t: t.tolist()), TYPE),
    *each("store:dk store_op:dk store_zero:dk", TENSOR + "NoneType", None, TYPE),
    *each("store_zero:dv gqa_reduce_out:dv_partial", TENSOR + "list", [1.0], TYPE),
    *each("gqa_postprocess:scale_dk gqa_reduce:scale_dk gqa_reduce_op:scale_dk", FP32_RANGE + r"1e\+300", 1e300),
    *[r for where, want, got in (  # dtypes: the cells, the dtype expected, the one given
        ("store:dk_accum,dv_accum store_op:dk_accum gqa_accumulate_op:dv_accum", "float32", "float64"),
        ("gqa_accumulate_op:dv_partial gqa_postprocess_op:dk_accum", "float32", "float16"),
        ("gqa_accumulate:dk_partial gqa_accumulate_op:dk_accum gqa_accum_to_dense_op:out", "float32", "bfloat16"),
        ("store:dv store_zero:dv gqa_postprocess_op:dv gqa_reduce_op:dv", r"bfloat16 \(the dtype of dk\)", "float16"),
        ("gqa_reduce_op:dv_partial", r"float32 \(the dtype of dk_partial\)", "bfloat16"),
        ("store_varlen:cu_seqlens store_zero_varlen:cu_seqlens gqa_reduce_varlen_op:cu_seqlens", "int32", "int64"),
        ("gqa_accumulate_op:semaphores", "int32", "int64"))
      for r in each(where, DT.format(want, got), on(lambda t, got=got: t.to(getattr(torch, got))), TYPE)],
    *[R(op, "dk_partial: " + DT.format(r"float32 or torch\.bfloat16 \(the dtype of dk\)", t), TYPE,
        **dict.fromkeys(PARTIALS, on(lambda x, t=t: x.to(getattr(torch, t)))))
      for op, t in (("gqa_reduce", "float64"), ("gqa_reduce_op", "float16"))],
    *each("store_zero:dk gqa_postprocess:dk gqa_reduce_op:dk", DT.format(HALF, "float32"), on(torch.Tensor.float),
          TYPE, dv=on(torch.Tensor.float)),
    *each("store_varlen:dv store_zero_varlen:dv", RANK_V + sh(1, 80, 2, 64), UNSQUEEZED),
    *each("gqa_postprocess_op:dv gqa_reduce_op:dv", DKS + r"\(2, 40, 1, 64\)", cut(1, 2)),
    *each("store_zero:dk gqa_accumulate_op:dk_partial", HD + "60", cut(60)),
    *each("store:dk_accum,dv_accum,dk,dv store_zero:dv gqa_accum_to_dense_op:out gqa_reduce_op:dv", LAST.format(WIDE),
          WIDENED),
    *each("store:dk,dv store_zero:dk gqa_postprocess_op:dk", PITCH.format(2, 8, 68, B_S_H_D, sh(5440, 136, 68, 1)),
          padded(4)),
    *each("store:dk_accum,dv_accum", PITCH.format(2, 4, 66, B_S_H_D, sh(5280, 132, 66, 1)), padded(2)),
    *each("store:dk,dv_accum store_zero:dv gqa_postprocess_op:dv gqa_reduce_op:dk_partial", ALIGN.format(8),
          misaligned()),
    *each("store:dk store_zero:dk gqa_postprocess:dk gqa_accum_to_dense_op:out",
          SELF.format(B_S_H_D, sh(0, 128, 64, 1)), EXPANDED),
    *each("store:dv store_zero:dv", SELF.format(B_S_H_D, sh(5120, 32, 64, 1)), OVERLAPPING),
    *each("store_op:dv store_zero:dv gqa_postprocess:dv gqa_reduce_op:dv", OVER.format("dk"), alias("dk")),
    *each("store:dv_accum,dk,dv store_varlen:cu_seqlens", DEV1.format("dk_accum"), CUDA1, gpus=2),
    *each("store_zero:batch_idx,head_idx", DEV1.format("dk"), ints(0, dev="cuda:1"), gpus=2),
    *each("gqa_accumulate:dv_partial gqa_reduce:dv_partial gqa_reduce_op:dk", DEV1.format("dk_partial"), CUDA1, gpus=2),
    *[R(op, f"{k}: " + CPU, _=lambda a, d: a.update({n: t.cpu() for n, t in a.items() if isinstance(t, torch.Tensor)}))
      for op, k in (("store", "dk_accum"), ("gqa_postprocess_op", "dk_accum"), ("store_zero", "dk"),
                    ("gqa_accum_to_dense_op", "accum"), ("gqa_reduce_op", "dk_partial"))],  # every tensor on the CPU
    *[R(op, "seqused: " + NUMEL.format(of, len(v)), seqused=ints(*v)) for of, cells in (
        (r"dk\.shape\[0\]", (("store", (1, 2, 3)), ("store_zero", (1,)), ("gqa_postprocess_op", (3,)))),
        (r"dk_partial\.shape\[0\]", (("gqa_accumulate_op", (1, 2, 3)), ("gqa_reduce_op", (1, 2, 3)))),
        (r"cu_seqlens\.numel\(\) - 1", (("store_varlen", (3,)), ("store_zero_varlen", (1, 2, 3)),
                                       ("gqa_accumulate_varlen_op", (1,))))) for op, v in cells],
    *[R(op, rf"{k}: expected a positive int, got {t}", PY if type(v) in (bool, float) else INPUT, **{k: v})
      for op, k, vts in (("gqa_accumulator", "num_heads_kv", [(True, "(True|bool)")]),
                         ("gqa_reduce", "num_heads_kv", [(0, "0"), (2.0, r"2\.0"), (True, "(True|bool)")]),
                         ("repeat_kv", "n_rep", [(0, "0"), (-2, "-2"), (True, "bool"), (2.0, "float")]),
                         ("repeat_kv_op", "n_rep", [(-1, "-1$")]), ("repeat_kv_backward_op", "n_rep", [(0, "0$")]))
      for v, t in vts],
    *[R(op, r"cu_seqlens\[2\]: expected >= cu_seqlens\[1\] = 50 \(non-decreasing\), got 30", cu_seqlens=ints(0, 50, 30),
        **CHECKED) for op in ("store_varlen", "store_zero_varlen", "gqa_accumulate_varlen")],
    *[R(op, r"cu_seqlens\[2\]: expected <= 80 \(the tensors' token count\), got 81", cu_seqlens=ints(0, 30, 81),
        **CHECKED) for op in ("store_varlen", "gqa_reduce_varlen")],
    *[R(op, r"seqused\[1\]: expected <= 50 \(the length of segment 1, cu_seqlens\[2\] - cu_seqlens\[1\]\), got 51",
        seqused=ints(30, 51), **CHECKED) for op in ("store_varlen", "gqa_accumulate_varlen")],
    *[R(op, r"expected torch\.Tensor arguments, got None for all of them", TYPE, **dict.fromkeys(args))  # no device
      for op, args in (("store", STORE4), ("gqa_reduce", PARTIALS + ("cu_seqlens", "seqused")))],
    R("store", "dk: " + DT.format(HALF, "int8"), TYPE, dk=on(lambda t: t.to(torch.int8)), dv=on(lambda t: t.char())),
    R("store", "dk_accum: " + RANK_B + sh(40, 2, 64), **dict.fromkeys(STORE4, FIRST)),
    R("store_varlen", "dk_accum: " + RANK_V + sh(1, 80, 2, 64), **dict.fromkeys(STORE4, UNSQUEEZED)),
    R("store", r"dk_accum: shape: expected \(2, 40, 2, 64\) \(the shape of dk\), got \(2, 41, 2, 64\)",
      dk_accum=zs(B, S + 1, H_K, D)),
    *each("store:dv_accum", r"shape: expected \(2, 40, 2, 64\) \(the shape of dv\), got \(2, 40, 2, 32\)", cut(32)),
    R("store", "dv: " + DKS + r"\(2, 40, 3, 64\)", dv_accum=zs(B, S, 3, D), dv=zs(B, S, 3, D, dtype=BF16)),
    R("store", "dk: " + HD + "60", dk_accum=cut(60), dk=cut(60)),
    R("store", "dv: " + HD + "264", dv_accum=zs(B, S, H_K, 264), dv=zs(B, S, H_K, 264, dtype=BF16)),
    R("store_op", "dk: " + HD + "12", dk_accum=cut(12), dk=cut(12)),
    R("store_varlen", "dk: " + PITCH.format(0, 8, 132, sh(80, 2, 64), sh(132, 64, 1)),
      dk=lambda a, d: z(d, TOTAL, 132, dtype=BF16)[:, :128].unflatten(1, (2, 64))),
    R("store_op", "dk: " + PITCH.format(1, 8, 68, sh(2, 40, 1, 64), sh(2720, 68, 68, 1)),
      dk=lambda a, d: z(d, B, S, 1, 68, dtype=BF16)[..., :64], dk_accum=cut(1, 2), dv_accum=cut(1, 2), dv=cut(1, 2)),
    R("store", "dv: " + OVER.format("dk") + r" \[0x[0-9a-f]+, 0x[0-9a-f]+\) overlapping dk's \[0x[0-9a-f]+, "
      r"0x[0-9a-f]+\)$", _=lambda a, d: a.update(dk=(w := z(d, B, S, H_K, 128, dtype=BF16))[..., :64],
                                                dv=w[..., 32:96])),
    *[R("store", f"{o}: " + OVER.format(i), **{o: like(i, BF16)}) for o in DKV for i in STORE4[:2]],
    *[R("store_varlen", "dv: " + OVER.format(k), **{"seqused": ints(30, 50), k: like("dv", I32, (n,))})
      for k, n in (("cu_seqlens", 3), ("seqused", 2))],
    R("store_varlen", rf"cu_seqlens: {TENSOR}list", TYPE, cu_seqlens=[0, 30, 80]),
    *each("store_varlen:cu_seqlens", r"rank: expected 1 dim \(batch \+ 1,\), got 2 dims, shape \(1, 3\)", UNSQUEEZED),
    R("store_varlen", r"cu_seqlens: stride\(0\): expected 1 \(contiguous\), got 2",
      cu_seqlens=ints(0, 9, 30, 9, 80, 9, step=2)),
    *each("store_varlen:cu_seqlens", r"numel: expected batch \+ 1 >= 2 \(at least one sequence\), got 1", cut(1)),
    R("store", rf"seqused: {TENSOR}tuple", TYPE, seqused=(1, 2)),
    R("store", "seqused: " + DT.format("int32", "float32"), TYPE, seqused=zs(2)),
    *each("store:seqused", r"rank: expected 1 dim, got 2 dims, shape \(2, 1\)", lambda a, d: i32(d, 1, 2)[:, None]),
    R("store", r"seqused: stride\(0\): expected 1 \(contiguous\), got 3", seqused=ints(1, 0, 0, 2, 0, 0, step=3)),
    R("store", "dk_accum: " + DT.format("float32", "float16"), TYPE, dk_accum=on(lambda t: t.cpu().half())),
    R("store", "seqused: " + DEV0.format("dk_accum", "cpu"), cpu=False, seqused=ints(S, 3, dev="cpu")),
    R("store", "seqused: " + DEV1.format("dk_accum"), gpus=2, seqused=ints(S, 3, dev="cuda:1")),
    R("store_varlen", r"cu_seqlens\[0\]: expected >= 0, got -4", cu_seqlens=ints(-4, 30, 80), **CHECKED),
    R("store", STATIC.format(1), seqused=ints(S, S + 1), **CHECKED),
    R("store", r"seqused\[0\]: expected >= 0, got -5", seqused=ints(-5, 3), **CHECKED),
    R("store_zero", "dk: " + RANK_B + sh(40, 2, 64), dk=FIRST, dv=FIRST),
    R("store_zero", "dv: " + DKS + r"\(2, 39, 2, 64\)", dv=cut(39, 1)),
    R("store_zero", "dv: " + HD + "264", dv=zs(B, S, H_K, 264, dtype=BF16)),
    *[R("store_zero_varlen", "dk: " + OVER.format(k), **{"seqused": ints(30, 50), k: like("dk", I32, (n,))})
      for k, n in (("cu_seqlens", 3), ("seqused", 2), ("batch_idx", 2), ("head_idx", 2))],
    R("store_zero_op", r"Expected a value of type 'Optional\[Tensor\]' for argument 'batch_idx'", RAW,
      batch_idx=[0, 1]),
    *each("store_zero:batch_idx", DT.format("int32", "int64"), lambda a, d: torch.tensor([0, 1], device=d), TYPE),
    R("store_zero", "head_idx: " + DT.format("int32", "int16"), TYPE, head_idx=lambda a, d: i32(d, 0).short()),
    R("store_zero", r"batch_idx: rank: expected 1 dim, got 0 dims, shape \(\)", batch_idx=lambda a, d: i32(d, 1)[0]),
    *each("store_zero:head_idx", r"rank: expected 1 dim, got 2 dims, shape \(1, 2\)", lambda a, d: i32(d, 0, 1)[None]),
    *each("store_zero:batch_idx,head_idx", r"stride\(0\): expected 1 \(contiguous\), got 2", ints(0, 9, 1, 9, step=2)),
    R("store_zero", r"batch_idx: numel: expected fewer than 65536 entries, got 65536", batch_idx=zs(65536, dtype=I32)),
    R("store_zero", r"dk: shape: expected rows < 2\^31 and heads, batch < 65536, got \(1, 8, 65536, 8\)",
      dk=zs(1, 8, 65536, 8, dtype=BF16), dv=zs(1, 8, 65536, 8, dtype=BF16)),
    # row ranges: int32s (checked by the op); a Python int past int64 (the wrapper); a wrong Python type
    *[R("store_zero", rf"row_start: expected an int in \[0, 2147483647\], got {v}", row_start=v) for v in (-1, 2**40)],
    *[R("store_zero", f"{k}: " + INT64, PY, **{k: 2**70}) for k in ("row_start", "row_end")],
    R("store_zero", ROW_END.format(10, 5), row_start=10, row_end=5),
    R("store_zero", ROW_END.format(0, 2**31), row_end=2**31),
    *[R("store_zero", rf"row_start: expected an int, got {t}", PY, row_start=v)
      for v, t in ((1.5, "float"), (True, "bool"), (None, "NoneType"))],
    R("store_zero", r"row_end: expected (None or )?an int, got float", PY, row_end=3.0),
    R("store_zero", "dv: " + DEV1.format("dk"), gpus=2, dv=CUDA1),
    # selections: Python values the wrapper converts to int32 tensors; contents (check_inputs=True)
    *[R("store_zero", r"batch_idx: expected None, an int, a sequence of ints or an int32 tensor, got " + t, PY,
        batch_idx=v) for v, t in ((1.0, "float"), (True, "bool"), ("01", "str"))],
    *[R("store_zero", rf"head_idx\[{i}\]: expected an int, got {t}", PY, head_idx=v)
      for v, i, t in (([0, 1.5], 1, "float"), ([False], 0, "bool"), (["a"], 0, "str"))],
    R("store_zero", r"head_idx\[1\]: " + INT32 + "1099511627776", head_idx=[0, 2**40]),
    R("store_zero", "batch_idx: " + INT32 + "-2147483649", batch_idx=-(2**31) - 1),
    R("store_zero", r"batch_idx\[1\]: " + IN_RANGE.format("batch size", 5), batch_idx=[0, 5], **CHECKED),
    R("store_zero", r"head_idx\[0\]: " + IN_RANGE.format("number of heads", -1), head_idx=-1, **CHECKED),
    R("store_zero", STATIC.format(1), seqused=ints(1, S + 1), batch_idx=[0], **CHECKED),
    R("store_zero_varlen", r"batch_idx\[0\]: " + IN_RANGE.format("batch size", 7), batch_idx=7, **CHECKED),
    # ---- gqa_accumulator (allocation; runs on any device)
    R("gqa_accumulator", r"num_heads_kv: expected (a positive int|an int in \[1, 65535\]), got 0", num_heads_kv=0),
    R("gqa_accumulator", r"num_heads_kv: expected an int in \[1, 65535\], got 65536", num_heads_kv=65536),
    R("gqa_accumulator", r"head_dim: (head dim: )?expected a multiple of 8 in \[8, 256\], got 260", head_dim=260),
    R("gqa_accumulator", r"head_dim_v: (head dim: )?expected a multiple of 8 in \[8, 256\], got 60", head_dim_v=60),
    R("gqa_accumulator", r"arch: expected 0 \(the device's path\), 80 or 90, got 86", arch=86),
    R("gqa_accumulator", r"deterministic: expected None or a bool, got int", PY, deterministic=1),
    R("gqa_accumulator", r"seqlen: expected an int >= 0 \(or cu_seqlens and total_tokens for the varlen layout\), "
      r"got None", seqlen=None),
    R("gqa_accumulator", r"batch: expected an int >= 0, got None", batch=None),
    R("gqa_accumulator", r"total_tokens: expected an int >= 0 \(the partials' row count\) in the varlen layout, "
      r"got None", seqlen=None, batch=None, cu_seqlens=ints(0, 30, TOTAL)),
    R("gqa_accumulator", r"seqlen: expected None in the varlen layout \(cu_seqlens/total_tokens given\), got 40",
      batch=None, total_tokens=TOTAL),
    R("gqa_accumulator", r"batch: expected None or 2 \(cu_seqlens\.numel\(\) - 1\), got 3", seqlen=None, batch=3,
      total_tokens=TOTAL, cu_seqlens=ints(0, 30, TOTAL)),
    R("gqa_accumulator", r"batch: expected an int >= 1 \(the number of sequences\) or cu_seqlens, got None",
      seqlen=None, batch=None, total_tokens=TOTAL),
    R("gqa_accumulator", "cu_seqlens: " + DT.format("int32", "int64"), PY, seqlen=None, batch=None,
      total_tokens=TOTAL, cu_seqlens=lambda a, d: torch.tensor([0, 30, TOTAL], device=d)),
    # ---- gqa_accumulate: the wrapper (the accumulator object, Python types)
    *each("gqa_accumulate:acc gqa_postprocess:acc", NOT_ACC + "Tensor", on(lambda acc: acc.dk_accum), PY),
    R("gqa_accumulate", "acc: " + NOT_ACC + "tuple", PY, acc=on(lambda acc: (acc.dk_accum, acc.dv_accum))),
    *each("gqa_accumulate:dk_partial,dv_partial", TENSOR + "list", [0.0], TYPE),
    *[R("gqa_accumulate", rf"{k}: {TENSOR}list", TYPE, acc=replace_acc(**{k: [0.0]}))
      for k in ("dk_accum", "dv_accum", "semaphores")],
    *[R("gqa_accumulate", rf"deterministic: expected a bool, got {t}", PY, deterministic=v)
      for v, t in ((1, "int"), ("yes", "str"))],
    R("gqa_accumulate", "dk_partial: " + HEADS.format(3, r"dk_accum\.shape\[1\]", 4),
      acc=lambda a, d: accumulator(d, h_k=3)),
    # an accumulator sized for another problem: named by its field (the wrapper) or its shape (the op)
    R("gqa_accumulate", r"(acc\.head_dim: expected 64 \(dk_partial\.shape\[-1\]\), got 128|dk_accum: "
      + acc_shape((2, 2, 1, 16384)) + ")", acc=lambda a, d: accumulator(d, hd=128)),
    R("gqa_accumulate", r"(acc\.rows: expected 40 \(dk_partial\.shape\[1\], the seqlen\), got 300|dk_accum: "
      + acc_shape((2, 2, 3, 8192)) + ")", acc=lambda a, d: accumulator(d, seqlen=300)),
    # the sm_80 path's ordered mode needs the semaphores (the sm_90 path, deterministic in both modes, has none)
    R("gqa_accumulate", SEMS, acc=lambda a, d: accumulator(d, False, arch=80), deterministic=True),
    R("gqa_accumulate_det", SEMS, acc=lambda a, d: accumulator(d, False, arch=80)),
    *[R("gqa_accumulate", rf"acc\.{f}: expected {want}, got {v}", acc=replace_acc(**{f: v}))
      for f, want, v in (("head_dim", r"64 \(dk_partial\.shape\[-1\]\)", 56),
                         ("head_dim_v", r"64 \(dv_partial\.shape\[-1\]\)", 56),
                         ("rows", r"40 \(dk_partial\.shape\[1\], the seqlen\)", 41),
                         ("varlen", r"False: the call's layout is batched \(cu_seqlens None\)", True))],
    R("gqa_accumulate_varlen", r"acc\.batch: expected 2 \(cu_seqlens\.numel\(\) - 1\), got 3",
      acc=replace_acc(batch=3)),
    R("gqa_accumulate", "dv_partial: " + LAST.format(".*"), dv_partial=WIDENED),
    *each("gqa_accumulate:dk_partial", CPU, CPU_T, dv_partial=CPU_T, acc=lambda a, d: accumulator("cpu", True)),
    R("gqa_accumulate", "dk_accum: " + DEV1.format("dk_partial"), gpus=2, acc=lambda a, d: accumulator("cuda:1", True)),
    R("gqa_accumulate_op", ARCH + "70", _arch=70),
    R("gqa_accumulate_op", "dk_partial: " + RANK_B + sh(40, 4, 64), dk_partial=FIRST),
    R("gqa_accumulate_varlen_op", "dv_partial: " + RANK_V + sh(1, 80, 4, 64), dv_partial=UNSQUEEZED),
    R("gqa_accumulate_op", "dv_accum: " + RANK_A + r"3 dims, shape \(2, 1, 8192\)", dv_accum=FIRST),
    *[R(op, f"{k}: " + BUT.format(want, of, what) + rf"\({got}\)", **{k: change})
      for op, k, want, of, what, got, change in (
          ("gqa_accumulate_op", "dv_partial", r"2, 40, 4, '\*'", "dk_partial", "last dim", "2, 40, 2, 64", cut(2, 2)),
          ("gqa_reduce_op", "dk", r"2, 40, '\*', 64", "dk_partial", "heads dim", "2, 39, 2, 64", cut(39, 1)),
          ("gqa_reduce_op", "dv", r"2, 40, '\*', 64", "dv_partial", "heads dim", "2, 40, 2, 32", cut(32)),
          ("gqa_reduce_op", "dv_partial", r"2, 40, 4, '\*'", "dk_partial", "last dim", "2, 40, 3, 64", cut(3, 2)))],
    R("gqa_accumulate_op", "dv_partial: " + HD + "264", dv_partial=zs(B, S, H_Q, 264)),
    R("gqa_accumulate_op", "dk_partial: " + HEADS.format(2, r"dk_accum\.shape\[1\]", 3),
      **dict.fromkeys(PARTIALS, cut(3, 2))),
    R("gqa_accumulate_op", r"dk_accum: heads: expected >= 1 \(dk_accum\.shape\[1\], the number of KV heads\), got 0",
      dk_accum=cut(0, 1), dv_accum=cut(0, 1)),
    R("gqa_accumulate_op", "dv_accum: " + acc_shape((2, 2, 2, 8192)), dv_accum=zs(B, H_K, 2, 8192)),
    R("gqa_accumulate_op", "dk_accum: " + acc_shape((2, 2, 1, 20480), (2, 2, 1, 16384), d=256, c=256, a=80),
      _arch=80, **dict.fromkeys(PARTIALS, zs(B, S, H_Q, 256)), dk_accum=lambda a, d: accumulator(d, hd=256).dk_accum,
      dv_accum=lambda a, d: accumulator(d, hd=256).dv_accum),
    R("gqa_accumulate_varlen_op", "dk_accum: " + acc_shape((1, 2, 2, 8192), (1, 2, 3, 8192),
      of="3 sequences of 80 total tokens"), cu_seqlens=ints(0, 30, 50, 80)),
    R("gqa_accumulate_op", "dv_partial: " + LAST.format(sh(20480, 512, 128, 2)), dv_partial=WIDENED),
    *each("gqa_accumulate_op:dk_partial", PITCH.format(2, 4, 66, sh(2, 40, 4, 64), sh(10560, 264, 66, 1)), padded(2)),
    *each("gqa_accumulate_op:dk_accum", CONTIG.format(sh(16384, 8192, 8192, 1), sh(32768, 16384, 16384, 2)), WIDENED),
    *each("gqa_accumulate_op:dv_accum gqa_postprocess_op:dk_accum",
          CONTIG.format(sh(16384, 8192, 8192, 1), sh(16392, 8196, 8196, 1)), padded(4)),
    R("gqa_accumulate_op", "dk_partial: " + ALIGN.format(4), dk_partial=misaligned(4)),
    R("gqa_accumulate_op", "dk_accum: " + CONTIGUOUS_OR_SELF, dk_accum=EXPANDED),
    R("gqa_accumulate_op", "dv_accum: " + CONTIGUOUS_OR_SELF, dv_accum=OVERLAPPING),
    R("gqa_accumulate_op", r"semaphores: (stride\(0\): expected 1 \(contiguous\), got 0|"
      + SELF.format(sh(9), sh(0)) + ")", semaphores=lambda a, d: i32(d, 0).expand(9)),
    R("gqa_accumulate_op", SEMS, semaphores=None, _arch=80),
    R("gqa_accumulate_op", r"semaphores: rank: expected 1 dim, got 2 dims, shape \(3, 3\)",
      semaphores=on(lambda t: t.view(3, 3))),
    R("gqa_accumulate_op", r"semaphores: stride\(0\): expected 1 \(contiguous\), got 2",
      semaphores=lambda a, d: torch.zeros(20, dtype=I32, device=d)[::2]),
    *[R("gqa_accumulate_op", r"semaphores: numel: expected >= 9 \(2 \* batch_extent \* num_tiles \* num_heads_kv \+ 1 "
        r"for dk_accum of shape \(2, 2, 1, 8192\)\), got 8", semaphores=cut(8), deterministic=det, _arch=80)
      for det in (True, False)],
    R("gqa_accumulate_op", "dv_accum: " + OVER.format("dk_accum"), dv_accum=alias("dk_accum")),
    R("gqa_accumulate_op", "semaphores: " + OVER.format("dk_accum"), semaphores=like("dk_accum", I32, (9,))),
    R("gqa_accumulate_op", "dk_accum: " + OVER.format("dv_partial"), dv_partial=like("dk_accum", F32, (B, S, H_Q, D))),
    R("gqa_accumulate_varlen_op", "dv_accum: " + OVER.format("cu_seqlens"), cu_seqlens=like("dv_accum", I32, (3,))),
    R("gqa_accumulate_varlen_op", r"cu_seqlens: numel: expected batch \+ 1 >= 2 \(at least one sequence\), got 1",
      cu_seqlens=ints(0)),
    *[R("gqa_postprocess", rf"{k}: expected a float, got {t}", PY, **{k: v})
      for k, v, t in (("scale_dk", "0.5", "str"), ("scale_dv", True, "bool"),
                      ("scale_dk", torch.tensor(1.0), "Tensor"))],
    *each("gqa_postprocess:scale_dv gqa_reduce:scale_dk", FP32_RANGE + "1" + "0" * 400 + "$", 10**400, PY),
    R("gqa_postprocess_op", "scale_dv: " + FP32_RANGE + r"-1e\+300", scale_dv=-1e300),
    R("gqa_postprocess", r"acc\.head_dim_v: expected 64 \(dv\.shape\[-1\]\), got 56", acc=replace_acc(head_dim_v=56)),
    *[R("gqa_postprocess", rf"{k}: device: expected cuda:1 \(the device of dk_accum\), got cuda:0", gpus=2,
        acc=lambda a, d: accumulator("cuda:1", False), **more) for k, more in (("dk", {}), ("dv", {"dk": CUDA1}))],
    R("gqa_postprocess", STATIC.format(0), seqused=ints(S + 1, 0), **CHECKED),
    R("gqa_postprocess_op", ARCH + "1", _arch=1),
    R("gqa_postprocess_op", "dv_accum: " + RANK_A + r"5 dims, shape \(1, 2, 2, 1, 8192\)", dv_accum=UNSQUEEZED),
    R("gqa_postprocess_op", "dk: " + RANK_V + B_S_H_D, cu_seqlens=ints(0, S)),
    R("gqa_postprocess_op", "dv: " + HD + "12", dv=cut(12)),
    R("gqa_postprocess_op", "dk_accum: " + acc_shape((2, 2, 1, 8192), (2, 1, 1, 8192), 1), dk=cut(1, 2), dv=cut(1, 2)),
    R("gqa_postprocess_op", "dk: " + OVER.format("dk_accum"), dk=like("dk_accum", BF16, (B, S, H_K, D))),
    # ---- gqa_accum_to_dense (GQAAccumulator.to_dense and the op)
    R("to_dense_varlen", r"cu_seqlens: expected the int32 cu_seqlens the varlen accumulator was filled with, got None",
      cu_seqlens=None),
    R("to_dense", r"cu_seqlens: expected None for an accumulator of the batched layout, got a tensor",
      cu_seqlens=ints(0, 30, TOTAL)),
    R("to_dense_varlen", r"acc\.batch: expected 3 \(cu_seqlens\.numel\(\) - 1\), got 2",
      cu_seqlens=ints(0, 30, 50, TOTAL)),
    R("to_dense", r"seqused: device: expected cuda:1 \(the device of accum\), got cuda:0", gpus=2,
      acc=lambda a, d: accumulator("cuda:1", False), seqused=ints(1, 2, dev="cuda:0")),
    R("gqa_accum_to_dense_op", r"Expected a value of type 'int' for argument 'head_dim'", RAW, head_dim=None),
    R("gqa_accum_to_dense_op", "head_dim: " + HD + "12", head_dim=12),
    R("gqa_accum_to_dense_op", "accum: " + RANK_A + r"3 dims, shape \(2, 2, 8192\)", accum=on(lambda t: t[:, :, 0])),
    R("gqa_accum_to_dense_op", r"out: head dim: expected <= head_dim = 64, got 128", out=zs(B, S, H_K, 128)),
    R("gqa_accum_to_dense_op", "out: " + OVER.format("accum"), out=like("accum", F32, (B, S, H_K, D))),
    R("gqa_accum_to_dense_op", "accum: " + acc_shape((2, 2, 1, 8192), (2, 2, 1, 16384), c=128), head_dim=128),
    *each("gqa_reduce:num_heads_kv", r"expected a divisor of the 4 query heads \(dk_partial\.shape\[-2\]\), got 3", 3),
    R("gqa_reduce", r"out_dtype: expected None, torch\.float16 or torch\.bfloat16, got torch\.float32", out_dtype=F32),
    R("gqa_reduce", rf"dk_partial: {TENSOR}list", TYPE, dk_partial=[1.0], dv_partial=None),
    R("gqa_reduce", r"scale_dv: expected a float, got NoneType", PY, scale_dv=None),
    R("gqa_reduce", "dk_partial: " + RANK_V + sh(2, 40, 4, 64), cu_seqlens=ints(0, S)),
    R("gqa_reduce_out", r"out: expected a \(dk, dv\) pair because dv_partial is given, got a torch\.Tensor", PY,
      out=on(lambda o: o[0])),
    R("gqa_reduce_out", r"out: expected None, a tensor \(dk\) or a \(dk, dv\) pair, got a tuple of length 3", PY,
      out=on(lambda o: o + o[:1])),
    R("gqa_reduce_out", r"out_dtype: expected None or torch\.bfloat16 \(the dtype of out\), got torch\.float16",
      out_dtype=F16),
    R("gqa_reduce_out", r"num_heads_kv: expected 2 \(the heads of out: dk\.shape\[-2\]\), got 1", num_heads_kv=1),
    R("gqa_reduce_out", r"dv: expected None because dv_partial is None, got Tensor", dv_partial=None),
    R("gqa_reduce_out", "dk: " + SELF.format(B_S_H_D, sh(0, 128, 64, 1)), out=on(lambda o: (EXPANDED.fn(o[0]), o[1]))),
    R("gqa_reduce_out", "dv: " + SELF.format(B_S_H_D, sh(5120, 32, 64, 1)),
      out=on(lambda o: (o[0], OVERLAPPING.fn(o[1])))),
    R("gqa_reduce_out", "dk: " + DEV1.format("dk_partial"), gpus=2, out=on(lambda o: (CUDA1.fn(o[0]), o[1]))),
    R("gqa_reduce", "seqused: " + DEV1.format("dk_partial"), gpus=2, seqused=ints(1, 2, dev="cuda:1")),
    R("gqa_reduce_op", r"dv: expected a torch\.Tensor because dv_partial is given, got NoneType", dv=None),
    R("gqa_reduce_op", "dk_partial: " + HEADS.format(3, r"dk\.shape\[-2\]", 4), dv_partial=None, dv=None,
      dk=zs(B, S, 3, D, dtype=BF16)),
    R("gqa_reduce_op", "dk: " + HD + "20", dv_partial=None, dv=None, dk_partial=cut(20), dk=cut(20)),
    R("gqa_reduce_op", "dk_partial: " + RANK_B + sh(40, 4, 64), dk_partial=FIRST, dv_partial=None, dv=None),
    R("gqa_reduce_op", "dk_partial: " + PITCH.format(2, 8, 68, sh(2, 40, 4, 64), sh(10880, 272, 68, 1)),
      dv_partial=on(torch.Tensor.bfloat16), dk_partial=lambda a, d: padded(4).fn(a["dk_partial"].bfloat16())),
    *each("gqa_reduce_op:dk", OVER.format("dk_partial"), alias("dk_partial", lambda t: t.view(BF16)[:, :, :H_K, :D])),
    # ---- repeat_kv: the wrapper and the two ops
    R("repeat_kv", r"x: rank: expected 4 dims: \(batch, kv_heads, seqlen, head_dim\) for dim=1, \(batch, seqlen, "
      r"kv_heads, head_dim\) for dim=2, got 3 dims, shape \(2, 40, 64\)", x=FIRST),
    R("repeat_kv", rf"x: {TENSOR}list", PY, x=[1.0]),
    *[R(op, DIM + f"{v}{end}", dim=v) for op, v, end in (("repeat_kv", 0, ""), ("repeat_kv", 3, ""),
                                                         ("repeat_kv_op", 0, "$"), ("repeat_kv_backward_op", 3, "$"))],
    R("repeat_kv", r"dim: expected .*, got float", PY, dim=1.0),
    R("repeat_kv_op", r"x: rank: expected 4 dims: .*, got 3 dims, shape \(2, 40, 64\)$", x=FIRST),
    R("repeat_kv_backward_op", r"grad: heads: expected a multiple of n_rep = 3 in dim 1, got 4 \(shape \(1, 4, 2, "
      r"8\)\)$", n_rep=3),
    *[R("repeat_kv_backward_op", rf"layout: expected a permutation of \[0, 1, 2\], got {re.escape(str(v))}$", layout=v)
      for v in ([0, 1, 1], [0, 1])],
    R("repeat_kv_backward_op", r"grad: rank: expected 4 dims: \(batch, heads, seqlen, head_dim\) for dim=1, \(batch, "
      r"seqlen, heads, head_dim\) for dim=2, got 3 dims, shape \(4, 2, 8\)$", grad=FIRST),
    # ---- the references (CPU or GPU tensors; messages of their own)
    R("store_reference", r"accumulator shapes \(2, 40, 2, 64\)/\(2, 40, 2, 64\) differ from dk/dv \(2, 41, 2, 64\)",
      dk=zs(B, S + 1, H_K, D, dtype=BF16)),
    R("store_reference", r"dk \(2, 40, 2, 64\) and dv \(2, 40, 3, 64\) differ before the last dim",
      dv_accum=zs(B, S, 3, D), dv=zs(B, S, 3, D, dtype=BF16)),
    R("gqa_reduce_reference", r"num_heads_kv=4 must divide the 6 query heads of partial", num_heads_kv=4),
    R("gqa_reduce_reference", r"out has dtype torch\.float32, out_dtype is torch\.float16", out=zs(1, 2, 3, 8)),
    R("gqa_reduce_reference", r"out has shape \(1, 2, 2, 8\), expected \(1, 2, 3, 8\)", out=zs(1, 2, 2, 8, dtype=F16)),
    R("gqa_reduce_sequential_fp32", r"num_heads_kv=0 must divide the 6 query heads", num_heads_kv=0),
    R("gqa_accumulate_reference", r"sequential=True adds in fp32: dk_dense must be float32, got torch\.float64",
      dk_dense=on(torch.Tensor.double)),
    R("gqa_accumulate_reference", r"dk_dense has shape \(10, 2, 8\), expected \(10, 3, 8\)", dk_dense=cut(2, 1)),
    R("gqa_accumulate_reference", r"dv_partial and dv_dense: give both or neither", dv_partial=alias("dk_partial")),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def _params(rows):
    seen, out = collections.Counter(), []
    for r in rows:  # ids: the op and the start of the message, numbered when they repeat
        rid = r.op + "-" + re.sub(r"[^A-Za-z0-9_]+", "-", r.match[:48]).strip("-")
        seen[rid] += 1
        rid += f"-{seen[rid]}" * (seen[rid] > 1)
        ops = [pytest.mark.ops] * (OP[r.op].name is not None and r.op != "repeat_kv")  # the others run without ops
        out += [pytest.param(r, "cpu", id=f"cpu-{rid}", marks=ops)] * r.cpu + [pytest.param(
            r, "cuda", id=f"cuda-{rid}", marks=[pytest.mark.gpu] + [two_gpus] * (r.gpus > 1))]
    return out


@pytest.mark.parametrize("row,dev", _params(ROWS))
def test_bad_input(row, dev):
    op = OP[row.op]
    check_accepted(op, dev)  # the baseline: the error comes from the row's change
    with pytest.raises(Exception) as info:
        call(op, dev, row.changes)
    err, msg = info.value, str(info.value)  # row.cls: that class exactly (INPUT: not its subclass TYPE); a tuple: any
    ok = type(err) is row.cls if isinstance(row.cls, type) else isinstance(err, row.cls)
    assert ok, f"{type(err).__name__} is not {row.cls}: {msg}"
    prefix = "" if row.cls is RAW or op.name is None else rf"^flash_epilogue\.{op.name}: "
    assert re.search(prefix + row.match, msg), f"message does not match {row.match!r}:\n{msg}"
    assert not prefix or "expected" in msg and ", got " in msg, msg
    if dev == "cuda":
        assert_healthy()


KV_PACKED = {"_": lambda a, d: a.update(dk=(kv := z(d, B, S, H_K, 2, D, dtype=BF16))[:, :, :, 0], dv=kv[:, :, :, 1])}
SPLIT_D = {"_": lambda a, d: a.update(dk=(both := z(d, B, S, H_K, 2 * D, dtype=BF16))[..., :D], dv=both[..., D:])}
ON_META = {k: on(lambda t: t.to("meta")) for k in STORE4}  # meta tensors: shape inference only (runs on CPU too)
GOOD = {  # the accepted changes of each op's baseline; FlashAttention's packed dkv shares no element
    "store": [
        KV_PACKED, SPLIT_D, {"dk": lambda a, d: z(d, B, H_K, S, D, dtype=BF16).transpose(1, 2), "dk_accum": padded(4)},
        {"_": lambda a, d: a.update(zip(STORE4, (  # batch 1, heads 1, strides not multiples of 16 B: ignored
            torch.zeros(16 * 64, dtype=t, device=d).as_strided((1, 16, 1, 64), s) for t, s in (
                (F32, (3, 64, 9, 1)), (F32, (1, 64, 1, 1)), (BF16, (7, 64, 3, 1)), (BF16, (5, 64, 1, 1))))))},
        {k: zs(0, S, H_K, D, dtype=F32 if "accum" in k else BF16) for k in STORE4},
        {**{k: zs(0, H_K, D, dtype=F32 if "accum" in k else BF16) for k in STORE4}, "cu_seqlens": ints(0, 0)}, ON_META,
        {"dk_accum": zs(B, S, H_K, 72), "dk": zs(B, S, H_K, 72, dtype=BF16), "dv_accum": zs(B, S, H_K, 40),
         "dv": zs(B, S, H_K, 40, dtype=BF16)}],
    "store_varlen": [{"seqused": ints(3, 50), "dv_accum": zs(TOTAL, H_K, 128), "dv": zs(TOTAL, H_K, 128, dtype=BF16)}],
    "store_zero": [
        KV_PACKED, SPLIT_D, {"batch_idx": [0, 0, 7, -1], "head_idx": lambda a, d: i32(d), "row_start": 4, "row_end": 4},
        {"batch_idx": (1,), "head_idx": range(2), "row_start": 2**31 - 1, "row_end": 2**31 - 1},
        {"batch_idx": np.int64(1), "head_idx": np.array([1, 0])}],
    "gqa_accumulate_op": [  # semaphores given but unused; more semaphores than needed; strided partials
        {"deterministic": False}, {"semaphores": zs(19, dtype=I32)},
        {"dk_partial": lambda a, d: z(d, B, H_Q, S, D).transpose(1, 2), "dv_partial": padded(4)}],
    "gqa_accumulate": [{"acc": lambda a, d: accumulator(d, batch=0), **dict.fromkeys(PARTIALS, zs(0, S, H_Q, D))}],
    "gqa_postprocess": [  # inf and nan scales pass
        {"dk": lambda a, d: z(d, B, H_K, S, D, dtype=BF16).transpose(1, 2), "dv": padded(8)},
        {"scale_dk": float("inf"), "scale_dv": float("nan")}, {"scale_dk": np.float32(0.5), "scale_dv": 3}],
    "gqa_reduce": [  # integer-likes (operator.index)
        {"dk_partial": on(torch.Tensor.bfloat16), "dv_partial": None},
        {"dk_partial": lambda a, d: z(d, B, H_Q, S, D).transpose(1, 2)},
        {"num_heads_kv": np.int64(2)}, {"num_heads_kv": torch.tensor(2)}, {"scale_dk": float("inf")}],
    "gqa_accumulator": [{"num_heads_kv": np.int32(2)}, {"num_heads_kv": torch.tensor(2), "head_dim": np.int64(64)}],
    "to_dense_varlen": [{"seqused": ints(3, 4)}],
    "gqa_accum_to_dense_op": [{"out": zs(1, 300, 1, 128), "head_dim": 128, "_arch": 80, "accum": lambda a, d: (
        accumulator(d, h_k=1, hd=128, batch=1, seqlen=300, arch=80).dk_accum)}],
    "repeat_kv": [{"dim": -3}, {"n_rep": np.int64(3), "dim": torch.tensor(2)}],
}


@pytest.mark.parametrize("op,changes,dev", [
    pytest.param(op, changes, dev, id=f"{dev}-{op}-{i}", marks=[pytest.mark.gpu] * (dev == "cuda") +
                 [pytest.mark.ops] * (op != "repeat_kv"))
    for i, (op, changes) in enumerate((op, c) for op, cs in GOOD.items() for c in cs) for dev in ("cpu", "cuda")])
def test_accepted(op, changes, dev):
    check_accepted(OP[op], dev, changes, runs=changes is ON_META)
