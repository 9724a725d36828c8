"""Property-based fuzzing (hypothesis) of every op against the pure-PyTorch reference.

Drawn per case: dtypes (bf16/fp16 outputs; fp32/bf16/fp16 partials for gqa_reduce), head dims (any
multiple of 8 up to 256; dv != d), batch (0 too), sequence lengths at the tile edges or anywhere up to
3 kBlockN, varlen with slack rows, seqused, strides (conftest.carve's layouts), GQA group sizes 1 to 16,
deterministic on/off, several accumulate calls, the sm_80 path (`_arch=80`). Outputs are views into
canary buffers compared whole, bit for bit, with the reference applied to a clone; inputs are views
into NaN buffers. Exact oracles but for the non-deterministic accumulate (the bound of test_gqa.py).
test_fuzz_unchecked_metadata draws inconsistent cu_seqlens / seqused, near the int32 limits too, with
the content checks off: every buffer around the written tensors (accumulators included) is intact.

Reproducible: derandomized (the same cases every run) unless FLASH_EPILOGUE_FUZZ_SEED=<int> picks
another seed; FLASH_EPILOGUE_FUZZ_SCALE=<float> scales the number of cases (default 1: 620 GPU
cases over the five checks, ~20-40 s on an H200). A failing case is shrunk and printed with a replay
line, a python command that reruns exactly that case, e.g.

    python -c "import sys; sys.path[:0] = ['.', 'tests']; import test_fuzz as t; t.check_store(**{...})"

test_fuzz_cases_validate_on_cpu runs a few cases of each op without a GPU (CI): every drawn call
passes every check of the op up to the last one, the device check, and the references run.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flash_epilogue as fe  # noqa: E402
from conftest import (LAYOUTS, assert_bits, block_n, canary, carve, cu_seqlens, input_view, int32,  # noqa: E402
                      rand, same_view)
from flash_epilogue.reference import (  # noqa: E402
    gqa_accumulate_reference,
    gqa_reduce_reference,
    store_reference,
    store_zero_reference,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COMPILED = (64, 96, 128, 192, 256)
GROUPS = (1, 2, 3, 4, 6, 8, 16)
SCALES = (1.0, 0.5, 3.0, 1.0 / 3.0, 128**-0.5, 0.0)
U32 = 2.0**-24

_SCALE = float(os.environ.get("FLASH_EPILOGUE_FUZZ_SCALE", "1"))
_SEED = os.environ.get("FLASH_EPILOGUE_FUZZ_SEED")


def fuzz_settings(n: int):
    """n cases (times FLASH_EPILOGUE_FUZZ_SCALE), no deadline, no example database, derandomized
    unless a seed is given."""
    return settings(max_examples=max(1, int(n * _SCALE)), deadline=None, database=None, derandomize=_SEED is None,
                    print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                            HealthCheck.filter_too_much,
                                                            HealthCheck.large_base_example])


def seeded(f):
    return hypothesis.seed(int(_SEED))(f) if _SEED is not None else f


# ---------------------------------------------------------------------------------------------
# tensors


def problem(dev, batch, seqlen, lens, slack, used):
    """(leading shape, seq kwargs without seqused, seq kwargs with seqused if given)."""
    if lens is not None:
        lead, seq = (sum(lens) + slack,), {"cu_seqlens": cu_seqlens(lens, dev)}
    else:
        lead, seq = (batch, seqlen), {}
    with_used = dict(seq)
    if used is not None:
        with_used["seqused"] = int32(*used, device=dev)
    return lead, seq, with_used


def executed(dev) -> bool:
    """Whether `call` runs the ops on this device (and the results are to be checked)."""
    return dev == "cuda"


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def assert_buffers_written(dev, *checks):
    """After an op that `call` ran: each (name, buffer, expected copy) bitwise equal, on a GPU."""
    if not executed(dev):
        return
    sync(dev)
    for name, got, want in checks:
        assert_bits(got, want, name)


def call(dev, fn, *args, **kwargs):
    """Run the op on a GPU. On CPU, check that the call passes every validation check but the last,
    the device check (what CI can say about the drawn arguments without a GPU)."""
    if dev == "cuda":
        return fn(*args, **kwargs)
    with pytest.raises(ValueError, match="device: expected a CUDA tensor, got a tensor on cpu"):
        fn(*args, **kwargs)
    return None


# ---------------------------------------------------------------------------------------------
# strategies: plain dicts of ints/strings/lists, so that a case prints as a python call


def head_dims():
    return st.one_of(st.sampled_from(COMPILED), st.integers(1, 32).map(lambda k: 8 * k))


def seqlens(n):
    # hypothesis shrinks towards the first choices: keep the empty cases out of front
    return st.one_of(st.integers(1, 3 * n), st.sampled_from((n + 1, n - 1, n, 1, 2 * n + 1, 2 * n - 1, 2 * n, 0)))


@st.composite
def geometry(draw, n, max_batch=3):
    """batch/seqlen (batched) or lens/slack (varlen), and seqused (None or per sequence)."""
    if draw(st.booleans()):
        lens = draw(st.lists(seqlens(n), min_size=1, max_size=4))
        g = {"batch": None, "seqlen": None, "lens": lens, "slack": draw(st.sampled_from((0, 0, 1, 5)))}
        limits = lens
    else:
        batch = draw(st.sampled_from(tuple(range(max_batch, 0, -1)) * 3 + (0,)))
        s = draw(seqlens(n))
        g = {"batch": batch, "seqlen": s, "lens": None, "slack": 0}
        limits = [s] * batch
    g["used"] = None
    if draw(st.booleans()):
        g["used"] = [draw(st.one_of(st.integers(0, m), st.just(m))) for m in limits]
    return g


def paths_and_dims(draw):
    """arch (0 twice as often as the sm_80 path), d and dv (often d)."""
    arch, d = draw(st.sampled_from((0, 0, 80))), draw(head_dims())
    return arch, d, draw(st.one_of(st.just(d), head_dims()))


@st.composite
def store_cases(draw):
    arch, d, dv = paths_and_dims(draw)
    p = {"dtype": draw(st.sampled_from(("bf16", "fp16"))), "d": d, "dv": dv, "arch": arch,
         "heads": draw(st.integers(1, 3))}
    p.update(draw(geometry(block_n(d, dv, arch))))
    p["layouts"] = [draw(st.sampled_from(LAYOUTS)) for _ in range(4)]  # dk, dv, dk_accum, dv_accum
    p["seed"] = draw(st.integers(0, 2**31 - 1))
    return p


@st.composite
def selection(draw, limit):
    """batch_idx / head_idx: None, an int, a list (out-of-range entries and duplicates too), the list
    as an int32 tensor, or empty."""
    form = draw(st.sampled_from(("list", "list", "tensor", "none", "int", "empty")))
    inside = st.integers(0, max(limit - 1, 0))
    entries = st.one_of(inside, inside, inside, st.sampled_from((-1, limit, limit + 1)))
    if form == "none":
        return None
    if form == "int":
        return draw(entries)
    v = [] if form == "empty" else draw(st.lists(entries, min_size=1, max_size=4))
    return {"tensor": v} if form == "tensor" or draw(st.booleans()) and form == "empty" else v


@st.composite
def store_zero_cases(draw):
    arch, d, dv = paths_and_dims(draw)
    n = block_n(d, dv, arch)
    heads = draw(st.sampled_from((2, 3, 1)))
    p = {"dtype": draw(st.sampled_from(("bf16", "fp16"))), "d": d, "dv": dv, "arch": arch, "heads": heads}
    p.update(draw(geometry(n)))
    nb = len(p["lens"]) if p["lens"] is not None else p["batch"]
    p["batch_idx"] = draw(selection(nb))
    p["head_idx"] = draw(selection(heads))
    p["row_start"] = draw(st.one_of(st.just(0), st.integers(0, n + 1), st.sampled_from((n - 1, n, n + 1, 2 * n + 2))))
    p["row_end"] = draw(st.one_of(st.none(), st.integers(0, 2 * n + 2).map(lambda k: p["row_start"] + k)))
    p["layouts"] = [draw(st.sampled_from(LAYOUTS)) for _ in range(2)]
    p["seed"] = draw(st.integers(0, 2**31 - 1))
    return p


@st.composite
def group_shape(draw):
    g = draw(st.sampled_from(GROUPS))
    h_k = draw(st.integers(1, max(1, min(3, 24 // g))))
    return h_k, g


@st.composite
def accumulate_cases(draw):
    arch, d, dv = paths_and_dims(draw)
    h_k, g = draw(group_shape())
    p = {"d": d, "dv": dv, "arch": arch, "h_k": h_k, "g": g, "deterministic": draw(st.booleans())}
    p.update(draw(geometry(block_n(d, dv, arch))))
    chunks = draw(st.integers(1, 3))
    p["chunk_seqused"] = [draw(st.booleans()) for _ in range(chunks)]  # which calls pass seqused
    p["partial_layouts"] = [draw(st.sampled_from(LAYOUTS)) for _ in range(2)]
    p["out_dtype"] = draw(st.sampled_from(("bf16", "fp16")))
    p["out_layouts"] = [draw(st.sampled_from(LAYOUTS)) for _ in range(2)]
    p["post_seqused"] = draw(st.booleans())
    p["scales"] = [draw(st.sampled_from(SCALES)) for _ in range(2)]
    p["seed"] = draw(st.integers(0, 2**31 - 1))
    return p


@st.composite
def reduce_cases(draw):
    arch, d, dv = paths_and_dims(draw)
    with_dv = draw(st.booleans())
    dv = dv if with_dv else d
    h_k, g = draw(group_shape())
    partial_dtype = draw(st.sampled_from(("fp32", "fp32", "bf16", "fp16")))
    out_dtype = partial_dtype if partial_dtype != "fp32" else draw(st.sampled_from(("bf16", "fp16")))
    p = {"d": d, "dv": dv, "with_dv": with_dv, "arch": arch, "h_k": h_k, "g": g, "partial_dtype": partial_dtype,
         "out_dtype": out_dtype}
    p.update(draw(geometry(block_n(d, dv, arch))))
    p["partial_layouts"] = [draw(st.sampled_from(LAYOUTS)) for _ in range(2)]
    p["give_out"] = draw(st.booleans())
    p["out_layouts"] = [draw(st.sampled_from(LAYOUTS)) for _ in range(2)]
    p["scales"] = [draw(st.sampled_from(SCALES)) for _ in range(2)]
    p["seed"] = draw(st.integers(0, 2**31 - 1))
    return p


@st.composite
def unchecked_metadata_cases(draw):
    """Inconsistent cu_seqlens / seqused near the int32 limits (and small ones), content checks off."""
    arch, d, dv = paths_and_dims(draw)
    n = block_n(d, dv, arch)
    total = draw(st.integers(0, 3 * n))
    near = (2**31 - 1, 2**31 - 2, 2**31 - n, 2**31 - n - 1, 2**31 - 5 * n - 3, -1, -n, -(2**31), -(2**31) + 1)
    entry = st.one_of(st.integers(0, total + 2), st.sampled_from(near))
    batch = draw(st.integers(1, 4))
    p = {"op": draw(st.sampled_from(("store", "store_zero", "gqa_accumulate", "gqa_postprocess", "gqa_reduce"))),
         "d": d, "dv": dv, "arch": arch, "total": total, "cu": draw(st.lists(entry, min_size=batch + 1,
                                                                            max_size=batch + 1))}
    p["cu"][0] = draw(st.sampled_from((0, 0, p["cu"][0])))
    p["used"] = draw(st.one_of(st.none(), st.lists(entry, min_size=batch, max_size=batch)))
    p["deterministic"] = draw(st.booleans())
    p["seed"] = draw(st.integers(0, 2**31 - 1))
    return p


# ---------------------------------------------------------------------------------------------
# checks: one case each; module-level so that a replay line can call them


def check_store(dtype, d, dv, arch, heads, batch, seqlen, lens, slack, used, layouts, seed, dev="cuda"):
    dt = DTYPES[dtype]
    gen = torch.Generator(device=dev).manual_seed(seed)
    lead, _, seq = problem(dev, batch, seqlen, lens, slack, used)
    shape_k, shape_v = lead + (heads, d), lead + (heads, dv)
    acc_k = input_view(shape_k, layouts[2], gen, binades=20)  # rounding of large and tiny magnitudes
    acc_v = input_view(shape_v, layouts[3], gen, binades=20)
    (buf_k, dk), (buf_v, dv_out) = carve(shape_k, dt, layouts[0], dev), carve(shape_v, dt, layouts[1], dev)
    expect_k, expect_v = buf_k.clone(), buf_v.clone()
    store_reference(acc_k, acc_v, same_view(expect_k, dk), same_view(expect_v, dv_out), **seq)
    call(dev, fe.store, acc_k, acc_v, dk, dv_out, _arch=arch, **seq)
    assert_buffers_written(dev, ("dk", buf_k, expect_k), ("dv", buf_v, expect_v))


def _selection(sel, dev):
    if isinstance(sel, dict):
        return torch.tensor(sel["tensor"], dtype=torch.int32, device=dev)
    return sel


def check_store_zero(dtype, d, dv, arch, heads, batch, seqlen, lens, slack, used, batch_idx, head_idx, row_start,
                     row_end, layouts, seed, dev="cuda"):
    dt = DTYPES[dtype]
    gen = torch.Generator(device=dev).manual_seed(seed)
    lead, _, seq = problem(dev, batch, seqlen, lens, slack, used)
    shape_k, shape_v = lead + (heads, d), lead + (heads, dv)
    (buf_k, dk), (buf_v, dv_out) = carve(shape_k, dt, layouts[0], dev), carve(shape_v, dt, layouts[1], dev)
    dk.copy_(rand(shape_k, gen, dt))  # nonzero contents in the view, canary around it
    dv_out.copy_(rand(shape_v, gen, dt))
    sel = {"batch_idx": _selection(batch_idx, dev), "head_idx": _selection(head_idx, dev)}
    expect_k, expect_v = buf_k.clone(), buf_v.clone()
    store_zero_reference(same_view(expect_k, dk), same_view(expect_v, dv_out), row_start=row_start, row_end=row_end,
                         **sel, **seq)
    call(dev, fe.store_zero, dk, dv_out, row_start=row_start, row_end=row_end, _arch=arch, **sel, **seq)
    assert_buffers_written(dev, ("dk", buf_k, expect_k), ("dv", buf_v, expect_v))


def _scaled(dense, scale):
    return dense * torch.tensor(scale, dtype=torch.float32, device=dense.device)


def check_accumulate(d, dv, arch, h_k, g, deterministic, batch, seqlen, lens, slack, used, chunk_seqused,
                     partial_layouts, out_dtype, out_layouts, post_seqused, scales, seed, dev="cuda"):
    """gqa_accumulate called once per entry of chunk_seqused (with seqused where True), checked
    through to_dense; then gqa_postprocess of the accumulator into canary-carved outputs."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    lead, seq, seq_used = problem(dev, batch, seqlen, lens, slack, used)
    alloc = {"cu_seqlens": seq["cu_seqlens"], "total_tokens": lead[0]} if lens is not None else \
        {"batch": batch, "seqlen": seqlen}
    acc = fe.gqa_accumulator(h_k, d, dv, deterministic=deterministic, device=dev, arch=arch, **alloc)
    ref = [torch.zeros(lead + (h_k, w), device=dev) for w in (d, dv)]
    ref64 = [torch.zeros(lead + (h_k, w), dtype=torch.float64, device=dev) for w in (d, dv)]
    mag = [torch.zeros(lead + (h_k, w), dtype=torch.float64, device=dev) for w in (d, dv)]
    for with_used in chunk_seqused:
        kw = seq_used if with_used else seq
        pk = input_view(lead + (h_k * g, d), partial_layouts[0], gen)
        pv = input_view(lead + (h_k * g, dv), partial_layouts[1], gen)
        call(dev, fe.gqa_accumulate, pk, pv, acc, deterministic=deterministic, **kw)
        gqa_accumulate_reference(pk, pv, *ref, num_heads_kv=h_k, **kw)
        gqa_accumulate_reference(pk, pv, *ref64, num_heads_kv=h_k, sequential=False, **kw)
        gqa_accumulate_reference(pk.abs(), pv.abs(), *mag, num_heads_kv=h_k, sequential=False, **kw)
    dt = DTYPES[out_dtype]
    (buf_k, dk), (buf_v, dv_out) = carve(lead + (h_k, d), dt, out_layouts[0], dev), \
        carve(lead + (h_k, dv), dt, out_layouts[1], dev)
    post = seq_used if post_seqused else seq
    if not executed(dev):
        call(dev, fe.gqa_postprocess, acc, dk, dv_out, scale_dk=scales[0], scale_dv=scales[1], **post)
        return
    dense = acc.to_dense(**seq)
    sync(dev)
    terms = len(chunk_seqused) * g
    for name, got, want, want64, m in zip(("dk", "dv"), dense, ref, ref64, mag):
        if deterministic:
            assert_bits(got, want, f"{name}_accum")
        else:
            err = (got.double() - want64).abs()
            excess = err - terms * U32 * m
            assert not (excess > 0).any(), f"{name}_accum: {int((excess > 0).sum())} elements past the fp32 " \
                                           f"reassociation bound, worst by {excess.max().item():.3e}"
    expect_k, expect_v = buf_k.clone(), buf_v.clone()
    store_reference(_scaled(dense[0], scales[0]), _scaled(dense[1], scales[1]), same_view(expect_k, dk),
                    same_view(expect_v, dv_out), **post)
    call(dev, fe.gqa_postprocess, acc, dk, dv_out, scale_dk=scales[0], scale_dv=scales[1], **post)
    sync(dev)
    assert_bits(buf_k, expect_k, "dk")
    assert_bits(buf_v, expect_v, "dv")


