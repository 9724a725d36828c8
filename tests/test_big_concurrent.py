"""Tensors of more than 2^31 elements (32-bit offsets would wrap), cu_seqlens near INT32_MAX, 65535 heads, and ops
running concurrently (two streams, a CUDA graph, host threads). All GPU and slow; a big test skips when the GPU lacks
the memory (peak about 70 GB). Outputs are canary buffers compared bitwise with the reference, big ones in chunks.
"""
import dataclasses
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import flash_epilogue as fe
from conftest import PATHS, cuda_graph, every_op_launches, run_in_child
from flash_epilogue.ops import _gqa_reduce, _store, _store_zero
from flash_epilogue.reference import (gqa_accumulate_reference, gqa_reduce_reference, gqa_reduce_sequential_fp32,
                                      sequence_bounds, store_zero_reference)
from flash_epilogue.testing import CANARY_BITS, bits, canary, first_diff, generator, int32, rand, same, same_view

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
DEV, BF16 = "cuda", torch.bfloat16
INT32_ELEMS, CHUNK_ELEMS = 2**31, 2**28  # CHUNK_ELEMS: elements compared at a time
native_sm80 = pytest.mark.parametrize("arch", (0, 80), ids=("native", "sm80"))


def need_gib(gib: float):
    torch.cuda.empty_cache()  # the memory an earlier test left cached counts as used
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs {gib:.0f} GiB of free GPU memory, {free / 2**30:.0f} GiB free")


def row_mask(rows: int, bounds) -> torch.Tensor:
    """bool (rows,): True on the valid rows [start, start + length) of every sequence."""
    mask = torch.zeros(rows, dtype=torch.bool, device=DEV)
    for start, length in bounds:
        mask[start : start + length] = True
    return mask


