"""Where one torch.autograd.grad through fe.repeat_kv spends its time: torch.profiler (CPU and CUDA)
over a few calls at dim=1 and dim=2, next to the original's (expand + reshape) graph.

    python benchmarks/profile_repeat_kv.py [--out DIR]     # needs a CUDA GPU

Prints each case's top operators by CPU and by CUDA time, and the wall time per call measured
with and without a synchronize, and writes profile_repeat_kv.json (the tables) to --out.
"""
import argparse
import importlib
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flash_epilogue as fe


def original_repeat_kv(x, n_rep, dim):
    shape = list(x.shape)
    shape.insert(dim + 1, n_rep)
    expanded = x.unsqueeze(dim + 1).expand(shape)
    out = list(x.shape)
    out[dim] *= n_rep
    return expanded.reshape(out)


def wall_us(fn, sync_each, reps=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def host_us(fn, reps=50):
    """Median host time of one call (the call returns once its work is queued), synced between calls."""
    times = []
    for _ in range(reps + 5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times = sorted(times[5:])
    return times[len(times) // 2] * 1e6


def host_layers(x, y, g, n_rep, dim):
    """Host time of each layer of repeat_kv's backward, outermost first."""
    R = importlib.import_module("flash_epilogue.repeat_kv")

    out = torch.empty_like(x)
    view = (lambda t: t.transpose(1, 2)) if dim == 1 else (lambda t: t)  # noqa: E731
    layout = R._layout_of(x)
    g_rows, out_rows = view(g).contiguous(), torch.empty_like(view(out), memory_format=torch.contiguous_format)
    # the backward op is C++ down to the launch (its autograd too): no Python layer between the op
    # and the gqa_reduce implementation to time any more; fe.gqa_reduce and the gqa_reduce op are the
    # standalone costs of the same launch
    return {
        "autograd.grad": host_us(lambda: torch.autograd.grad(y, x, g, retain_graph=True)),
        "torch.ops.repeat_kv_backward": host_us(lambda: torch.ops.flash_epilogue.repeat_kv_backward(g, n_rep, dim, layout)),
        "fe.gqa_reduce": host_us(lambda: fe.gqa_reduce(view(g), num_heads_kv=out.shape[dim], out=view(out))),
        "torch.ops.gqa_reduce": host_us(lambda: torch.ops.flash_epilogue.gqa_reduce(view(g), None, view(out), None)),
        "torch.ops.gqa_reduce, contiguous (b,s,h,d)": host_us(
            lambda: torch.ops.flash_epilogue.gqa_reduce(g_rows, None, out_rows, None)),
        "empty_like(x)": host_us(lambda: torch.empty_like(x)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    b, hk, n_rep, s, d = 4, 8, 4, 8192, 128
    result = {}
    for dim in (1, 2):
        x = torch.randn((b, hk, s, d) if dim == 1 else (b, s, hk, d), device="cuda").bfloat16().requires_grad_()
        for name, make in (("repeat_kv", lambda: fe.repeat_kv(x, n_rep, dim=dim)),
                           ("original", lambda: original_repeat_kv(x, n_rep, dim))):
            y = make()
            g = torch.randn_like(y)
            if name == "repeat_kv":
                layers = host_layers(x, y, g, n_rep, dim)
                print(f"===== dim{dim} host us per call: {layers}", flush=True)
                result[f"dim{dim}_host_us"] = layers
            fn = lambda: torch.autograd.grad(y, x, g, retain_graph=True)  # noqa: E731
            timing = {"wall_us_async": wall_us(fn, False), "wall_us_synced": wall_us(fn, True)}
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
            avg = prof.key_averages()
            cpu = avg.table(sort_by="self_cpu_time_total", row_limit=18)
            cuda = avg.table(sort_by="self_device_time_total", row_limit=8)
            key = f"dim{dim}_{name}"
            print(f"===== {key}: {timing}\n{cpu}\n{cuda}", flush=True)
            result[key] = {"timing": timing, "cpu_table": cpu, "cuda_table": cuda}
    with open(os.path.join(args.out, "profile_repeat_kv.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
