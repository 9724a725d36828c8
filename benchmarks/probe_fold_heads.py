"""Do our stores lose their last 5% to DRAM locality? A (b, s, h, d) tensor's per-head tile (BLK_N rows
of one head) is BLK_N segments of d elements, h*d apart; `.to` and Triton's cvt2 stream the tensor as
one flat range. `store` is elementwise and gqa_reduce sums the g consecutive Q heads of each
(token, KV head) row, so both give the same bits on the folded views (b, s*h, 1, d) (store; varlen (total*h, 1, d) with cu_seqlens*h) and
(b, s*h_k, g, d) -> (b, s*h_k, 1, d) (gqa_reduce), whose tiles are contiguous ranges. Timed like
bench_ops (do_bench median, buffers rotating over >= 3x L2), folded and unfolded, against Triton.

    python3 benchmarks/probe_fold_heads.py      (writes $OUT/fold_heads.json)
"""
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_ops as bo  # noqa: E402

import flash_epilogue  # noqa: E402,F401 (defines torch.ops.flash_epilogue)


def fold(x, heads):
    """(..., rows, h, d) -> (..., rows * heads, h // heads, d); varlen tensors have no batch dim."""
    *lead, rows, h, d = x.shape
    return x.view(*lead, rows * heads, h // heads, d)


def folded_store(t):
    ak, av, dk, dv, cu = t["ak"], t["av"], t["dk"], t["dv"], t["cu"]
    h = ak.shape[-2]
    fak, fav, fdk, fdv = (fold(x, h) for x in (ak, av, dk, dv))
    fcu = None if cu is None else cu * h
    op = torch.ops.flash_epilogue.store
    return lambda: (op(fak, fav, fdk, fdv, cu_seqlens=fcu, seqused=None), dk, dv)[1:]


def folded_reduce(t, hk):
    pk, pv, ok, ov, cu = t["pk"], t["pv"], t["ok"], t["ov"], t["cu"]
    fpk, fpv, fok, fov = (fold(x, hk) for x in (pk, pv, ok, ov))
    fcu = None if cu is None else cu * hk
    op = torch.ops.flash_epilogue.gqa_reduce
    return lambda: (op(fpk, fpv, fok, fov, cu_seqlens=fcu, seqused=None, scale_dk=1.0, scale_dv=1.0), ok, ov)[1:]


def measure(op, shape, insts):
    fold = folded_store if op.name.startswith("store") else (lambda t: folded_reduce(t, shape.hk))
    row = {}
    try:
        base = [x.clone() for x in op.make("flash_epilogue", shape, insts[0])()]
        folded = fold(insts[0])()
        row["folded_bitwise_equal"] = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                                          for a, b in zip(base, folded))
        fns = {"fe": bo.rotating([op.make("flash_epilogue", shape, t) for t in insts]),
               "fe_folded": bo.rotating([fold(t) for t in insts]),
               "triton": bo.rotating([op.make("triton", shape, t) for t in insts])}
        for _ in range(2):  # interleaved, twice: drift shows as disagreement
            for k, fn in fns.items():
                fn()
                torch.cuda.synchronize()
                row.setdefault(k, []).append(round(1e3 * do_bench(fn, warmup=25, rep=100, return_mode="median"), 2))
        row["fe/triton"] = round(min(row["triton"]) / min(row["fe"]), 3)
        row["fe_folded/triton"] = round(min(row["triton"]) / min(row["fe_folded"]), 3)
    except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]
    return row


def main():
    rows = bo.probe_rows(["store", "store_varlen", "gqa_reduce"], bo.all_shapes(quick=False), measure,
                         skip=lambda op, s: op.name == "store_varlen" and s.packed and not s.name.startswith("packed_b4_"))
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "fold_heads.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
