"""GPU tests of problems whose tensors exceed 2^31 elements (32-bit offsets would wrap) and of ops
running concurrently on several CUDA streams and host threads.

Big: every op once on tensors of more than 2^31 elements (store batched, heads-major, on both paths, and
varlen + seqused; store_zero; gqa_reduce with big inputs and with big outputs; gqa_accumulate into
accumulators of more than 2^31 floats, both modes, + gqa_postprocess). Canary outputs are checked in chunks
of rows: valid rows bitwise against the reference of that chunk, all others still the canary. Peak GPU
memory about 50 GB (a test skips when less is free); about 10-20 s on an H200.

Limits: cu_seqlens near INT32_MAX, unchecked (child process: canaries intact, process healthy) and checked
(a clear error); valid varlen offsets past 2^31 - batch * kBlockN (about 70 GB); 65535 heads on every op.

Concurrent: two streams each running deterministic gqa_accumulate into their own accumulators
(reading the same partials), interleaved launch by launch, repeatedly: bitwise equal to the
sequential reference every time; store/store_zero on one stream against gqa_reduce and
non-deterministic accumulate + postprocess on another; the persistent store beside gqa_reduce or
another store, 300 rounds; the persistent drivers on big problems on two streams and in a replayed
CUDA graph; four host threads with a stream each.
Fresh threads: every op from host threads that never made a CUDA call (in a child process).
"""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

import flash_epilogue as fe
from conftest import CANARY_BITS, bits, canary, cuda_graph, rand
from flash_epilogue.reference import (
    gqa_accumulate_reference,
    gqa_reduce_reference,
    gqa_reduce_sequential_fp32,
    sequence_bounds,
    store_zero_reference,
)

pytestmark = pytest.mark.gpu

DEV = "cuda"
I32 = torch.int32
INT32_ELEMS = 2**31
CHUNK_ELEMS = 2**28  # elements compared at a time


def need_gib(gib: float):
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs {gib:.0f} GiB of free GPU memory, {free / 2**30:.0f} GiB free")


def run_in_child(workload):
    """Run `workload` (a function of this module that prints OK at its end) in a fresh Python process,
    so that a fault (a sticky CUDA error, a crash) fails only the calling test."""
    import subprocess
    import sys
    from pathlib import Path

    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import test_big_concurrent; test_big_concurrent.{workload.__name__}()")
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}")


@pytest.fixture(autouse=True)
def _release_memory():
    yield
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def row_mask(rows: int, bounds) -> torch.Tensor:
    """bool (rows,): True on the valid rows [start, start + length) of every sequence."""
    mask = torch.zeros(rows, dtype=torch.bool, device=DEV)
    for start, length in bounds:
        mask[start : start + length] = True
    return mask


