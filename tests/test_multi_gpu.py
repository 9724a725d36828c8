"""Two sm_90 GPUs: every op on both paths on cuda:1 tensors, cuda:0 current, gives the reference's results on device
1's *current* stream, a side stream that first sleeps, then copies the real inputs over zeroed ones (an op launched on
any other stream would read the zeros); hdim 96 and 80 (the raised dynamic shared-memory limit, an attribute set per
device) work on device 1 first in a fresh process."""
import itertools

import pytest
import torch

import flash_epilogue as fe
from conftest import HAVE_SM90, PATHS, arch_param, every_op_launches, run_in_child
from flash_epilogue import testing
from flash_epilogue.ops import _gqa_reduce, _store, _store_zero
from flash_epilogue.reference import (gqa_accumulate_reference, gqa_reduce_reference, store_reference,
                                      store_zero_reference)
from flash_epilogue.testing import generator, int32, same

BF16, F16 = torch.bfloat16, torch.float16
SLEEP_CYCLES = 200_000_000  # ~100 ms at the H200's clock: far longer than enqueueing one op
D0, D1 = torch.device("cuda", 0), torch.device("cuda", 1)
_OK = HAVE_SM90 and torch.cuda.device_count() >= 2 and torch.cuda.get_device_capability(1) == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(not _OK, reason="needs two sm_90 devices")]


def rand(shape, seed, dtype=torch.float32):
    return testing.rand(shape, generator(seed, D1), dtype, binades=6)


def run_on_device1(call, real, outputs=()):
    """call(*inputs) with cuda:0 current and device 1's current stream a side stream that first sleeps, then copies
    `real` into `inputs` (zeroed cuda:1 tensors); returns its result once that stream finished. A warm-up run (short
    sleep) first loads every kernel on device 1 (lazy loading can wait for running work); inputs, outputs restored."""
    inputs = [torch.zeros_like(r) for r in real]
    before = [o.clone() for o in outputs]
    for sleep in (1000, SLEEP_CYCLES):
        torch.cuda.synchronize(D0)
        torch.cuda.synchronize(D1)
        with torch.no_grad():
            for o, b in zip([*inputs, *outputs], [*map(torch.zeros_like, real), *before]):
                o.copy_(b)
        torch.cuda.synchronize(D1)
        torch.cuda.set_device(0)
        stream = torch.cuda.Stream(device=D1)
        with torch.cuda.device(1):
            previous = torch.cuda.current_stream()
            torch.cuda.set_stream(stream)
        try:
            assert torch.cuda.current_device() == 0 and torch.cuda.current_stream(D1) == stream
            with torch.cuda.device(1):
                torch.cuda._sleep(sleep)  # on device 1's current stream
            with torch.no_grad():  # tensor ops on cuda:1 tensors run on device 1's current stream
                for i, r in zip(inputs, real):
                    i.copy_(r)
            assert torch.cuda.current_device() == 0
            result = call(*inputs)
            assert torch.cuda.current_device() == 0, "the op changed the current device"
            assert sleep < SLEEP_CYCLES or not stream.query(), "the stream finished before the op: raise SLEEP_CYCLES"
            stream.synchronize()
        finally:
            with torch.cuda.device(1):
                torch.cuda.set_stream(previous)
            torch.cuda.set_device(0)
    return result


@arch_param
def test_store_and_store_zero_on_device1(arch):
    ak, av, used = rand((2, 300, 3, 128), 1), rand((2, 300, 3, 64), 2), int32(300, 131, device=D1)
    dk = torch.zeros(2, 300, 3, 128, dtype=BF16, device=D1)
    dv = torch.zeros(2, 3, 300, 64, dtype=BF16, device=D1).transpose(1, 2)
    run_on_device1(lambda k, v: _store(k, v, dk, dv, seqused=used, _arch=arch), (ak, av), (dk, dv))
    want_k, want_v = torch.zeros_like(dk), torch.zeros_like(dv)
    store_reference(ak, av, want_k, want_v, seqused=used)
    assert same(dk, want_k) and same(dv, want_v)
    # store_zero: the selection tensor is the staged input here (0 before the copy: another batch)
    run_on_device1(lambda idx: _store_zero(dk, dv, seqused=used, batch_idx=idx, row_start=100, _arch=arch),
                   (int32(1, device=D1),), (dk, dv))
    store_zero_reference(want_k, want_v, seqused=used, batch_idx=[1], row_start=100)
    assert same(dk, want_k) and same(dv, want_v)
    cu, heads = int32(0, 129, 129, 400, device=D1), int32(1, device=D1)  # heads: a list would be copied with a sync
    ak, av = rand((410, 2, 96), 3), rand((410, 2, 96), 4)
    vk, vv = torch.zeros(410, 2, 96, dtype=F16, device=D1), torch.zeros(410, 2, 96, dtype=F16, device=D1)
    run_on_device1(lambda k, v: (_store(k, v, vk, vv, cu_seqlens=cu, _arch=arch),
                                 _store_zero(vk, vv, cu_seqlens=cu, head_idx=heads, row_end=64, _arch=arch)),
                   (ak, av), (vk, vv))
    want_k, want_v = torch.zeros_like(vk), torch.zeros_like(vv)
    store_reference(ak, av, want_k, want_v, cu_seqlens=cu)
    store_zero_reference(want_k, want_v, cu_seqlens=cu, head_idx=[1], row_end=64)
    assert same(vk, want_k) and same(vv, want_v)


