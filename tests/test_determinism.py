"""torch.use_deterministic_algorithms(True), per code path: gqa_accumulate runs deterministically by default; on the
sm_80 path gqa_accumulator allocates the ordered mode's semaphores and the atomic mode asked for explicitly is torch's
alert (with warn_only a warning), on the sm_90 path (deterministic in both modes) neither; the other ops are
unchanged. Every deterministic path repeated 1000 times (FlashAttention-3's standard; marked slow) on
stressing shapes, the outputs refilled with canary bits before each repeat: each repeat bitwise the first.
"""
import contextlib
import warnings

import pytest
import torch

import flash_epilogue as fe
from conftest import deterministic_algorithms, every_op_launches
from flash_epilogue.reference import (gqa_accumulate_reference, gqa_reduce_sequential_fp32, group_sum_reference,
                                      store_reference, store_zero_reference)
from flash_epilogue.testing import bits, canary, generator, problem, rand

F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.ops
@pytest.mark.parametrize("arch", [90, 80])
def test_accumulator_default_follows_the_switch(arch):
    # the accumulator's flag follows the switch; only the sm_80 path's ordered mode has semaphores to allocate
    kw = dict(batch=1, seqlen=64, device="cpu", arch=arch)

    def flags(acc):
        return acc.deterministic, acc.semaphores is not None

    assert flags(fe.gqa_accumulator(2, 128, **kw)) == (False, False)
    for warn_only in (False, True):
        with deterministic_algorithms(warn_only):
            assert flags(fe.gqa_accumulator(2, 128, **kw)) == (True, arch == 80)
            assert flags(fe.gqa_accumulator(2, 128, deterministic=False, **kw)) == (False, False)
    assert flags(fe.gqa_accumulator(2, 128, deterministic=True, **kw)) == (True, arch == 80)


ALERT = r"gqa_accumulate\(deterministic=False\) on the sm_80 path does not have a deterministic implementation"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", [90, 80])
def test_ops_under_the_switch(arch):
    # sm_80: the atomic mode is torch's alert (with warn_only a warning), the ordered one needs the semaphores. sm_90:
    # deterministic in both modes, so neither: every call gives the sequential sum's bits
    gen = generator(1)
    pk, pv = rand((2, 300, 8, 128), gen), rand((2, 300, 8, 128), gen)
    ref = [torch.zeros(2, 300, 2, 128, device="cuda") for _ in range(2)]
    gqa_accumulate_reference(pk, pv, *ref, num_heads_kv=2)
    magnitude = [torch.zeros(2, 300, 2, 128, device="cuda") for _ in range(2)]  # each group's sum of |partial|
    gqa_accumulate_reference(pk.abs(), pv.abs(), *magnitude, num_heads_kv=2)

    def exact(acc):
        return all(torch.equal(bits(g), bits(w)) for g, w in zip(acc.to_dense(), ref))

    with deterministic_algorithms():
        acc = fe.gqa_accumulator(2, 128, batch=2, seqlen=300, arch=arch)  # deterministic by default
        fe.gqa_accumulate(pk, pv, acc)  # the sequential sum, exactly
        assert exact(acc)
        plain = fe.gqa_accumulator(2, 128, batch=2, seqlen=300, deterministic=False, arch=arch)
        calls = (lambda: fe.gqa_accumulate(pk, pv, plain, deterministic=False),
                 lambda: torch.ops.flash_epilogue.gqa_accumulate(pk, pv, plain.dk_accum, plain.dv_accum, _arch=arch))
        if arch == 80:
            with pytest.raises(ValueError, match=r"semaphores: expected an int32 tensor of >= \d+ entries because "
                               r"deterministic=True on the sm_80 path \(allocate the accumulator with "
                               r"flash_epilogue\.gqa_accumulator\(\.\.\., deterministic=True\)\), got None"):
                fe.gqa_accumulate(pk, pv, plain)  # deterministic by the switch
            for call in calls:
                with pytest.raises(RuntimeError, match=r"flash_epilogue\." + ALERT + r", but you set "
                                   r"'torch\.use_deterministic_algorithms\(True\)'"):
                    call()
            assert not plain.dk_accum.any() and not plain.dv_accum.any()  # refused before the launch
        else:
            for call in (lambda: fe.gqa_accumulate(pk, pv, plain), *calls):
                plain.reset()
                call()
                assert plain.semaphores is None and exact(plain)
    with deterministic_algorithms(warn_only=True):
        for kw in ({}, {"deterministic": False}):
            plain.reset()
            if arch == 80:
                with pytest.warns(UserWarning, match=ALERT):
                    fe.gqa_accumulate(pk, pv, plain, **kw)
                # atomic adds in any order: each sum within the rounding error of its 4 fp32 adds (4 u times the
                # group's sum of |partial|), and the sequential reference within as much
                for got, want, size in zip(plain.to_dense(), ref, magnitude):
                    assert ((got - want).abs() <= 2 * 4 * 2.0**-24 * size).all()
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    fe.gqa_accumulate(pk, pv, plain, **kw)
                assert exact(plain)
    if arch == 90:
        for switch in (False, True):  # every op else: the same reference-exact bits either way
            with deterministic_algorithms() if switch else contextlib.nullcontext():
                _, launches, check = every_op_launches(128, generator(2), lead=(2, 200), h=2, g=8)
                for launch in launches:
                    launch()
            check(switch)


