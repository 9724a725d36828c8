"""Are bench_ops' small-shape rows GPU time or host time? For the tiny (1, 512, 8, 4, 128) and the
(1, 8192, 1, 8, 128) shapes, every op against torch eager and Triton, timed three ways:
  plain:  do_bench's median, as bench_ops measures (a launch per call from Python; when the host
          issues calls slower than the GPU runs them, this is the host's rate),
  graph:  do_bench_cudagraph's median: the same calls replayed from a CUDA graph (GPU time alone),
  issue:  the host's time per call, 2000 calls issued back to back without waiting (then one sync).
Buffers rotate over >= 3x L2 as in bench_ops (each call of the graph takes the next copy).

    python3 benchmarks/probe_small_shapes.py      (writes $OUT/small_shapes.json)
"""
import json
import os
import sys
import time

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_ops as bo  # noqa: E402

import flash_epilogue  # noqa: E402,F401 (defines torch.ops.flash_epilogue)


def issue_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    shapes = [s for s in bo.all_shapes(quick=False) if s.name.startswith(("tiny_", "b1_s8192_hk1"))]

    def timings(fn):
        plain = do_bench(fn, warmup=25, rep=100, return_mode="median")
        graph = do_bench_cudagraph(fn, rep=100, return_mode="median")
        return {"plain_us": round(plain * 1e3, 2), "graph_us": round(graph * 1e3, 2), "issue_us": round(issue_us(fn), 2)}

    rows = bo.probe_rows(list(bo.OPS), shapes, lambda op, shape, insts: bo.per_impl(op, shape, insts, timings))
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "small_shapes.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