@arch_param
@pytest.mark.parametrize("deterministic", [True, False])
def test_gqa_ops_and_repeat_kv_on_device1(arch, deterministic):
    hk, g, d, b, s = 2, 4, 128, 2, 300
    pk_real, pv_real = rand((b, s, hk * g, d), 5), rand((b, s, hk * g, d), 6)
    used = int32(s, 150, device=D1)
    acc = fe.gqa_accumulator(hk, d, batch=b, seqlen=s, deterministic=deterministic, device=D1, arch=arch)
    ok, ov = (torch.zeros(b, s, hk, d, dtype=BF16, device=D1) for _ in range(2))
    x_real, gy_real = rand((2, 2, 300, 128), 7, BF16), rand((2, 8, 300, 128), 8, BF16)

    def call(pk, pv, x, gy):
        acc.reset()
        fe.gqa_accumulate(pk, pv, acc, deterministic=deterministic, seqused=used)
        fe.gqa_postprocess(acc, ok, ov, scale_dk=0.5)
        y = fe.repeat_kv(x.requires_grad_(), 4)
        return (acc.to_dense(), _gqa_reduce(pk, pv, num_heads_kv=hk, out_dtype=F16, _arch=arch), y,
                torch.autograd.grad(y, x, gy)[0])

    (dense_k, dense_v), (rk, rv), y, gx = run_on_device1(call, (pk_real, pv_real, x_real, gy_real),
                                                         (ok, ov, acc.dk_accum, acc.dv_accum))
    ref = [torch.zeros(b, s, hk, d, device=D1) for _ in range(2)]
    gqa_accumulate_reference(pk_real, pv_real, *ref, num_heads_kv=hk, seqused=used)
    want_k, want_v = torch.zeros_like(ok), torch.zeros_like(ov)
    store_reference(ref[0] * 0.5, ref[1], want_k, want_v, seqused=used)
    if deterministic:
        assert same(dense_k, ref[0]) and same(dense_v, ref[1])
        assert same(ok, want_k) and same(ov, want_v)
    else:  # any order of the fp32 adds: within g adds' rounding of the group's magnitude (see test_gqa.py)
        mag = [torch.zeros(b, s, hk, d, dtype=torch.float64, device=D1) for _ in range(2)]
        gqa_accumulate_reference(pk_real.abs(), pv_real.abs(), *mag, num_heads_kv=hk, seqused=used, sequential=False)
        for got, want, m in zip((dense_k, dense_v), ref, mag):
            assert ((got.double() - want.double()).abs() <= 2 * g * 2.0**-24 * m).all()
    want = gqa_reduce_reference(pk_real, pv_real, num_heads_kv=hk, out_dtype=F16, sequential=True)
    assert same(rk, want[0]) and same(rv, want[1])
    assert acc.device == rk.device == rv.device == y.device == gx.device == D1
    assert same(y, x_real.repeat_interleave(4, dim=1))
    # repeat_kv's backward: the sequential fp32 group sum, rounded once
    want = gqa_reduce_reference(gy_real.transpose(1, 2), num_heads_kv=2, out_dtype=BF16, sequential=True)
    assert same(gx, want.transpose(1, 2))


def hdim_80_96_workload():
    torch.cuda.set_device(0)
    for dev, arch, d in itertools.product((1, 0), PATHS, (96, 80)):
        gen = generator(d + arch, torch.device("cuda", dev))
        _, launches, check = every_op_launches(d, gen, lead=(2, 200), h=2, g=3, arch=arch, store_dtype=F16)
        for launch in launches:
            launch()
        assert torch.cuda.current_device() == 0
        check(dev, arch, d)
    print("OK")


def test_hdim_80_96_on_device1_first_in_a_fresh_process():
    run_in_child(hdim_80_96_workload)