def check_reduce(d, dv, with_dv, arch, h_k, g, partial_dtype, out_dtype, batch, seqlen, lens, slack, used,
                 partial_layouts, give_out, out_layouts, scales, seed, dev="cuda"):
    gen = torch.Generator(device=dev).manual_seed(seed)
    lead, _, seq = problem(dev, batch, seqlen, lens, slack, used)
    pdt, odt = DTYPES[partial_dtype], DTYPES[out_dtype]
    pk = input_view(lead + (h_k * g, d), partial_layouts[0], gen, dtype=pdt)
    pv = input_view(lead + (h_k * g, dv), partial_layouts[1], gen, dtype=pdt) if with_dv else None
    kw = {"num_heads_kv": h_k, "scale_dk": scales[0], "scale_dv": scales[1], "_arch": arch, **seq}
    if give_out:
        (buf_k, dk), (buf_v, dv_out) = carve(lead + (h_k, d), odt, out_layouts[0], dev), \
            carve(lead + (h_k, dv), odt, out_layouts[1], dev)
        expect_k, expect_v = buf_k.clone(), buf_v.clone()
        gqa_reduce_reference(pk, pv if with_dv else None, num_heads_kv=h_k, scale_dk=scales[0], scale_dv=scales[1],
                             out=(same_view(expect_k, dk), same_view(expect_v, dv_out)), sequential=True, **seq)
        ret = call(dev, fe.gqa_reduce, pk, pv, out=(dk, dv_out) if with_dv else dk, **kw)
        if not executed(dev):
            return
        sync(dev)
        assert (ret[0] is dk and ret[1] is dv_out) if with_dv else ret is dk
        assert_bits(buf_k, expect_k, "dk")
        assert_bits(buf_v, expect_v, "dv")
        return
    out_kw = {"out_dtype": odt} if partial_dtype == "fp32" else {}
    ret = call(dev, fe.gqa_reduce, pk, pv, **out_kw, **kw)
    if not executed(dev):
        return
    outs = list(ret) if with_dv else [ret]
    sync(dev)
    for name, out, p, scale in zip(("dk", "dv"), outs, (pk, pv), scales):
        assert out.dtype == odt and out.shape == lead + (h_k, p.shape[-1])
        got = out.clone()
        want = got.clone()  # rows outside the valid rows are uninitialized: compare the valid rows only
        gqa_reduce_reference(p, num_heads_kv=h_k, out=want, scale_dk=scale, sequential=True, **seq)
        assert_bits(got, want, name)