def check_rows(name, out, expected_rows, mask, row_dim, row_elems=None):
    """Walk `out` in chunks along `row_dim`: rows where `mask` holds equal expected_rows(a, b)
    bitwise, the others are still the canary. `row_elems`: elements per row that expected_rows
    reads (sets the chunk size; default out's)."""
    rows = out.shape[row_dim]
    row_elems = row_elems or max(1, out.numel() // max(rows, 1))
    step = max(1, CHUNK_ELEMS // row_elems)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        got = bits(out.narrow(row_dim, a, b - a))
        want = bits(expected_rows(a, b))
        m = mask[a:b].view([-1 if i == row_dim else 1 for i in range(got.dim())])
        want = torch.where(m, want, torch.full_like(want, CANARY_BITS))
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            first = bad[0].tolist()
            first[row_dim] += a
            raise AssertionError(f"{name}: {bad.shape[0]} elements differ in rows [{a}, {b}), first at {first}")


# ---------------------------------------------------------------------------------------------
# beyond 2^31 elements

S_BIG, H_BIG, D_BIG = 2**20 + 77, 16, 128  # S * H * D = 2^31 + 157696 elements per tensor
S_ACC = 2**23 + 129  # accumulate: (1, 2, 65538, 128 * 128) floats per accumulator


@pytest.mark.parametrize("arch", (0, 80), ids=("native", "sm80"))
def test_store_beyond_int32_batched(arch):
    # dk in (b, s, h, d) and dv in heads-major (b, h, s, d) storage: the last head starts past 2^31
    need_gib(30)
    shape = (1, S_BIG, H_BIG, D_BIG)
    assert S_BIG * H_BIG * D_BIG > INT32_ELEMS
    acc_k = torch.randn(shape, device=DEV)
    acc_v = torch.randn((1, H_BIG, S_BIG, D_BIG), device=DEV).transpose(1, 2)
    dk = canary(shape)
    dv = canary((1, H_BIG, S_BIG, D_BIG)).transpose(1, 2)
    fe.store(acc_k, acc_v, dk, dv, _arch=arch)
    torch.cuda.synchronize()
    mask = torch.ones(S_BIG, dtype=torch.bool, device=DEV)
    check_rows("dk", dk, lambda a, b: acc_k[:, a:b].to(torch.bfloat16), mask, 1)
    check_rows("dv", dv, lambda a, b: acc_v[:, a:b].to(torch.bfloat16), mask, 1)
    # and the very last element of each, explicitly
    assert bits(dk[0, -1, -1, -1]) == bits(acc_k[0, -1, -1, -1].to(torch.bfloat16))
    assert bits(dv[0, -1, -1, -1]) == bits(acc_v[0, -1, -1, -1].to(torch.bfloat16))


def varlen_big(total):
    """cu_seqlens and seqused over `total` rows: a short first sequence, two long ones, the last
    five rows a sequence of their own (the rows past 2^31 elements); seqused cuts two of them."""
    first = min(1000, total // 8)
    cu = [0, first, total // 2, total - 5, total]
    used = [first, total // 2 - first - 3, (total - 5 - total // 2) - 77, 5]
    return torch.tensor(cu, dtype=I32, device=DEV), torch.tensor(used, dtype=I32, device=DEV)


def test_store_beyond_int32_varlen_seqused():
    need_gib(30)
    total, h, d, dv_dim = S_BIG, H_BIG, D_BIG, 64
    cu, used = varlen_big(total)
    acc_k = torch.randn(total, h, d, device=DEV)
    acc_v = torch.randn(total, h, dv_dim, device=DEV)
    dk, dv = canary((total, h, d)), canary((total, h, dv_dim))
    fe.store(acc_k, acc_v, dk, dv, cu_seqlens=cu, seqused=used, check_inputs=True)
    torch.cuda.synchronize()
    mask = row_mask(total, sequence_bounds(4, total, cu, used))
    assert mask[-5:].all() and not mask[-6]
    check_rows("dk", dk, lambda a, b: acc_k[a:b].to(torch.bfloat16), mask, 0)
    check_rows("dv", dv, lambda a, b: acc_v[a:b].to(torch.bfloat16), mask, 0)


@pytest.mark.parametrize("layout", ("varlen", "batched"))
def test_store_zero_beyond_int32(layout):
    need_gib(25)
    h, d, dv_dim = H_BIG, D_BIG, 64
    if layout == "varlen":
        cu, used = varlen_big(S_BIG)
        lead, seq, row_dim = (S_BIG,), {"cu_seqlens": cu, "seqused": used}, 0
        kw = {"head_idx": [0, h - 1], "row_start": 3}
    else:  # zero the last rows of the batch only: they sit past 2^31 elements
        lead, seq, row_dim = (1, S_BIG), {}, 1
        kw = {"row_start": S_BIG - 100, "row_end": S_BIG + 7}
    dk = torch.full(lead + (h, d), 1.0, dtype=torch.bfloat16, device=DEV)
    dv = torch.full(lead + (h, dv_dim), 1.0, dtype=torch.bfloat16, device=DEV)
    ref_k, ref_v = dk.clone(), dv.clone()
    store_zero_reference(ref_k, ref_v, **seq, **kw)
    fe.store_zero(dk, dv, **seq, **kw)
    torch.cuda.synchronize()
    for name, got, want in (("dk", dk, ref_k), ("dv", dv, ref_v)):
        rows = got.shape[row_dim]
        step = CHUNK_ELEMS // (got.numel() // rows)
        for a in range(0, rows, step):
            n = min(step, rows - a)
            assert torch.equal(bits(got.narrow(row_dim, a, n)), bits(want.narrow(row_dim, a, n))), f"{name} rows {a}+"
        zeroed = (want == 0).sum().item()
        assert zeroed > 0 and (got == 0).sum().item() == zeroed
        # the last row (past 2^31 elements) explicitly
        last = got.narrow(row_dim, rows - 1, 1)
        if layout == "batched":
            assert (last == 0).all() and (got.narrow(row_dim, rows - 101, 1) == 1).all()
        else:  # sequence 3 is the last 5 rows; rows 3 and 4 of it are zeroed in heads 0 and h - 1
            assert (last[:, 0] == 0).all() and (last[:, -1] == 0).all() and (last[:, 1:-1] == 1).all()


@pytest.mark.parametrize("g,partial_dtype", [(8, torch.float32), (1, torch.bfloat16)],
                         ids=("big-partials-fp32", "big-partials-and-output-bf16"))
def test_gqa_reduce_beyond_int32(g, partial_dtype):
    # g = 8: 2^31+ fp32 partial elements reduced into 2 KV heads; g = 1: partials and output both
    # past 2^31 elements
    need_gib(30)
    total, h_q, d = S_BIG, H_BIG, D_BIG
    h_k = h_q // g
    cu, used = varlen_big(total)
    pk = torch.randn(total, h_q, d, device=DEV).to(partial_dtype)
    out = canary((total, h_k, d))
    scale = 0.125
    ret = fe.gqa_reduce(pk, num_heads_kv=h_k, out=out, cu_seqlens=cu, seqused=used, scale_dk=scale)
    torch.cuda.synchronize()
    assert ret is out
    mask = row_mask(total, sequence_bounds(4, total, cu, used))
    check_rows("dk", out, lambda a, b: gqa_reduce_sequential_fp32(pk[a:b], h_k, scale).to(torch.bfloat16), mask, 0,
               row_elems=h_q * d)


@pytest.mark.parametrize("deterministic", (True, False), ids=("deterministic", "atomic"))
def test_gqa_accumulate_beyond_int32(deterministic):
    # accumulators of more than 2^31 floats each: (1, 2 KV heads, 65538 tiles, 128 x 128 floats);
    # two query heads per KV head, one call, so both modes give the same bits (0 + p0 + p1 in any
    # order rounds once, commutatively); then postprocess to canary-filled bf16 outputs
    need_gib(60)
    s, h_k, g, d, dv_dim = S_ACC, 2, 2, 128, 64
    pk = torch.randn(1, s, h_k * g, d, device=DEV)
    pv = torch.randn(1, s, h_k * g, dv_dim, device=DEV)
    used = torch.tensor([s - 3], dtype=I32, device=DEV)
    acc = fe.gqa_accumulator(h_k, d, dv_dim, batch=1, seqlen=s, deterministic=deterministic, device=DEV)
    assert acc.dk_accum.numel() > INT32_ELEMS
    fe.gqa_accumulate(pk, pv, acc, deterministic=deterministic, seqused=used)
    dk, dv = canary((1, s, h_k, d)), canary((1, s, h_k, dv_dim))
    fe.gqa_postprocess(acc, dk, dv)  # every row: the accumulator holds zeros past seqused
    torch.cuda.synchronize()
    del acc
    mask = torch.ones(s, dtype=torch.bool, device=DEV)
    limit = s - 3

    def expected(p):
        def rows(a, b):
            r = gqa_reduce_sequential_fp32(p[:, a:b], h_k)
            if b > limit:
                r[:, max(a, limit) - a :] = 0  # rows past seqused added nothing
            return r.to(torch.bfloat16)
        return rows

    check_rows("dk", dk, expected(pk), mask, 1, row_elems=h_k * g * d)
    check_rows("dv", dv, expected(pv), mask, 1, row_elems=h_k * g * dv_dim)


# ---------------------------------------------------------------------------------------------
# sequence metadata near the int32 limit: sums such as cu_seqlens[b] + b * kBlockN pass 2^31

BAD_CU = ([0, 100, 200, 2**31 - 11, 2**31 - 1], [2**31 - 1] * 3)  # on 300 tokens: past the end, and wrapping
BAD_OPS = ("store", "store_d64", "gqa_reduce", "gqa_accumulate", "gqa_postprocess", "to_dense")


def bad_metadata_call(op, cu, arch, check_inputs):
    """One op on 300 tokens with cu_seqlens `cu` (unchecked contents unless check_inputs); returns
    [(buffer, view, want)]: canary buffers that must be unchanged outside `view`, and inside it on the
    rows of the sequences that lie in the tensor (want: their expected bits, None for no such rows)."""
    total, h_k, g = 300, 2, 2
    d = 64 if op == "store_d64" else 128
    cu_t = torch.tensor(cu, dtype=I32, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(3)
    valid = 200 if cu[0] == 0 else 0  # rows of the sequences inside the tensor: [0, 100), [100, 200)
    kw = {"cu_seqlens": cu_t, "check_inputs": check_inputs}

    def out_view(heads, dtype=torch.bfloat16):
        buf = canary((total + 8, heads + 2, d + 8), dtype)
        return buf, buf[4 : total + 4, 1 : heads + 1, 8:]

    if op in ("store", "store_d64"):
        a = rand((total, h_k, d), gen)
        (bk, k), (bv, v) = out_view(h_k), out_view(h_k)
        fe.store(a, a, k, v, _arch=arch, **kw)
        return [(bk, k, a[:valid].to(torch.bfloat16)), (bv, v, a[:valid].to(torch.bfloat16))]
    p = rand((total, h_k * g, d), gen)
    want = gqa_reduce_sequential_fp32(p[:valid], h_k)
    if op == "gqa_reduce":
        bk, k = out_view(h_k)
        fe.gqa_reduce(p, num_heads_kv=h_k, out=k, _arch=arch, **kw)
        return [(bk, k, want.to(torch.bfloat16))]
    # accumulators carved out of NaN buffers (contiguous views) so that writes past them show
    acc = fe.gqa_accumulator(h_k, d, cu_seqlens=cu_t, total_tokens=total, deterministic=True, device=DEV, arch=arch)
    pads = []
    for name in ("dk_accum", "dv_accum"):
        t = getattr(acc, name)
        buf = canary((t.numel() + 2048,), torch.float32)
        view = buf[1024 : 1024 + t.numel()].view(t.shape).zero_()
        pads.append((buf, view.view(-1), None))
        acc = dataclasses.replace(acc, **{name: view})
    if op == "gqa_accumulate":
        fe.gqa_accumulate(p, p, acc, deterministic=True, **kw)
        return pads
    if not check_inputs:  # the metadata under test fills the accumulator too
        fe.gqa_accumulate(p, p, acc, deterministic=True, cu_seqlens=cu_t, check_inputs=False)
    if op == "gqa_postprocess":
        (bk, k), (bv, v) = out_view(h_k), out_view(h_k)
        fe.gqa_postprocess(acc, k, v, **kw)
        return pads + [(bk, k, want.to(torch.bfloat16)), (bv, v, want.to(torch.bfloat16))]
    dk_dense, _ = acc.to_dense(**kw)
    torch.cuda.synchronize()
    assert torch.equal(bits(dk_dense[:valid]), bits(want))
    return pads


def bad_metadata_workload():
    """Every op of BAD_OPS with each of BAD_CU, content checks off, on both paths: canaries intact, the
    rows of the sequences inside the tensor right, and the process healthy after (a later op works).
    Run in a child process by test_unchecked_metadata_near_int32_limit (a fault would end this one)."""
    for cu in BAD_CU:
        for op in BAD_OPS:
            for arch in (0, 80):
                checks = bad_metadata_call(op, cu, arch, check_inputs=False)
                torch.cuda.synchronize()
                for buf, view, want in checks:
                    got = buf.clone()
                    rows = 0 if want is None else want.shape[0]
                    if rows:
                        assert torch.equal(bits(view[:rows]), bits(want)), (op, cu, arch)
                    got.as_strided(view.shape, view.stride(), view.storage_offset()).copy_(view.new_zeros(()))
                    fresh = canary(buf.shape, buf.dtype)
                    fresh.as_strided(view.shape, view.stride(), view.storage_offset()).copy_(view.new_zeros(()))
                    assert torch.equal(bits(got), bits(fresh)), f"{op} {cu} arch {arch}: written outside the tensor"
    a = torch.ones(2, 64, 2, 128, device=DEV)
    dk = canary(a.shape)
    fe.store(a, a, dk, canary(a.shape))
    torch.cuda.synchronize()
    assert bool((dk == 1).all())
    print("OK")


def test_unchecked_metadata_near_int32_limit():
    # cu_seqlens entries near INT32_MAX once wrapped 32-bit sums before the clamp: an illegal address
    # (sticky: every later CUDA call failed). In a child process, so that a fault fails this test only.
    run_in_child(bad_metadata_workload)


@pytest.mark.parametrize("cu", BAD_CU, ids=("past-the-end", "all-int32-max"))
@pytest.mark.parametrize("op", BAD_OPS)
def test_checked_metadata_near_int32_limit(op, cu):
    # with the content checks on, the same calls raise before any launch
    last = len(cu) - 1
    with pytest.raises(fe.FlashEpilogueInputError, match=rf"cu_seqlens\[{last}\]: expected <= 300 \(the tensors' "
                                                        rf"token count\), got 2147483647"):
        bad_metadata_call(op, cu, 0, check_inputs=True)


def near_limit_cu(total, batch=24):
    """cu_seqlens over `total` tokens: two long sequences, then batch - 2 short ones in the last 2300 rows, where
    cu_seqlens[b] + b * kBlockN passes 2^31 (valid contents; every offset is < 2^31)."""
    tail = [total - 2300 + 100 * k for k in range(batch - 2)]
    return torch.tensor([0, 1000] + tail + [total], dtype=I32, device=DEV)


@pytest.mark.parametrize("arch", (0, 80), ids=("native", "sm80"))
@pytest.mark.parametrize("op", ("store_zero", "gqa_reduce"))
def test_varlen_offsets_near_int32_limit(op, arch):
    # total tokens 2^31 - 100 at d = 8: offsets past 2^31 - batch * kBlockN, valid metadata. Two
    # 16-bit tensors of these rows, 32 GiB each, are the least any op needs (an fp32 input alone
    # takes 64 GiB): store_zero's dk and dv, gqa_reduce's bf16 partials and output (64 GiB, and
    # the row mask and a chunk's reference)
    need_gib(72)
    total, d = 2**31 - 100, 8
    cu = near_limit_cu(total)
    batch = cu.numel() - 1
    assert cu[-2].item() + (batch - 1) * 128 >= 2**31
    used = torch.tensor([1000, 2**20] + [100 - 7 * (b % 3) for b in range(batch - 3)] + [2300 - 100 * (batch - 3)],
                        dtype=I32, device=DEV)
    outs = [canary((total, 1, d))]
    if op == "store_zero":
        outs.append(canary((total, 1, d)))
        fe.store_zero(*outs, cu_seqlens=cu, seqused=used, row_start=3, check_inputs=True, _arch=arch)
        bounds = [(s + 3, n - 3) for s, n in sequence_bounds(batch, total, cu, used)]
        expected = lambda a, b: torch.zeros((b - a, 1, d), dtype=torch.bfloat16, device=DEV)  # noqa: E731
    else:
        p = torch.randn((total, 1, d), dtype=torch.bfloat16, device=DEV)
        fe.gqa_reduce(p, num_heads_kv=1, out=outs[0], cu_seqlens=cu, seqused=used, scale_dk=0.5, check_inputs=True,
                      _arch=arch)
        bounds = sequence_bounds(batch, total, cu, used)
        expected = lambda a, b: gqa_reduce_sequential_fp32(p[a:b], 1, 0.5).to(torch.bfloat16)  # noqa: E731
    torch.cuda.synchronize()
    mask = row_mask(total, bounds)
    last = cu[-2].item()
    assert mask[last + 3 : last + 6].all()  # rows of the last sequence, past the 32-bit wrap, are written
    for name, out in zip(("dk", "dv"), outs):
        check_rows(name, out, expected, mask, 0)


# ---------------------------------------------------------------------------------------------
# 65535 heads: the one-CTA-per-tile grids hold them (the output tensor in gridDim.x, not in y)

H_MAX = 65535


@pytest.mark.parametrize("arch", (0, 80), ids=("native", "sm80"))
@pytest.mark.parametrize("d", (64, 128))
def test_store_and_store_zero_65535_heads(d, arch):
    gen = torch.Generator(device=DEV).manual_seed(4)
    a_k, a_v = rand((1, 2, H_MAX, d), gen), rand((1, 2, H_MAX, d), gen)
    dk, dv = canary(a_k.shape), canary(a_v.shape)
    fe.store(a_k, a_v, dk, dv, _arch=arch)
    torch.cuda.synchronize()
    assert torch.equal(bits(dk), bits(a_k.to(torch.bfloat16))) and torch.equal(bits(dv), bits(a_v.to(torch.bfloat16)))
    fe.store_zero(dk, dv, row_start=1, _arch=arch)
    torch.cuda.synchronize()
    assert bool((dk[:, 1] == 0).all()) and torch.equal(bits(dk[:, 0]), bits(a_k[:, 0].to(torch.bfloat16)))
    assert bool((dv[:, 1] == 0).all()) and torch.equal(bits(dv[:, 0]), bits(a_v[:, 0].to(torch.bfloat16)))


@pytest.mark.parametrize("arch", (0, 80), ids=("native", "sm80"))
@pytest.mark.parametrize("deterministic", (True, False), ids=("deterministic", "atomic"))
def test_gqa_ops_65535_heads(deterministic, arch):
    # 65535 query heads into 65535 KV heads (accumulate, to_dense, postprocess), and gqa_reduce of them
    need_gib(8)
    gen = torch.Generator(device=DEV).manual_seed(5)
    s, d = 2, 64
    pk, pv = rand((1, s, H_MAX, d), gen), rand((1, s, H_MAX, d), gen)
    acc = fe.gqa_accumulator(H_MAX, d, batch=1, seqlen=s, deterministic=deterministic, device=DEV, arch=arch)
    fe.gqa_accumulate(pk, pv, acc, deterministic=deterministic)
    dk, dv = canary(pk.shape), canary(pv.shape)
    fe.gqa_postprocess(acc, dk, dv, scale_dv=0.5)
    dense_k, dense_v = acc.to_dense()
    red_k, red_v = canary(pk.shape), canary(pv.shape)
    fe.gqa_reduce(pk, pv, num_heads_kv=H_MAX, out=(red_k, red_v), scale_dv=0.5, _arch=arch)
    torch.cuda.synchronize()
    assert torch.equal(bits(dense_k), bits(pk)) and torch.equal(bits(dense_v), bits(pv))  # g = 1: 0 + p exactly
    for got in (dk, red_k):
        assert torch.equal(bits(got), bits(pk.to(torch.bfloat16)))
    for got in (dv, red_v):
        assert torch.equal(bits(got), bits((pv * 0.5).to(torch.bfloat16)))


# ---------------------------------------------------------------------------------------------
# concurrency: streams and threads


def test_two_streams_deterministic_accumulations():
    # acc_a and acc_b (same problem, same partials) on two streams, acc_c (another head dim, varlen)
    # with them; launches interleaved; three rounds must give identical, reference-exact bits
    gen = torch.Generator(device=DEV).manual_seed(0)
    b, s, h_k, g, d = 2, 8192, 2, 8, 128
    chunks = [(rand((b, s, h_k * g, d), gen), rand((b, s, h_k * g, d), gen)) for _ in range(3)]
    lens = [4000, 0, 5000, 7000]
    cu = torch.tensor([0] + lens, dtype=I32).cumsum(0, dtype=I32).to(DEV)
    total = sum(lens) + 11
    chunks_c = [(rand((total, 16, 64), gen), rand((total, 16, 64), gen)) for _ in range(3)]
    acc_a = fe.gqa_accumulator(h_k, d, batch=b, seqlen=s, deterministic=True, device=DEV)
    acc_b = fe.gqa_accumulator(h_k, d, batch=b, seqlen=s, deterministic=True, device=DEV)
    acc_c = fe.gqa_accumulator(4, 64, cu_seqlens=cu, total_tokens=total, deterministic=True, device=DEV)
    ref = [torch.zeros(b, s, h_k, d, device=DEV) for _ in range(2)]
    for pk, pv in chunks:
        gqa_accumulate_reference(pk, pv, *ref, num_heads_kv=h_k)
    ref_c = [torch.zeros(total, 4, 64, device=DEV) for _ in range(2)]
    for pk, pv in chunks_c:
        gqa_accumulate_reference(pk, pv, *ref_c, num_heads_kv=4, cu_seqlens=cu)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    first = None
    for _ in range(3):
        for st in (s1, s2):
            st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s1):
            acc_a.reset()
            acc_c.reset()
        with torch.cuda.stream(s2):
            acc_b.reset()
        for (pk, pv), (ck, cv) in zip(chunks, chunks_c):
            with torch.cuda.stream(s1):
                fe.gqa_accumulate(pk, pv, acc_a)
            with torch.cuda.stream(s2):
                fe.gqa_accumulate(pk, pv, acc_b)
            with torch.cuda.stream(s1):
                fe.gqa_accumulate(ck, cv, acc_c, cu_seqlens=cu)
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)
        got = [t.clone() for t in (acc_a.dk_accum, acc_a.dv_accum, acc_b.dk_accum, acc_b.dv_accum, acc_c.dk_accum)]
        torch.cuda.synchronize()
        assert torch.equal(bits(got[0]), bits(got[2])) and torch.equal(bits(got[1]), bits(got[3]))
        if first is None:
            first = got
            for acc, r, seq in ((acc_a, ref, {}), (acc_b, ref, {}), (acc_c, ref_c, {"cu_seqlens": cu})):
                for x, w in zip(acc.to_dense(**seq), r):
                    assert torch.equal(bits(x), bits(w))
        else:
            for x, w in zip(got, first):
                assert torch.equal(bits(x), bits(w))


def test_two_streams_mixed_ops():
    # stream 1: store + store_zero; stream 2: gqa_reduce + non-deterministic accumulate +
    # postprocess; five rounds each, launches interleaved, then everything against the reference
    gen = torch.Generator(device=DEV).manual_seed(1)
    b, s, h, d = 2, 4096, 8, 128
    accs = [(rand((b, s, h, d), gen), rand((b, s, h, d), gen)) for _ in range(5)]
    parts = [rand((b, s, 2 * h, d), gen) for _ in range(5)]
    outs_store = [[canary((b, s, h, d)) for _ in range(2)] for _ in range(5)]
    outs_reduce = [canary((b, s, h, d), torch.float16) for _ in range(5)]
    outs_post = [[canary((b, s, h, d)) for _ in range(2)] for _ in range(5)]
    acc = fe.gqa_accumulator(h, d, batch=b, seqlen=s, device=DEV)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    for i in range(5):
        with torch.cuda.stream(s1):
            fe.store(*accs[i], *outs_store[i])
            fe.store_zero(*outs_store[i], head_idx=[i % h], row_start=100, row_end=1000)
        with torch.cuda.stream(s2):
            fe.gqa_reduce(parts[i], num_heads_kv=h, out=outs_reduce[i], scale_dk=0.5)
            acc.reset()
            fe.gqa_accumulate(parts[i], parts[i], acc, deterministic=False)
            fe.gqa_postprocess(acc, *outs_post[i], scale_dv=2.0)
    torch.cuda.current_stream().wait_stream(s1)
    torch.cuda.current_stream().wait_stream(s2)
    torch.cuda.synchronize()
    for i in range(5):
        for out, a in zip(outs_store[i], accs[i]):
            want = a.to(torch.bfloat16)
            want[:, 100:1000, i % h] = 0
            assert torch.equal(bits(out), bits(want)), f"store round {i}"
        want = gqa_reduce_reference(parts[i], num_heads_kv=h, out_dtype=torch.float16, scale_dk=0.5, sequential=True)
        assert torch.equal(bits(outs_reduce[i]), bits(want)), f"reduce round {i}"
        # two query heads per KV head, one call: the atomic sum is exact regardless of order
        summed = gqa_reduce_sequential_fp32(parts[i], h)
        assert torch.equal(bits(outs_post[i][0]), bits(summed.to(torch.bfloat16))), f"postprocess dk round {i}"
        assert torch.equal(bits(outs_post[i][1]), bits((summed * 2.0).to(torch.bfloat16))), f"postprocess dv round {i}"


def test_persistent_drivers_on_two_streams_and_in_a_graph():
    # The persistent sm_90 drivers on problems of 8-31 tiles per SM (store 31, gqa_reduce 8, gqa_accumulate 16
    # on 132 SMs): two streams at once, launches interleaved; then the three in one CUDA graph, replayed on new
    # inputs. Every output bitwise against the reference, every time.
    gen = torch.Generator(device=DEV).manual_seed(3)
    b, s, h, d = 4, 8192, 8, 128
    ak, av = rand((b, s, h, d), gen), rand((b, s, h, d), gen)
    red = rand((b, s // 2, 4 * h, d), gen, dtype=torch.bfloat16)
    pk, pv = rand((b // 2, s, 4 * h, d), gen), rand((b // 2, s, 4 * h, d), gen)
    accs = [fe.gqa_accumulator(h, d, batch=b // 2, seqlen=s, device=DEV) for _ in range(2)]

    def step(acc, outs):
        fe.store(ak, av, outs[0], outs[1])
        fe.gqa_reduce(red, num_heads_kv=h, out=outs[2])
        acc.reset()
        fe.gqa_accumulate(pk, pv, acc)
        return acc.to_dense()

    def expected():  # of the current inputs: dk, dv, the reduced dk, the accumulators' dense dk and dv
        return [ak.to(torch.bfloat16), av.to(torch.bfloat16),
                gqa_reduce_reference(red, num_heads_kv=h, out_dtype=torch.bfloat16, sequential=True),
                gqa_reduce_sequential_fp32(pk, h), gqa_reduce_sequential_fp32(pv, h)]

    def check(outs, dense, want):
        for got, w in zip([*outs, *dense], want):
            assert torch.equal(bits(got), bits(w))

    def outputs():
        return [canary((b, s, h, d)), canary((b, s, h, d)), canary((b, s // 2, h, d))]

    outs = [outputs(), outputs()]
    want = expected()
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    for st in streams:
        st.wait_stream(torch.cuda.current_stream())
    for _ in range(3):
        dense = [None, None]
        for i in (0, 1):
            with torch.cuda.stream(streams[i]):
                dense[i] = step(accs[i], outs[i])
        for st in streams:
            torch.cuda.current_stream().wait_stream(st)
        for i in (0, 1):
            check(outs[i], dense[i], want)

    graph, dense = cuda_graph(lambda: step(accs[0], outs[0]))
    for _ in range(3):
        for t in (ak, av, pk, pv):
            t.copy_(rand(t.shape, gen))
        red.copy_(rand(red.shape, gen, dtype=torch.bfloat16))
        graph.replay()
        check(outs[0], dense, expected())


def test_persistent_store_beside_another_kernel():
    # The persistent store's TMA hand-off once shared a named barrier id with the tile's first barrier
    # (two thread counts on one id): beside another kernel the issuing warp lagged, the other warps
    # reached the next tile's barrier first, and this loop faulted ("illegal instruction") one run in two.
    gen = torch.Generator(device=DEV).manual_seed(2)
    b, s, h, d = 2, 4096, 8, 128
    acc_k, acc_v, part = rand((b, s, h, d), gen), rand((b, s, h, d), gen), rand((b, s, 2 * h, d), gen)
    outs = [canary((b, s, h, d)) for _ in range(5)]
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    for st in streams:
        st.wait_stream(torch.cuda.current_stream())
    for i in range(300):
        with torch.cuda.stream(streams[0]):
            fe.store(acc_k, acc_v, outs[0], outs[1])
        with torch.cuda.stream(streams[1]):  # gqa_reduce and a second store, in turn
            fe.gqa_reduce(part, num_heads_kv=h, out=outs[2]) if i % 2 else fe.store(acc_v, acc_k, outs[3], outs[4])
    torch.cuda.synchronize()
    reduced = gqa_reduce_reference(part, num_heads_kv=h, out_dtype=torch.bfloat16, sequential=True)
    for out, want in zip(outs, (acc_k, acc_v, reduced, acc_v, acc_k)):
        assert torch.equal(bits(out), bits(want.to(torch.bfloat16)))


def test_host_threads_with_own_streams():
    # four host threads, each with its own stream and tensors, validating and launching at once
    errors, results = [], {}
    barrier = threading.Barrier(4, timeout=60)

    def worker(k):
        try:
            torch.cuda.set_device(0)
            gen = torch.Generator(device=DEV).manual_seed(100 + k)
            stream = torch.cuda.Stream()
            d = (64, 96, 128, 256)[k]
            with torch.cuda.stream(stream):
                a = rand((2, 1000, 4, d), gen)
                p = rand((2, 1000, 8, d), gen)
                acc = fe.gqa_accumulator(4, d, batch=2, seqlen=1000, deterministic=True, device=DEV)
                barrier.wait()
                for _ in range(10):
                    out = canary((2, 1000, 4, d))
                    fe.store(a, a, out, canary((2, 1000, 4, d)))
                    red = fe.gqa_reduce(p, num_heads_kv=4, out_dtype=torch.bfloat16)
                    acc.reset()
                    fe.gqa_accumulate(p, p, acc)
                    dk = canary((2, 1000, 4, d))
                    fe.gqa_postprocess(acc, dk, canary((2, 1000, 4, d)))
                stream.synchronize()
                results[k] = (a, p, out, red, dk)
        except Exception as e:  # noqa: BLE001 (reported by the main thread)
            errors.append((k, repr(e)))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(results) == [0, 1, 2, 3]
    torch.cuda.synchronize()
    for k, (a, p, out, red, dk) in results.items():
        assert torch.equal(bits(out), bits(a.to(torch.bfloat16))), k
        want = gqa_reduce_sequential_fp32(p, 4).to(torch.bfloat16)
        assert torch.equal(bits(red), bits(want)), k
        assert torch.equal(bits(dk), bits(want)), k


def fresh_thread_workload():
    """Every op called from host threads that have made no CUDA call (no current CUDA context),
    then repeat_kv's backward through the autograd engine's device thread; every result checked
    bitwise. Run in a child process by test_every_op_from_a_fresh_thread."""

    def in_fresh_thread(fn):  # everything fn touches is allocated by the caller
        errors = []

        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        t.join()
        if errors:
            raise errors[0]

    gen = torch.Generator(device=DEV).manual_seed(7)
    b, s, h, g, d = 2, 300, 4, 2, 128
    a = rand((b, s, h, d), gen)
    p32 = rand((b, s, h * g, d), gen)
    p16 = p32.to(torch.bfloat16)
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

    want_store = bits(a.to(torch.bfloat16))
    want_reduce = bits(gqa_reduce_sequential_fp32(p32, h).to(torch.bfloat16))
    assert torch.equal(bits(outs["dk"]), want_store) and torch.equal(bits(outs["dv"]), want_store), "store"
    assert bool((outs["z0"] == 0).all()) and bool((outs["z1"] == 0).all()), "store_zero"
    assert torch.equal(bits(outs["r32"]), want_reduce), "gqa_reduce fp32 partials"
    want16 = bits(gqa_reduce_sequential_fp32(p16.float(), h).to(torch.bfloat16))
    assert torch.equal(bits(outs["r16"]), want16), "gqa_reduce bf16 partials"
    assert torch.equal(bits(outs["pk"]), want_reduce) and torch.equal(bits(outs["pv"]), want_reduce), \
        "gqa_accumulate + postprocess"

    # the autograd engine runs backward on a device thread of its own: repeat_kv's kernel backward
    x = rand((b, h, s, d), gen, torch.bfloat16).requires_grad_()
    grad = rand((b, h * g, s, d), gen, torch.bfloat16)
    (dx,) = torch.autograd.grad(fe.repeat_kv(x, g), x, grad)
    want = gqa_reduce_sequential_fp32(grad.transpose(1, 2).float(), h).to(torch.bfloat16).transpose(1, 2)
    assert torch.equal(bits(dx), bits(want)), "repeat_kv backward"
    print("OK")


def test_every_op_from_a_fresh_thread():
    # A host thread without a current CUDA context (c10's device guard does not bind one when the
    # index already matches) made the TMA descriptor encode fail and the process crash (seen on the
    # H200): every op runs from such threads in a child process, so a crash fails this test only.
    run_in_child(fresh_thread_workload)
