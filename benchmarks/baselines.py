"""The baselines each op is timed against, all deterministic. torch eager: what a user writes
(`.to(bf16)`, `.view(...).sum(group)`, `acc += ...`, a scaled `.to`, a masked_fill_ of the valid rows
with the mask built inside the timed call). torch.compile, as a user gets it: the same functions under
torch.compile's default static shapes (dynamic=False: one compile per shape, warmed before timing), on
the tensors as given. torch.compile(dynamic=True) beside it: one wrapper per op, given (rows, heads, d)
views of batched tensors (as varlen ones are) so that shapes share graphs; its kernels are generic in
the sizes and slower at some shapes than the static ones. Plain Triton: one streaming kernel of the same
math (one launch for dK and dV, except the row zeroing: one per tensor).
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from common import OUT


def eager_store(ak, av):
    return ak.to(OUT), av.to(OUT)


def eager_zero(dk, dv, seqused):
    mask = (torch.arange(dk.shape[1], device=dk.device)[None, :] < seqused[:, None])[:, :, None, None]
    dk.masked_fill_(mask, 0)
    dv.masked_fill_(mask, 0)
    return dk, dv


def eager_zero_varlen(dk, dv, cu_seqlens, seqused):
    pos = torch.arange(dk.shape[0], device=dk.device, dtype=torch.int32)
    # the last sequence starting at or before pos, searched in the whole cu_seqlens: torch.compile
    # (2.11) searches a cu_seqlens[1:] view as if it started at cu_seqlens[0] (docs/performance.md, method)
    seq = (torch.searchsorted(cu_seqlens, pos, right=True) - 1).clamp_(min=0, max=seqused.shape[0] - 1)
    mask = (((pos - cu_seqlens[seq]) < seqused[seq]) & (pos < cu_seqlens[1:][seq]))[:, None, None]
    dk.masked_fill_(mask, 0)
    dv.masked_fill_(mask, 0)
    return dk, dv


def _group_sum(p, hk):
    return p.view(*p.shape[:-2], hk, p.shape[-2] // hk, p.shape[-1]).sum(-2)


def eager_gqa_reduce(pk, pv, hk: int):
    return _group_sum(pk, hk).to(OUT), _group_sum(pv, hk).to(OUT)


def eager_gqa_accumulate(pk, pv, ak, av):
    ak += _group_sum(pk, ak.shape[-2])
    av += _group_sum(pv, av.shape[-2])
    return ak, av


def eager_gqa_postprocess(ak, av, scale_dk: float, scale_dv: float):
    return (ak * scale_dk).to(OUT), (av * scale_dv).to(OUT)


EAGER = {"store": eager_store, "store_zero": eager_zero, "store_zero_varlen": eager_zero_varlen,
         "gqa_reduce": eager_gqa_reduce, "gqa_accumulate": eager_gqa_accumulate,
         "gqa_postprocess": eager_gqa_postprocess}
_COMPILED: dict[tuple, Callable] = {}


def _configure_dynamo() -> None:
    import torch._dynamo
    import torch.fx.experimental._config as fx_config
    fx_config.use_duck_shape = False  # d == dv would otherwise add a guard and recompile for d != dv
    # past the limit dynamo silently runs the eager code: the compile rows would time eager
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))


def _static_entry(fn: Callable) -> Callable:
    # a frame of its own for the static compiles (dynamo caches per code object: the dynamic wrapper
    # compiles EAGER[key] itself, so the two never share, or count against, one cache)
    return lambda *args: fn(*args)


def compiled(key: str, dynamic: bool = False) -> Callable:
    """One torch.compile wrapper per op and mode. Static (the default a user gets): one graph per shape
    and dtype. dynamic=True: only size-1 heads/groups, dtypes and store_zero's batched mask (which
    keeps the 4-D layout) recompile."""
    if (key, dynamic) not in _COMPILED:
        if not _COMPILED:
            _configure_dynamo()
        fn = EAGER[key] if dynamic else _static_entry(EAGER[key])
        _COMPILED[key, dynamic] = torch.compile(fn, dynamic=dynamic)
    return _COMPILED[key, dynamic]


def flat(t):
    """(b, s, h, d) -> (b * s, h, d), sharing memory; varlen tensors unchanged. detach(): an alias
    without `_base`, so that dynamo guards see batched and varlen inputs alike."""
    return t.flatten(0, 1).detach() if t is not None and t.dim() == 4 else t


def compiled_call(key: str, *args, shapes=None, dynamic: bool = False) -> Callable:
    """The compiled baseline: static on the tensors as given, dynamic on flat views with its outputs
    viewed back to `shapes`. shapes None: the op writes its last two arguments, which it returns."""
    fn = compiled(key, dynamic)
    if not dynamic:
        return (lambda: (fn(*args), *args[-2:])[1:]) if shapes is None else (lambda: fn(*args))
    fargs = [flat(a) if isinstance(a, torch.Tensor) else a for a in args]
    if shapes is None:
        return lambda: (fn(*fargs), *args[-2:])[1:]
    return lambda: tuple(o.view(sh) for o, sh in zip(fn(*fargs), shapes))


@triton.jit
def _cvt_part(x, y, n, pid, scale, BLOCK: tl.constexpr):
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(x + offs, mask=m)
    tl.store(y + offs, (v * scale).to(y.dtype.element_ty), mask=m)


@triton.jit
def _cvt2_kernel(xk, yk, nk, xv, yv, nv, scale_k, scale_v, BLOCK: tl.constexpr):
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


@triton.jit
def _gsum2_kernel(pk, ok, pv, ov, n_rh, scale_k, scale_v, G: tl.constexpr, DK: tl.constexpr,
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
def _zero_rows_kernel(y, cu, used, S, W, VARLEN: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr):
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
    """y = (x * scale).to(y.dtype) for dK and dV, one launch."""
    nk, nv = xk.numel(), xv.numel()
    grid = (triton.cdiv(nk, BLOCK) + triton.cdiv(nv, BLOCK),)
    _cvt2_kernel[grid](xk, yk, nk, xv, yv, nv, scale_k, scale_v, BLOCK=BLOCK, num_warps=8)
    return yk, yv


def gsum2(pk, ok, pv, ov, accum=False):
    """o (+)= the group sum of p, in fp32 and head order, for dK and dV, one launch."""
    hk, d, dv = ok.shape[-2], ok.shape[-1], ov.shape[-1]
    n_rh = ok.numel() // d
    bdk, bdv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
    brk, brv = max(1, 4096 // bdk), max(1, 4096 // bdv)
    grid = (triton.cdiv(n_rh, brk) + triton.cdiv(n_rh, brv),)
    _gsum2_kernel[grid](pk, ok, pv, ov, n_rh, 1.0, 1.0, G=pk.shape[-2] // hk, DK=d, BDK=bdk, BRK=brk, DV=dv,
                       BDV=bdv, BRV=brv, ACCUM=accum, num_warps=8)
    return ok, ov


def zero_rows(dk, dv, used, max_len, cu=None):
    """Zero the valid rows of each sequence, one launch per tensor."""
    varlen = cu is not None
    for t in (dk, dv):
        w = t.shape[-2] * t.shape[-1]
        bw = min(1024, triton.next_power_of_2(w))
        br = max(1, 4096 // bw)
        grid = (triton.cdiv(max_len, br) * triton.cdiv(w, bw), used.numel())
        _zero_rows_kernel[grid](t, cu if varlen else used, used, 0 if varlen else dk.shape[1], w, VARLEN=varlen,
                               BR=br, BW=bw, num_warps=8)
    return dk, dv
