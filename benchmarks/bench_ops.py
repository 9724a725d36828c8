"""Benchmark suite of the performance issue: every op against torch eager, torch.compile, a
plain Triton kernel and the device-to-device copy roofline, measured in one run.

    python benchmarks/bench_ops.py --out benchmarks/results --commit abc1234   # H200: ~4-5 min
    python benchmarks/bench_ops.py --quick --out /tmp/r                        # smoke run: 3 shapes
    python benchmarks/bench_ops.py --dry-run                                   # CPU: no timing
    python benchmarks/bench_ops.py --from-json benchmarks/results/h200.json    # CSV/PNG/tables again

Ops (rows' "op"): store, store_varlen, store_zero, gqa_reduce (fp32 and bf16 partials: the rows'
"dtype"), gqa_accumulate, gqa_accumulate_det, gqa_postprocess. Implementations ("impl"):

* flash_epilogue: torch.ops.flash_epilogue.* (`--api wrapper`: the Python wrappers,
  check_inputs=False; their host time then counts where it exceeds the GPU's idle gap).
* torch_eager: what a user writes: `.to(bf16)`; `p.view(b, s, h_k, g, d).sum(3).to(bf16)`;
  `acc += p.view(...).sum(3)` on a dense fp32 accumulator; `(acc * scale).to(bf16)`; a
  masked_fill_ of the valid rows (mask built from seqused / cu_seqlens inside the timed call).
* torch_compile: the same functions under torch.compile(dynamic=True), one wrapper per op, given
  (rows, heads, d) views of batched tensors (as varlen ones are) so that shapes share graphs:
  ~17 inductor graphs in all (size-1 heads/groups, dtypes and store_zero's 4-D mask recompile).
* triton: a plain streaming Triton kernel of the same math (one launch for dK and dV, except
  store_zero: one per tensor).
gqa_accumulate_det times flash_epilogue only; its baseline rows are gqa_accumulate's (torch's
group sum and the Triton kernel are deterministic already), marked "shared_with".

Timing: triton.testing.do_bench(fn, return_mode="median") (it clears L2 before each call);
problems whose footprint is below 3x L2 rotate over copies of their buffers. Bytes are the
minimum traffic: every input read once, every output written once; accumulate counts the
accumulator's read and write (dense fp32 sizes); store_zero counts the valid rows written.

Shapes (batch, seqlen, h_k, group, d[, dv]) from the issue, plus a varlen batch of 32k tokens
(random lengths, fixed seed) and a tiny one for latency. `store` works on the h_k heads;
store_varlen runs on the varlen batch and on every batched shape packed as equal-length
sequences. The tiny shape also gets a host+GPU time per call in a plain Python loop (no
graphs): flash_epilogue.store vs two torch `.to` calls.

Writes DIR/NAME.json (keys of the issue plus versions, clocks, targets, comparison), DIR/NAME.csv
and DIR/NAME.png (matplotlib if importable; else use --from-json on a machine that has it).
Compares with the last committed NAME.json (--baseline, else git HEAD's, else the file in the
tree: read before writing) and prints regressions over 5%. Each (op, shape, impl) is first
checked against torch eager's outputs (rows' "check"): a fast wrong kernel shows.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import gc
import itertools
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a source checkout without an install
    sys.path.insert(0, REPO)

OUT = torch.bfloat16
DEVICE = "cuda"
MB = 1e6
L2_DEFAULT = 60 * 1024 * 1024
IMPLS = ("flash_epilogue", "torch_eager", "torch_compile", "triton")
OPS = ("store", "store_varlen", "store_zero", "gqa_reduce", "gqa_accumulate", "gqa_accumulate_det",
       "gqa_postprocess")
BIG_BYTES = 256 * MB  # the store target: >= 0.98x on shapes moving more than this
SCALE_DK, SCALE_DV = 0.125, 1.0  # gqa_postprocess


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# Shapes


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    b: int  # batch (number of sequences in varlen)
    s: int  # seqlen (batched); unused in varlen
    hk: int
    g: int
    d: int
    dv: int
    lengths: Optional[tuple[int, ...]] = None  # varlen: the sequence lengths
    packed: bool = False  # a batched shape packed as varlen (equal lengths)

    @property
    def hq(self) -> int:
        return self.hk * self.g

    @property
    def varlen(self) -> bool:
        return self.lengths is not None

    @property
    def rows(self) -> int:
        """Token rows: batch * seqlen, or the total tokens in varlen."""
        return sum(self.lengths) if self.varlen else self.b * self.s

    @property
    def layout(self) -> str:
        return "varlen" if self.varlen else "batched"

    def shape_list(self) -> list[int]:
        """[batch, seqlen, h_k, group, d, dv]; varlen: [sequences, total_tokens, h_k, group, d, dv]."""
        return [self.b, self.rows if self.varlen else self.s, self.hk, self.g, self.d, self.dv]

    def lead(self) -> tuple[int, ...]:
        """Leading dims of every tensor: (b, s), or (total,) in varlen."""
        return (self.rows,) if self.varlen else (self.b, self.s)

    def as_packed(self) -> "Shape":
        """The same tokens as a varlen batch of `b` equal-length sequences."""
        if self.varlen:
            return self
        return dataclasses.replace(self, name="packed_" + self.name, lengths=(self.s,) * self.b, packed=True)

    def small(self) -> "Shape":
        """A CPU-sized version with the same heads and head dims (the dry run's values check)."""
        if self.varlen:
            lengths = (5, 17, 9) if self.packed else (5, 0, 17, 9, 1)
            return dataclasses.replace(self, b=len(lengths), lengths=lengths)
        return dataclasses.replace(self, b=min(self.b, 2), s=37)


def varlen_lengths(total: int = 32768, max_len: int = 4096, seed: int = 0) -> tuple[int, ...]:
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(1, max_len), total - sum(lengths)))
    return tuple(lengths)


def _batched(b, s, hk, g, d, dv=None, prefix=""):
    dv = d if dv is None else dv
    name = f"{prefix}b{b}_s{s}_hk{hk}_g{g}_d{d}" + (f"_dv{dv}" if dv != d else "")
    return Shape(name, b, s, hk, g, d, dv)


def all_shapes(quick: bool) -> list[Shape]:
    lengths = varlen_lengths()
    varlen = Shape("varlen32k_hk8_g4_d128", len(lengths), 0, 8, 4, 128, 128, lengths=lengths)
    tiny = _batched(1, 512, 8, 4, 128, prefix="tiny_")
    main = _batched(4, 8192, 8, 4, 128)
    if quick:
        return [main, varlen, tiny]
    return [
        main,
        _batched(2, 16384, 8, 8, 128),
        _batched(8, 4096, 4, 8, 64),
        _batched(2, 8192, 8, 4, 256),
        _batched(1, 8192, 1, 8, 128),
        _batched(2, 8192, 16, 1, 192, 128),
        varlen,
        tiny,
    ]


def shapes_for(op: str, shapes: list[Shape]) -> list[Shape]:
    if op == "store":
        return [s for s in shapes if not s.varlen]
    if op == "store_varlen":
        return [s for s in shapes if s.varlen] + [s.as_packed() for s in shapes if not s.varlen]
    return list(shapes)


# ---------------------------------------------------------------------------------------------
# The user's PyTorch code (torch_eager; torch_compile compiles these same functions)


def eager_store(ak, av):
    return ak.to(OUT), av.to(OUT)


def eager_zero(dk, dv, seqused):
    mask = torch.arange(dk.shape[1], device=dk.device)[None, :] < seqused[:, None]  # (b, s)
    mask = mask[:, :, None, None]
    dk.masked_fill_(mask, 0)
    dv.masked_fill_(mask, 0)
    return dk, dv


def eager_zero_varlen(dk, dv, cu_seqlens, seqused):
    pos = torch.arange(dk.shape[0], device=dk.device, dtype=torch.int32)
    # the last sequence starting at or before pos; searching the whole cu_seqlens, not a cu_seqlens[1:]
    # view: torch.compile (2.11) searched such a view as if it started at cu_seqlens[0], off by one
    # sequence, and zeroed the invalid rows too (H200, 1fa5a26)
    seq = (torch.searchsorted(cu_seqlens, pos, right=True) - 1).clamp_(min=0, max=seqused.shape[0] - 1)
    end = cu_seqlens[1:][seq]
    mask = ((pos - cu_seqlens[seq]) < seqused[seq]) & (pos < end)
    mask = mask[:, None, None]
    dk.masked_fill_(mask, 0)
    dv.masked_fill_(mask, 0)
    return dk, dv