def assert_repeatable(step, outputs, want=(), n=1000):
    """step() n times, the outputs set to all-ones bits before each: every output bitwise its value after the first
    run (compared on the GPU, one count read at the end), and the first outputs bitwise `want` (as many as given)."""
    first, differing = None, torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(n):
        for o in outputs:
            bits(o).fill_(-1)
        step()
        first = first or [bits(o).clone() for o in outputs]
        for o, f in zip(outputs, first):
            differing += (bits(o) != f).any()
    torch.cuda.synchronize()
    assert differing.item() == 0, f"{differing.item()} (output, repeat) pairs of {n - 1} repeats differ from the first"
    for f, w in zip(first, want):
        assert torch.equal(f, bits(w))


# (d, dv, h_k, group, layout): group 8 and 16, hundreds of short sequences, head dim 256, (192, 128)
GQA_SHAPES = [(128, 128, 4, 8, "batched"), (128, 128, 2, 16, "varlen"), (256, 256, 2, 8, "batched"),
              (192, 128, 2, 16, "varlen"), (64, 64, 4, 16, "varlen")]


def gqa_problem(layout, seed):
    """The Problem: batched (2, 1000), or varlen: 400 sequences of 1-48 tokens."""
    if layout == "batched":
        return problem(2, 1000)
    return problem(lens=torch.randint(1, 49, (400,), generator=torch.Generator().manual_seed(seed)).tolist())


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("op", ["reduce-fp32", "reduce-bf16", "accumulate-sm90", "accumulate-sm80"])
@pytest.mark.parametrize("d,dv,h_k,g,layout", GQA_SHAPES)
def test_gqa_1000_repeats(d, dv, h_k, g, layout, op):
    # reduce: fp32 or bf16 partials; accumulate: three calls into one deterministic accumulator, then the postprocess
    accumulate = op.startswith("accumulate")
    p = gqa_problem(layout, seed=d + g + accumulate)
    lead, kw = p.lead, p.seq
    gen = generator(d * g + accumulate)
    outs = canary(lead + (h_k, d)), canary(lead + (h_k, dv))
    if not accumulate:
        pk, pv = (rand(lead + (h_k * g, n), gen, F32 if op == "reduce-fp32" else BF16) for n in (d, dv))
        want = gqa_reduce_sequential_fp32(pk.float(), h_k, 0.5).to(BF16)
        assert_repeatable(lambda: fe.gqa_reduce(pk, pv, num_heads_kv=h_k, out=outs, scale_dk=0.5, **kw), outs, [want])
        return
    chunks = [(rand(lead + (h_k * g, d), gen), rand(lead + (h_k * g, dv), gen)) for _ in range(3)]
    acc = fe.gqa_accumulator(h_k, d, dv, deterministic=True, arch=int(op[-2:]), **p.alloc)

    def step():
        acc.reset()
        for pk, pv in chunks:
            fe.gqa_accumulate(pk, pv, acc, **kw)
        fe.gqa_postprocess(acc, *outs, scale_dk=0.125, **kw)

    assert_repeatable(step, (*outs, acc.dk_accum, acc.dv_accum))
    ref = [torch.zeros(lead + (h_k, n), device="cuda") for n in (d, dv)]
    for pk, pv in chunks:
        gqa_accumulate_reference(pk, pv, *ref, num_heads_kv=h_k, **kw)
    assert all(torch.equal(bits(got), bits(want)) for got, want in zip(acc.to_dense(**kw), ref))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("d,n_rep", [(128, 8), (256, 16), (64, 16)])
def test_repeat_kv_backward_1000_repeats(d, n_rep, dim):
    gen = generator(d + n_rep + dim)
    x = rand((2, 2, 1000, d) if dim == 1 else (2, 1000, 2, d), gen, BF16).requires_grad_()
    y = fe.repeat_kv(x, n_rep, dim=dim)
    g = rand(y.shape, gen, BF16)
    gx = torch.empty_like(x)
    assert_repeatable(lambda: gx.copy_(torch.autograd.grad(y, x, g, retain_graph=True)[0]), (gx,),
                      [group_sum_reference(g, n_rep, dim)])


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("d,dv,layout", [(128, 128, "varlen"), (256, 256, "batched"), (192, 128, "varlen"),
                                         (64, 64, "batched")])
def test_store_and_store_zero_1000_repeats(d, dv, layout):
    p = gqa_problem(layout, seed=d + 7)
    lead, kw = p.lead, p.seq
    gen = generator(d + 7)
    ak, av = rand(lead + (4, d), gen), rand(lead + (4, dv), gen)
    outs = canary(lead + (4, d)), canary(lead + (4, dv))
    sel = dict(batch_idx=[0, 1, 5, 300][: 2 if layout == "batched" else 4], head_idx=[1, 3], row_start=3, row_end=40)
    want = [o.clone() for o in outs]
    store_reference(ak, av, *want, **kw)
    store_zero_reference(*want, **sel, **kw)

    def step():
        fe.store(ak, av, *outs, **kw)
        fe.store_zero(*outs, **sel, **kw)

    assert_repeatable(step, outs, want)
