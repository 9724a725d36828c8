#!/usr/bin/env python3
"""The workload scripts/sanitize.sh runs under compute-sanitizer: every op on small shapes over a
representative set of configurations, each result checked against the reference. Only the public
API: the wrappers (their `_arch=80` selects the sm_80 path), fe.gqa_accumulator, fe.tile_config and
flash_epilogue.reference.

    python3 scripts/sanitize_workload.py --tool memcheck [--group store|gqa|all] [--list]
    python3 scripts/sanitize_workload.py --device cpu      # dry run: every call must pass the op's checks

--tool picks the configuration set: memcheck and synccheck run the full set (every head dim
64/80/96/128/160/192/256 for store batched and varlen+seqused, store_zero, deterministic and
atomic gqa_accumulate + postprocess + to_dense, gqa_reduce, the `_arch=80` path, unchecked cu_seqlens
near the int32 limit); racecheck and
initcheck are much slower per kernel, so they run a reduced set that still covers each op, both
code paths, the swapAB configs (192, 256), varlen+seqused and deterministic mode.

Memory is laid out for the tools: of each op's two inputs, one is a view whose surrounding memory
is never initialized (torch.empty; initcheck reports a kernel reading outside it) and the other an
allocation of its own (memcheck reports a read past its end, with PYTORCH_NO_CUDA_MEMORY_CACHING=1);
outputs are canary-filled allocations of their own (memcheck reports a write past them, the
comparison any write outside the valid rows), so the checks themselves never read uninitialized
memory. Exit status 1 when a result differs from the reference; one line per
configuration on stdout (what sanitize.sh's log shows when a run times out).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flash_epilogue as fe  # noqa: E402
from flash_epilogue.reference import (  # noqa: E402
    gqa_accumulate_reference,
    gqa_reduce_reference,
    store_reference,
    store_zero_reference,
)

CANARY_BITS = 0x7FBF
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_DIMS = (64, 80, 96, 128, 160, 192, 256)
U32 = 2.0**-24
DEV = "cuda"


# ---------------------------------------------------------------------------------------------
# tensors


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def canary(shape, dtype):
    return torch.full(shape, CANARY_BITS, dtype=torch.int16, device=DEV).view(dtype)


def block_n(d, dv, arch):
    return fe.tile_config(d, dv, arch=80 if arch == 80 else 90).block_n


def values(shape, gen, dtype=torch.float32):
    x = torch.randn(shape, device=DEV, generator=gen)
    return (x * torch.exp2(torch.randint(-8, 9, shape, device=DEV, generator=gen).float())).to(dtype)


def input_view(shape, gen, dtype=torch.float32, padded=True):
    """An input of `shape`: a view into a bigger torch.empty buffer (extra rows, heads and 8
    columns on each side) whose own elements alone are initialized."""
    if not padded:
        return values(shape, gen, dtype)
    d = shape[-1]
    if len(shape) == 4:
        b, s, h, _ = shape
        buf = torch.empty((b + 1, s + 2, h + 1, d + 16), dtype=dtype, device=DEV)
        view = buf[1:, 1 : s + 1, 1:, 8 : d + 8]
    else:
        t, h, _ = shape
        buf = torch.empty((t + 3, h + 1, d + 16), dtype=dtype, device=DEV)
        view = buf[2 : t + 2, 1:, 8 : d + 8]
    return view.copy_(values(shape, gen, dtype))


def output_view(shape, dtype, transposed=False):
    """(canary-filled buffer, view): the view is the buffer, or heads-major storage transposed."""
    if not transposed:
        buf = canary(shape, dtype)
        return buf, buf
    if len(shape) == 4:
        b, s, h, d = shape
        buf = canary((b, h, s, d), dtype)
        return buf, buf.transpose(1, 2)
    t, h, d = shape
    buf = canary((h, t, d), dtype)
    return buf, buf.transpose(0, 1)


def same_view(clone, view):
    return clone.as_strided(view.shape, view.stride(), view.storage_offset())


def geometry(layout, n, seqused):
    """(leading shape, seq kwargs, gqa_accumulator kwargs): batched (2 sequences of 2n + 3 rows,
    seqused cutting both) or varlen (lengths n + 1, 0, 37, 2n - 1 and 5 slack rows; seqused cutting
    some)."""
    if layout == "batched":
        s = 2 * n + 3
        seq = {"seqused": torch.tensor([s - 4, n + 1], dtype=torch.int32, device=DEV)} if seqused else {}
        return (2, s), seq, {"batch": 2, "seqlen": s}
    lens = [n + 1, 0, 37, 2 * n - 1]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEV)
    total = sum(lens) + 5
    seq = {"cu_seqlens": cu}
    if seqused:
        seq["seqused"] = torch.tensor([n - 1, 0, 37, n + 2], dtype=torch.int32, device=DEV)
    return (total,), seq, {"cu_seqlens": cu, "total_tokens": total}


def call(fn, *args, **kwargs):
    """Run the op; in the CPU dry run, check that it stops at the device check, the last one."""
    if DEV == "cuda":
        return fn(*args, **kwargs)
    try:
        fn(*args, **kwargs)
    except ValueError as e:
        if "expected a CUDA tensor" in str(e):
            return None
        raise
    raise AssertionError("the call passed the device check on CPU")


def executed():
    return DEV == "cuda"


def expect_equal(name, got, want):
    if not torch.equal(bits(got), bits(want)):
        n = int((bits(got) != bits(want)).sum())
        raise AssertionError(f"{name}: {n} elements differ from the reference")


# ---------------------------------------------------------------------------------------------
# one run of each op


def run_store(d, dv=None, layout="batched", seqused=False, dtype="bf16", arch=0, seed=0):
    dv = d if dv is None else dv
    gen = torch.Generator(device=DEV).manual_seed(seed)
    lead, seq, _ = geometry(layout, block_n(d, dv, arch), seqused)
    h = 2
    acc_k, acc_v = input_view(lead + (h, d), gen), input_view(lead + (h, dv), gen, padded=False)
    (buf_k, dk), (buf_v, dv_out) = output_view(lead + (h, d), DT[dtype]), \
        output_view(lead + (h, dv), DT[dtype], transposed=True)
    want_k, want_v = buf_k.clone(), buf_v.clone()
    store_reference(acc_k, acc_v, same_view(want_k, dk), same_view(want_v, dv_out), **seq)
    call(fe.store, acc_k, acc_v, dk, dv_out, _arch=arch, **seq)
    if executed():
        torch.cuda.synchronize()
        expect_equal("dk", buf_k, want_k)
        expect_equal("dv", buf_v, want_v)


def run_store_zero(d, dv=None, layout="batched", seqused=False, dtype="bf16", arch=0, seed=0):
    dv = d if dv is None else dv
    gen = torch.Generator(device=DEV).manual_seed(seed)
    n = block_n(d, dv, arch)
    lead, seq, _ = geometry(layout, n, seqused)
    h = 3
    (buf_k, dk), (buf_v, dv_out) = output_view(lead + (h, d), DT[dtype]), output_view(lead + (h, dv), DT[dtype])
    dk.copy_(values(dk.shape, gen, DT[dtype]))
    dv_out.copy_(values(dv_out.shape, gen, DT[dtype]))
    nb = 2 if layout == "batched" else 4
    sel = {"batch_idx": [nb - 1, 0, nb + 3], "head_idx": torch.tensor([2, 0], dtype=torch.int32, device=DEV),
           "row_start": n - 1, "row_end": 2 * n + 1}
    want_k, want_v = buf_k.clone(), buf_v.clone()
    store_zero_reference(want_k, want_v, **sel, **seq)
    call(fe.store_zero, dk, dv_out, _arch=arch, **sel, **seq)
    if executed():
        torch.cuda.synchronize()
        expect_equal("dk", buf_k, want_k)
        expect_equal("dv", buf_v, want_v)


def run_gqa_accumulate(d, dv=None, layout="batched", seqused=False, deterministic=True, h_k=2, g=4, arch=0,
                       dtype="bf16", seed=0):
    """Two accumulate calls (the second with seqused when asked), to_dense against the reference,
    then postprocess into canary outputs."""
    dv = d if dv is None else dv
    gen = torch.Generator(device=DEV).manual_seed(seed)
    lead, seq_used, alloc = geometry(layout, block_n(d, dv, arch), seqused)
    seq = {k: v for k, v in seq_used.items() if k == "cu_seqlens"}
    acc = fe.gqa_accumulator(h_k, d, dv, deterministic=deterministic, device=DEV, arch=arch, **alloc)
    ref = [torch.zeros(lead + (h_k, w), device=DEV) for w in (d, dv)]
    ref64 = [torch.zeros(lead + (h_k, w), dtype=torch.float64, device=DEV) for w in (d, dv)]
    mag = [torch.zeros(lead + (h_k, w), dtype=torch.float64, device=DEV) for w in (d, dv)]
    for kw in (seq, seq_used):
        pk, pv = input_view(lead + (h_k * g, d), gen), input_view(lead + (h_k * g, dv), gen, padded=False)
        call(fe.gqa_accumulate, pk, pv, acc, deterministic=deterministic, **kw)
        gqa_accumulate_reference(pk, pv, *ref, num_heads_kv=h_k, **kw)
        gqa_accumulate_reference(pk, pv, *ref64, num_heads_kv=h_k, sequential=False, **kw)
        gqa_accumulate_reference(pk.abs(), pv.abs(), *mag, num_heads_kv=h_k, sequential=False, **kw)
    (buf_k, dk), (buf_v, dv_out) = output_view(lead + (h_k, d), DT[dtype]), \
        output_view(lead + (h_k, dv), DT[dtype], transposed=True)
    scales = (d**-0.5, 1.0)
    if not executed():
        call(fe.gqa_postprocess, acc, dk, dv_out, scale_dk=scales[0], scale_dv=scales[1], **seq_used)
        return
    dense = acc.to_dense(**seq)
    torch.cuda.synchronize()
    for name, got, want, want64, m in zip(("dk", "dv"), dense, ref, ref64, mag):
        if deterministic:
            expect_equal(f"{name}_accum", got, want)
        elif ((got.double() - want64).abs() > 2 * g * U32 * m).any():
            raise AssertionError(f"{name}_accum: past the fp32 reassociation bound")
    want_k, want_v = buf_k.clone(), buf_v.clone()
    scale = [torch.tensor(s, dtype=torch.float32, device=DEV) for s in scales]
    store_reference(dense[0] * scale[0], dense[1] * scale[1], same_view(want_k, dk), same_view(want_v, dv_out),
                    **seq_used)
    call(fe.gqa_postprocess, acc, dk, dv_out, scale_dk=scales[0], scale_dv=scales[1], **seq_used)
    torch.cuda.synchronize()
    expect_equal("dk", buf_k, want_k)
    expect_equal("dv", buf_v, want_v)


def run_gqa_reduce(d, dv=None, layout="batched", seqused=False, partial="fp32", dtype="bf16", h_k=2, g=4, arch=0,
                   give_out=True, seed=0):
    dv = d if dv is None else dv
    gen = torch.Generator(device=DEV).manual_seed(seed)
    lead, seq, _ = geometry(layout, block_n(d, dv, arch), seqused)
    pk = input_view(lead + (h_k * g, d), gen, DT[partial])
    pv = input_view(lead + (h_k * g, dv), gen, DT[partial], padded=False)
    kw = {"num_heads_kv": h_k, "scale_dk": 0.5, "scale_dv": 1.0, "_arch": arch, **seq}
    if give_out:
        (buf_k, dk), (buf_v, dv_out) = output_view(lead + (h_k, d), DT[dtype]), \
            output_view(lead + (h_k, dv), DT[dtype], transposed=True)
        want_k, want_v = buf_k.clone(), buf_v.clone()
        gqa_reduce_reference(pk, num_heads_kv=h_k, out=same_view(want_k, dk), scale_dk=0.5, sequential=True, **seq)
        gqa_reduce_reference(pv, num_heads_kv=h_k, out=same_view(want_v, dv_out), scale_dk=1.0, sequential=True, **seq)
        call(fe.gqa_reduce, pk, pv, out=(dk, dv_out), **kw)
        if executed():
            torch.cuda.synchronize()
            expect_equal("dk", buf_k, want_k)
            expect_equal("dv", buf_v, want_v)
        return
    # new outputs: only with every row valid (batched, no seqused), so all of it is written
    assert layout == "batched" and not seqused
    out = call(fe.gqa_reduce, pk, pv, out_dtype=DT[dtype] if partial == "fp32" else None, **kw)
    if executed():
        torch.cuda.synchronize()
        want = gqa_reduce_reference(pk, pv, num_heads_kv=h_k, out_dtype=DT[dtype], scale_dk=0.5, sequential=True)
        expect_equal("dk", out[0], want[0])
        expect_equal("dv", out[1], want[1])


def run_bad_metadata(d, arch=0, seed=0):
    """Unchecked cu_seqlens near the int32 limit (their sums pass 2^31) through every op that reads them: the
    tools see whether anything outside the tensors is read or written; what lands inside is unspecified."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    for cu in ([0, 100, 200, 2**31 - 11, 2**31 - 1], [2**31 - 1] * 3):
        seq = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32, device=DEV)}
        acc_k, acc_v = input_view((300, 2, d), gen), input_view((300, 2, d), gen, padded=False)
        (_, dk), (_, dv) = output_view((300, 2, d), torch.bfloat16), output_view((300, 2, d), torch.bfloat16, True)
        call(fe.store, acc_k, acc_v, dk, dv, _arch=arch, **seq)
        pk, pv = input_view((300, 8, d), gen), input_view((300, 8, d), gen, padded=False)
        call(fe.gqa_reduce, pk, pv, num_heads_kv=2, out=(dk, dv), _arch=arch, **seq)
        acc = fe.gqa_accumulator(2, d, deterministic=True, device=DEV, arch=arch, total_tokens=300, **seq)
        call(fe.gqa_accumulate, pk, pv, acc, deterministic=True, **seq)
        call(fe.gqa_postprocess, acc, dk, dv, **seq)
        if executed():
            acc.to_dense(**seq)
            torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# the configuration sets


