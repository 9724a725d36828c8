"""Host time of the Python wrappers: µs per call in a plain Python loop, wrapper against the op.

    python benchmarks/bench_host.py                 # GPU if there is an sm_90 one, else the CPU mode
    python benchmarks/bench_host.py --shape 1,512,8,128 --iters 2000 --json out.json

GPU mode (an sm_90 GPU and the built kernels): for each op, the wrapper (flash_epilogue.<op>),
torch.ops.flash_epilogue.<op> directly, the Python validation alone (validation.validate_<op>, no
launch) and, for store, torch's two `.to` calls (the baseline). Two numbers per row: "host" is the
loop's time before the final synchronize (what the CPU spends per call while the GPU keeps up),
"loop" includes the synchronize (GPU-bound when the kernel takes longer than the host).

CPU mode (no GPU; the numbers are this machine's, not the H200 host's): the ops cannot run, so
the op is replaced by a no-op Python stand-in and the device hooks of the validation accept CPU
tensors. Per op: the wrapper on its fast path (op first; validation only if it raises), the
wrapper forced onto the validate-first path (what every call cost before), the stand-in alone
(so wrapper - stand-in = the wrapper's own overhead), the Python validation alone, and
torch.ops.flash_epilogue.<op> on meta tensors (dispatcher + fake kernel, for scale).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flash_epilogue as fe  # noqa: E402
import flash_epilogue.validation as V  # noqa: E402
from flash_epilogue import ops as fe_ops  # noqa: E402

OPS = ("store", "store_zero", "gqa_accumulate", "gqa_postprocess", "gqa_reduce")
GROUP = 2  # query heads per KV head for the GQA ops


def _problem(op: str, b: int, s: int, h: int, d: int, device: str, dtype=torch.bfloat16):
    """(wrapper call, op call, validation call) closures for one op at (b, s, h, d)."""
    f32 = dict(dtype=torch.float32, device=device)
    half = dict(dtype=dtype, device=device)
    dk, dv = torch.zeros(b, s, h, d, **half), torch.zeros(b, s, h, d, **half)
    ops = lambda: getattr(torch.ops.flash_epilogue, op)  # noqa: E731 (looked up per call, as the wrappers do)
    if op == "store":
        ak, av = torch.zeros(b, s, h, d, **f32), torch.zeros(b, s, h, d, **f32)
        return (lambda: fe.store(ak, av, dk, dv), lambda: ops()(ak, av, dk, dv),
                lambda: V.validate_store(ak, av, dk, dv))
    if op == "store_zero":
        return (lambda: fe.store_zero(dk, dv), lambda: ops()(dk, dv), lambda: V.validate_store_zero(dk, dv))
    pk, pv = torch.zeros(b, s, GROUP * h, d, **f32), torch.zeros(b, s, GROUP * h, d, **f32)
    acc = fe.gqa_accumulator(h, d, batch=b, seqlen=s, device=device, deterministic=False)
    if op == "gqa_accumulate":
        return (lambda: fe.gqa_accumulate(pk, pv, acc, deterministic=False),
                lambda: ops()(pk, pv, acc.dk_accum, acc.dv_accum, None, deterministic=False, _arch=acc.arch),
                lambda: V.validate_gqa_accumulate(pk, pv, acc.dk_accum, acc.dv_accum, None, _arch=acc.arch))
    if op == "gqa_postprocess":
        return (lambda: fe.gqa_postprocess(acc, dk, dv, scale_dk=0.125),
                lambda: ops()(acc.dk_accum, acc.dv_accum, dk, dv, scale_dk=0.125, _arch=acc.arch),
                lambda: V.validate_gqa_postprocess(acc.dk_accum, acc.dv_accum, dk, dv, scale_dk=0.125,
                                                   _arch=acc.arch))
    if op == "gqa_reduce":
        return (lambda: fe.gqa_reduce(pk, pv, num_heads_kv=h, out=(dk, dv)), lambda: ops()(pk, pv, dk, dv),
                lambda: V.validate_gqa_reduce(pk, pv, dk, dv))
    raise ValueError(op)


def _time(fn, iters: int, repeats: int, sync) -> tuple[float, float]:
    """(host, loop) µs per call, medians over `repeats` loops of `iters` calls."""
    for _ in range(min(iters, 50)):
        fn()
    sync()
    host, loop = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        host.append((t1 - t0) / iters * 1e6)
        loop.append((t2 - t0) / iters * 1e6)
    return statistics.median(host), statistics.median(loop)


def run_gpu(shape, iters, repeats) -> list[dict]:
    b, s, h, d = shape
    sync = torch.cuda.synchronize
    rows = []
    for op in OPS:
        wrapper, direct, validate = _problem(op, b, s, h, d, "cuda")
        for what, fn in (("wrapper", wrapper), ("torch.ops", direct), ("validation only", validate)):
            host, loop = _time(fn, iters, repeats, sync)
            rows.append({"op": op, "what": what, "host_us": host, "loop_us": loop})
        if op == "store":
            ak, av = torch.zeros(b, s, h, d, device="cuda"), torch.zeros(b, s, h, d, device="cuda")
            host, loop = _time(lambda: (ak.to(torch.bfloat16), av.to(torch.bfloat16)), iters, repeats, sync)
            rows.append({"op": op, "what": "torch .to x2", "host_us": host, "loop_us": loop})
    return rows


def run_cpu(shape, iters, repeats) -> list[dict]:
    b, s, h, d = shape
    V._is_cuda_device = lambda device: True  # the validation accepts CPU tensors
    V._device_capability = lambda device: (9, 0)
    V._compiled_archs = lambda: ("sm_90a",)
    real_ops = {op: getattr(torch.ops.flash_epilogue, op) for op in OPS}

    def stub(*args, **kwargs):
        return None

    def fast(t, check_inputs):  # _op_checks_first with is_cpu for is_cuda (the same cost)
        if check_inputs is None:
            check_inputs = fe_ops._CHECK_INPUTS
        return not check_inputs and not torch.compiler.is_compiling() and type(t) is torch.Tensor and t.is_cpu

    real_first = fe_ops._op_checks_first
    rows = []
    nosync = lambda: None  # noqa: E731
    try:
        for op in OPS:
            setattr(torch.ops.flash_epilogue, op, stub)
            wrapper, direct, validate = _problem(op, b, s, h, d, "cpu")
            fe_ops._op_checks_first = fast
            rows.append({"op": op, "what": "wrapper, fast path", "host_us": _time(wrapper, iters, repeats, nosync)[0]})
            fe_ops._op_checks_first = lambda t, check_inputs: False
            rows.append({"op": op, "what": "wrapper, validate first", "host_us": _time(wrapper, iters, repeats,
                                                                                         nosync)[0]})
            fe_ops._op_checks_first = real_first
            rows.append({"op": op, "what": "stand-in op alone", "host_us": _time(direct, iters, repeats, nosync)[0]})
            rows.append({"op": op, "what": "validation only", "host_us": _time(validate, iters, repeats, nosync)[0]})
            setattr(torch.ops.flash_epilogue, op, real_ops[op])
            _, meta_direct, _ = _problem(op, b, s, h, d, "meta")
            rows.append({"op": op, "what": "torch.ops on meta (fake kernel)",
                         "host_us": _time(meta_direct, iters, repeats, nosync)[0]})
    finally:
        fe_ops._op_checks_first = real_first
        for op, fn in real_ops.items():
            setattr(torch.ops.flash_epilogue, op, fn)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="1,512,8,128", help="b,s,h,d (h: KV heads; GQA partials have 2h)")
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="the CPU mode even with a GPU")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    gpu = (not args.cpu and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
           and fe.kernels_available())
    rows = run_gpu(shape, args.iters, args.repeats) if gpu else run_cpu(shape, args.iters, args.repeats)
    mode = f"GPU {torch.cuda.get_device_name()}" if gpu else "CPU (stand-in ops; this machine's host)"
    print(f"# bench_host: {mode}, shape (b, s, h, d) = {shape}, {args.iters} calls x {args.repeats}, median")
    print(f"{'op':<16} {'what':<34} {'host us/call':>13}" + (f" {'loop us/call':>13}" if gpu else ""))
    for r in rows:
        print(f"{r['op']:<16} {r['what']:<34} {r['host_us']:>13.2f}" + (f" {r['loop_us']:>13.2f}" if gpu else ""))
    if not gpu:
        print("# wrapper overhead on the fast path = 'wrapper, fast path' - 'stand-in op alone'")
    if args.json:
        Path(args.json).write_text(json.dumps({"mode": mode, "shape": shape, "torch": torch.__version__,
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
