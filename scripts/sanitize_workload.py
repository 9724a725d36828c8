#!/usr/bin/env python3
"""The workload scripts/sanitize.sh runs under compute-sanitizer: every op on small shapes over a
representative set of configurations, each result checked against the reference. Only the package's
API: the wrappers (the sm_80 path through their private twins' `_arch=80`), fe.gqa_accumulator,
fe.tile_config, flash_epilogue.reference and flash_epilogue.testing (buffers, problems, the bitwise
comparison).

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
outputs are views of canary-filled allocations of their own (memcheck reports a write past them,
the comparison of the whole allocation any other write outside the valid rows), so the checks
themselves never read uninitialized memory. Exit status 1 when a result differs from the reference; one line per
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
from flash_epilogue.ops import _gqa_reduce, _store, _store_zero  # noqa: E402
from flash_epilogue.reference import (  # noqa: E402
    gqa_accumulate_reference,
    gqa_reduce_reference,
    store_reference,
    store_zero_reference,
)
from flash_epilogue.testing import (  # noqa: E402
    assert_bits,
    block_n,
    call_op,
    carve,
    generator,
    input_view,
    int32,
    problem,
    rand,
    same_view,
)

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_DIMS = (64, 80, 96, 128, 160, 192, 256)
U32 = 2.0**-24
DEV = "cuda"


# ---------------------------------------------------------------------------------------------
# tensors (flash_epilogue.testing) and geometries


def padded(shape, gen, dtype=torch.float32):
    """An input: a view into a bigger torch.empty buffer whose own elements alone are initialized (slack rows, heads
    and head-dim columns around it). The other input of each op is an allocation of its own (rand)."""
    return input_view(shape, "padded", gen, dtype, fill="empty")


def output(shape, dtype, layout="plain"):
    """(canary-filled buffer, view): the view is the buffer ("plain"), or heads-major storage seen as `shape`."""
    return carve(shape, DT[dtype], layout, DEV)


def geometry(layout, n, seqused):
    """The Problem: batched (2 sequences of 2n + 3 rows, seqused cutting both) or varlen (lengths n + 1, 0, 37, 2n - 1
    and 5 slack rows; seqused cutting some)."""
    if layout == "batched":
        s = 2 * n + 3
        return problem(2, s, seqused=[s - 4, n + 1] if seqused else None, device=DEV)
    return problem(lens=[n + 1, 0, 37, 2 * n - 1], slack=5, seqused=[n - 1, 0, 37, n + 2] if seqused else None,
                   device=DEV)


def executed():
    return DEV == "cuda"


def expect_equal(*checks):
    """After the device finished: each (name, buffer, expected copy) bitwise equal."""
    torch.cuda.synchronize()
    for name, got, want in checks:
        assert_bits(got, want, name)


# ---------------------------------------------------------------------------------------------
# one run of each op


def run_store(d, dv=None, layout="batched", seqused=False, dtype="bf16", arch=0, seed=0):
    dv = d if dv is None else dv
    gen = generator(seed, DEV)
    p = geometry(layout, block_n(d, dv, arch), seqused)
    h = 2
    acc_k, acc_v = padded(p.lead + (h, d), gen), rand(p.lead + (h, dv), gen)
    (buf_k, dk), (buf_v, dv_out) = output(p.lead + (h, d), dtype), output(p.lead + (h, dv), dtype, "transposed")
    want_k, want_v = buf_k.clone(), buf_v.clone()
    store_reference(acc_k, acc_v, same_view(want_k, dk), same_view(want_v, dv_out), **p.seq_used)
    call_op(DEV, _store, acc_k, acc_v, dk, dv_out, _arch=arch, **p.seq_used)
    if executed():
        expect_equal(("dk", buf_k, want_k), ("dv", buf_v, want_v))


def run_store_zero(d, dv=None, layout="batched", seqused=False, dtype="bf16", arch=0, seed=0):
    dv = d if dv is None else dv
    gen = generator(seed, DEV)
    n = block_n(d, dv, arch)
    p = geometry(layout, n, seqused)
    h = 3
    (buf_k, dk), (buf_v, dv_out) = output(p.lead + (h, d), dtype), output(p.lead + (h, dv), dtype)
    dk.copy_(rand(dk.shape, gen, DT[dtype]))
    dv_out.copy_(rand(dv_out.shape, gen, DT[dtype]))
    sel = {"batch_idx": [p.batch - 1, 0, p.batch + 3], "head_idx": int32(2, 0, device=DEV), "row_start": n - 1,
           "row_end": 2 * n + 1}
    want_k, want_v = buf_k.clone(), buf_v.clone()
    store_zero_reference(want_k, want_v, **sel, **p.seq_used)
    call_op(DEV, _store_zero, dk, dv_out, _arch=arch, **sel, **p.seq_used)
    if executed():
        expect_equal(("dk", buf_k, want_k), ("dv", buf_v, want_v))


def run_gqa_accumulate(d, dv=None, layout="batched", seqused=False, deterministic=True, h_k=2, g=4, arch=0,
                       dtype="bf16", seed=0):
    """Two accumulate calls (the second with seqused when asked), to_dense against the reference,
    then postprocess into canary outputs."""
    dv = d if dv is None else dv
    gen = generator(seed, DEV)
    p = geometry(layout, block_n(d, dv, arch), seqused)
    acc = fe.gqa_accumulator(h_k, d, dv, deterministic=deterministic, device=DEV, arch=arch, **p.alloc)
    ref = [torch.zeros(p.lead + (h_k, w), device=DEV) for w in (d, dv)]
    ref64 = [torch.zeros(p.lead + (h_k, w), dtype=torch.float64, device=DEV) for w in (d, dv)]
    mag = [torch.zeros(p.lead + (h_k, w), dtype=torch.float64, device=DEV) for w in (d, dv)]
    for kw in (p.seq, p.seq_used):
        pk, pv = padded(p.lead + (h_k * g, d), gen), rand(p.lead + (h_k * g, dv), gen)
        call_op(DEV, fe.gqa_accumulate, pk, pv, acc, deterministic=deterministic, **kw)
        gqa_accumulate_reference(pk, pv, *ref, num_heads_kv=h_k, **kw)
        gqa_accumulate_reference(pk, pv, *ref64, num_heads_kv=h_k, sequential=False, **kw)
        gqa_accumulate_reference(pk.abs(), pv.abs(), *mag, num_heads_kv=h_k, sequential=False, **kw)
    (buf_k, dk), (buf_v, dv_out) = output(p.lead + (h_k, d), dtype), output(p.lead + (h_k, dv), dtype, "transposed")
    scales = (d**-0.5, 1.0)
    if not executed():
        call_op(DEV, fe.gqa_postprocess, acc, dk, dv_out, scale_dk=scales[0], scale_dv=scales[1], **p.seq_used)
        return
    dense = acc.to_dense(**p.seq)
    torch.cuda.synchronize()
    for name, got, want, want64, m in zip(("dk", "dv"), dense, ref, ref64, mag):
        if deterministic:
            expect_equal((f"{name}_accum", got, want))
        elif ((got.double() - want64).abs() > 2 * g * U32 * m).any():
            raise AssertionError(f"{name}_accum: past the fp32 reassociation bound")
    want_k, want_v = buf_k.clone(), buf_v.clone()
    scale = [torch.tensor(s, dtype=torch.float32, device=DEV) for s in scales]
    store_reference(dense[0] * scale[0], dense[1] * scale[1], same_view(want_k, dk), same_view(want_v, dv_out),
                    **p.seq_used)
    call_op(DEV, fe.gqa_postprocess, acc, dk, dv_out, scale_dk=scales[0], scale_dv=scales[1], **p.seq_used)
    expect_equal(("dk", buf_k, want_k), ("dv", buf_v, want_v))


def run_gqa_reduce(d, dv=None, layout="batched", seqused=False, partial="fp32", dtype="bf16", h_k=2, g=4, arch=0,
                   give_out=True, seed=0):
    dv = d if dv is None else dv
    gen = generator(seed, DEV)
    p = geometry(layout, block_n(d, dv, arch), seqused)
    pk, pv = padded(p.lead + (h_k * g, d), gen, DT[partial]), rand(p.lead + (h_k * g, dv), gen, DT[partial])
    kw = {"num_heads_kv": h_k, "scale_dk": 0.5, "scale_dv": 1.0, "_arch": arch, **p.seq_used}
    if give_out:
        (buf_k, dk), (buf_v, dv_out) = output(p.lead + (h_k, d), dtype), output(p.lead + (h_k, dv), dtype, "transposed")
        want_k, want_v = buf_k.clone(), buf_v.clone()
        for part, buf, view, scale in ((pk, want_k, dk, 0.5), (pv, want_v, dv_out, 1.0)):
            gqa_reduce_reference(part, num_heads_kv=h_k, out=same_view(buf, view), scale_dk=scale, sequential=True,
                                 **p.seq_used)
        call_op(DEV, _gqa_reduce, pk, pv, out=(dk, dv_out), **kw)
        if executed():
            expect_equal(("dk", buf_k, want_k), ("dv", buf_v, want_v))
        return
    # new outputs: only with every row valid (batched, no seqused), so all of it is written
    assert layout == "batched" and not seqused
    out = call_op(DEV, _gqa_reduce, pk, pv, out_dtype=DT[dtype] if partial == "fp32" else None, **kw)
    if executed():
        want = gqa_reduce_reference(pk, pv, num_heads_kv=h_k, out_dtype=DT[dtype], scale_dk=0.5, sequential=True)
        expect_equal(("dk", out[0], want[0]), ("dv", out[1], want[1]))


def run_bad_metadata(d, arch=0, seed=0):
    """Unchecked cu_seqlens near the int32 limit (their sums pass 2^31) through every op that reads them: the
    tools see whether anything outside the tensors is read or written; what lands inside is unspecified."""
    gen = generator(seed, DEV)
    for cu in ([0, 100, 200, 2**31 - 11, 2**31 - 1], [2**31 - 1] * 3):
        seq = {"cu_seqlens": int32(*cu, device=DEV)}
        acc_k, acc_v = padded((300, 2, d), gen), rand((300, 2, d), gen)
        (_, dk), (_, dv) = output((300, 2, d), "bf16"), output((300, 2, d), "bf16", "transposed")
        call_op(DEV, _store, acc_k, acc_v, dk, dv, _arch=arch, **seq)
        pk, pv = padded((300, 8, d), gen), rand((300, 8, d), gen)
        call_op(DEV, _gqa_reduce, pk, pv, num_heads_kv=2, out=(dk, dv), _arch=arch, **seq)
        acc = fe.gqa_accumulator(2, d, deterministic=True, device=DEV, arch=arch, total_tokens=300, **seq)
        call_op(DEV, fe.gqa_accumulate, pk, pv, acc, deterministic=True, **seq)
        call_op(DEV, fe.gqa_postprocess, acc, dk, dv, **seq)
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
        # dV launched alone on its own tile: 7 hdim-256 row tiles x 165 KV heads, past the plan's gqa_reduce gate
        ("gqa_reduce", run_gqa_reduce, {"d": 256, "dv": 96, "layout": "varlen", "seqused": True, "h_k": 165, "g": 1}),
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
                                                "g": 1}),  # dV's accumulator on its own tile (7 x 80 tiles)
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
    # the sm_80 path's configurations where the build has that path (the GPU check builds it)
    sm80 = fe._extension.sm80_path_callable()
    cfgs = [(op, fn, kw) for op, fn, kw in SETS[args.tool]()
            if (ops is None or op in ops) and (sm80 or kw.get("arch", 0) != 80)]
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
