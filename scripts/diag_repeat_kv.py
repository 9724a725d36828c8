"""Diagnostic (H200): which gqa_reduce call of repeat_kv's backward crashes. Prints each call's
arguments before making it (flushed). Modes (one process each: a crash ends the process):
  main      R._reduce from the main thread (passed at aa06760)
  thread    R._reduce from a plain Python thread
  function  gqa_reduce from the backward of a plain torch.autograd.Function
  op        torch.ops.flash_epilogue.repeat_kv_backward called from the main thread (custom op nesting)
  autograd  torch.autograd.grad through fe.repeat_kv (segfaulted at aa06760)
Usage on the device: for m in main thread function op autograd; do
  FLASH_EPILOGUE_REPEAT_KV_KERNEL=1 timeout 60 python3 -X faulthandler scripts/diag_repeat_kv.py $m \
    > $OUT/diag_$m.log 2>&1; done"""
import sys

import torch

import flash_epilogue as fe
import flash_epilogue.ops as ops

sys.path.insert(0, "tests")
from test_repeat_kv import leading_order_storage  # noqa: E402

real = ops.gqa_reduce


def describe(t):
    return None if t is None else (tuple(t.shape), tuple(t.stride()), str(t.dtype), t.data_ptr() % 256)


def traced(dk_partial, dv_partial=None, **kw):
    out = kw.get("out")
    print("gqa_reduce", describe(dk_partial), describe(dv_partial), describe(out) if torch.is_tensor(out) else out,
          {k: v for k, v in kw.items() if k != "out"}, flush=True)
    return real(dk_partial, dv_partial, **kw)


ops.gqa_reduce = traced
mode = sys.argv[1]
for d in (64, 80, 96, 128, 192, 256):
    for dtype in (torch.bfloat16, torch.float16):
        for i, (dim, hk, n_rep, order) in enumerate(((1, 2, 4, (0, 1, 2)), (1, 1, 8, (0, 2, 1)), (2, 2, 3, (0, 1, 2)),
                                                     (2, 4, 2, (0, 2, 1)))):
            s = 131 + 64 * i
            shape = (2, hk, s, d) if dim == 1 else (2, s, hk, d)
            x = leading_order_storage(shape, order, dtype, "cuda").requires_grad_()
            y = fe.repeat_kv(x, n_rep, dim=dim)
            g = torch.randn(y.shape, device="cuda").to(dtype)
            for grad in (g, g.transpose(1, 2).contiguous().transpose(1, 2)):
                print("case", mode, d, dtype, i, flush=True)
                import importlib
                R = importlib.import_module("flash_epilogue.repeat_kv")
                if mode == "main":
                    R._reduce(grad, n_rep, dim, torch.empty_like(x))
                elif mode == "thread":
                    import threading
                    th = threading.Thread(target=R._reduce, args=(grad, n_rep, dim, torch.empty_like(x)))
                    th.start()
                    th.join()
                elif mode == "function":
                    class Sum(torch.autograd.Function):
                        @staticmethod
                        def forward(ctx, t):
                            return t.repeat_interleave(n_rep, dim=dim)

                        @staticmethod
                        def backward(ctx, gy):
                            out = torch.empty_like(x)
                            R._reduce(gy, n_rep, dim, out)
                            return out

                    torch.autograd.grad(Sum.apply(x), x, grad)
                elif mode == "op":
                    torch.ops.flash_epilogue.repeat_kv_backward(grad, n_rep, dim, R._layout_of(x))
                else:
                    torch.autograd.grad(y, x, grad, retain_graph=True)
                torch.cuda.synchronize()
print("ALL OK", mode, flush=True)
