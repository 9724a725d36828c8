"""repeat_kv's backward (the deterministic group reduce) against the expand+reshape original's.

    python benchmarks/bench_repeat_kv.py --out benchmarks/results/repeat_kv.json --commit abc1234
    python benchmarks/bench_repeat_kv.py --dry-run --out /tmp/repeat_kv.json     # CPU: small shape, no triton

Shape (issue): batch 4, h_k 8 KV heads, group 4 (h_q 32), seqlen 8192, head dim 128, bf16; both
layouts: dim=1 (b, h, s, d) as transformers' Llama and dim=2 (b, s, h, d).

Rows ("name"), each the median of triton.testing.do_bench(fn, return_mode="median") (it clears L2
before each call; the gradient is 268 MB, past the H200's 60 MB L2 anyway):
* original_backward / repeat_kv_backward: torch.autograd.grad(y, x, g) through the original's graph
  (expand + reshape: its backward is a sum over the group dim) and through fe.repeat_kv's
  (torch.ops.flash_epilogue.repeat_kv_backward -> gqa_reduce); autograd engine and host time included.
* original_group_sum: the original's backward kernel alone, g.unflatten(dim, (h_k, group)).sum(dim + 1)
  (the issue measured 0.140 ms for it at dim=1).
* repeat_kv_backward_op: the backward op alone; gqa_reduce_kernel: torch.ops.flash_epilogue.gqa_reduce
  alone (no Python validation), the same strided views as repeat_kv's backward passes.
* original_forward / repeat_kv_forward: the forward copies, for completeness.
Bytes: the gradient read once, x's gradient written once (forward: x read, the output written).
Before timing, repeat_kv's gradient is checked bitwise against the sequential fp32 reference and
the original's within the fp32-ordering bound (flash_epilogue.repeat_kv docs).
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a source checkout without an install
    sys.path.insert(0, REPO)

import flash_epilogue as fe  # noqa: E402

R = importlib.import_module("flash_epilogue.repeat_kv")

MEASURED_ORIGINAL_GROUP_SUM_MS = 0.140  # the number: (4, 8, 4, 8192, 128) bf16, dim=1


def original_repeat_kv(x, n_rep, dim):
    if dim == 1:
        b, h, s, d = x.shape
        return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)
    b, s, h, d = x.shape
    return x[:, :, :, None, :].expand(b, s, h, n_rep, d).reshape(b, s, h * n_rep, d)


def bench_gpu(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def bench_cpu(fn, reps=5):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def check(x, y, y0, g, n_rep, dim):
    """repeat_kv's forward bitwise the original's; its gradient bitwise the sequential fp32 sum and
    within the derived bound of the original's."""
    assert torch.equal(y, y0), "forward differs from the original"
    (gx,) = torch.autograd.grad(y, x, g, retain_graph=True)
    (g0,) = torch.autograd.grad(y0, x, g, retain_graph=True)
    want = R.group_sum_reference(g, n_rep, dim)
    assert torch.equal(gx.view(torch.int16), want.view(torch.int16)), "backward is not the sequential fp32 sum"
    g64 = g.double().unflatten(dim, (-1, n_rep))
    exact, mag = g64.sum(dim + 1), g64.abs().sum(dim + 1)
    u = 2.0**-8 if g.dtype == torch.bfloat16 else 2.0**-11
    for name, got in (("repeat_kv", gx), ("original", g0)):
        bound = u * exact.abs() + 2 * n_rep * 2.0**-24 * mag + torch.finfo(g.dtype).smallest_normal * u
        assert ((got.double() - exact).abs() <= bound).all(), f"{name}'s gradient is off the fp64 sum"
    return float((gx.view(torch.int16) == g0.view(torch.int16)).float().mean())


