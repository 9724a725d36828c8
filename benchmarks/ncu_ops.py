"""The kernels to read with Nsight Compute: `store` beside torch's `.to` on the same tensors, and
gqa_postprocess / gqa_reduce, which reach the streaming ceiling through the same collective
(benchmarks/NOTES.md v0.4 asks why `store` does not). Each op runs once to warm up, then once
between cudaProfilerStart/Stop, so `ncu --profile-from-start off` captures exactly those calls:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \\
        -o OUT/ncu_ops python3 benchmarks/ncu_ops.py        (scripts/gpu_check.sh ncu does this)

Shape (b, s, h_k, g, d) = (4, 8192, 8, 4, 128): bench_ops' first shape.
"""
import torch

import flash_epilogue as fe


def main():
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    b, s, hk, g, d = 4, 8192, 8, 4, 128
    dev = "cuda"
    ak, av = torch.randn(b, s, hk, d, device=dev), torch.randn(b, s, hk, d, device=dev)
    ok, ov = torch.empty_like(ak, dtype=torch.bfloat16), torch.empty_like(av, dtype=torch.bfloat16)
    pk, pv = torch.randn(b, s, hk * g, d, device=dev), torch.randn(b, s, hk * g, d, device=dev)
    acc = fe.gqa_accumulator(hk, d, batch=b, seqlen=s, device=dev)
    fe.gqa_accumulate(pk, pv, acc)
    calls = {
        "store": lambda: torch.ops.flash_epilogue.store(ak, av, ok, ov),
        "torch .to (dK, dV)": lambda: (ak.to(torch.bfloat16), av.to(torch.bfloat16)),
        "gqa_postprocess": lambda: fe.gqa_postprocess(acc, ok, ov),
        "gqa_reduce fp32": lambda: fe.gqa_reduce(pk, pv, num_heads_kv=hk, out=(ok, ov)),
    }
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn in calls.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(calls))


if __name__ == "__main__":
    main()
