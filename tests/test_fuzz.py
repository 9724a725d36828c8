"""Property-based fuzzing (hypothesis) of every op against the reference, with conftest's GQA checks (test_gqa.py's;
canary buffers compared whole). Drawn: dtypes, head dims (multiples of 8 up to 256; dv != d), batch (0 too), sequence
lengths at the tile edges or up to 3 kBlockN, varlen with slack rows, seqused, strides (the layouts of
flash_epilogue.testing.carve), GQA groups 1 to 16, deterministic on/off, several accumulate calls, the sm_80 path; the
unchecked_metadata cases: inconsistent cu_seqlens / seqused near the int32 limits, content checks off, every buffer
around the written tensors intact.

Derandomized unless FLASH_EPILOGUE_FUZZ_SEED=<int>; FLASH_EPILOGUE_FUZZ_SCALE=<float> scales the number of cases
(default 620 GPU cases). A failing case is shrunk and printed with a replay line (run_case). On the CPU (CI), a few
drawn calls each pass every check but the device check and the references run.
"""

import dataclasses
import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import conftest  # noqa: E402
import flash_epilogue as fe  # noqa: E402
from conftest import HAVE_SM90, SM80_PATH, assert_written, check_postprocess  # noqa: E402
from flash_epilogue.ops import _gqa_reduce, _store, _store_zero  # noqa: E402
from flash_epilogue.reference import store_reference, store_zero_reference  # noqa: E402
from flash_epilogue.testing import (LAYOUTS, assert_bits, block_n, call_op, canary, carve, input_view,  # noqa: E402
                                    int32, problem, rand, same_view)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COMPILED = (64, 96, 128, 192, 256)
GROUPS = (1, 2, 3, 4, 6, 8, 16)
SCALES = (1.0, 0.5, 3.0, 1.0 / 3.0, 128**-0.5, 0.0)
SEEDS = st.integers(0, 2**31 - 1)

_SCALE = float(os.environ.get("FLASH_EPILOGUE_FUZZ_SCALE", "1"))
_SEED = os.environ.get("FLASH_EPILOGUE_FUZZ_SEED")
seeded = hypothesis.seed(int(_SEED)) if _SEED is not None else (lambda f: f)


# ---- strategies: plain dicts of ints/strings/lists, so that a case prints as a python call
def head_dims():
    return st.one_of(st.sampled_from(COMPILED), st.integers(1, 32).map(lambda k: 8 * k))


def seqlens(n):
    # hypothesis shrinks towards the first choices: keep the empty cases out of front
    return st.one_of(st.integers(1, 3 * n), st.sampled_from((n + 1, n - 1, n, 1, 2 * n + 1, 2 * n - 1, 2 * n, 0)))


def picks(draw, k, choices=LAYOUTS):
    return [draw(st.sampled_from(choices)) for _ in range(k)]


@st.composite
def geometry(draw, n):
    """batch/seqlen (batched) or lens/slack (varlen), and seqused (None or per sequence)."""
    if draw(st.booleans()):
        lens = draw(st.lists(seqlens(n), min_size=1, max_size=4))
        g, limits = {"batch": None, "seqlen": None, "lens": lens, "slack": draw(st.sampled_from((0, 0, 1, 5)))}, lens
    else:
        batch = draw(st.sampled_from((3, 2, 1) * 3 + (0,)))
        s = draw(seqlens(n))
        g, limits = {"batch": batch, "seqlen": s, "lens": None, "slack": 0}, [s] * batch
    return g | {"seqused": [draw(st.one_of(st.integers(0, m), st.just(m))) for m in limits] if draw(st.booleans())
                else None}


def paths_and_dims(draw):
    """arch (0 twice as often as the sm_80 path), d and dv (often d)."""
    arch, d = draw(st.sampled_from((0, 0, 80) if SM80_PATH or not HAVE_SM90 else (0,))), draw(head_dims())
    return arch, d, draw(st.one_of(st.just(d), head_dims()))


@st.composite
def store_cases(draw):
    arch, d, dv = paths_and_dims(draw)
    p = {"dtype": draw(st.sampled_from(("bf16", "fp16"))), "d": d, "dv": dv, "arch": arch,
         "heads": draw(st.integers(1, 3))}
    # layouts: dk, dv, dk_accum, dv_accum
    return p | draw(geometry(block_n(d, dv, arch))) | {"layouts": picks(draw, 4), "seed": draw(SEEDS)}


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
    p |= draw(geometry(n))
    p["batch_idx"] = draw(selection(len(p["lens"]) if p["lens"] is not None else p["batch"]))
    p["head_idx"] = draw(selection(heads))
    p["row_start"] = draw(st.one_of(st.just(0), st.integers(0, n + 1), st.sampled_from((n - 1, n, n + 1, 2 * n + 2))))
    p["row_end"] = draw(st.one_of(st.none(), st.integers(0, 2 * n + 2).map(lambda k: p["row_start"] + k)))
    return p | {"layouts": picks(draw, 2), "seed": draw(SEEDS)}


