"""Is bench_ops' hdim-192 row (store and gqa_reduce at 0.92 of Triton, (2, 8192, 16, 1, 192) with
dv = 128) slow because of the hdim-192 tile config itself, or because dV's 128 columns go through
that config (a dK/dV pair is launched at the compiled head dim serving max(d, dv): dV's tiles are
96 x 192 boxes of which a third lies past its last column)? Hypothesis: the mixed pair. Each row is
the same tokens and heads with (d, dv) = (192, 128), (192, 192), (128, 128) and (128, 192): if the
(192, 192) and (128, 128) pairs each sit near 0.95 while the mixed ones sit at 0.92, dV wants its
own launch at its own head dim.

    python3 benchmarks/probe_head_dims.py      (writes $OUT/head_dims.json)
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_ops as bo  # noqa: E402

import flash_epilogue  # noqa: E402,F401 (defines torch.ops.flash_epilogue)

PAIRS = ((192, 128), (192, 192), (128, 128), (128, 192), (256, 128))


def main():
    shapes = [bo._batched(2, 8192, 16, 1, d, dv) for d, dv in PAIRS]

    def measure(op, shape, insts):
        out = bo.per_impl(op, shape, insts, lambda fn: bo.do_bench_median(fn, 25, 100), impls=("flash_epilogue", "triton"))
        fe, tr = out.get("flash_epilogue"), out.get("triton")
        if isinstance(fe, float) and isinstance(tr, float):
            out["fe/triton"] = round(tr / fe, 3)
        return out

    rows = bo.probe_rows(["store", "gqa_reduce"], shapes, measure)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "unit": "ms", "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "head_dims.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
