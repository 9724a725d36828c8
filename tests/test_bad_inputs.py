"""The bad-input matrix: one table of bad arguments to the public API, each a distinct class of
mistake, each raising a clear error that names the argument and says what was expected and what
was given; afterwards the process is healthy.

Unlike tests/test_validation.py and tests/test_gqa_validation.py (every message of each validator,
called directly, with the device checks monkeypatched), this goes through the wrappers users call
(flash_epilogue.store, ..., gqa_accumulator) end to end, and every row is checked twice:

* bad: the call raises an error of the row's types whose message names the op and matches the
  row's pattern (argument, expected, got);
* good: the same call without the row's mutation is accepted, so the error comes from the
  mutation and not from a broken baseline.

Rows whose error comes before the device check run with CPU tensors as well (here the good call
must reach the device check and stop there: "expected a CUDA tensor"), so CI covers them without
a GPU. On an sm_90 GPU every row runs with CUDA tensors; after each one a valid store and
deterministic GQA reduce/accumulate must still give bitwise-correct results and
torch.cuda.synchronize() must succeed (no sticky CUDA error). GPU time: well under 5 s.

Messages are matched on their parts (argument name, expected, got), not whole strings, and the
accepted types are the natural ones for the mistake (FlashEpilogueInputError is a ValueError;
TypeError for a wrong Python type; RuntimeError where a C++ check may be the one reporting a device
problem), so the rows hold whether the wrappers validate before or after calling the C++ op.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import flash_epilogue as fe
from flash_epilogue.reference import gqa_accumulate_reference, gqa_reduce_reference

BF16, F16, F32, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int32
B, S, H_K, G, D = 2, 40, 2, 2, 64  # the baseline problem: batch 2, seqlen 40, 2 KV heads of 2 query heads, d 64
H_Q = H_K * G
TOTAL = 80  # varlen baselines: cu_seqlens [0, 30, 80]

VALUE = (ValueError,)  # FlashEpilogueInputError is a ValueError
PYTYPE = (ValueError, TypeError)  # an argument of the wrong Python type
DEVICE = (ValueError, RuntimeError)  # a C++ device check may report it first


# ---------------------------------------------------------------------------------------------
# baselines: valid keyword arguments of each op on a device


def _rand(shape, dev, dtype=F32):
    g = torch.Generator(device="cpu").manual_seed(hash(shape) & 0xFFFF)
    return torch.randn(shape, generator=g).to(device=dev, dtype=dtype)


def _cu(dev, vals=(0, 30, TOTAL)):
    return torch.tensor(vals, dtype=I32, device=dev)


def store_args(dev):
    return {"dk_accum": _rand((B, S, H_K, D), dev), "dv_accum": _rand((B, S, H_K, D), dev),
            "dk": torch.zeros(B, S, H_K, D, dtype=BF16, device=dev), "dv": torch.zeros(B, S, H_K, D, dtype=BF16, device=dev)}


def store_varlen_args(dev):
    return {"dk_accum": _rand((TOTAL, H_K, D), dev), "dv_accum": _rand((TOTAL, H_K, D), dev),
            "dk": torch.zeros(TOTAL, H_K, D, dtype=BF16, device=dev),
            "dv": torch.zeros(TOTAL, H_K, D, dtype=BF16, device=dev), "cu_seqlens": _cu(dev)}


def store_zero_args(dev):
    return {"dk": _rand((B, S, H_K, D), dev, BF16), "dv": _rand((B, S, H_K, D), dev, BF16)}


def accumulate_args(dev):
    return {"dk_partial": _rand((B, S, H_Q, D), dev), "dv_partial": _rand((B, S, H_Q, D), dev),
            "acc": fe.gqa_accumulator(H_K, D, batch=B, seqlen=S, deterministic=True, device=dev)}


def postprocess_args(dev):
    return {"acc": fe.gqa_accumulator(H_K, D, batch=B, seqlen=S, device=dev),
            "dk": torch.zeros(B, S, H_K, D, dtype=BF16, device=dev), "dv": torch.zeros(B, S, H_K, D, dtype=BF16, device=dev)}


def reduce_args(dev):
    return {"dk_partial": _rand((B, S, H_Q, D), dev), "dv_partial": _rand((B, S, H_Q, D), dev), "num_heads_kv": H_K}


def accumulator_args(dev):
    return {"num_heads_kv": H_K, "head_dim": D, "batch": B, "seqlen": S, "device": dev}


OPS = {  # name -> (public callable, baseline builder, the op name in messages)
    "store": (fe.store, store_args, "store"),
    "store_varlen": (fe.store, store_varlen_args, "store"),
    "store_zero": (fe.store_zero, store_zero_args, "store_zero"),
    "gqa_accumulate": (fe.gqa_accumulate, accumulate_args, "gqa_accumulate"),
    "gqa_postprocess": (fe.gqa_postprocess, postprocess_args, "gqa_postprocess"),
    "gqa_reduce": (fe.gqa_reduce, reduce_args, "gqa_reduce"),
    "gqa_accumulator": (fe.gqa_accumulator, accumulator_args, "gqa_accumulator"),
}


# ---------------------------------------------------------------------------------------------
# mutations (each edits the keyword arguments in place)


def put(**changes):
    """Replace arguments: values, or callables of (args, dev) giving the value."""
    def mutate(a, dev):
        for k, v in changes.items():
            a[k] = v(a, dev) if callable(v) else v
    return mutate


def all_to_cpu(a, dev):
    for k, v in list(a.items()):
        if isinstance(v, torch.Tensor):
            a[k] = v.cpu()
        if k == "device":
            a[k] = "cpu"


def misaligned(t):
    """t's values in a new tensor whose data starts 8 bytes past a 16-byte boundary."""
    flat = torch.zeros(t.numel() + 8, dtype=t.dtype, device=t.device)
    out = flat[8 // t.element_size():][: t.numel()].view(t.shape)
    return out.copy_(t)


def padded_rows(t, extra):
    """t's values in a view whose row pitch (stride(-2)) is t.shape[-1] + extra elements."""
    buf = torch.zeros(*t.shape[:-1], t.shape[-1] + extra, dtype=t.dtype, device=t.device)
    return buf[..., : t.shape[-1]].copy_(t)


def other_acc(**kw):
    def make(a, dev):
        base = {"batch": B, "seqlen": S, "device": dev}
        base.update(kw)
        return fe.gqa_accumulator(base.pop("num_heads_kv", H_K), base.pop("head_dim", D), **base)
    return make


@dataclass
class Case:
    id: str
    op: str  # a key of OPS
    mutate: Callable  # (args, dev) -> None
    match: str  # regex searched in the message: argument, expected, got
    types: tuple = VALUE
    cpu: bool = True  # the error comes before the device check: the row also runs with CPU tensors


CASES = [
    # --- store: dtypes
    Case("accum-dtype-float64", "store", put(dk_accum=lambda a, d: a["dk_accum"].double()),
         r"dk_accum: dtype: expected torch\.float32, got torch\.float64"),
    Case("output-dtype-float32", "store", put(dk=lambda a, d: a["dk"].float(), dv=lambda a, d: a["dv"].float()),
         r"dk: dtype: expected torch\.float16 or torch\.bfloat16, got torch\.float32"),
    Case("outputs-of-two-dtypes", "store", put(dv=lambda a, d: a["dv"].half()),
         r"dv: dtype: expected torch\.bfloat16 \(the dtype of dk\), got torch\.float16"),
    # --- ranks and shapes
    Case("rank-3-without-cu_seqlens", "store",
         put(**{k: (lambda k: lambda a, d: a[k][0])(k) for k in ("dk_accum", "dv_accum", "dk", "dv")}),
         r"dk_accum: rank: expected 4 dims .*cu_seqlens is None, got 3 dims"),
    Case("rank-4-with-cu_seqlens", "store_varlen",
         put(**{k: (lambda k: lambda a, d: a[k][None])(k) for k in ("dk_accum", "dv_accum", "dk", "dv")}),
         r"dk_accum: rank: expected 3 dims .*cu_seqlens is given, got 4 dims"),
    Case("accum-shape-differs-from-output", "store", put(dk_accum=lambda a, d: _rand((B, S + 1, H_K, D), d)),
         rf"dk_accum: shape: expected \({B}, {S}, {H_K}, {D}\) \(the shape of dk\), got \({B}, {S + 1}, {H_K}, {D}\)"),
    Case("dv-heads-differ-from-dk", "store",
         put(dv_accum=lambda a, d: _rand((B, S, H_K + 1, D), d),
             dv=lambda a, d: torch.zeros(B, S, H_K + 1, D, dtype=BF16, device=d)),
         rf"dv: shape: expected .*dk's shape but the last dim.*, got \({B}, {S}, {H_K + 1}, {D}\)"),
    # --- head dims
    Case("head-dim-not-multiple-of-8", "store",
         put(dk_accum=lambda a, d: _rand((B, S, H_K, 60), d), dk=lambda a, d: torch.zeros(B, S, H_K, 60, dtype=BF16, device=d)),
         r"dk: head dim: expected a multiple of 8 in \[8, 256\], got 60"),
    Case("head-dim-above-256", "store",
         put(dk_accum=lambda a, d: _rand((B, S, H_K, 264), d), dk=lambda a, d: torch.zeros(B, S, H_K, 264, dtype=BF16, device=d)),
         r"dk: head dim: expected a multiple of 8 in \[8, 256\], got 264"),
    # --- strides and alignment
    Case("last-dim-not-contiguous", "store",
         put(dk=lambda a, d: torch.zeros(B, S, H_K, 2 * D, dtype=BF16, device=d)[..., ::2]),
         r"dk: stride\(-1\): expected 1 \(last dim contiguous\), got 2"),
    Case("row-pitch-not-16-bytes-16bit", "store", put(dk=lambda a, d: padded_rows(a["dk"], 4)),
         r"dk: stride\(2\): expected a non-negative multiple of 8 elements \(16 bytes\), got 68"),
    Case("row-pitch-not-16-bytes-fp32", "store", put(dv_accum=lambda a, d: padded_rows(a["dv_accum"], 2)),
         r"dv_accum: stride\(2\): expected a non-negative multiple of 4 elements \(16 bytes\), got 66"),
    Case("misaligned-data-pointer", "store", put(dk=lambda a, d: misaligned(a["dk"])),
         r"dk: data_ptr: expected a 16-byte aligned address, got 0x[0-9a-f]+ \(address % 16 = 8\)"),
    # --- aliasing
    Case("dk-and-dv-alias", "store", put(dv=lambda a, d: a["dk"]),
         r"dv: memory: expected no overlap with dk, got bytes"),
    Case("output-overlaps-input", "store", put(dk=lambda a, d: a["dk_accum"].view(BF16)[..., :D]),
         r"dk: memory: expected no overlap with dk_accum, got bytes"),
    # --- cu_seqlens / seqused metadata
    Case("cu_seqlens-int64", "store_varlen", put(cu_seqlens=lambda a, d: a["cu_seqlens"].long()),
         r"cu_seqlens: dtype: expected torch\.int32, got torch\.int64"),
    Case("cu_seqlens-2d", "store_varlen", put(cu_seqlens=lambda a, d: a["cu_seqlens"][None]),
         r"cu_seqlens: rank: expected 1 dim \(batch \+ 1,\), got 2 dims"),
    Case("cu_seqlens-one-entry", "store_varlen", put(cu_seqlens=lambda a, d: a["cu_seqlens"][:1]),
         r"cu_seqlens: numel: expected batch \+ 1 >= 2 \(at least one sequence\), got 1"),
    Case("cu_seqlens-not-contiguous", "store_varlen",
         put(cu_seqlens=lambda a, d: torch.tensor([0, 9, 30, 9, 80, 9], dtype=I32, device=d)[::2]),
         r"cu_seqlens: stride\(0\): expected 1 \(contiguous\), got 2"),
    Case("seqused-wrong-size", "store", put(seqused=lambda a, d: torch.tensor([1, 2, 3], dtype=I32, device=d)),
         rf"seqused: numel: expected {B} \(batch = dk\.shape\[0\]\), got 3"),
    Case("seqused-int64", "store_varlen", put(seqused=lambda a, d: torch.tensor([30, 50], device=d)),
         r"seqused: dtype: expected torch\.int32, got torch\.int64"),
    # --- Python types and devices
    Case("not-a-tensor", "store", put(dk_accum=lambda a, d: a["dk_accum"].tolist()),
         r"dk_accum: expected a torch\.Tensor, got list", PYTYPE),
    Case("cpu-tensors", "store", all_to_cpu,
         r"dk_accum: device: expected a CUDA tensor, got a tensor on cpu", DEVICE),
    Case("meta-tensors", "store", put(**{k: (lambda k: lambda a, d: a[k].to("meta"))(k)
                                        for k in ("dk_accum", "dv_accum", "dk", "dv")}),
         r"dk_accum: device: expected a CUDA tensor, got a tensor on meta", DEVICE),
    Case("mixed-devices", "store", put(seqused=lambda a, d: torch.tensor([S, 3], dtype=I32)),
         r"seqused: device: expected a CUDA tensor, got a tensor on cpu", DEVICE, cpu=False),
    # --- contents (checked with check_inputs=True only: a host sync, so after the device checks)
    Case("cu_seqlens-decreasing", "store_varlen",
         put(cu_seqlens=lambda a, d: _cu(d, (0, 50, 30, TOTAL)), check_inputs=True),
         r"cu_seqlens\[2\]: expected >= cu_seqlens\[1\] = 50 \(non-decreasing\), got 30", cpu=False),
    Case("cu_seqlens-past-the-tokens", "store_varlen",
         put(cu_seqlens=lambda a, d: _cu(d, (0, 30, TOTAL + 1)), check_inputs=True),
         rf"cu_seqlens\[2\]: expected <= {TOTAL} \(the tensors' token count\), got {TOTAL + 1}", cpu=False),
    Case("cu_seqlens-negative-start", "store_varlen",
         put(cu_seqlens=lambda a, d: _cu(d, (-4, 30, TOTAL)), check_inputs=True),
         r"cu_seqlens\[0\]: expected >= 0, got -4", cpu=False),
    Case("seqused-longer-than-segment", "store_varlen",
         put(seqused=lambda a, d: torch.tensor([30, 51], dtype=I32, device=d), check_inputs=True),
         r"seqused\[1\]: expected <= 50 \(the length of segment 1, cu_seqlens\[2\] - cu_seqlens\[1\]\), got 51",
         cpu=False),
    Case("seqused-longer-than-seqlen", "store",
         put(seqused=lambda a, d: torch.tensor([S, S + 1], dtype=I32, device=d), check_inputs=True),
         rf"seqused\[1\]: expected <= {S} \(the static seqlen\), got {S + 1}", cpu=False),
    Case("seqused-negative", "store",
         put(seqused=lambda a, d: torch.tensor([-5, 3], dtype=I32, device=d), check_inputs=True),
         r"seqused\[0\]: expected >= 0, got -5", cpu=False),
    # --- store_zero selections and row ranges
    Case("row_start-negative", "store_zero", put(row_start=-1), r"row_start: expected >= 0, got -1"),
    Case("row_end-before-row_start", "store_zero", put(row_start=10, row_end=5),
         r"row_end: expected None or >= row_start = 10, got 5"),
    Case("row_start-a-float", "store_zero", put(row_start=1.5), r"row_start: expected an int, got float", PYTYPE),
    Case("batch_idx-of-floats", "store_zero", put(batch_idx=[0, 0.5]), r"batch_idx\[1\]: expected an int, got float",
         PYTYPE),
    Case("batch_idx-a-bool", "store_zero", put(batch_idx=True),
         r"batch_idx: expected None, an int, a sequence of ints or an int32 tensor, got bool", PYTYPE),
    Case("head_idx-beyond-int32", "store_zero", put(head_idx=[0, 2**40]),
         r"head_idx\[1\]: expected an int32 value in \[-2147483648, 2147483647\], got 1099511627776"),
    Case("head_idx-int64-tensor", "store_zero", put(head_idx=lambda a, d: torch.tensor([0, 1], device=d)),
         r"head_idx: dtype: expected torch\.int32, got torch\.int64"),
    Case("batch_idx-out-of-range-checked", "store_zero", put(batch_idx=[0, 5], check_inputs=True),
         rf"batch_idx\[1\]: expected a value in \[0, {B}\) \(the batch size\), got 5", cpu=False),
    Case("store_zero-dk-dv-alias", "store_zero", put(dv=lambda a, d: a["dk"]),
         r"dv: memory: expected no overlap with dk"),
    # --- gqa_accumulator: allocation
    Case("accumulator-head-dim-260", "gqa_accumulator", put(head_dim=260),
         r"head_dim: expected a multiple of 8 in \[8, 256\], got 260"),
    Case("accumulator-no-kv-heads", "gqa_accumulator", put(num_heads_kv=0), r"num_heads_kv: expected a positive int, got 0"),
    Case("accumulator-varlen-without-total", "gqa_accumulator",
         put(seqlen=None, batch=None, cu_seqlens=lambda a, d: _cu(d)),
         r"total_tokens: expected an int >= 0 \(the partials' row count\) in the varlen layout, got None"),
    # --- gqa_accumulate
    Case("acc-not-an-accumulator", "gqa_accumulate", put(acc=lambda a, d: a["acc"].dk_accum),
         r"acc: expected a flash_epilogue\.GQAAccumulator .*, got Tensor", PYTYPE),
    Case("group-size-not-dividing", "gqa_accumulate", put(acc=other_acc(num_heads_kv=3)),
         rf"dk_partial: heads: expected a positive multiple of the 3 KV heads .*, got {H_Q} query heads"),
    Case("accumulator-for-another-head-dim", "gqa_accumulate", put(acc=other_acc(head_dim=128)),
         r"dk_accum: shape: expected \(.*\) \(the accumulator of batch 2, seqlen 40, .*allocate it with "
         r"flash_epilogue\.gqa_accumulator\), got \("),
    Case("accumulator-for-another-seqlen", "gqa_accumulate", put(acc=other_acc(seqlen=300, deterministic=True)),
         r"dk_accum: shape: expected \(2, 2, 1, 8192\) .*, got \(2, 2, 3, 8192\)"),
    Case("deterministic-without-semaphores", "gqa_accumulate", put(acc=other_acc(), deterministic=True),
         r"acc\.semaphores: expected an int32 workspace because deterministic=True.*, got None"),
    Case("deterministic-not-a-bool", "gqa_accumulate", put(deterministic="yes"),
         r"deterministic: expected a bool, got str", PYTYPE),
    Case("partials-bf16", "gqa_accumulate", put(dk_partial=lambda a, d: a["dk_partial"].bfloat16()),
         r"dk_partial: dtype: expected torch\.float32, got torch\.bfloat16"),
    # --- gqa_postprocess
    Case("scale-a-string", "gqa_postprocess", put(scale_dk="0.5"), r"scale_dk: expected a float, got str", PYTYPE),
    Case("postprocess-output-fp32", "gqa_postprocess",
         put(dk=lambda a, d: a["dk"].float(), dv=lambda a, d: a["dv"].float()),
         r"dk: dtype: expected torch\.float16 or torch\.bfloat16, got torch\.float32"),
    # --- gqa_reduce
    Case("num_heads_kv-not-a-divisor", "gqa_reduce", put(num_heads_kv=3),
         rf"num_heads_kv: expected a divisor of the {H_Q} query heads \(dk_partial\.shape\[-2\]\), got 3"),
    Case("num_heads_kv-zero", "gqa_reduce", put(num_heads_kv=0), r"num_heads_kv: expected a positive int, got 0"),
    Case("out_dtype-float32", "gqa_reduce", put(out_dtype=torch.float32),
         r"out_dtype: expected None, torch\.float16 or torch\.bfloat16, got torch\.float32"),
    Case("out-a-triple", "gqa_reduce", put(out=lambda a, d: (a["dk_partial"],) * 3),
         r"out: expected None, a tensor \(dk\) or a \(dk, dv\) pair, got a tuple of length 3", PYTYPE),
    Case("out-one-tensor-for-two-partials", "gqa_reduce",
         put(out=lambda a, d: torch.zeros(B, S, H_K, D, dtype=BF16, device=d)),
         r"out: expected a \(dk, dv\) pair because dv_partial is given, got a torch\.Tensor", PYTYPE),
    Case("partials-fp16-out-bf16", "gqa_reduce",
         put(dk_partial=lambda a, d: a["dk_partial"].half(), dv_partial=lambda a, d: a["dv_partial"].half(),
             out_dtype=BF16),
         r"dk_partial: dtype: expected torch\.float32 or torch\.bfloat16 \(the dtype of dk\), got torch\.float16"),
    Case("out-heads-disagree-with-num_heads_kv", "gqa_reduce",
         put(num_heads_kv=1, out=lambda a, d: tuple(torch.zeros(B, S, H_K, D, dtype=BF16, device=d) for _ in "kv")),
         rf"num_heads_kv: expected {H_K} \(the heads of out: dk\.shape\[-2\]\), got 1", cpu=False),
]

assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


def _params():
    out = []
    for c in CASES:
        if c.cpu:
            out.append(pytest.param(c, "cpu", id=f"cpu-{c.id}"))
        out.append(pytest.param(c, "cuda", id=f"cuda-{c.id}", marks=pytest.mark.gpu))
    return out


# ---------------------------------------------------------------------------------------------
# the process is healthy afterwards


def assert_healthy():
    """A valid store, gqa_reduce and deterministic accumulate + postprocess give bitwise-correct
    results, and the device synchronizes without a (sticky) error."""
    dev = "cuda"
    acc_k, acc_v = _rand((B, S, H_K, D), dev), _rand((B, S, H_K, D), dev)
    dk, dv = (torch.full((B, S, H_K, D), float("nan"), dtype=BF16, device=dev) for _ in range(2))
    fe.store(acc_k, acc_v, dk, dv)
    pk, pv = _rand((B, S, H_Q, D), dev), _rand((B, S, H_Q, D), dev)
    rk = fe.gqa_reduce(pk, num_heads_kv=H_K, out_dtype=BF16)
    acc = fe.gqa_accumulator(H_K, D, batch=B, seqlen=S, deterministic=True, device=dev)
    fe.gqa_accumulate(pk, pv, acc)
    ok, ov = (torch.full((B, S, H_K, D), float("nan"), dtype=BF16, device=dev) for _ in range(2))
    fe.gqa_postprocess(acc, ok, ov)
    torch.cuda.synchronize()
    assert torch.equal(dk.view(torch.int16), acc_k.to(BF16).view(torch.int16))
    assert torch.equal(dv.view(torch.int16), acc_v.to(BF16).view(torch.int16))
    want = gqa_reduce_reference(pk, H_K, out_dtype=BF16, sequential=True)
    assert torch.equal(rk.view(torch.int16), want.view(torch.int16))
    ref = [torch.zeros(B, S, H_K, D, device=dev) for _ in range(2)]
    gqa_accumulate_reference(pk, pv, *ref, num_heads_kv=H_K)
    assert torch.equal(ok.view(torch.int16), ref[0].to(BF16).view(torch.int16))
    assert torch.equal(ov.view(torch.int16), ref[1].to(BF16).view(torch.int16))


def _call(case: Case, dev: str, bad: bool):
    fn, build, _ = OPS[case.op]
    args = build(dev)
    if bad:
        case.mutate(args, dev)
    return fn(**args)


@pytest.mark.parametrize("case,dev", _params())
def test_bad_input(case: Case, dev: str):
    op_name = OPS[case.op][2]
    # the baseline is accepted: on a GPU it runs; on CPU it stops at the device check, the last one
    # (gqa_accumulator allocates on any device)
    if dev == "cuda" or case.op == "gqa_accumulator":
        _call(case, dev, bad=False)
        if dev == "cuda":
            torch.cuda.synchronize()
    else:
        with pytest.raises(DEVICE, match=r"device: expected a CUDA tensor, got a tensor on cpu"):
            _call(case, dev, bad=False)
    # the mutation is rejected with a message naming the op, the argument, expected and got
    with pytest.raises(Exception) as info:
        _call(case, dev, bad=True)
    err = info.value
    assert isinstance(err, case.types), f"{type(err).__name__} is not one of {case.types}: {err}"
    msg = str(err)
    assert f"flash_epilogue.{op_name}" in msg, msg
    assert re.search(case.match, msg), f"message does not match {case.match!r}:\n{msg}"
    assert "expected" in msg and "got" in msg, msg
    if dev == "cuda":
        assert_healthy()


def test_matrix_size():
    # the issue asks for at least 25 distinct classes; the CPU-reachable part runs in CI
    assert len(CASES) >= 25
    assert sum(c.cpu for c in CASES) >= 25
    assert {c.op for c in CASES} == set(OPS)