def run(shape, dim, device, bench, paths):
    b, hk, n_rep, s, d = shape
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    x_shape = (b, hk, s, d) if dim == 1 else (b, s, hk, d)
    x = torch.randn(x_shape, device=device, generator=gen).to(dtype).requires_grad_()
    y, y0 = fe.repeat_kv(x, n_rep, dim=dim), original_repeat_kv(x, n_rep, dim)
    g = torch.randn(y.shape, device=device, generator=gen).to(dtype)
    bitwise_equal_fraction = check(x, y, y0, g, n_rep, dim)
    out = torch.empty_like(x)
    view = (lambda t: t.transpose(1, 2)) if dim == 1 else (lambda t: t)
    grad_bytes = (g.numel() + x.numel()) * g.element_size()
    fns = {
        "original_backward": (lambda: torch.autograd.grad(y0, x, g, retain_graph=True), grad_bytes),
        "repeat_kv_backward": (lambda: torch.autograd.grad(y, x, g, retain_graph=True), grad_bytes),
        "original_group_sum": (lambda: g.unflatten(dim, (hk, n_rep)).sum(dim + 1), grad_bytes),
        "repeat_kv_backward_op": (lambda: torch.ops.flash_epilogue.repeat_kv_backward(g, n_rep, dim, [0, 1, 2]),
                                  grad_bytes),
        "original_forward": (lambda: original_repeat_kv(x.detach(), n_rep, dim), grad_bytes),
        "repeat_kv_forward": (lambda: torch.ops.flash_epilogue.repeat_kv(x.detach(), n_rep, dim), grad_bytes),
    }
    if device == "cuda":
        fns["gqa_reduce_kernel"] = (lambda: torch.ops.flash_epilogue.gqa_reduce(view(g), None, view(out), None),
                                    grad_bytes)
    rows = []
    for name, (fn, nbytes) in fns.items():
        paths.clear()
        ms = bench(fn)
        row = {"name": name, "dim": dim, "shape": list(shape), "ms": ms, "TBps": nbytes / ms / 1e9}
        if paths:
            row["backward_path"] = sorted(set(paths))
        rows.append(row)
        print(f"dim={dim} {name:24s} {ms * 1e3:9.1f} us  {nbytes / ms / 1e9:5.2f} TB/s"
              + (f"  ({', '.join(row['backward_path'])})" if paths else ""), flush=True)
    return rows, bitwise_equal_fraction


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="write the results as JSON to this path")
    parser.add_argument("--commit", default=os.environ.get("FLASH_EPILOGUE_COMMIT", "unknown"))
    parser.add_argument("--dry-run", action="store_true", help="CPU, a small shape, no triton (checks the script)")
    args = parser.parse_args()
    if args.dry_run:
        shape, device, bench = (2, 2, 4, 64, 128), "cpu", bench_cpu
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --dry-run)")
        shape, device, bench = (4, 8, 4, 8192, 128), "cuda", bench_gpu
    rows, agree = [], {}
    with R._recording_paths() as paths:  # which backward path ran (kernel or the plain-PyTorch fallback)
        for dim in (1, 2):
            r, frac = run(shape, dim, device, bench, paths)
            rows += r
            agree[str(dim)] = frac
    by = {(r["dim"], r["name"]): r["ms"] for r in rows}
    speedup = {str(dim): {"backward": by[(dim, "original_backward")] / by[(dim, "repeat_kv_backward")],
                          "kernel": by[(dim, "original_group_sum")] / by.get((dim, "gqa_reduce_kernel"),
                                                                            by[(dim, "repeat_kv_backward_op")])}
               for dim in (1, 2)}
    for dim, sp in speedup.items():
        print(f"dim={dim}: backward speedup {sp['backward']:.2f}x, group-sum kernel speedup {sp['kernel']:.2f}x; "
              f"gradient bitwise equal to the original's on {agree[dim]:.4%} of elements")
    result = {
        "benchmark": "repeat_kv",
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "dry_run": args.dry_run,
        "date": datetime.date.today().isoformat(),
        "commit": args.commit,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "flash_epilogue": fe.__version__,
        "dtype": "bfloat16",
        "shape_b_hk_group_s_d": list(shape),
        "timing": "triton.testing.do_bench(return_mode='median')" if not args.dry_run else "perf_counter median of 5",
        "measured_original_group_sum_ms_issue": MEASURED_ORIGINAL_GROUP_SUM_MS,
        "rows": rows,
        "speedup": speedup,
        "gradient_bitwise_equal_to_original_fraction": agree,
    }
    if device == "cuda":
        result["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                          capture_output=True, text=True).stdout.strip()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