def check_rows(name, out, expected_rows, mask, row_dim, row_elems=None):
    """Walk `out` in chunks along `row_dim`: rows where `mask` holds (all if None) equal expected_rows(a, b) bitwise,
    the others are still the canary. `row_elems`: elements per row that expected_rows reads (sets the chunk size)."""
    rows = out.shape[row_dim]
    step = max(1, CHUNK_ELEMS // (row_elems or max(1, out.numel() // max(rows, 1))))
    for a in range(0, rows, step):
        b = min(rows, a + step)
        got, want = bits(out.narrow(row_dim, a, b - a)), bits(expected_rows(a, b))
        if mask is not None:
            m = mask[a:b].view([-1 if i == row_dim else 1 for i in range(got.dim())])
            want = torch.where(m, want, torch.full_like(want, CANARY_BITS))
        assert torch.equal(got, want), f"{name}, rows [{a}, {b}) (indices from row a): {first_diff(got, want)}"


# beyond 2^31 elements: every op once
S_BIG, H_BIG, D_BIG = 2**20 + 77, 16, 128  # S * H * D = 2^31 + 157696 elements per tensor
S_ACC = 2**23 + 129  # accumulate: (1, 2, 65538, 128 * 128) floats per accumulator


def varlen_big():
    """cu_seqlens and seqused over S_BIG rows: a short first sequence, two long ones, the last five rows a sequence
    of their own (the rows past 2^31 elements); seqused cuts two of them; and the mask of the valid rows."""
    first, half = 1000, S_BIG // 2
    cu, used = int32(0, first, half, S_BIG - 5, S_BIG), int32(first, half - first - 3, (S_BIG - 5 - half) - 77, 5)
    return cu, used, row_mask(S_BIG, sequence_bounds(4, S_BIG, cu, used))


@pytest.mark.parametrize("layout,arch", [("batched", 0), ("batched", 80), ("varlen", 0)],
                         ids=("batched-native", "batched-sm80", "varlen-seqused"))
def test_store_and_store_zero_beyond_int32(layout, arch):
    need_gib(30)
    if layout == "batched":  # dk in (b, s, h, d), dv in heads-major (b, h, s, d) storage: its last head past 2^31
        assert S_BIG * H_BIG * D_BIG > INT32_ELEMS
        acc_k = torch.randn((1, S_BIG, H_BIG, D_BIG), device=DEV)
        acc_v = torch.randn((1, H_BIG, S_BIG, D_BIG), device=DEV).transpose(1, 2)
        dk, dv = canary(acc_k.shape), canary((1, H_BIG, S_BIG, D_BIG)).transpose(1, 2)
        mask, kw = None, {}
        zero_kw = {"row_start": S_BIG - 100, "row_end": S_BIG + 7}  # the last rows of the batch: past 2^31 elements
    else:  # sequence 3 is the last 5 rows; rows 3 and 4 of it are zeroed in heads 0 and h - 1
        cu, used, mask = varlen_big()
        assert mask[-5:].all() and not mask[-6]
        acc_k, acc_v = torch.randn(S_BIG, H_BIG, D_BIG, device=DEV), torch.randn(S_BIG, H_BIG, 64, device=DEV)
        dk, dv = canary(acc_k.shape), canary(acc_v.shape)
        kw = {"cu_seqlens": cu, "seqused": used, "check_inputs": True}
        zero_kw = {"cu_seqlens": cu, "seqused": used, "head_idx": [0, H_BIG - 1], "row_start": 3}
    _store(acc_k, acc_v, dk, dv, _arch=arch, **kw)
    row_dim, rows = dk.dim() - 3, dk.shape[dk.dim() - 3]
    for name, out, acc in (("dk", dk, acc_k), ("dv", dv, acc_v)):
        check_rows(name, out, lambda a, b: acc.narrow(row_dim, a, b - a).to(BF16), mask, row_dim)
    acc_k = acc_v = acc = None  # freed: room for the store_zero references
    pairs = [(dk, dv)] + [(dk, torch.ones(1, S_BIG, H_BIG, 64, dtype=BF16, device=DEV))] * (layout == "batched")
    for zk, zv in pairs:  # batched: dv heads-major, then a contiguous dv of head dim 64
        ref_k, ref_v = zk.clone(), zv.clone()
        store_zero_reference(ref_k, ref_v, **zero_kw)
        _store_zero(zk, zv, _arch=arch, **zero_kw)
        for name, got, want in (("dk", zk, ref_k), ("dv", zv, ref_v)):
            check_rows(name, got, lambda a, b: want.narrow(row_dim, a, b - a), None, row_dim)
            last = got.narrow(row_dim, rows - 1, 1)  # zeroed (and so the reference too), past 2^31 elements
            assert (last[..., 0, :] == 0).all() and (last[..., -1, :] == 0).all()


@pytest.mark.parametrize("g,partial_dtype", [(8, torch.float32), (1, BF16)],
                         ids=("big-partials-fp32", "big-partials-and-output-bf16"))
def test_gqa_reduce_beyond_int32(g, partial_dtype):
    # g = 8: 2^31+ fp32 partial elements reduced into 2 KV heads; g = 1: partials and output both past 2^31 elements
    need_gib(30)
    h_k = H_BIG // g
    cu, used, mask = varlen_big()
    pk = torch.randn(S_BIG, H_BIG, D_BIG, device=DEV).to(partial_dtype)
    out = canary((S_BIG, h_k, D_BIG))
    assert fe.gqa_reduce(pk, num_heads_kv=h_k, out=out, cu_seqlens=cu, seqused=used, scale_dk=0.125) is out
    check_rows("dk", out, lambda a, b: gqa_reduce_sequential_fp32(pk[a:b], h_k, 0.125).to(BF16), mask, 0,
               row_elems=H_BIG * D_BIG)


@pytest.mark.parametrize("deterministic", (True, False), ids=("deterministic", "atomic"))
def test_gqa_accumulate_beyond_int32(deterministic):
    # accumulators of more than 2^31 floats; two query heads per KV head, one call, so both modes give the same bits
    # (0 + p0 + p1 in any order rounds once, commutatively); then postprocess into canary-filled bf16 outputs
    need_gib(60)
    s, h_k, g, d, dv_dim = S_ACC, 2, 2, 128, 64
    pk, pv = torch.randn(1, s, h_k * g, d, device=DEV), torch.randn(1, s, h_k * g, dv_dim, device=DEV)
    acc = fe.gqa_accumulator(h_k, d, dv_dim, batch=1, seqlen=s, deterministic=deterministic, device=DEV)
    assert acc.dk_accum.numel() > INT32_ELEMS
    fe.gqa_accumulate(pk, pv, acc, deterministic=deterministic, seqused=int32(s - 3))
    dk, dv = canary((1, s, h_k, d)), canary((1, s, h_k, dv_dim))
    fe.gqa_postprocess(acc, dk, dv)  # every row: the accumulator holds zeros past seqused
    del acc
    for name, out, p in (("dk", dk, pk), ("dv", dv, pv)):
        def rows(a, b):
            r = gqa_reduce_sequential_fp32(p[:, a:b], h_k)
            r[:, max(a, s - 3) - a :] = 0  # rows past seqused added nothing
            return r.to(BF16)
        check_rows(name, out, rows, None, 1, row_elems=h_k * g * p.shape[-1])


# sequence metadata near the int32 limit: sums such as cu_seqlens[b] + b * kBlockN pass 2^31
BAD_CU = ([0, 100, 200, 2**31 - 11, 2**31 - 1], [2**31 - 1] * 3)  # on 300 tokens: past the end, and wrapping
BAD_OPS = ("store", "store_d64", "gqa_reduce", "gqa_accumulate", "gqa_postprocess", "to_dense")


def bad_metadata_call(op, cu, arch, check_inputs):
    """One op on 300 tokens with cu_seqlens `cu`; returns [(buffer, view, want)]: canary buffers that must be
    unchanged outside `view`, and inside it on the rows of the sequences that lie in the tensor (want: their expected
    bits, None for no such rows)."""
    total, h_k, g, d = 300, 2, 2, 64 if op == "store_d64" else 128
    cu_t, gen = int32(*cu), generator(3)
    valid = 200 if cu[0] == 0 else 0  # rows of the sequences inside the tensor: [0, 100), [100, 200)
    kw = {"cu_seqlens": cu_t, "check_inputs": check_inputs}
    bufs = [canary((total + 8, h_k + 2, d + 8)) for _ in range(2)]
    k, v = (buf[4 : total + 4, 1 : h_k + 1, 8:] for buf in bufs)
    if op in ("store", "store_d64"):
        a = rand((total, h_k, d), gen)
        _store(a, a, k, v, _arch=arch, **kw)
        return [(buf, view, a[:valid].to(BF16)) for buf, view in zip(bufs, (k, v))]
    p = rand((total, h_k * g, d), gen)
    want = gqa_reduce_sequential_fp32(p[:valid], h_k)
    outs = [(buf, view, want.to(BF16)) for buf, view in zip(bufs, (k, v))]
    if op == "gqa_reduce":
        _gqa_reduce(p, num_heads_kv=h_k, out=k, _arch=arch, **kw)
        return outs[:1]
    # accumulators carved out of NaN buffers (contiguous views) so that writes past them show
    acc = fe.gqa_accumulator(h_k, d, cu_seqlens=cu_t, total_tokens=total, deterministic=True, device=DEV, arch=arch)
    pad_bufs = [canary((t.numel() + 2048,), torch.float32) for t in (acc.dk_accum, acc.dv_accum)]
    views = [buf[1024:-1024].view(t.shape).zero_() for buf, t in zip(pad_bufs, (acc.dk_accum, acc.dv_accum))]
    acc = dataclasses.replace(acc, dk_accum=views[0], dv_accum=views[1])
    pads = [(buf, view.view(-1), None) for buf, view in zip(pad_bufs, views)]
    if op == "gqa_accumulate" or not check_inputs:  # unchecked, the metadata under test fills the accumulator too
        fe.gqa_accumulate(p, p, acc, deterministic=True, **kw)
    if op == "gqa_postprocess":
        fe.gqa_postprocess(acc, k, v, **kw)
        return pads + outs
    if op == "to_dense":
        dk_dense, _ = acc.to_dense(**kw)
        assert torch.equal(bits(dk_dense[:valid]), bits(want))
    return pads


def bad_metadata_workload():
    """Every op of BAD_OPS with each of BAD_CU, content checks off, on both paths (where built): canaries intact, the
    rows of the sequences inside the tensor right, and the process healthy after (a later op works). 32-bit sums of
    such entries before the clamp would wrap: an illegal address, sticky (every later CUDA call fails)."""
    for cu, op, arch in itertools.product(BAD_CU, BAD_OPS, PATHS):
        for buf, view, want in bad_metadata_call(op, cu, arch, check_inputs=False):
            if want is not None and len(want):
                assert torch.equal(bits(view[: len(want)]), bits(want)), (op, cu, arch)
            got, fresh = buf.clone(), canary(buf.shape, buf.dtype)
            for t in (got, fresh):  # all but the view must still be the canary
                same_view(t, view).zero_()
            assert torch.equal(bits(got), bits(fresh)), f"{op} {cu} arch {arch}: written outside the tensor"
    a = torch.ones(2, 64, 2, 128, device=DEV)
    dk = canary(a.shape)
    fe.store(a, a, dk, canary(a.shape))
    assert (dk == 1).all()
    print("OK")


@pytest.mark.parametrize("cu", BAD_CU, ids=("past-the-end", "all-int32-max"))
@pytest.mark.parametrize("op", BAD_OPS)
def test_checked_metadata_near_int32_limit(op, cu):
    # with the content checks on, the same calls raise before any launch
    with pytest.raises(fe.FlashEpilogueInputError, match=rf"cu_seqlens\[{len(cu) - 1}\]: expected <= 300 \(the "
                       rf"tensors' token count\), got 2147483647"):
        bad_metadata_call(op, cu, 0, check_inputs=True)


@native_sm80
@pytest.mark.parametrize("op", ("store_zero", "gqa_reduce"))
def test_varlen_offsets_near_int32_limit(op, arch):
    # 2^31 - 100 tokens at d = 8, valid metadata (every offset < 2^31): two long sequences, then 22 short ones in the
    # last 2300 rows, where cu_seqlens[b] + b * kBlockN passes 2^31. Two 16-bit tensors of these rows (32 GiB each;
    # an fp32 input alone takes 64) are the least any op needs: store_zero's dk and dv, gqa_reduce's bf16 p and out
    need_gib(72)
    total, d, batch = 2**31 - 100, 8, 24
    cu = int32(0, 1000, *[total - 2300 + 100 * k for k in range(batch - 2)], total)
    assert cu[-2].item() + (batch - 1) * 128 >= 2**31
    used = int32(1000, 2**20, *[100 - 7 * (b % 3) for b in range(batch - 3)], 2300 - 100 * (batch - 3))
    kw = {"cu_seqlens": cu, "seqused": used, "check_inputs": True, "_arch": arch}
    bounds, outs = sequence_bounds(batch, total, cu, used), [canary((total, 1, d))]
    if op == "store_zero":
        outs.append(canary((total, 1, d)))
        _store_zero(*outs, row_start=3, **kw)
        bounds = [(s + 3, n - 3) for s, n in bounds]
        expected = lambda a, b: torch.zeros((b - a, 1, d), dtype=BF16, device=DEV)  # noqa: E731
    else:
        p = torch.randn((total, 1, d), dtype=BF16, device=DEV)
        _gqa_reduce(p, num_heads_kv=1, out=outs[0], scale_dk=0.5, **kw)
        expected = lambda a, b: gqa_reduce_sequential_fp32(p[a:b], 1, 0.5).to(BF16)  # noqa: E731
    mask = row_mask(total, bounds)
    assert mask[cu[-2].item() + 3 : cu[-2].item() + 6].all()  # rows of the last sequence, past the 32-bit wrap
    for name, out in zip(("dk", "dv"), outs):
        check_rows(name, out, expected, mask, 0)


@native_sm80
@pytest.mark.parametrize("deterministic", (True, False), ids=("deterministic", "atomic"))
def test_every_op_65535_heads(deterministic, arch):
    # the one-CTA-per-tile grids hold 65535 heads (the output tensor in gridDim.x, not in y): every op at d 128 and 64,
    # 65535 query heads into 65535 KV heads (g = 1: 0 + p exactly in either mode, the accumulator's)
    need_gib(8)
    for d in (128, 64):
        _, launches, check = every_op_launches(d, generator(4), (2, 2), 65535, 1, arch, deterministic=deterministic)
        for launch in launches:
            launch()
        check(d)


# concurrency: streams, a graph, host threads
def test_two_streams_then_a_graph():
    # on two streams at once, launches interleaved, three rounds, each reference-exact: per stream, the persistent
    # sm_90 drivers on problems of 8-31 tiles per SM (store 31, gqa_reduce 8, gqa_accumulate 16 on 132 SMs) into its
    # own outputs, and deterministic accumulations of three chunks: acc_a and acc_b (same problem, same partials) on
    # one stream each, acc_c (another head dim, varlen) beside acc_a; the raw accumulators of every round bitwise the
    # first's. Then the persistent drivers in one CUDA graph replayed on new inputs
    gen = generator(3)
    b, s, h, d = 4, 8192, 8, 128
    ak, av = rand((b, s, h, d), gen), rand((b, s, h, d), gen)
    red = rand((b, s // 2, 4 * h, d), gen, dtype=BF16)
    pk, pv = rand((b // 2, s, 4 * h, d), gen), rand((b // 2, s, 4 * h, d), gen)
    accs = [fe.gqa_accumulator(h, d, batch=b // 2, seqlen=s, device=DEV) for _ in range(2)]
    outs = [[canary((b, s, h, d)), canary((b, s, h, d)), canary((b, s // 2, h, d))] for _ in range(2)]
    cu, total = int32(0, 4000, 4000, 9000, 16000), 16011  # sequences of 4000, 0, 5000, 7000 tokens, 11 rows after
    chunks = [(rand((2, s, 16, d), gen), rand((2, s, 16, d), gen)) for _ in range(3)]
    chunks_c = [(rand((total, 16, 64), gen), rand((total, 16, 64), gen)) for _ in range(3)]
    det = [fe.gqa_accumulator(2, d, batch=2, seqlen=s, deterministic=True, device=DEV) for _ in range(2)]
    det.append(fe.gqa_accumulator(4, 64, cu_seqlens=cu, total_tokens=total, deterministic=True, device=DEV))
    ref = [torch.zeros(2, s, 2, d, device=DEV) for _ in range(2)]
    ref_c = [torch.zeros(total, 4, 64, device=DEV) for _ in range(2)]
    for (ck, cv), (vk, vv) in zip(chunks, chunks_c):
        gqa_accumulate_reference(ck, cv, *ref, num_heads_kv=2)
        gqa_accumulate_reference(vk, vv, *ref_c, num_heads_kv=4, cu_seqlens=cu)

    def step(acc, outs, stream=None):  # None: the current stream
        with torch.cuda.stream(stream):
            fe.store(ak, av, outs[0], outs[1])
            fe.gqa_reduce(red, num_heads_kv=h, out=outs[2])
            acc.reset()
            fe.gqa_accumulate(pk, pv, acc)
            return acc.to_dense()

    def expected():  # of the current inputs: dk, dv, the reduced dk, the accumulators' dense dk and dv
        return [ak.to(BF16), av.to(BF16), gqa_reduce_reference(red, num_heads_kv=h, out_dtype=BF16, sequential=True),
                gqa_reduce_sequential_fp32(pk, h), gqa_reduce_sequential_fp32(pv, h)]

    want, streams, first = expected(), (torch.cuda.Stream(), torch.cuda.Stream()), None
    # (accumulator, stream, partials, kwargs), launched in this order for each chunk
    jobs = [(det[0], streams[0], chunks, {}), (det[1], streams[1], chunks, {}),
            (det[2], streams[0], chunks_c, {"cu_seqlens": cu})]
    for _ in range(3):
        for st in streams:
            st.wait_stream(torch.cuda.current_stream())
        dense = [step(acc, o, st) for st, acc, o in zip(streams, accs, outs)]
        for i, (acc, st, parts, kw) in itertools.product(range(3), jobs):
            with torch.cuda.stream(st):
                if i == 0:
                    acc.reset()
                fe.gqa_accumulate(*parts[i], acc, **kw)
        for st in streams:
            torch.cuda.current_stream().wait_stream(st)
        for o, dn in zip(outs, dense):
            assert all(same(got, w) for got, w in zip([*o, *dn], want))
        raw = [t.clone() for acc, *_ in jobs for t in (acc.dk_accum, acc.dv_accum)]
        first = first or raw
        assert same(raw[0], raw[2]) and same(raw[1], raw[3]) and all(same(x, w) for x, w in zip(raw, first))
        for (acc, _, _, kw), r in zip(jobs, (ref, ref, ref_c)):
            assert all(same(x, w) for x, w in zip(acc.to_dense(**kw), r))
    graph, dense = cuda_graph(lambda: step(accs[0], outs[0]))
    for _ in range(3):
        for t in (ak, av, pk, pv, red):
            t.copy_(rand(t.shape, gen, dtype=t.dtype))
        graph.replay()
        assert all(same(got, w) for got, w in zip([*outs[0], *dense], expected()))


def test_persistent_store_beside_other_ops():
    # a named barrier id must not serve two thread counts (the store's TMA hand-off and a tile's first barrier): beside
    # another kernel the issuing warp lags, the others reach the next tile's barrier first ("illegal instruction").
    # Stream 0: the store; stream 1: the launches of every_op_launches in turn, with bf16 and with fp16 outputs (its
    # accumulate atomic: two query heads per KV head, one call, exact in any order); launches interleaved, then every
    # result
    gen = generator(2)
    b, s, h, d = 2, 4096, 8, 128
    acc_k, acc_v = rand((b, s, h, d), gen), rand((b, s, h, d), gen)
    dk, dv = canary((b, s, h, d)), canary((b, s, h, d))
    ops = [every_op_launches(d, gen, (b, s), h, 2, store_dtype=dt, deterministic=False) for dt in (BF16, torch.float16)]
    launches = [launch for acc, each, _ in ops for launch in (acc.reset, *each)]
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    for st in streams:
        st.wait_stream(torch.cuda.current_stream())
    for i in range(17 * len(launches)):  # 306 rounds, the launches run whole
        with torch.cuda.stream(streams[0]):
            fe.store(acc_k, acc_v, dk, dv)
        with torch.cuda.stream(streams[1]):
            launches[i % len(launches)]()
    torch.cuda.synchronize()
    assert same(dk, acc_k.to(BF16)) and same(dv, acc_v.to(BF16))
    for *_, check in ops:
        check()


def test_host_threads_with_own_streams():
    # four host threads, each with its own stream and tensors, validating and launching at once
    barrier = threading.Barrier(4, timeout=60)

    def worker(d):
        torch.cuda.set_device(0)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            acc, launches, check = every_op_launches(d, generator(100 + d), lead=(2, 1000))
            barrier.wait()
            for launch in [acc.reset, *launches] * 10:
                launch()
            stream.synchronize()
        return check

    with ThreadPoolExecutor(4) as pool:  # four threads: each task waits at the barrier for the others
        for d, check in zip((64, 96, 128, 256), pool.map(worker, (64, 96, 128, 256), timeout=120)):
            check(d)


def fresh_thread_workload():
    """Every op from a host thread that made no CUDA call: without a current CUDA context (c10's device guard binds
    none when the index already matches) the TMA descriptor encode failed and the process crashed."""
    _, launches, check = every_op_launches(128, generator(7))
    for launch in launches:  # all on the default stream, in order
        with ThreadPoolExecutor(1) as pool:  # a new host thread for each op
            pool.submit(launch).result()
    check()
    print("OK")


@pytest.mark.parametrize("workload", (bad_metadata_workload, fresh_thread_workload),
                         ids=("unchecked-metadata-near-int32-limit", "every-op-from-a-fresh-thread"))
def test_in_a_fresh_process(workload):
    run_in_child(workload)