def full_set():
    cfgs = []
    for i, d in enumerate(HEAD_DIMS):
        cfgs.append(("store", run_store, {"d": d, "dtype": ("bf16", "fp16")[i % 2]}))
        cfgs.append(("store", run_store, {"d": d, "layout": "varlen", "seqused": True}))
    cfgs += [
        ("store", run_store, {"d": 192, "dv": 128, "layout": "varlen", "seqused": True}),
        ("store", run_store, {"d": 64, "dv": 256, "seqused": True}),
        ("store", run_store, {"d": 128, "layout": "varlen", "seqused": True, "arch": 80}),
        ("store", run_store, {"d": 192, "arch": 80}),
        ("store_zero", run_store_zero, {"d": 128}),
        ("store_zero", run_store_zero, {"d": 64, "layout": "varlen", "seqused": True}),
        ("store_zero", run_store_zero, {"d": 192, "dv": 128, "seqused": True, "dtype": "fp16"}),
        ("store_zero", run_store_zero, {"d": 256, "layout": "varlen", "arch": 80}),
        ("gqa_reduce", run_gqa_reduce, {"d": 64}),
        ("gqa_reduce", run_gqa_reduce, {"d": 128, "layout": "varlen", "seqused": True, "partial": "bf16"}),
        ("gqa_reduce", run_gqa_reduce, {"d": 192, "dv": 128, "partial": "fp16", "dtype": "fp16", "h_k": 1, "g": 8}),
        ("gqa_reduce", run_gqa_reduce, {"d": 256, "seqused": True, "g": 3}),
        # dV launched alone on its own tile: 512 hdim-256 tiles x KV heads or more
        ("gqa_reduce", run_gqa_reduce, {"d": 256, "dv": 96, "layout": "varlen", "seqused": True, "h_k": 86, "g": 1}),
        ("gqa_reduce", run_gqa_reduce, {"d": 96, "give_out": False}),
        ("gqa_reduce", run_gqa_reduce, {"d": 128, "layout": "varlen", "seqused": True, "arch": 80}),
    ]
    for d in (64, 96, 128, 192, 256):  # atomic (bulk reduce-add) mode
        cfgs.append(("gqa_accumulate", run_gqa_accumulate,
                     {"d": d, "deterministic": False, "layout": ("batched", "varlen")[d % 3 == 0], "seqused": True}))
    cfgs.append(("gqa_accumulate", run_gqa_accumulate, {"d": 128, "deterministic": False, "arch": 80}))
    # deterministic mode last: its CTAs spin-wait on each other (a hang shows as a timeout here)
    for d in (64, 96, 128, 192, 256):
        cfgs.append(("gqa_accumulate", run_gqa_accumulate, {"d": d, "layout": ("varlen", "batched")[d % 3 == 0],
                                                            "seqused": True, "g": (4, 1, 8, 3, 2)[d % 5]}))
    cfgs += [
        ("gqa_accumulate", run_gqa_accumulate, {"d": 192, "dv": 128, "layout": "varlen", "seqused": True, "h_k": 1,
                                                "g": 16}),
        ("gqa_accumulate", run_gqa_accumulate, {"d": 128, "layout": "varlen", "seqused": True, "arch": 80}),
        ("gqa_accumulate", run_gqa_accumulate, {"d": 256, "arch": 80, "g": 6, "h_k": 1}),
        ("gqa_accumulate", run_gqa_accumulate, {"d": 256, "dv": 96, "layout": "varlen", "seqused": True, "h_k": 80,
                                                "g": 1}),  # dV's accumulator on its own tile
    ]
    cfgs += [("bad_metadata", run_bad_metadata, {"d": d, "arch": arch}) for d in (64, 128) for arch in (0, 80)]
    return cfgs


