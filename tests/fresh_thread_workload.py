"""Every op called from host threads that have made no CUDA call (no current CUDA context), then
repeat_kv's backward through the autograd engine's device thread: run by
tests/test_big_concurrent.py::test_every_op_from_a_fresh_thread in a process of its own, because
the failure this guards against was a segfault (cuTensorMapEncodeTiled failed without a context,
and CUTLASS's error path crashed). Prints "OK" after checking every result bitwise."""
import threading

import torch

import flash_epilogue as fe
from flash_epilogue.reference import gqa_reduce_sequential_fp32

DEV, BF16 = "cuda", torch.bfloat16


def in_fresh_thread(fn):
    """Run fn in a new thread (everything it touches is allocated by the caller); re-raise."""
    errors = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller)
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def canary(shape):
    return torch.full(shape, float("nan"), device=DEV, dtype=BF16)


def bits_equal(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def main():
    gen = torch.Generator(device=DEV).manual_seed(7)
    b, s, h, g, d = 2, 300, 4, 2, 128
    a = torch.randn((b, s, h, d), device=DEV, generator=gen)
    p32 = torch.randn((b, s, h * g, d), device=DEV, generator=gen)
    p16 = p32.to(BF16)
    outs = {k: canary((b, s, h, d)) for k in ("dk", "dv", "z0", "z1", "r32", "r16", "pk", "pv")}
    acc = fe.gqa_accumulator(h, d, batch=b, seqlen=s, deterministic=True, device=DEV)
    torch.cuda.synchronize()

    in_fresh_thread(lambda: fe.store(a, a, outs["dk"], outs["dv"]))
    in_fresh_thread(lambda: fe.store_zero(outs["z0"], outs["z1"]))
    in_fresh_thread(lambda: fe.gqa_reduce(p32, num_heads_kv=h, out=outs["r32"]))
    in_fresh_thread(lambda: fe.gqa_reduce(p16, num_heads_kv=h, out=outs["r16"]))
    in_fresh_thread(lambda: fe.gqa_accumulate(p32, p32, acc))
    in_fresh_thread(lambda: fe.gqa_postprocess(acc, outs["pk"], outs["pv"]))
    torch.cuda.synchronize()

    want_store = a.to(BF16)
    want_reduce = gqa_reduce_sequential_fp32(p32, h).to(BF16)
    assert bits_equal(outs["dk"], want_store) and bits_equal(outs["dv"], want_store), "store"
    assert bool((outs["z0"] == 0).all()) and bool((outs["z1"] == 0).all()), "store_zero"
    assert bits_equal(outs["r32"], want_reduce), "gqa_reduce fp32 partials"
    assert bits_equal(outs["r16"], gqa_reduce_sequential_fp32(p16.float(), h).to(BF16)), "gqa_reduce bf16 partials"
    assert bits_equal(outs["pk"], want_reduce) and bits_equal(outs["pv"], want_reduce), "gqa_accumulate + postprocess"

    # the autograd engine runs backward on a device thread of its own: repeat_kv's kernel backward
    x = torch.randn((b, h, s, d), device=DEV, generator=gen).to(BF16).requires_grad_()
    grad = torch.randn((b, h * g, s, d), device=DEV, generator=gen).to(BF16)
    (dx,) = torch.autograd.grad(fe.repeat_kv(x, g), x, grad)
    want = gqa_reduce_sequential_fp32(grad.transpose(1, 2).float(), h).to(BF16).transpose(1, 2)
    assert bits_equal(dx, want), "repeat_kv backward"
    print("OK")


if __name__ == "__main__":
    main()
