"""Host time per call: each op's Python wrapper against torch.ops.flash_epilogue.<op> (and, for
store, torch's two `.to` calls), microseconds per call in a plain Python loop (benchmarks/common.py).

    python benchmarks/bench_host.py --json out.json [--shape 1,512,8,128] [--iters 1000]

"host" is the loop's time before the final synchronize (the CPU's cost while the GPU keeps up),
"loop" includes it (GPU-bound when the kernel takes longer than the host). wrapper - torch.ops is
what the Python layer adds to a valid call; that difference must not grow.
"""
from __future__ import annotations

import argparse

import torch

from common import OUT, host_loop, log, write_json

GROUP = 2  # query heads per KV head for the GQA ops


def host_calls(b: int, s: int, h: int, d: int) -> dict:
    """{op: {what: call}} on (b, s, h, d) CUDA tensors (GQA partials: GROUP * h heads). The op is
    looked up per call, as the wrappers do."""
    import flash_epilogue as fe
    ops = torch.ops.flash_epilogue
    ak, av, pk, pv = (torch.randn(b, s, n, d, device="cuda") for n in (h, h, GROUP * h, GROUP * h))
    dk, dv = (torch.zeros(b, s, h, d, dtype=OUT, device="cuda") for _ in range(2))
    acc = fe.gqa_accumulator(h, d, batch=b, seqlen=s, device="cuda")
    k, v, arch = acc.dk_accum, acc.dv_accum, acc.arch
    x = torch.randn(b, h, s, d, dtype=OUT, device="cuda", requires_grad=True)  # repeat_kv: (b, h_k, s, d)
    y, expanded = fe.repeat_kv(x, GROUP), x[:, :, None].expand(b, h, GROUP, s, d).reshape(b, GROUP * h, s, d)
    g = torch.randn_like(y)
    return {
        "store": {"wrapper": lambda: fe.store(ak, av, dk, dv), "torch.ops": lambda: ops.store(ak, av, dk, dv),
                  "torch .to x2": lambda: (ak.to(OUT), av.to(OUT))},
        "store_zero": {"wrapper": lambda: fe.store_zero(dk, dv), "torch.ops": lambda: ops.store_zero(dk, dv)},
        "gqa_accumulate": {"wrapper": lambda: fe.gqa_accumulate(pk, pv, acc), "torch.ops": lambda: ops.gqa_accumulate(
            pk, pv, k, v, None, deterministic=False, _arch=arch)},
        "gqa_postprocess": {"wrapper": lambda: fe.gqa_postprocess(acc, dk, dv, scale_dk=0.125),
                            "torch.ops": lambda: ops.gqa_postprocess(k, v, dk, dv, scale_dk=0.125, _arch=arch)},
        "gqa_reduce": {"wrapper": lambda: fe.gqa_reduce(pk, pv, num_heads_kv=h, out=(dk, dv)),
                       "torch.ops": lambda: ops.gqa_reduce(pk, pv, dk, dv)},
        # the backward alone (the graph kept), and transformers' expand + reshape for scale
        "repeat_kv bwd": {"wrapper": lambda: torch.autograd.grad(y, x, g, retain_graph=True),
                          "expand+reshape": lambda: torch.autograd.grad(expanded, x, g, retain_graph=True)},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1,512,8,128", help="b,s,h,d (h: KV heads; GQA partials have 2h)")
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_host: needs a CUDA device and the built extension")
    shape = tuple(int(x) for x in args.shape.split(","))
    log(f"# bench_host: {torch.cuda.get_device_name()}, (b, s, h, d) = {shape}, {args.iters} calls x {args.repeats}")
    log(f"{'op':<16} {'what':<14} {'host us/call':>13} {'loop us/call':>13}")
    rows = []
    for op, calls in host_calls(*shape).items():
        for what, fn in calls.items():
            host, loop = host_loop(fn, args.iters, args.repeats)
            rows.append({"op": op, "what": what, "host_us": host, "loop_us": loop})
            log(f"{op:<16} {what:<14} {host:>13.2f} {loop:>13.2f}")
    if args.json:
        write_json({"mode": f"GPU {torch.cuda.get_device_name()}", "shape": shape, "torch": torch.__version__,
                    "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