def reduced_set():
    return [
        ("store", run_store, {"d": 64}),
        ("store", run_store, {"d": 192}),
        ("store", run_store, {"d": 256, "layout": "varlen"}),
        ("store", run_store, {"d": 128, "layout": "varlen", "seqused": True}),
        ("store", run_store, {"d": 128, "layout": "varlen", "seqused": True, "arch": 80}),
        ("store_zero", run_store_zero, {"d": 128, "seqused": True}),
        ("store_zero", run_store_zero, {"d": 192, "layout": "varlen", "arch": 80}),
        ("gqa_reduce", run_gqa_reduce, {"d": 192, "layout": "varlen", "seqused": True}),
        ("gqa_reduce", run_gqa_reduce, {"d": 128, "partial": "bf16", "arch": 80}),
        ("gqa_accumulate", run_gqa_accumulate, {"d": 64, "deterministic": False}),
        ("gqa_accumulate", run_gqa_accumulate, {"d": 128, "layout": "varlen", "seqused": True}),
        ("gqa_accumulate", run_gqa_accumulate, {"d": 256, "g": 2}),
        ("gqa_accumulate", run_gqa_accumulate, {"d": 128, "layout": "varlen", "seqused": True, "arch": 80}),
        ("bad_metadata", run_bad_metadata, {"d": 128}),
    ]


