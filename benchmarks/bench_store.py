"""First timing of `store` against torch's `.to()` (eager and compiled) and the copy roofline.

    python benchmarks/bench_store.py --out benchmarks/results/store_first.json

Bytes counted from the minimum traffic: the fp32 dK and dV read once, the 16-bit outputs
written once. Inputs are larger than the H200's 60 MB L2 for the main shape.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess

import torch

import flash_epilogue as fe

SHAPES = [(4, 8192, 8, 128), (8, 4096, 4, 64), (2, 8192, 8, 256), (1, 512, 8, 128)]


def bench(fn, reps=None):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default=os.environ.get("FLASH_EPILOGUE_COMMIT", "unknown"))
    args = parser.parse_args()
    dtype = torch.bfloat16
    rows = []
    big = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    big_dst = torch.empty_like(big)
    copy_ms = bench(lambda: big_dst.copy_(big))
    copy_tbps = 2 * big.numel() * 4 / copy_ms / 1e9
    del big, big_dst
    compiled = torch.compile(lambda a, b: (a.to(dtype), b.to(dtype)), dynamic=True)
    for shape in SHAPES:
        acc_k, acc_v = torch.randn(shape, device="cuda"), torch.randn(shape, device="cuda")
        dk, dv = torch.empty_like(acc_k, dtype=dtype), torch.empty_like(acc_v, dtype=dtype)
        nbytes = 2 * acc_k.numel() * (4 + 2)
        impls = {
            "flash_epilogue": lambda: torch.ops.flash_epilogue.store(acc_k, acc_v, dk, dv),
            "torch_eager": lambda: (dk.copy_(acc_k), dv.copy_(acc_v)),
            "torch_compile": lambda: compiled(acc_k, acc_v),
        }
        for impl, fn in impls.items():
            ms = bench(fn)
            rows.append({"op": "store", "shape": list(shape), "impl": impl, "ms": ms, "TBps": nbytes / ms / 1e9})
            print(f"store {shape} {impl:15s} {ms * 1e3:8.1f} us  {nbytes / ms / 1e9:5.2f} TB/s", flush=True)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "commit": args.commit,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip(),
        "copy_TBps": copy_tbps,
        "rows": rows,
    }
    print(f"copy roofline {copy_tbps:.2f} TB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