def group_shape(draw):
    g = draw(st.sampled_from(GROUPS))
    return draw(st.integers(1, max(1, min(3, 24 // g)))), g


@st.composite
def accumulate_cases(draw):
    arch, d, dv = paths_and_dims(draw)
    h_k, g = group_shape(draw)
    p = {"d": d, "dv": dv, "arch": arch, "h_k": h_k, "g": g, "deterministic": draw(st.booleans())}
    p |= draw(geometry(block_n(d, dv, arch)))
    chunks = draw(st.integers(1, 3))
    return p | {"chunk_seqused": [draw(st.booleans()) for _ in range(chunks)],  # which calls pass seqused
                "partial_layouts": picks(draw, 2), "out_dtype": draw(st.sampled_from(("bf16", "fp16"))),
                "out_layouts": picks(draw, 2), "post_seqused": draw(st.booleans()), "scales": picks(draw, 2, SCALES),
                "seed": draw(SEEDS)}


@st.composite
def reduce_cases(draw):
    arch, d, dv = paths_and_dims(draw)
    with_dv = draw(st.booleans())
    dv = dv if with_dv else d
    h_k, g = group_shape(draw)
    partial_dtype = draw(st.sampled_from(("fp32", "fp32", "bf16", "fp16")))
    out_dtype = partial_dtype if partial_dtype != "fp32" else draw(st.sampled_from(("bf16", "fp16")))
    p = {"d": d, "dv": dv, "with_dv": with_dv, "arch": arch, "h_k": h_k, "g": g, "partial_dtype": partial_dtype,
         "out_dtype": out_dtype} | draw(geometry(block_n(d, dv, arch)))
    return p | {"partial_layouts": picks(draw, 2), "give_out": draw(st.booleans()), "out_layouts": picks(draw, 2),
                "scales": picks(draw, 2, SCALES), "seed": draw(SEEDS)}


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
    return p | {"deterministic": draw(st.booleans()), "seed": draw(SEEDS)}


# ---- checks: one case each; module-level so that a replay line can call them
def store_problem(dtype, d, dv, heads, layouts, seed, dev, batch, seqlen, lens, slack, seqused):
    """(generator, leading shape, seq kwargs, (buffer, view) of dk and of dv carved per layouts[:2])."""
    p = problem(batch, seqlen, lens, slack, seqused, device=dev)
    outs = [carve(p.lead + (heads, w), DTYPES[dtype], layout, dev) for w, layout in zip((d, dv), layouts)]
    return torch.Generator(device=dev).manual_seed(seed), p.lead, p.seq_used, outs


def check_store(dtype, d, dv, arch, heads, layouts, seed, dev="cuda", **geometry):
    gen, lead, seq, ((buf_k, dk), (buf_v, dv_out)) = store_problem(dtype, d, dv, heads, layouts, seed, dev, **geometry)
    # binades=20: the rounding of large and tiny magnitudes
    acc_k, acc_v = (input_view(lead + (heads, w), layout, gen, binades=20) for w, layout in zip((d, dv), layouts[2:]))
    expect_k, expect_v = buf_k.clone(), buf_v.clone()
    store_reference(acc_k, acc_v, same_view(expect_k, dk), same_view(expect_v, dv_out), **seq)
    call_op(dev, _store, acc_k, acc_v, dk, dv_out, _arch=arch, **seq)
    assert_written(dev, ("dk", buf_k, expect_k), ("dv", buf_v, expect_v))


def check_store_zero(dtype, d, dv, arch, heads, batch_idx, head_idx, row_start, row_end, layouts, seed, dev="cuda",
                     **geometry):
    gen, lead, seq, ((buf_k, dk), (buf_v, dv_out)) = store_problem(dtype, d, dv, heads, layouts, seed, dev, **geometry)
    dk.copy_(rand(dk.shape, gen, dk.dtype))  # nonzero contents in the view, canary around it
    dv_out.copy_(rand(dv_out.shape, gen, dv_out.dtype))
    sel = {k: torch.tensor(v["tensor"], dtype=torch.int32, device=dev) if isinstance(v, dict) else v
           for k, v in (("batch_idx", batch_idx), ("head_idx", head_idx))}
    expect_k, expect_v = buf_k.clone(), buf_v.clone()
    store_zero_reference(same_view(expect_k, dk), same_view(expect_v, dv_out), row_start=row_start, row_end=row_end,
                         **sel, **seq)
    call_op(dev, _store_zero, dk, dv_out, row_start=row_start, row_end=row_end, _arch=arch, **sel, **seq)
    assert_written(dev, ("dk", buf_k, expect_k), ("dv", buf_v, expect_v))


def check_accumulate(d, dv, arch, h_k, g, deterministic, batch, seqlen, lens, slack, seqused, chunk_seqused,
                     partial_layouts, out_dtype, out_layouts, post_seqused, scales, seed, dev="cuda"):
    """conftest.check_accumulate, then gqa_postprocess of the accumulator into canary-carved outputs."""
    case = conftest.check_accumulate(d, dv, arch, h_k, g, deterministic, batch, seqlen, lens, slack, seqused,
                                     chunk_seqused, partial_layouts, seed, dev)
    check_postprocess(case, DTYPES[out_dtype], out_layouts, scales, case.seq_used if post_seqused else case.seq)


def check_reduce(partial_dtype, out_dtype, **p):
    conftest.check_reduce(partial_dtype=DTYPES[partial_dtype], out_dtype=DTYPES[out_dtype], **p)


def check_unchecked_metadata(op, d, dv, arch, total, cu, used, deterministic, seed, dev="cuda"):
    """One op with cu_seqlens / seqused as drawn and the content checks off: whatever it writes inside its
    tensors, every canary buffer around them (outputs, accumulators) is unchanged outside the view."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    h_k, g = 2, 2
    seq = {"cu_seqlens": int32(*cu, device=dev), "check_inputs": False}
    if used is not None:
        seq["seqused"] = int32(*used, device=dev)
    written = []

    def out(w):
        buf, view = carve((total, h_k, w), torch.bfloat16, "padded", dev)
        written.append((buf, view))
        return view

    if op == "store":
        dk, dv_out = out(d), out(dv)
        ak, av = input_view((total, h_k, d), "padded", gen), input_view((total, h_k, dv), "padded", gen)
        call_op(dev, _store, ak, av, dk, dv_out, _arch=arch, **seq)
    elif op == "store_zero":
        call_op(dev, _store_zero, out(d), out(dv), row_start=1, _arch=arch, **seq)
    elif op == "gqa_reduce":
        pk = input_view((total, h_k * g, d), "padded", gen)
        call_op(dev, _gqa_reduce, pk, num_heads_kv=h_k, out=out(d), _arch=arch, **seq)
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
        call_op(dev, fe.gqa_accumulate, pk, pv, acc, deterministic=deterministic, **seq)
        if op == "gqa_postprocess":
            call_op(dev, fe.gqa_postprocess, acc, out(d), out(dv), **seq)
    if dev != "cuda":
        return
    torch.cuda.synchronize()
    for i, (buf, view) in enumerate(written):
        got, want = buf.clone(), canary(buf.shape, buf.dtype, dev)
        for t in (got, want):
            same_view(t, view).zero_()
        assert_bits(got, want, f"buffer {i} outside its tensor")


# ---- the tests
def run_case(check, p, dev="cuda"):
    """check(**p), noting a shell command that reruns exactly this case (from the repository root)."""
    extra = "" if dev == "cuda" else f", dev={dev!r}"
    note("replay: python -c \"import sys; sys.path[:0] = ['.', 'tests']; import test_fuzz as t; "
         f"t.{check.__name__}(**{p!r}{extra})\"")
    check(**p, dev=dev)


def fuzz_settings(n):
    return settings(max_examples=max(1, int(n * _SCALE)), deadline=None, database=None, derandomize=_SEED is None,
                    print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                            HealthCheck.filter_too_much,
                                                            HealthCheck.large_base_example])


CASES = {"store": (check_store, store_cases, 160), "store_zero": (check_store_zero, store_zero_cases, 100),
         "gqa_accumulate_postprocess": (check_accumulate, accumulate_cases, 140),
         "gqa_reduce": (check_reduce, reduce_cases, 120),
         "unchecked_metadata": (check_unchecked_metadata, unchecked_metadata_cases, 100)}


@pytest.mark.parametrize("dev", [pytest.param("cuda", marks=pytest.mark.gpu),
                                 pytest.param("cpu", marks=pytest.mark.ops)])
@pytest.mark.parametrize("check,cases,n", CASES.values(), ids=CASES)
def test_fuzz(check, cases, n, dev):
    # on the GPU: n drawn cases, derandomized ones following the source of `test` (decorators and indentation
    # included: keep it as it is); no GPU (CI): a few cases each get through every check but the device one, and the
    # references accept them
    @pytest.mark.gpu
    @seeded
    @fuzz_settings(n)
    @given(p=cases())
    def test(p):
        run_case(check, p)

    @settings(max_examples=10, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(p=cases())
    def run(p):
        run_case(check, p, dev="cpu")

    (test if dev == "cuda" else run)()
