"""The kernels to read with Nsight Compute: `store` beside torch's `.to` and bench_ops' plain Triton
conversion on the same tensors; gqa_postprocess / gqa_reduce fp32, which reach the streaming
ceiling through the same collective (benchmarks/NOTES.md v0.4 asks why `store` does not); and
gqa_reduce with bf16 partials beside bench_ops' Triton group sum (0.94-0.96 of it, NOTES v0.6), at
the first shape and at hdim 64 (8, 4096, 4, 8, 64); and gqa_accumulate non-deterministic beside
deterministic (1.33x its time, NOTES v0.6): whether the deterministic order costs DRAM traffic
(accumulator tiles evicted between two members' adds) or only waiting; and at the tiny shape
(1, 512, 8, 4, 128), `store` beside Triton's conversion and the deterministic accumulate: where the
1.6 us of kernel time over Triton go (NOTES v0.7, probe_small_shapes). Each op runs once to warm up, then once
between cudaProfilerStart/Stop, so `ncu --profile-from-start off` captures exactly those calls:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \\
        -o OUT/ncu_ops python3 benchmarks/ncu_ops.py        (scripts/gpu_check.sh ncu does this)

Shape (b, s, h_k, g, d) = (4, 8192, 8, 4, 128): bench_ops' first shape.
"""
import torch

import flash_epilogue as fe
from bench_ops import triton_kernels  # benchmarks/ is sys.path[0] when run as a script


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
    acc_det = fe.gqa_accumulator(hk, d, batch=b, seqlen=s, device=dev, deterministic=True)
    triton = triton_kernels()
    bk, bv = pk.bfloat16(), pv.bfloat16()
    b64, s64, hk64, g64, d64 = 8, 4096, 4, 8, 64
    qk, qv = (torch.randn(b64, s64, hk64 * g64, d64, device=dev, dtype=torch.bfloat16) for _ in range(2))
    o64k, o64v = (torch.empty(b64, s64, hk64, d64, device=dev, dtype=torch.bfloat16) for _ in range(2))
    tk, tv = (torch.randn(1, 512, 8, 128, device=dev) for _ in range(2))
    tok, tov = (torch.empty(1, 512, 8, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    tpk, tpv = (torch.randn(1, 512, 32, 128, device=dev) for _ in range(2))
    tiny_acc_det = fe.gqa_accumulator(8, 128, batch=1, seqlen=512, device=dev, deterministic=True)
    calls = {
        "store": lambda: torch.ops.flash_epilogue.store(ak, av, ok, ov),
        "torch .to (dK, dV)": lambda: (ak.to(torch.bfloat16), av.to(torch.bfloat16)),
        "triton cvt2 (dK, dV)": lambda: triton["cvt2"](ak, ok, av, ov),
        "gqa_postprocess": lambda: fe.gqa_postprocess(acc, ok, ov),
        "gqa_reduce fp32": lambda: fe.gqa_reduce(pk, pv, num_heads_kv=hk, out=(ok, ov)),
        "gqa_reduce bf16": lambda: fe.gqa_reduce(bk, bv, num_heads_kv=hk, out=(ok, ov)),
        "triton gsum2 bf16": lambda: triton["gsum2"](bk, ok, bv, ov),
        "gqa_reduce bf16 hdim 64": lambda: fe.gqa_reduce(qk, qv, num_heads_kv=hk64, out=(o64k, o64v)),
        "triton gsum2 bf16 hdim 64": lambda: triton["gsum2"](qk, o64k, qv, o64v),
        "gqa_accumulate": lambda: fe.gqa_accumulate(pk, pv, acc, deterministic=False),
        "gqa_accumulate deterministic": lambda: fe.gqa_accumulate(pk, pv, acc_det, deterministic=True),
        "store tiny": lambda: torch.ops.flash_epilogue.store(tk, tv, tok, tov),
        "triton cvt2 tiny": lambda: triton["cvt2"](tk, tok, tv, tov),
        "gqa_accumulate deterministic tiny": lambda: fe.gqa_accumulate(tpk, tpv, tiny_acc_det, deterministic=True),
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