SETS = {"memcheck": full_set, "synccheck": full_set, "racecheck": reduced_set, "initcheck": reduced_set}
GROUPS = {"all": None, "store": ("store", "store_zero", "bad_metadata"), "gqa": ("gqa_accumulate", "gqa_reduce")}


def describe(op, kw):
    return op + " " + " ".join(f"{k}={v}" for k, v in kw.items())


def main(argv=None) -> int:
    global DEV
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tool", choices=sorted(SETS), default="memcheck", help="which configuration set")
    ap.add_argument("--group", choices=sorted(GROUPS), default="all", help="which ops")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: dry run (needs the built extension), every call must pass the op's checks "
                         "up to the device check")
    ap.add_argument("--list", action="store_true", help="print the configurations and exit")
    args = ap.parse_args(argv)
    DEV = args.device
    ops = GROUPS[args.group]
    cfgs = [(op, fn, kw) for op, fn, kw in SETS[args.tool]() if ops is None or op in ops]
    if args.list:
        for op, _, kw in cfgs:
            print(describe(op, kw))
        return 0
    failed = 0
    start = time.time()
    for i, (op, fn, kw) in enumerate(cfgs):
        t0 = time.time()
        tag = f"[{i + 1}/{len(cfgs)}]"
        print(f"{tag} {describe(op, kw)}", flush=True)
        try:
            fn(seed=i, **kw)
        except Exception:  # noqa: BLE001 (reported, the run goes on)
            failed += 1
            print(f"{tag} FAILED", flush=True)
            traceback.print_exc()
            if DEV == "cuda":
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001 (a sticky device error: nothing after it can run)
                    print("the device is in an error state: stopping", flush=True)
                    break
            continue
        print(f"{tag} ok ({time.time() - t0:.2f} s)", flush=True)
    print(f"workload: {len(cfgs) - failed} of {len(cfgs)} configurations match the reference "
          f"({args.tool} set, group {args.group}, {time.time() - start:.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
