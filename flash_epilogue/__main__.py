"""`python -m flash_epilogue`: a self-check on this machine's GPU and a small benchmark table; without an sm_90 GPU
(or without the kernels), the pure-PyTorch reference on the CPU and what the kernels need."""
import torch

import flash_epilogue as fe


def _time_ms(fn, iters=50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    print(f"flash_epilogue {fe.__version__}, torch {torch.__version__}")
    cc = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if cc != (9, 0) or not fe.kernels_available():
        why = fe.UNAVAILABLE_REASON or ("no CUDA device" if cc is None else f"device is sm_{''.join(map(str, cc))}")
        print(f"kernels need an sm_90 GPU (H100/H200) and a CUDA build; here: {why}")
        acc = torch.randn(2, 100, 4, 64)
        dk, dv = (torch.zeros(2, 100, 4, 64, dtype=torch.bfloat16) for _ in range(2))
        fe.reference.store_reference(acc, acc, dk, dv)
        ok = torch.equal(dk, acc.to(torch.bfloat16))
        print(f"reference store on CPU: {'ok' if ok else 'MISMATCH'}")
        return 0 if ok else 1
    print(f"device: {torch.cuda.get_device_name()}")
    failures = 0
    for d in fe.COMPILED_HEAD_DIMS:
        for dtype in (torch.bfloat16, torch.float16):
            acc_k, acc_v = torch.randn(2, 1000, 4, d, device="cuda"), torch.randn(2, 1000, 4, d, device="cuda")
            dk, dv = torch.empty_like(acc_k, dtype=dtype), torch.empty_like(acc_v, dtype=dtype)
            fe.store(acc_k, acc_v, dk, dv)
            ok = torch.equal(dk, acc_k.to(dtype)) and torch.equal(dv, acc_v.to(dtype))
            failures += not ok
            print(f"  store d={d:<3} {str(dtype):15s} {'ok' if ok else 'MISMATCH'}")
    print("\nbenchmark (bf16, median of 50): flash_epilogue.store vs torch .to()")
    print(f"  {'shape':22s} {'store us':>9s} {'TB/s':>6s} {'.to us':>8s} {'TB/s':>6s}")
    for shape in [(4, 8192, 8, 128), (8, 4096, 4, 64), (1, 512, 8, 128)]:
        acc_k, acc_v = torch.randn(shape, device="cuda"), torch.randn(shape, device="cuda")
        dk, dv = torch.empty_like(acc_k, dtype=torch.bfloat16), torch.empty_like(acc_v, dtype=torch.bfloat16)
        nbytes = 2 * acc_k.numel() * 6
        t_fe = _time_ms(lambda: fe.store(acc_k, acc_v, dk, dv))
        t_to = _time_ms(lambda: (dk.copy_(acc_k), dv.copy_(acc_v)))
        print(f"  {str(shape):22s} {t_fe * 1e3:9.1f} {nbytes / t_fe / 1e9:6.2f} "
              f"{t_to * 1e3:8.1f} {nbytes / t_to / 1e9:6.2f}")
    print("self-check:", "ok" if failures == 0 else f"{failures} FAILED")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