def check_unchecked_metadata(op, d, dv, arch, total, cu, used, deterministic, seed, dev="cuda"):
    """One op with cu_seqlens / seqused as drawn and the content checks off: whatever it writes inside its
    tensors, every canary buffer around them (outputs, accumulators) is unchanged outside the view."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    h_k, g = 2, 2
    seq = {"cu_seqlens": int32(*cu, device=dev), "check_inputs": False}
    if used is not None:
        seq["seqused"] = int32(*used, device=dev)
    written = []

    def out(w, heads=h_k):
        buf, view = carve((total, heads, w), torch.bfloat16, "padded", dev)
        written.append((buf, view))
        return view

    if op in ("store", "store_zero"):
        dk, dv_out = out(d), out(dv)
        if op == "store":
            ak, av = input_view((total, h_k, d), "padded", gen), input_view((total, h_k, dv), "padded", gen)
            call(dev, fe.store, ak, av, dk, dv_out, _arch=arch, **seq)
        else:
            call(dev, fe.store_zero, dk, dv_out, row_start=1, _arch=arch, **seq)
    elif op == "gqa_reduce":
        pk = input_view((total, h_k * g, d), "padded", gen)
        call(dev, fe.gqa_reduce, pk, num_heads_kv=h_k, out=out(d), _arch=arch, **seq)
    else:
        acc = fe.gqa_accumulator(h_k, d, dv, cu_seqlens=seq["cu_seqlens"], total_tokens=total,
                                 deterministic=deterministic, device=dev, arch=arch)
        for name in ("dk_accum", "dv_accum"):  # contiguous views into NaN buffers
            t = getattr(acc, name)
            buf = canary((t.numel() + 64,), torch.float32, dev)
            view = buf[32 : 32 + t.numel()].view(t.shape).zero_()
            written.append((buf, view))
            acc = dataclasses.replace(acc, **{name: view})
        pk = input_view((total, h_k * g, d), "padded", gen)
        pv = input_view((total, h_k * g, dv), "padded", gen)
        call(dev, fe.gqa_accumulate, pk, pv, acc, deterministic=deterministic, **seq)
        if op == "gqa_postprocess":
            call(dev, fe.gqa_postprocess, acc, out(d), out(dv), **seq)
    if not executed(dev):
        return
    sync(dev)
    for i, (buf, view) in enumerate(written):
        got, want = buf.clone(), canary(buf.shape, buf.dtype, dev)
        for t in (got, want):
            same_view(t, view).zero_()
        assert_bits(got, want, f"buffer {i} outside its tensor")


# ---------------------------------------------------------------------------------------------
# the tests


def replay(check, p, dev="cuda") -> str:
    """A shell command that reruns exactly this case (from the repository root)."""
    extra = "" if dev == "cuda" else f", dev={dev!r}"
    return ("python -c \"import sys; sys.path[:0] = ['.', 'tests']; import test_fuzz as t; "
            f"t.{check.__name__}(**{p!r}{extra})\"")


def run_case(check, p, dev="cuda"):
    note(f"replay: {replay(check, p, dev)}")
    check(**p, dev=dev)


@pytest.mark.gpu
@seeded
@fuzz_settings(160)
@given(p=store_cases())
def test_fuzz_store(p):
    run_case(check_store, p)


@pytest.mark.gpu
@seeded
@fuzz_settings(100)
@given(p=store_zero_cases())
def test_fuzz_store_zero(p):
    run_case(check_store_zero, p)


@pytest.mark.gpu
@seeded
@fuzz_settings(140)
@given(p=accumulate_cases())
def test_fuzz_gqa_accumulate_postprocess(p):
    run_case(check_accumulate, p)


@pytest.mark.gpu
@seeded
@fuzz_settings(120)
@given(p=reduce_cases())
def test_fuzz_gqa_reduce(p):
    run_case(check_reduce, p)


@pytest.mark.gpu
@seeded
@fuzz_settings(100)
@given(p=unchecked_metadata_cases())
def test_fuzz_unchecked_metadata(p):
    run_case(check_unchecked_metadata, p)


@pytest.mark.parametrize("check,cases", [(check_store, store_cases), (check_store_zero, store_zero_cases),
                                         (check_accumulate, accumulate_cases), (check_reduce, reduce_cases),
                                         (check_unchecked_metadata, unchecked_metadata_cases)],
                         ids=("store", "store_zero", "gqa_accumulate", "gqa_reduce", "unchecked_metadata"))
@pytest.mark.ops
def test_fuzz_cases_validate_on_cpu(check, cases):
    # no GPU: the drawn arguments are valid inputs (they get through every check but the device
    # one) and the references accept them; a few cases each, for CI
    @settings(max_examples=10, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(p=cases())
    def run(p):
        run_case(check, p, dev="cpu")

    run()