def eager_gqa_reduce(pk, pv, hk: int):
    *lead, hq, d = pk.shape
    dk = pk.view(*lead, hk, hq // hk, d).sum(-2).to(OUT)
    *lead, hq, dv_ = pv.shape
    dv = pv.view(*lead, hk, hq // hk, dv_).sum(-2).to(OUT)
    return dk, dv


def eager_gqa_accumulate(pk, pv, ak, av):
    hk = ak.shape[-2]
    ak += pk.view(*pk.shape[:-2], hk, pk.shape[-2] // hk, pk.shape[-1]).sum(-2)
    av += pv.view(*pv.shape[:-2], hk, pv.shape[-2] // hk, pv.shape[-1]).sum(-2)
    return ak, av


def eager_gqa_postprocess(ak, av, scale_dk: float, scale_dv: float):
    return (ak * scale_dk).to(OUT), (av * scale_dv).to(OUT)


EAGER = {
    "store": eager_store,
    "store_varlen": eager_store,
    "store_zero": eager_zero,
    "store_zero_varlen": eager_zero_varlen,
    "gqa_reduce": eager_gqa_reduce,
    "gqa_accumulate": eager_gqa_accumulate,
    "gqa_postprocess": eager_gqa_postprocess,
}

_COMPILED: dict[str, Callable] = {}
COMPILE_BACKEND = "inductor"


def _configure_dynamo() -> None:
    import torch._dynamo
    import torch.fx.experimental._config as fx_config
    # d == dv would otherwise add a guard (duck sizing) and recompile for the d != dv shape
    fx_config.use_duck_shape = False
    # past the limit dynamo silently runs the eager code: the compile rows would time eager
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))


def compiled(key: str) -> Callable:
    """One torch.compile(dynamic=True) wrapper per op. The callers pass rank-3 (rows, heads, d)
    views of batched tensors (as varlen ones are), so batched and varlen shapes share graphs and
    only size-1 heads/groups recompile (store_zero's batched mask keeps the 4-D layout)."""
    if key not in _COMPILED:
        if not _COMPILED:
            _configure_dynamo()
        _COMPILED[key] = torch.compile(EAGER[key], dynamic=True, backend=COMPILE_BACKEND)
    return _COMPILED[key]


def flat(t):
    """(b, s, h, d) -> (b * s, h, d), sharing memory; varlen tensors unchanged. detach(): an alias
    without `_base`, so that dynamo guards see batched and varlen inputs alike."""
    return t.flatten(0, 1).detach() if t is not None and t.dim() == 4 else t


# ---------------------------------------------------------------------------------------------
# Plain Triton kernels (what a kernel-savvy user writes in ~20 lines)

_TRITON = None


def triton_kernels():
    """Defined lazily: the dry run sets TRITON_INTERPRET=1 before triton decorates them."""
    global _TRITON
    if _TRITON is not None:
        return _TRITON
    import triton
    import triton.language as tl

    @triton.jit
    def _cvt_part(x, y, n, pid, scale, BLOCK: tl.constexpr):
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        v = tl.load(x + offs, mask=m)
        tl.store(y + offs, (v * scale).to(y.dtype.element_ty), mask=m)

    globals()["_cvt_part"] = _cvt_part  # triton resolves callees in the module's globals, not in closures

    @triton.jit
    def cvt2_kernel(xk, yk, nk, xv, yv, nv, scale_k, scale_v, BLOCK: tl.constexpr):
        # y = (x * scale).to(y.dtype) for dK's blocks, then dV's, in one launch
        pid = tl.program_id(0)
        nbk = tl.cdiv(nk, BLOCK)
        if pid < nbk:
            _cvt_part(xk, yk, nk, pid, scale_k, BLOCK)
        else:
            _cvt_part(xv, yv, nv, pid - nbk, scale_v, BLOCK)

    @triton.jit
    def _gsum_part(p, o, n_rh, pid, scale, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                   BR: tl.constexpr, ACCUM: tl.constexpr):
        rh = pid.to(tl.int64) * BR + tl.arange(0, BR)  # (token, kv head) rows of o
        c = tl.arange(0, BD)
        m = (rh[:, None] < n_rh) & (c[None, :] < D)
        if ACCUM:
            acc = tl.load(o + rh[:, None] * D + c[None, :], mask=m, other=0.0)
        else:
            acc = tl.zeros((BR, BD), dtype=tl.float32)
        for j in tl.static_range(G):  # the group's query heads, in order
            acc += tl.load(p + (rh[:, None] * G + j) * D + c[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(o + rh[:, None] * D + c[None, :], (acc * scale).to(o.dtype.element_ty), mask=m)

    globals()["_gsum_part"] = _gsum_part

    @triton.jit
    def gsum2_kernel(pk, ok, pv, ov, n_rh, scale_k, scale_v, G: tl.constexpr, DK: tl.constexpr,
                     BDK: tl.constexpr, BRK: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr,
                     BRV: tl.constexpr, ACCUM: tl.constexpr):
        # o[r, h, :] (+)= sum_j p[r, h * G + j, :] for dK's row blocks, then dV's
        pid = tl.program_id(0)
        nbk = tl.cdiv(n_rh, BRK)
        if pid < nbk:
            _gsum_part(pk, ok, n_rh, pid, scale_k, G, DK, BDK, BRK, ACCUM)
        else:
            _gsum_part(pv, ov, n_rh, pid - nbk, scale_v, G, DV, BDV, BRV, ACCUM)

    @triton.jit
    def zero_rows_kernel(y, cu, used, S, W, VARLEN: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr):
        # zero rows [start_b, start_b + used[b]) of a (rows, W) tensor; grid (row x col blocks, batch)
        pid = tl.program_id(0)
        b = tl.program_id(1)
        nwb = tl.cdiv(W, BW)
        rb = pid // nwb
        wb = pid % nwb
        n = tl.load(used + b)
        if VARLEN:
            start = tl.load(cu + b).to(tl.int64)
        else:
            start = b.to(tl.int64) * S
        if rb * BR < n:
            r = rb * BR + tl.arange(0, BR)
            c = wb * BW + tl.arange(0, BW)
            m = (r[:, None] < n) & (c[None, :] < W)
            tl.store(y + (start + r[:, None]) * W + c[None, :], tl.zeros((BR, BW), dtype=y.dtype.element_ty), mask=m)

    def cvt2(xk, yk, xv, yv, scale_k=1.0, scale_v=1.0, BLOCK=4096):
        nk, nv = xk.numel(), xv.numel()
        grid = (triton.cdiv(nk, BLOCK) + triton.cdiv(nv, BLOCK),)
        cvt2_kernel[grid](xk, yk, nk, xv, yv, nv, scale_k, scale_v, BLOCK=BLOCK, num_warps=8)
        return yk, yv

    def gsum2(pk, ok, pv, ov, scale_k=1.0, scale_v=1.0, accum=False):
        hk, d, dv = ok.shape[-2], ok.shape[-1], ov.shape[-1]
        g = pk.shape[-2] // hk
        n_rh = ok.numel() // d
        bdk, bdv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
        brk, brv = max(1, 4096 // bdk), max(1, 4096 // bdv)
        grid = (triton.cdiv(n_rh, brk) + triton.cdiv(n_rh, brv),)
        gsum2_kernel[grid](pk, ok, pv, ov, n_rh, scale_k, scale_v, G=g, DK=d, BDK=bdk, BRK=brk, DV=dv, BDV=bdv,
                           BRV=brv, ACCUM=accum, num_warps=8)
        return ok, ov

    def zero_rows(dk, dv, used, max_len, cu=None):
        varlen = cu is not None
        batch = used.numel()
        seqlen = 0 if varlen else dk.shape[1]
        for t in (dk, dv):
            w = t.shape[-2] * t.shape[-1]
            bw = min(1024, triton.next_power_of_2(w))
            br = max(1, 4096 // bw)
            grid = (triton.cdiv(max_len, br) * triton.cdiv(w, bw), batch)
            zero_rows_kernel[grid](t, cu if varlen else used, used, seqlen, w, VARLEN=varlen, BR=br, BW=bw,
                                   num_warps=8)
        return dk, dv

    _TRITON = {"cvt2": cvt2, "gsum2": gsum2, "zero_rows": zero_rows}
    return _TRITON


# ---------------------------------------------------------------------------------------------
# Problems: the tensors of one (op, shape, dtype), their traffic, and one callable per impl


def _int32(values, device):
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def _cu(shape: Shape, device):
    return _int32(itertools.accumulate((0,) + tuple(shape.lengths)), device) if shape.varlen else None


def zero_seqused(shape: Shape, seed: int = 1) -> list[int]:
    """store_zero's valid lengths: seqused[b] in [len/2, len] (fixed seed)."""
    rng = random.Random(seed)
    lengths = shape.lengths if shape.varlen else (shape.s,) * shape.b
    return [rng.randint(n // 2, n) if n else 0 for n in lengths]


class Op:
    """One op of the suite. `in_dtype` is the partials'/accumulators' dtype (rows' "dtype")."""

    name = ""
    in_dtype = torch.float32
    impls = IMPLS

    def __init__(self, api: str = "op"):
        self.api = api

    @property
    def dtype_name(self) -> str:
        return str(self.in_dtype).replace("torch.", "")

    def key(self, shape: Shape) -> str:
        return self.name

    # -- to override
    def build(self, shape: Shape, device, real_gpu: bool) -> dict:
        raise NotImplementedError

    def traffic(self, shape: Shape) -> int:
        """Minimum bytes moved, from the shape alone."""
        raise NotImplementedError

    def make(self, impl: str, shape: Shape, t: dict) -> Callable:
        raise NotImplementedError

    def fresh(self, t: dict) -> dict:
        """Tensors in their initial state for a correctness check (in-place ops clone/reset)."""
        return t

    def reference(self, shape: Shape, t: dict):
        """The expected outputs (flash_epilogue.reference semantics), CPU dry run only."""
        raise NotImplementedError

    def tensor_bytes(self, shape: Shape, t: dict) -> int:
        """The minimum traffic again, from the tensors the problem built (the dry run compares)."""
        raise NotImplementedError

    def tolerance(self, impl: str) -> Optional[dict]:
        return None  # exact

    def footprint(self, shape: Shape) -> int:
        return self.traffic(shape)


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


class StoreOp(Op):
    name = "store"

    def traffic(self, s):
        return s.rows * s.hk * (s.d + s.dv) * (4 + 2)

    def build(self, s, device, real_gpu):
        ak = torch.randn(*s.lead(), s.hk, s.d, device=device)
        av = torch.randn(*s.lead(), s.hk, s.dv, device=device)
        return {"ak": ak, "av": av, "dk": torch.empty_like(ak, dtype=OUT), "dv": torch.empty_like(av, dtype=OUT),
                "tk": torch.empty_like(ak, dtype=OUT), "tv": torch.empty_like(av, dtype=OUT), "cu": _cu(s, device)}

    def make(self, impl, s, t):
        ak, av, dk, dv, cu = t["ak"], t["av"], t["dk"], t["dv"], t["cu"]
        if impl == "flash_epilogue":
            if self.api == "wrapper":
                import flash_epilogue as fe
                return lambda: (fe.store(ak, av, dk, dv, cu_seqlens=cu, check_inputs=False), dk, dv)[1:]
            op = torch.ops.flash_epilogue.store
            return lambda: (op(ak, av, dk, dv, cu_seqlens=cu, seqused=None), dk, dv)[1:]
        if impl == "torch_eager":
            return lambda: eager_store(ak, av)
        if impl == "torch_compile":
            fn, fk, fv, sk, sv = compiled("store"), flat(ak), flat(av), dk.shape, dv.shape
            return lambda: tuple(o.view(sh) for o, sh in zip(fn(fk, fv), (sk, sv)))
        cvt2 = triton_kernels()["cvt2"]
        tk, tv = t["tk"], t["tv"]
        return lambda: cvt2(ak, tk, av, tv)

    def reference(self, s, t):
        from flash_epilogue.reference import store_reference
        dk, dv = torch.zeros_like(t["dk"]), torch.zeros_like(t["dv"])
        store_reference(t["ak"], t["av"], dk, dv, cu_seqlens=t["cu"])
        return dk, dv

    def tensor_bytes(self, s, t):
        return _nbytes(t["ak"], t["av"], t["dk"], t["dv"])

    def tolerance(self, impl):
        if impl == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
            return {"rtol": 2 ** -7, "atol": 0}  # the interpreter does not round to nearest even
        return None


class StoreVarlenOp(StoreOp):
    name = "store_varlen"


class StoreZeroOp(Op):
    name = "store_zero"
    in_dtype = OUT

    def key(self, s):
        return "store_zero_varlen" if s.varlen else "store_zero"

    def traffic(self, s):
        valid = sum(zero_seqused(s))
        return valid * s.hk * (s.d + s.dv) * 2

    def footprint(self, s):
        return s.rows * s.hk * (s.d + s.dv) * 2

    def build(self, s, device, real_gpu):
        used = zero_seqused(s)
        return {"dk": torch.randn(*s.lead(), s.hk, s.d, device=device).to(OUT),
                "dv": torch.randn(*s.lead(), s.hk, s.dv, device=device).to(OUT),
                "cu": _cu(s, device), "used": _int32(used, device), "max_len": max(used + [1])}

    def fresh(self, t):
        return dict(t, dk=t["dk"].clone(), dv=t["dv"].clone())

    def make(self, impl, s, t):
        dk, dv, cu, used = t["dk"], t["dv"], t["cu"], t["used"]
        if impl == "flash_epilogue":
            if self.api == "wrapper":
                import flash_epilogue as fe
                return lambda: (fe.store_zero(dk, dv, cu_seqlens=cu, seqused=used, check_inputs=False), dk, dv)[1:]
            op = torch.ops.flash_epilogue.store_zero
            return lambda: (op(dk, dv, cu_seqlens=cu, seqused=used, batch_idx=None, head_idx=None, row_start=0,
                               row_end=None), dk, dv)[1:]
        if impl in ("torch_eager", "torch_compile"):
            fn = EAGER[self.key(s)] if impl == "torch_eager" else compiled(self.key(s))
            if s.varlen:
                return lambda: fn(dk, dv, cu, used)
            return lambda: fn(dk, dv, used)
        zero_rows = triton_kernels()["zero_rows"]
        max_len = t["max_len"]
        return lambda: zero_rows(dk, dv, used, max_len, cu)

    def reference(self, s, t):
        from flash_epilogue.reference import store_zero_reference
        dk, dv = t["dk"].clone(), t["dv"].clone()
        store_zero_reference(dk, dv, cu_seqlens=t["cu"], seqused=t["used"])
        return dk, dv

    def tensor_bytes(self, s, t):
        dk, dv = t["dk"].clone().fill_(1), t["dv"].clone().fill_(1)
        from flash_epilogue.reference import store_zero_reference
        store_zero_reference(dk, dv, cu_seqlens=t["cu"], seqused=t["used"])
        return int((dk == 0).sum()) * dk.element_size() + int((dv == 0).sum()) * dv.element_size()


class GQAReduceOp(Op):
    name = "gqa_reduce"

    def __init__(self, api="op", in_dtype=torch.float32):
        super().__init__(api)
        self.in_dtype = in_dtype

    def traffic(self, s):
        e = torch.empty(0, dtype=self.in_dtype).element_size()
        return s.rows * (s.d + s.dv) * (s.hq * e + s.hk * 2)

    def build(self, s, device, real_gpu):
        pk = torch.randn(*s.lead(), s.hq, s.d, device=device).to(self.in_dtype)
        pv = torch.randn(*s.lead(), s.hq, s.dv, device=device).to(self.in_dtype)
        out = lambda d: torch.empty(*s.lead(), s.hk, d, dtype=OUT, device=device)  # noqa: E731
        return {"pk": pk, "pv": pv, "ok": out(s.d), "ov": out(s.dv), "tk": out(s.d), "tv": out(s.dv),
                "cu": _cu(s, device)}

    def make(self, impl, s, t):
        pk, pv, ok, ov, cu = t["pk"], t["pv"], t["ok"], t["ov"], t["cu"]
        if impl == "flash_epilogue":
            if self.api == "wrapper":
                import flash_epilogue as fe
                return lambda: fe.gqa_reduce(pk, pv, num_heads_kv=s.hk, cu_seqlens=cu, out=(ok, ov),
                                             check_inputs=False)
            op = torch.ops.flash_epilogue.gqa_reduce
            return lambda: (op(pk, pv, ok, ov, cu_seqlens=cu, seqused=None, scale_dk=1.0, scale_dv=1.0), ok, ov)[1:]
        if impl == "torch_eager":
            return lambda: eager_gqa_reduce(pk, pv, s.hk)
        if impl == "torch_compile":
            fn, fk, fv, hk, sk, sv = compiled(self.name), flat(pk), flat(pv), s.hk, ok.shape, ov.shape
            return lambda: tuple(o.view(sh) for o, sh in zip(fn(fk, fv, hk), (sk, sv)))
        gsum2 = triton_kernels()["gsum2"]
        tk, tv = t["tk"], t["tv"]
        return lambda: gsum2(pk, tk, pv, tv)

    def reference(self, s, t):
        from flash_epilogue.reference import gqa_reduce_reference
        return tuple(gqa_reduce_reference(p, s.hk, out_dtype=OUT, cu_seqlens=t["cu"]) for p in (t["pk"], t["pv"]))

    def tensor_bytes(self, s, t):
        return _nbytes(t["pk"], t["pv"], t["ok"], t["ov"])

    def tolerance(self, impl):
        return {"rtol": 2 ** -6, "atol": 1e-2}  # bf16 outputs of sums taken in another order (1-2 ulp)


class GQAAccumulateOp(Op):
    name = "gqa_accumulate"
    deterministic = False

    def key(self, s):
        return "gqa_accumulate"

    def traffic(self, s):
        return s.rows * (s.d + s.dv) * (s.hq * 4 + 2 * s.hk * 4)

    def build(self, s, device, real_gpu):
        pk = torch.randn(*s.lead(), s.hq, s.d, device=device)
        pv = torch.randn(*s.lead(), s.hq, s.dv, device=device)
        cu = _cu(s, device)
        return {"pk": pk, "pv": pv, "cu": cu, "acc": _accumulator(s, cu, device, self.deterministic),
                "ak": torch.zeros(*s.lead(), s.hk, s.d, device=device),
                "av": torch.zeros(*s.lead(), s.hk, s.dv, device=device)}

    def fresh(self, t):
        t["ak"].zero_()
        t["av"].zero_()
        if t["acc"] is not None:
            t["acc"].reset()
        return t

    def make(self, impl, s, t):
        pk, pv, cu, ak, av, acc = t["pk"], t["pv"], t["cu"], t["ak"], t["av"], t["acc"]
        if impl == "flash_epilogue":
            det = self.deterministic
            if self.api == "wrapper":
                import flash_epilogue as fe
                return lambda: fe.gqa_accumulate(pk, pv, acc, deterministic=det, cu_seqlens=cu, check_inputs=False)
            op = torch.ops.flash_epilogue.gqa_accumulate
            k, v, sem, arch = acc.dk_accum, acc.dv_accum, acc.semaphores if det else None, acc.arch
            return lambda: op(pk, pv, k, v, sem, cu_seqlens=cu, seqused=None, deterministic=det, _arch=arch)
        if impl == "torch_eager":
            return lambda: eager_gqa_accumulate(pk, pv, ak, av)
        if impl == "torch_compile":
            fn, args = compiled(self.key(s)), (flat(pk), flat(pv), flat(ak), flat(av))
            return lambda: (fn(*args), ak, av)[1:]
        gsum2 = triton_kernels()["gsum2"]
        return lambda: gsum2(pk, ak, pv, av, accum=True)

    def reference(self, s, t):
        from flash_epilogue.reference import gqa_accumulate_reference
        ak, av = torch.zeros_like(t["ak"]), torch.zeros_like(t["av"])
        gqa_accumulate_reference(t["pk"], t["pv"], ak, av, num_heads_kv=s.hk, cu_seqlens=t["cu"])
        return ak, av

    def tensor_bytes(self, s, t):
        return _nbytes(t["pk"], t["pv"]) + 2 * _nbytes(t["ak"], t["av"])

    def tolerance(self, impl):
        return {"rtol": 1e-5, "atol": 1e-5}  # fp32 sums in another order


class GQAAccumulateDetOp(GQAAccumulateOp):
    name = "gqa_accumulate_det"
    deterministic = True
    impls = ("flash_epilogue",)  # baselines: gqa_accumulate's rows (deterministic already)


class GQAPostprocessOp(Op):
    name = "gqa_postprocess"

    def traffic(self, s):
        return s.rows * s.hk * (s.d + s.dv) * (4 + 2)

    def build(self, s, device, real_gpu):
        cu = _cu(s, device)
        acc = _accumulator(s, cu, device, False)
        if acc is not None:
            acc.dk_accum.normal_()
            acc.dv_accum.normal_()
        if real_gpu:  # the dense accumulator holds the same values: outputs comparable bit for bit
            ak, av = acc.to_dense(cu_seqlens=cu)
        else:
            ak = torch.randn(*s.lead(), s.hk, s.d, device=device)
            av = torch.randn(*s.lead(), s.hk, s.dv, device=device)
        out = lambda d: torch.empty(*s.lead(), s.hk, d, dtype=OUT, device=device)  # noqa: E731
        return {"acc": acc, "ak": ak, "av": av, "cu": cu, "dk": out(s.d), "dv": out(s.dv), "tk": out(s.d),
                "tv": out(s.dv)}

    def make(self, impl, s, t):
        acc, ak, av, cu, dk, dv = t["acc"], t["ak"], t["av"], t["cu"], t["dk"], t["dv"]
        if impl == "flash_epilogue":
            if self.api == "wrapper":
                import flash_epilogue as fe
                return lambda: (fe.gqa_postprocess(acc, dk, dv, scale_dk=SCALE_DK, scale_dv=SCALE_DV, cu_seqlens=cu,
                                                   check_inputs=False), dk, dv)[1:]
            op = torch.ops.flash_epilogue.gqa_postprocess
            k, v, arch = acc.dk_accum, acc.dv_accum, acc.arch
            return lambda: (op(k, v, dk, dv, scale_dk=SCALE_DK, scale_dv=SCALE_DV, cu_seqlens=cu, seqused=None,
                               _arch=arch), dk, dv)[1:]
        if impl == "torch_eager":
            return lambda: eager_gqa_postprocess(ak, av, SCALE_DK, SCALE_DV)
        if impl == "torch_compile":
            fn, fk, fv, sk, sv = compiled(self.name), flat(ak), flat(av), dk.shape, dv.shape
            return lambda: tuple(o.view(sh) for o, sh in zip(fn(fk, fv, SCALE_DK, SCALE_DV), (sk, sv)))
        cvt2 = triton_kernels()["cvt2"]
        tk, tv = t["tk"], t["tv"]
        return lambda: cvt2(ak, tk, av, tv, SCALE_DK, SCALE_DV)

    def reference(self, s, t):
        from flash_epilogue.reference import store_reference
        dk, dv = torch.zeros_like(t["dk"]), torch.zeros_like(t["dv"])
        f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731 (the scale rounded to fp32)
        store_reference(t["ak"] * f32(SCALE_DK), t["av"] * f32(SCALE_DV), dk, dv, cu_seqlens=t["cu"])
        return dk, dv

    def tensor_bytes(self, s, t):
        return _nbytes(t["ak"], t["av"], t["dk"], t["dv"])

    def tolerance(self, impl):
        return StoreOp.tolerance(self, impl)


def _accumulator(s: Shape, cu, device, deterministic: bool):
    """flash_epilogue's GQA accumulator (None on a CPU device: the kernels need a GPU)."""
    if torch.device(device).type != "cuda":
        return None
    import flash_epilogue as fe
    if s.varlen:
        return fe.gqa_accumulator(s.hk, s.d, s.dv, cu_seqlens=cu, total_tokens=s.rows, deterministic=deterministic,
                                  device=device)
    return fe.gqa_accumulator(s.hk, s.d, s.dv, batch=s.b, seqlen=s.s, deterministic=deterministic, device=device)


# op name (OPS) -> the benchmark problems it stands for; gqa_reduce is timed with fp32 and bf16 partials
OP_FACTORIES: dict[str, Callable[[str], list[Op]]] = {
    "store": lambda api: [StoreOp(api)],
    "store_varlen": lambda api: [StoreVarlenOp(api)],
    "store_zero": lambda api: [StoreZeroOp(api)],
    "gqa_reduce": lambda api: [GQAReduceOp(api, torch.float32), GQAReduceOp(api, torch.bfloat16)],
    "gqa_accumulate": lambda api: [GQAAccumulateOp(api)],
    "gqa_accumulate_det": lambda api: [GQAAccumulateDetOp(api)],
    "gqa_postprocess": lambda api: [GQAPostprocessOp(api)],
}
assert set(OP_FACTORIES) == set(OPS), "every op of OPS needs a factory"


def make_ops(selected: list[str], api: str) -> list[Op]:
    return [op for name in selected for op in OP_FACTORIES[name](api)]


def rotation(footprint: int, l2_bytes: int, cap: int = 64) -> int:
    """Copies of a problem's buffers to cycle through so that the set is >= 3x L2."""
    return max(1, min(cap, math.ceil(3 * l2_bytes / max(footprint, 1))))


def rotating(fns: list[Callable]) -> Callable:
    if len(fns) == 1:
        return fns[0]
    it = itertools.cycle(fns)
    return lambda: next(it)()


def probe_rows(op_names: list[str], shapes: list[Shape], measure: Callable, device: str = "cuda",
               skip: Optional[Callable] = None) -> list[dict]:
    """The probe scripts' loop: for each op and shape (unless skip(op, shape)), buffers rotated over
    >= 3x L2 as here, then a row {op, dtype, shape, copies} updated with measure(op, shape, insts),
    printed as it comes; each problem's buffers are freed before the next is built."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else 0
    rows = []
    for op in make_ops(op_names, "op"):
        for shape in shapes_for(op.name, shapes):
            if skip is not None and skip(op, shape):
                continue
            torch.manual_seed(0)
            insts = [op.build(shape, device, device == "cuda") for _ in range(rotation(op.footprint(shape), l2))]
            row = {"op": op.name, "dtype": op.dtype_name, "shape": shape.name, "copies": len(insts)}
            row.update(measure(op, shape, insts))
            print(row, flush=True)
            rows.append(row)
            del insts
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def per_impl(op: "Op", shape: Shape, insts: list, timings: Callable,
             impls: tuple[str, ...] = ("flash_epilogue", "torch_eager", "triton")) -> dict:
    """{impl: timings(fn)} for the impls op has, fn cycling over insts (run once first); a failing
    impl gets {"error": ...} instead of ending the probe."""
    out = {}
    for impl in impls:
        if impl not in op.impls:
            continue
        try:
            fn = rotating([op.make(impl, shape, t) for t in insts])
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            out[impl] = timings(fn)
        except Exception as e:  # noqa: BLE001
            out[impl] = {"error": repr(e)[:300]}
    return out


def _close(got, want, tol: Optional[dict]) -> Optional[str]:
    """None when equal (or within tol), else what differs."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"output {i}: {tuple(g.shape)} {g.dtype}, expected {tuple(w.shape)} {w.dtype}"
        if tol is None:
            if not torch.equal(g, w):
                diff = g != w
                rows = diff.reshape(diff.shape[0], -1).any(1).nonzero().flatten()
                first = rows[:4].tolist()
                sample = [(r, g.reshape(g.shape[0], -1)[r, :2].tolist(), w.reshape(w.shape[0], -1)[r, :2].tolist())
                          for r in first]
                return (f"output {i}: {diff.sum().item()} of {g.numel()} elements differ (bitwise check) in "
                        f"{rows.numel()} of {g.shape[0]} rows (dim 0); first (row, got, want): {sample}")
        else:
            try:
                torch.testing.assert_close(g.float(), w.float(), **tol)
            except AssertionError as e:
                return f"output {i}: " + str(e).splitlines()[0] + " " + " ".join(str(e).split("\n")[1:3])
    return None


# ---------------------------------------------------------------------------------------------
# Timing


def do_bench_median(fn, warmup, rep) -> float:
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def copy_roofline(warmup, rep) -> float:
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench_median(lambda: dst.copy_(src), warmup, rep)
    del src, dst
    return 2 * (1 << 28) * 4 / ms / 1e9


def host_loop(fn, iters=1000, repeats=5, sync=True) -> float:
    """Microseconds per call of fn in a plain Python loop (host + GPU, no graphs)."""
    for _ in range(50):
        fn()
    if sync:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if sync:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(times)


def tiny_host_times(shape: Shape) -> dict:
    import flash_epilogue as fe
    from flash_epilogue import validation
    ak = torch.randn(*shape.lead(), shape.hk, shape.d, device="cuda")
    av = torch.randn(*shape.lead(), shape.hk, shape.dv, device="cuda")
    dk, dv = torch.empty_like(ak, dtype=OUT), torch.empty_like(av, dtype=OUT)
    op = torch.ops.flash_epilogue.store
    res = {
        "shape": shape.shape_list(),
        "flash_epilogue.store (wrapper, check_inputs=False)": host_loop(
            lambda: fe.store(ak, av, dk, dv, check_inputs=False)),
        "torch.ops.flash_epilogue.store": host_loop(lambda: op(ak, av, dk, dv)),
        "torch .to x2 (dK, dV)": host_loop(lambda: (ak.to(OUT), av.to(OUT))),
        "validation.validate_store only (host, no launch)": host_loop(
            lambda: validation.validate_store(ak, av, dk, dv, None, None), sync=False),
    }
    return res


# ---------------------------------------------------------------------------------------------
# Environment


def _run(cmd) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def default_commit() -> str:
    env = os.environ.get("FLASH_EPILOGUE_COMMIT")
    if env and env != "unknown":
        return env
    return _run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"]) or "unknown"


def environment() -> dict:
    import triton
    props = torch.cuda.get_device_properties(0)
    smi = _run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm,clocks.mem",
                "--format=csv,noheader"]).split(", ")
    smi += [""] * (4 - len(smi))
    try:
        import flash_epilogue as fe
        fe_version = fe.__version__
    except Exception:  # noqa: BLE001
        fe_version = "?"
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": smi[0],
        "triton": triton.__version__,
        "flash_epilogue": fe_version,
        "python": sys.version.split()[0],
        "sm_count": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", L2_DEFAULT),
        "clocks": {"sm": smi[1], "max_sm": smi[2], "mem": smi[3]},
    }


# ---------------------------------------------------------------------------------------------
# The GPU run


def run_gpu(args, ops: list[Op], shapes: list[Shape]) -> dict:
    import flash_epilogue as fe
    if not torch.cuda.is_available():
        raise SystemExit("bench_ops: no CUDA device (use --dry-run on a CPU machine)")
    if not fe.kernels_available():
        log(f"WARNING: flash_epilogue kernels unavailable ({fe.UNAVAILABLE_REASON}): its rows will fail")
    t_start = time.time()
    env = environment()
    l2 = env["l2_bytes"] or L2_DEFAULT
    log(f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, driver {env['driver']}, triton {env['triton']}, "
        f"SM clock {env['clocks']['sm']} (max {env['clocks']['max_sm']}), L2 {l2 / 2**20:.0f} MiB")
    copy_start = copy_roofline(args.warmup, args.rep)
    log(f"copy roofline: {copy_start:.3f} TB/s")
    impls = [i for i in IMPLS if i in args.impls]
    rows, errors, skipped, compile_s = [], [], [], {}
    compile_spent = 0.0
    # SIGINT (gpu_check.sh's `timeout -s INT` when a device call runs short): finish the row being
    # measured, then stop and write the rows so far, marked "interrupted" (a hung kernel is still
    # killed: timeout -k)
    interrupted = []
    signal.signal(signal.SIGINT, lambda *_: interrupted.append(time.time() - t_start))
    for op in ops:
        if interrupted:
            break
        repeats = args.store_repeats if op.name in ("store", "store_varlen") else 1
        for shape in shapes_for(op.name, shapes):
            if interrupted:
                log(f"[{interrupted[0]:6.1f} s] INTERRUPTED: writing the {len(rows)} rows measured so far")
                break
            label = f"{op.name}[{op.dtype_name}] {shape.name}"
            nbytes = op.traffic(shape)
            try:
                torch.manual_seed(0)
                n_rot = rotation(op.footprint(shape), l2)
                insts = [op.build(shape, DEVICE, DEVICE == "cuda") for _ in range(n_rot)]
            except Exception as e:  # noqa: BLE001
                errors.append({"op": op.name, "name": shape.name, "impl": "build", "error": repr(e)[:500]})
                log(f"  {label}: BUILD FAILED {e!r}")
                continue
            # every impl's check starts from this copy of the initial state: the timing loops
            # write into insts (in-place ops), so insts[0] changes from one impl to the next
            pristine = op.fresh(insts[0])
            ref_out, line = None, []
            for impl in impls:
                if impl not in op.impls:
                    continue
                if impl == "torch_compile" and compile_spent > args.compile_budget:
                    skipped.append({"op": op.name, "name": shape.name, "impl": impl, "why": "compile budget spent"})
                    continue
                try:
                    if ref_out is None:  # torch eager's outputs from the initial state of the first copy
                        ref_out = [o.clone() for o in op.make("torch_eager", shape, op.fresh(pristine))()]
                    t0 = time.time()
                    fns = [op.make(impl, shape, t) for t in insts]
                    # correctness on the first copy, against torch eager (a fast wrong kernel must show)
                    state = op.fresh(pristine)
                    out = op.make(impl, shape, state)()
                    if impl == "flash_epilogue" and op.name.startswith("gqa_accumulate"):
                        out = state["acc"].to_dense(cu_seqlens=state["cu"])
                    torch.cuda.synchronize()
                    why = _close(out, ref_out, op.tolerance(impl))
                    check = "ok" if not why else "MISMATCH vs torch_eager: " + why
                    if why:
                        log(f"  WARNING {label} {impl}: {check}")
                    del out, state
                    warm_s = time.time() - t0
                    if impl == "torch_compile":
                        compile_spent += warm_s
                        compile_s[f"{op.key(shape)}/{shape.name}"] = round(warm_s, 2)
                    fn = rotating(fns)
                    runs = [do_bench_median(fn, args.warmup, args.rep) for _ in range(repeats)]
                    ms = statistics.median(runs)
                except Exception as e:  # noqa: BLE001
                    errors.append({"op": op.name, "name": shape.name, "impl": impl, "error": repr(e)[:500]})
                    log(f"  {label} {impl}: FAILED {e!r}"[:400])
                    continue
                row = {"op": op.name, "shape": shape.shape_list(), "impl": impl, "ms": ms, "TBps": nbytes / ms / 1e9,
                       "name": shape.name, "layout": shape.layout, "dtype": op.dtype_name, "bytes": nbytes,
                       "rotation": n_rot, "check": check}
                if repeats > 1:
                    row["runs_ms"] = runs
                rows.append(row)
                line.append(f"{impl} {row['TBps']:5.2f}")
            if isinstance(op, GQAAccumulateDetOp):  # the baselines of gqa_accumulate, shared
                for r in [r for r in rows if r["op"] == "gqa_accumulate" and r["name"] == shape.name
                          and r["impl"] != "flash_epilogue"]:
                    rows.append(dict(r, op=op.name, shared_with="gqa_accumulate"))
            log(f"  {label:58s} {nbytes / MB:8.1f} MB  x{n_rot:<2d} " + "  ".join(line) + "  TB/s")
            del insts, pristine
            gc.collect()
            torch.cuda.empty_cache()
        if not interrupted:
            log(f"[{time.time() - t_start:6.1f} s] {op.name}[{op.dtype_name}] done")
    host = None
    tiny = [s for s in shapes if s.name.startswith("tiny_")]
    if tiny and "store" in args.ops and not interrupted:
        try:
            host = tiny_host_times(tiny[0])
        except Exception as e:  # noqa: BLE001
            errors.append({"op": "host_loop", "name": tiny[0].name, "impl": "", "error": repr(e)[:500]})
    copy_end = None if interrupted else copy_roofline(args.warmup, args.rep)
    if copy_end is not None:
        log(f"copy roofline at the end: {copy_end:.3f} TB/s; total {time.time() - t_start:.0f} s "
            f"(compile warm-ups {compile_spent:.0f} s)")
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "gpu": env["gpu"], "date": now.date().isoformat(), "commit": args.commit, "copy_TBps": copy_start,
        "rows": rows,
        "timestamp": now.isoformat(timespec="seconds"), "torch": env["torch"], "cuda": env["cuda"],
        "driver": env["driver"], "triton": env["triton"], "flash_epilogue": env["flash_epilogue"],
        "python": env["python"], "sm_count": env["sm_count"], "l2_bytes": l2, "clocks": env["clocks"],
        "copy_TBps_end": copy_end, "api": args.api, "quick": args.quick,
        "method": {"timer": "triton.testing.do_bench(return_mode='median')", "warmup_ms": args.warmup,
                   "rep_ms": args.rep, "store_repeats": args.store_repeats,
                   "bytes": "minimum traffic: inputs read once, outputs written once; accumulate: + accumulator "
                            "read and write (dense fp32); store_zero: valid rows written",
                   "rotation": "buffer copies cycled so a problem's set is >= 3x L2",
                   "scales": {"gqa_postprocess": [SCALE_DK, SCALE_DV], "gqa_reduce": [1.0, 1.0]}},
        "host_loop_us": host, "compile_warmup_s": compile_s, "errors": errors, "skipped": skipped,
        "elapsed_s": round(time.time() - t_start, 1), "interrupted": bool(interrupted),
    }


# ---------------------------------------------------------------------------------------------
# Targets, comparison, outputs


def _index(rows):
    return {(r["op"], r["name"], r.get("dtype", ""), r["impl"]): r for r in rows}


def targets(result: dict) -> list[dict]:
    """The issue's targets, each a ratio measured in this run."""
    idx = _index(result["rows"])
    out = []

    def add(op, name, dtype, metric, value, target, ok):
        out.append({"op": op, "name": name, "dtype": dtype, "metric": metric, "value": value, "target": target,
                    "met": bool(ok)})

    names = []
    for r in result["rows"]:
        if (r["op"], r["name"], r.get("dtype", "")) not in names:
            names.append((r["op"], r["name"], r.get("dtype", "")))
    for op, name, dtype in names:
        fe_row = idx.get((op, name, dtype, "flash_epilogue"))
        if fe_row is None:
            continue
        get = lambda impl: idx.get((op, name, dtype, impl))  # noqa: E731
        if op in ("store", "store_varlen"):
            base = [r for r in (get("torch_eager"), get("triton")) if r]
            if not base:
                continue
            best = min(r["ms"] for r in base)
            ratio = best / fe_row["ms"]
            if fe_row["bytes"] > BIG_BYTES:
                add(op, name, dtype, "fe TB/s / best(eager, triton)", ratio, ">= 0.98", ratio >= 0.98)
            else:
                add(op, name, dtype, "best(eager, triton) ms / fe ms", ratio, "> 1", ratio > 1.0)
        elif op == "gqa_reduce":
            for impl in ("torch_eager", "torch_compile"):
                if get(impl):
                    ratio = get(impl)["ms"] / fe_row["ms"]
                    add(op, name, dtype, f"{impl} ms / fe ms", ratio, "> 1", ratio > 1.0)
            if get("triton") and not name.startswith("tiny_"):
                ratio = get("triton")["ms"] / fe_row["ms"]
                add(op, name, dtype, "fe TB/s / triton TB/s", ratio, ">= 0.95", ratio >= 0.95)
        elif op == "gqa_accumulate_det":
            nd = idx.get(("gqa_accumulate", name, dtype, "flash_epilogue"))
            if nd:
                ratio = fe_row["ms"] / nd["ms"]
                add(op, name, dtype, "det ms / non-det ms", ratio, "<= 1.15", ratio <= 1.15)
    host = result.get("host_loop_us")
    if host:
        fe_us = host.get("flash_epilogue.store (wrapper, check_inputs=False)")
        to_us = host.get("torch .to x2 (dK, dV)")
        if fe_us and to_us:
            add("store", "tiny host loop", "float32", "fe.store us / (.to x2) us", fe_us / to_us, "< 1", fe_us < to_us)
    return out


def load_baseline(args) -> Optional[dict]:
    """The last committed results: --baseline, else git HEAD's file, else the file in the tree."""
    rel = f"benchmarks/results/{args.name}.json"
    if args.baseline:
        with open(args.baseline) as f:
            return json.load(f)
    text = _run(["git", "-C", REPO, "show", f"HEAD:{rel}"])
    if text:
        try:
            return json.loads(text)
        except ValueError:
            pass
    path = os.path.join(REPO, rel)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return None


def compare(result: dict, base: Optional[dict], threshold: float = 0.05) -> dict:
    if not base:
        log("no previous results to compare with")
        return {"baseline": None}
    bidx = _index(base.get("rows", []))
    regressions, drift = [], []
    for r in result["rows"]:
        if r.get("shared_with"):
            continue
        b = bidx.get((r["op"], r["name"], r.get("dtype", ""), r["impl"]))
        if not b or not b.get("ms"):
            continue
        change = r["ms"] / b["ms"] - 1
        if change > threshold:
            item = {"op": r["op"], "name": r["name"], "dtype": r.get("dtype", ""), "impl": r["impl"],
                    "ms": r["ms"], "base_ms": b["ms"], "change": change}
            (regressions if r["impl"] == "flash_epilogue" else drift).append(item)
    log(f"\ncompared with {base.get('commit', '?')} ({base.get('date', '?')}): copy {base.get('copy_TBps', 0):.3f} "
        f"-> {result['copy_TBps']:.3f} TB/s")
    if regressions:
        log(f"REGRESSIONS over {threshold:.0%} (flash_epilogue):")
        for x in regressions:
            log(f"  {x['op']}[{x['dtype']}] {x['name']}: {x['base_ms'] * 1e3:.1f} -> {x['ms'] * 1e3:.1f} us "
                f"(+{x['change']:.1%})")
    else:
        log(f"no flash_epilogue regression over {threshold:.0%}")
    if drift:
        log(f"baselines slower by over {threshold:.0%} (machine drift?): "
            + ", ".join(f"{x['op']}/{x['name']}/{x['impl']} +{x['change']:.0%}" for x in drift[:12])
            + (" ..." if len(drift) > 12 else ""))
    return {"baseline": {"commit": base.get("commit"), "date": base.get("date")}, "threshold": threshold,
            "regressions": regressions, "baseline_drift": drift}


def print_tables(result: dict) -> None:
    rows = result["rows"]
    copy = result.get("copy_TBps") or 0
    log(f"\nTB/s (ms) per op and shape; copy roofline {copy:.2f} TB/s")
    if result.get("interrupted"):
        log("PARTIAL: the run was interrupted (SIGINT); rows and targets after that point are missing")
    log(f"{'op':20s} {'dtype':8s} {'shape':34s} " + " ".join(f"{i:>17s}" for i in IMPLS))
    seen = []
    idx = _index(rows)
    for r in rows:
        k = (r["op"], r["name"], r.get("dtype", ""))
        if k in seen:
            continue
        seen.append(k)
        cells = []
        for impl in IMPLS:
            x = idx.get(k + (impl,))
            cells.append(f"{x['TBps']:5.2f} ({x['ms'] * 1e3:7.1f}us)" if x else f"{'-':>17s}")
        log(f"{k[0]:20s} {k[2]:8s} {k[1]:34s} " + " ".join(cells))
    host = result.get("host_loop_us")
    if host:
        log("\ntiny shape, host + GPU per call in a Python loop (no graphs):")
        for k, v in host.items():
            if k != "shape":
                log(f"  {k:52s} {v:8.1f} us")
    tg = result.get("targets") or []
    if tg:
        met = sum(t["met"] for t in tg)
        log(f"\ntargets: {met} of {len(tg)} met")
        log(f"{'op':20s} {'dtype':8s} {'shape':34s} {'metric':34s} {'value':>7s} {'target':>8s}")
        for t in tg:
            log(f"{t['op']:20s} {t['dtype']:8s} {t['name']:34s} {t['metric']:34s} {t['value']:7.3f} "
                f"{t['target']:>8s} {'ok' if t['met'] else 'MISSED'}")
    for e in result.get("errors") or []:
        log(f"ERROR {e}")


def write_csv(result: dict, path: str) -> None:
    copy = result.get("copy_TBps") or float("nan")
    cols = ["op", "name", "layout", "dtype", "shape", "impl", "ms", "TBps", "frac_of_copy", "bytes", "rotation",
            "check", "shared_with"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in result["rows"]:
            w.writerow([r["op"], r.get("name", ""), r.get("layout", ""), r.get("dtype", ""),
                        "x".join(map(str, r["shape"])), r["impl"], f"{r['ms']:.6f}", f"{r['TBps']:.4f}",
                        f"{r['TBps'] / copy:.4f}", r.get("bytes", ""), r.get("rotation", ""), r.get("check", ""),
                        r.get("shared_with", "")])


def _short(name: str) -> str:
    return (name.replace("packed_", "pk ").replace("tiny_", "tiny ").replace("_hk", " hk").replace("_g", " g")
            .replace("_d", " d").replace("_s", " s").replace("_", " "))


def write_plot(result: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"matplotlib is not importable: no plot (run `python benchmarks/bench_ops.py --from-json "
            f"{os.path.splitext(path)[0]}.json` where it is)")
        return False
    panels = []
    for r in result["rows"]:
        k = (r["op"], r.get("dtype", ""))
        if k not in panels:
            panels.append(k)
    ncols = 2
    nrows = max(1, math.ceil(len(panels) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(16, 3.6 * nrows), squeeze=False)
    colors = {"flash_epilogue": "tab:blue", "torch_eager": "tab:orange", "torch_compile": "tab:green",
              "triton": "tab:purple"}
    copy = result.get("copy_TBps")
    for ax, (op, dtype) in zip(axes.flat, panels):
        rows = [r for r in result["rows"] if r["op"] == op and r.get("dtype", "") == dtype]
        names = list(dict.fromkeys(r["name"] for r in rows))
        width = 0.8 / len(IMPLS)
        for j, impl in enumerate(IMPLS):
            xs, ys = [], []
            for i, n in enumerate(names):
                hit = [r for r in rows if r["name"] == n and r["impl"] == impl]
                if hit:
                    xs.append(i + (j - (len(IMPLS) - 1) / 2) * width)
                    ys.append(hit[0]["TBps"])
            if xs:
                ax.bar(xs, ys, width, color=colors[impl])
        if copy:
            ax.axhline(copy, color="red", linestyle="--", linewidth=1)
        ax.set_ylim(0, 1.12 * max([copy or 0] + [r["TBps"] for r in rows]))
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([_short(n) for n in names], rotation=20, ha="right", fontsize=7)
        ax.set_ylabel("TB/s")
        ax.set_title(f"{op}" + (f" ({dtype} in)" if dtype else ""), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    present = [i for i in IMPLS if any(r["impl"] == i for r in result["rows"])]
    handles = [Patch(color=colors[i]) for i in present]
    labels = list(present)
    if copy:
        handles.append(Line2D([], [], color="red", linestyle="--", linewidth=1))
        labels.append(f"device copy {copy:.2f} TB/s")
    fig.suptitle(f"flash_epilogue vs torch eager / torch.compile / Triton: {result.get('gpu')}, torch "
                 f"{result.get('torch')}, {result.get('date')}, commit {result.get('commit')} (TB/s, minimum traffic)",
                 y=0.995, fontsize=11)
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.975), ncol=5, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_outputs(result: dict, out_dir: str, name: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, name)
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    write_csv(result, base + ".csv")
    wrote_png = write_plot(result, base + ".png")
    log(f"wrote {base}.json, {base}.csv" + (f", {base}.png" if wrote_png else ""))


# ---------------------------------------------------------------------------------------------
# Dry run (CPU): build everything, check bytes and the baselines' semantics, no timing


@contextlib.contextmanager
def _pretend_sm90():
    """flash_epilogue's device hooks answer as on an H200 (as the CPU tests do)."""
    from flash_epilogue import validation as V
    saved = (V._is_cuda_device, V._device_capability, V._compiled_archs)
    V._is_cuda_device = lambda device: True
    V._device_capability = lambda device: (9, 0)
    V._compiled_archs = lambda: ("sm_90a",)
    try:
        yield
    finally:
        V._is_cuda_device, V._device_capability, V._compiled_archs = saved


def dry_run(args, ops: list[Op], shapes: list[Shape]) -> int:
    global COMPILE_BACKEND
    COMPILE_BACKEND = "eager"  # dynamo tracing only: checks the compiled code path without codegen
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        triton_kernels()
        have_triton = True
    except Exception as e:  # noqa: BLE001
        log(f"triton unavailable here ({e!r}): Triton kernels not checked")
        have_triton = False
    failures = 0
    log("dry run: full-size problems as fake CUDA tensors (shapes, bytes, rotation, flash_epilogue calls through "
        "its fake kernels and its wrappers' validation), then CPU-sized problems checked against "
        "flash_epilogue.reference (torch eager, torch.compile(backend='eager'), Triton interpreter)")
    log(f"\n{'op':20s} {'dtype':8s} {'shape':34s} {'MB':>9s} {'rot':>4s}  full-size fake run")
    total_gb, n_bench = 0.0, 0
    for op in ops:
        for shape in shapes_for(op.name, shapes):
            n_rot = rotation(op.footprint(shape), L2_DEFAULT)
            status = []
            try:
                with FakeTensorMode(), _pretend_sm90():
                    t = op.build(shape, torch.device("cuda", 0), False)
                    for api in ("op", "wrapper"):
                        op.api = api
                        op.make("flash_epilogue", shape, t)()
                    op.api = args.api
                    outs = op.make("torch_eager", shape, t)()
                    assert op.name == "store_zero" or op.tensor_bytes(shape, t) == op.traffic(shape), \
                        f"bytes from tensors {op.tensor_bytes(shape, t)} != formula {op.traffic(shape)}"
                    for o in outs:
                        assert o.shape[:-2] == shape.lead() and o.dtype in (OUT, torch.float32), (o.shape, o.dtype)
                status.append("ok")
            except Exception as e:  # noqa: BLE001
                failures += 1
                status.append(f"FAILED {e!r}"[:300])
            total_gb += op.footprint(shape) * n_rot / 1e9
            n_bench += len(op.impls) * (args.store_repeats if op.name in ("store", "store_varlen") else 1)
            log(f"{op.name:20s} {op.dtype_name:8s} {shape.name:34s} {op.traffic(shape) / MB:9.1f} {n_rot:4d}  "
                + " ".join(status))
    log(f"{n_bench} do_bench calls in a full run; buffers built over the run: {total_gb:.0f} GB "
        "(one problem at a time)")

    log(f"\n{'op':20s} {'dtype':8s} {'small shape':34s} {'bytes':>8s}  " + "  ".join(f"{i:>13s}" for i in IMPLS[1:]))
    from torch._dynamo.utils import counters
    for op in ops:
        for shape in shapes_for(op.name, shapes):
            small = shape.small()
            torch.manual_seed(0)
            cells = []
            try:
                t = op.build(small, "cpu", False)
                tb, fb = op.tensor_bytes(small, t), op.traffic(small)
                if tb != fb:
                    failures += 1
                    cells.append(f"BYTES {tb} != {fb}")
                want = op.reference(small, op.fresh(t))
            except Exception as e:  # noqa: BLE001
                failures += 1
                log(f"{op.name:20s} {op.dtype_name:8s} {small.name:34s} BUILD/REFERENCE FAILED {e!r}"[:400])
                continue
            for impl in IMPLS[1:]:
                if impl not in op.impls:
                    cells.append(f"{'(shared)':>13s}")
                    continue
                if impl == "triton" and not have_triton:
                    cells.append(f"{'n/a':>13s}")
                    continue
                try:
                    got = op.make(impl, small, op.fresh(t))()
                    why = _close(got, want, op.tolerance(impl))
                except Exception as e:  # noqa: BLE001
                    why = f"raised {e!r}"[:300]
                if why:
                    failures += 1
                    cells.append(f"FAIL: {why}")
                else:
                    cells.append(f"{'ok':>13s}")
            log(f"{op.name:20s} {op.dtype_name:8s} {small.name:34s} {op.traffic(small):8d}  " + "  ".join(cells))
    log(f"torch.compile(dynamic=True) graphs traced: {dict(counters['stats'])} over {len(_COMPILED)} compiled "
        f"functions (each graph is one inductor compile on the GPU run)")

    # the writers, on made-up timings
    fake = {"gpu": "dry-run (no GPU)", "date": datetime.date.today().isoformat(), "commit": args.commit,
            "copy_TBps": 4.2, "torch": torch.__version__, "rows": [],
            "host_loop_us": {"flash_epilogue.store (wrapper, check_inputs=False)": 20.0,
                             "torch .to x2 (dK, dV)": 17.3}}
    speed = {"flash_epilogue": 3.5, "torch_eager": 3.9, "torch_compile": 3.3, "triton": 4.0}
    for op in ops:
        for shape in shapes_for(op.name, shapes):
            for impl in op.impls:
                ms = op.traffic(shape) / (speed[impl] * 1e9)
                fake["rows"].append({"op": op.name, "shape": shape.shape_list(), "impl": impl, "ms": ms,
                                     "TBps": op.traffic(shape) / ms / 1e9, "name": shape.name, "layout": shape.layout,
                                     "dtype": op.dtype_name, "bytes": op.traffic(shape)})
    fake["targets"] = targets(fake)
    out_dir = args.out_given or tempfile.mkdtemp(prefix="bench_ops_dry_")
    try:
        write_outputs(fake, out_dir, args.name + "_dryrun")
        compare(fake, json.loads(json.dumps(fake)))
        with open(os.path.join(out_dir, args.name + "_dryrun.json")) as f:
            again = json.load(f)
        for k in ("gpu", "date", "commit", "copy_TBps", "rows"):
            assert k in again, k
        for r in again["rows"]:
            assert set(r) >= {"op", "shape", "impl", "ms", "TBps"} and r["op"] in OPS and r["impl"] in IMPLS, r
        log(f"writers: ok ({len(fake['rows'])} made-up rows, {len(fake['targets'])} target ratios)")
    except Exception as e:  # noqa: BLE001
        failures += 1
        log(f"writers FAILED: {e!r}")
    log(f"\ndry run: {'ok' if failures == 0 else f'{failures} FAILED'}")
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--name", default="h200", help="file stem of the results (default h200)")
    p.add_argument("--commit", default=None, help="commit measured (default $FLASH_EPILOGUE_COMMIT, else git HEAD)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of: " + ", ".join(OPS))
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of: " + ", ".join(IMPLS))
    p.add_argument("--quick", action="store_true", help="3 shapes, one run each: a smoke run")
    p.add_argument("--dry-run", action="store_true", help="CPU: build every problem, check bytes and baselines")
    p.add_argument("--api", choices=("op", "wrapper"), default="op",
                   help="flash_epilogue through torch.ops (default) or the Python wrappers (check_inputs=False)")
    p.add_argument("--store-repeats", type=int, default=None, help="do_bench runs per store row (default 3; quick 1)")
    p.add_argument("--warmup", type=float, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=float, default=100, help="do_bench rep, ms")
    p.add_argument("--compile-budget", type=float, default=180,
                   help="seconds of torch.compile warm-ups after which compile rows are skipped")
    p.add_argument("--baseline", default=None, help="results to compare with (default: git HEAD's NAME.json)")
    p.add_argument("--from-json", default=None, help="no run: tables, targets, CSV and PNG from this results file")
    args = p.parse_args(argv)
    args.out_given = args.out
    args.out = args.out or os.path.join(REPO, "benchmarks", "results")
    args.commit = args.commit or default_commit()
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    for o in args.ops:
        if o not in OPS:
            p.error(f"--ops: unknown op {o!r} (choose from {', '.join(OPS)})")
    for i in args.impls:
        if i not in IMPLS:
            p.error(f"--impls: unknown impl {i!r} (choose from {', '.join(IMPLS)})")
    if args.store_repeats is None:
        args.store_repeats = 1 if args.quick else 3

    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        result["targets"] = targets(result)
        print_tables(result)
        out_dir = args.out_given or os.path.dirname(os.path.abspath(args.from_json))
        stem = os.path.splitext(os.path.basename(args.from_json))[0]
        os.makedirs(out_dir, exist_ok=True)
        write_csv(result, os.path.join(out_dir, stem + ".csv"))
        write_plot(result, os.path.join(out_dir, stem + ".png"))
        return 0

    shapes = all_shapes(args.quick)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels
        ops = make_ops(args.ops, args.api)
        return dry_run(args, ops, shapes)

    ops = make_ops(args.ops, args.api)
    baseline = load_baseline(args)  # before writing: --out may be the folder of the committed file
    result = run_gpu(args, ops, shapes)
    result["targets"] = targets(result)
    result["comparison"] = compare(result, baseline)
    print_tables(result)
    write_outputs(result, args.out, args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
