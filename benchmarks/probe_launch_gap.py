"""Where does a plain do_bench row's time beyond its CUDA-graph time go (NOTES v0.7: about 3-4 us on
every row of ours, 2.7 on Triton's)? Hypothesis: our kernels need up to 228 KB of shared memory per SM,
and do_bench's L2 flush before each call (a 256 MB fill, no shared memory) leaves the SMs in a
different L1/shared-memory split, so each of our launches waits for the SMs to be reconfigured;
Triton's cvt2 and torch's `.to` need none. In a backward pass the kernel before ours is an attention
kernel that uses as much shared memory as we do.

Each row times one call between two events (median of 200), after one of:
  flush:     do_bench's own flush (a 256 MB zero_),
  flush_mm:  the flush, then a 2048^3 bf16 matmul (cuBLAS's Hopper kernels use ~200 KB of shared memory),
  none:      nothing (buffers still rotate over >= 3x L2 as in bench_ops).

    python3 benchmarks/probe_launch_gap.py      (writes $OUT/launch_gap.json)
"""
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_ops as bo  # noqa: E402

import flash_epilogue  # noqa: E402,F401 (defines torch.ops.flash_epilogue)

PRE_KINDS = ("flush", "flush_mm", "none")


def event_median_us(fn, pre, iters=200) -> float:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for _ in range(10):
        pre()
        fn()
    for s, e in zip(starts, ends):
        pre()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return round(1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), 2)


def main():
    flush_buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    pres = {"flush": flush_buf.zero_, "flush_mm": lambda: (flush_buf.zero_(), a @ b), "none": lambda: None}
    wanted = ("tiny_", "b1_s8192_hk1", "b4_s8192_hk8")
    shapes = [s for s in bo.all_shapes(quick=False) if s.name.startswith(wanted)]
    rows = bo.probe_rows(
        ["store", "store_zero", "gqa_reduce", "gqa_accumulate", "gqa_accumulate_det"], shapes,
        lambda op, shape, insts: bo.per_impl(op, shape, insts, lambda fn: {k: event_median_us(fn, pres[k]) for k in PRE_KINDS}),
        skip=lambda op, shape: op.name != "store" and not shape.name.startswith("tiny_"))
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "pre": list(PRE_KINDS), "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "launch_gap.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
