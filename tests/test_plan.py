"""CPU tests of the dispatch plan (_C.plan): every rule on both sides of its threshold, the thresholds read from the
plan itself, and the GQA accumulator's layout following the plan's tiles."""
import pytest
import torch

import flash_epilogue as fe

C = fe._extension._C
pytestmark = pytest.mark.skipif(C is None, reason=f"no extension: {fe.UNAVAILABLE_REASON}")
T = C.plan_thresholds() if C is not None else {}
SMS = 132  # an H100/H200
BUILT = set(fe.COMPILED_HEAD_DIMS)


def plan(op, d, dv=None, *, rows, batch=1, heads=1, arch=90, varlen=False, seqused=False, deterministic=False,
         sms=SMS):
    return C.plan(op, arch, rows, batch, heads, varlen, seqused, d, d if dv is None else dv, deterministic, sms)


def needs(*head_dims):
    return pytest.mark.skipif(not set(head_dims) <= BUILT, reason=f"head dims {head_dims} not built")


def test_thresholds_are_named():
    assert set(T) == {"store_rows64_min_average_rows", "store_tiles_per_sm_unstreamed", "store_tiles_per_sm_rows64",
                      "dv_own_tile_min_tiles_accumulator", "dv_own_tile_min_tiles_reduce",
                      "dv_own_tile_shared_head_dim", "dv_own_tile_max_head_dim"}
    assert all(isinstance(v, int) and v > 0 for v in T.values())


@needs(64)
def test_store_hdim64_rows64_tile_from_the_average_sequence_length():
    n = T["store_rows64_min_average_rows"]
    for batch in (1, 3):
        below = plan("store", 64, rows=n * batch - 1, batch=batch, varlen=True)
        at = plan("store", 64, rows=n * batch, batch=batch, varlen=True)
        assert below["tile"] == (64, 128) and at["tile"] == at["dv_tile"] == (64, 64)
        for p in (below, at):
            assert (p["driver"], p["ctas_per_sm"], p["predicated"]) == ("one_cta_per_tile", 2, True)
    # batched (even with seqused) keeps FA3's tile, predicated only with seqused
    for seqused in (False, True):
        p = plan("store", 64, rows=4 * n, batch=2, seqused=seqused)
        assert (p["tile"], p["driver"], p["predicated"]) == ((64, 128), "one_cta_per_tile", seqused)


@needs(192, 256)
@pytest.mark.parametrize("d, block_n", [(192, 96), (256, 80)])
def test_store_wide_tiles_unstreamed_up_to_a_few_tiles_per_sm(d, block_n):
    most = T["store_tiles_per_sm_unstreamed"] * SMS // 2  # dK's and dV's tiles each
    for varlen in (False, True):
        extra = 1 if varlen else 0  # varlen: rows // block_n + batch tiles
        at = plan("store", d, rows=block_n * (most - extra), varlen=varlen)
        above = plan("store", d, rows=block_n * (most - extra + 1), varlen=varlen)
        assert (at["driver"], at["ctas_per_sm"]) == ("one_cta_per_tile", 2)
        assert (above["driver"], above["ctas_per_sm"]) == ("stream", 1)
        assert at["tile"] == above["tile"] == (d, block_n)


@needs(128)
def test_store_hdim128_rows64_tiles_in_small_problems():
    # batched: one CTA per 64-row tile; with cu_seqlens: 64-row tiles streamed; both two CTAs to an SM
    most = T["store_tiles_per_sm_rows64"] * SMS // 2
    for heads, batch in ((1, 1), (2, 3)):
        per = heads * batch
        at = plan("store", 128, rows=128 * (most // per), heads=heads, batch=batch)
        above = plan("store", 128, rows=128 * (most // per + 1), heads=heads, batch=batch)
        assert (at["tile"], at["driver"], at["ctas_per_sm"]) == ((128, 64), "one_cta_per_tile", 2)
        assert (above["tile"], above["driver"], above["ctas_per_sm"]) == ((128, 128), "stream", 1)
    varlen_most = most - 1  # varlen: rows // 128 + batch tiles
    at = plan("store", 128, rows=128 * varlen_most, varlen=True)
    above = plan("store", 128, rows=128 * (varlen_most + 1), varlen=True)
    assert (at["tile"], at["driver"], at["ctas_per_sm"]) == ((128, 64), "stream", 2)
    assert (above["tile"], above["driver"], above["ctas_per_sm"]) == ((128, 128), "stream", 1)
    # the rule counts SMs: the same problem on a smaller GPU is above it
    assert plan("store", 128, rows=128 * most, sms=SMS // 2)["tile"] == (128, 128)


@needs(96)
def test_store_hdim96_always_streams():
    for rows in (1, 10**6):
        assert plan("store", 96, rows=rows)["driver"] == "stream"


@pytest.mark.parametrize("op", ["store", "store_zero", "gqa_postprocess", "gqa_reduce", "gqa_accum_to_dense"])
def test_sm80_path_one_cta_per_tile_predicated(op):
    for d in fe.COMPILED_HEAD_DIMS:
        p = plan(op, d, rows=10**6, arch=80)
        assert (p["arch"], p["driver"], p["predicated"], p["dv_own_launch"]) == (80, "one_cta_per_tile", True, False)
        assert p["tile"] == (fe.tile_config(d, arch=80).head_dim, fe.tile_config(d, arch=80).block_n)


@needs(64)
def test_store_one_cta_per_tile_is_one_kernel_on_both_paths():
    sm90 = plan("store", 64, rows=4096)
    assert sm90["driver"] == "one_cta_per_tile"
    assert all(plan("store", d, rows=8192, arch=80)["ctas_per_sm"] == sm90["ctas_per_sm"] for d in BUILT)


def test_gqa_accumulate_ordered_only_on_the_sm80_path():
    for d in fe.COMPILED_HEAD_DIMS:
        for det in (False, True):
            p90, p80 = (plan("gqa_accumulate", d, rows=4096, arch=a, deterministic=det) for a in (90, 80))
            assert (p90["driver"], p90["ctas_per_sm"], p90["ordered"]) == ("stream", 1, False)
            assert (p80["driver"], p80["ordered"]) == ("per_query_head", det)


@needs(128, 256)
@pytest.mark.parametrize("op", ["gqa_accumulate", "gqa_postprocess", "gqa_reduce"])
@pytest.mark.parametrize("dv", [64, 96, 128])
def test_gqa_dv_own_tile_from_the_gate(op, dv):
    if fe.tile_config(dv).head_dim not in BUILT:
        pytest.skip("dv's tile not built")
    # one gate for the accumulator ops (they share its layout), one for gqa_reduce
    gate = T["dv_own_tile_min_tiles_reduce" if op == "gqa_reduce" else "dv_own_tile_min_tiles_accumulator"]
    block_n = fe.tile_config(256).block_n
    own = (fe.tile_config(dv).head_dim, fe.tile_config(dv).block_n)
    shapes = [dict(heads=1, batch=1), dict(heads=4, batch=2)]
    for s in shapes:
        per = s["heads"] * s["batch"]
        below = plan(op, 256, dv, rows=block_n * (gate // per) - block_n, **s)
        at = plan(op, 256, dv, rows=block_n * -(-gate // per), **s)
        assert below["dv_tile"] == below["tile"] == (256, block_n) and not below["dv_own_launch"]
        assert at["tile"] == (256, block_n) and at["dv_tile"] == own and at["dv_own_launch"]
        # the accumulators follow the plan of the accumulator ops
        for p, rows in ((below, block_n * (gate // per) - block_n), (at, block_n * -(-gate // per))):
            layout = C.gqa_accum_layout(s["heads"], 256, dv, s["batch"], rows, False, 90, torch.device("cpu"))
            accumulator = p if op != "gqa_reduce" else plan("gqa_accumulate", 256, dv, rows=rows, **s)
            assert layout["tile_head_dims"] == (accumulator["tile"][0], accumulator["dv_tile"][0])
    # never on the sm_80 path, beside a narrower dK, or for a dv past the rule's widest tile
    big = dict(rows=block_n * gate)
    assert not plan(op, 256, dv, arch=80, **big)["dv_own_launch"]
    assert not plan(op, 128, dv, **big)["dv_own_launch"]
    if 192 in BUILT:
        assert T["dv_own_tile_max_head_dim"] < 192 and not plan(op, 256, 192, **big)["dv_own_launch"]


@pytest.mark.parametrize("op", ["store", "gqa_postprocess", "gqa_reduce"])
def test_predicated_with_sequence_metadata(op):
    d = fe.COMPILED_HEAD_DIMS[-1]
    for varlen in (False, True):
        for seqused in (False, True):
            assert plan(op, d, rows=8192, varlen=varlen, seqused=seqused)["predicated"] == (varlen or seqused)


def test_plan_refuses_unknown_ops_and_paths():
    with pytest.raises(ValueError, match="op: expected an op name, got nope"):
        C.plan("nope", 90, 1, 1, 1, False, False, 64, 64, False, SMS)
    with pytest.raises(ValueError, match="arch: expected 80 or 90"):
        C.plan("store", 70, 1, 1, 1, False, False, 64, 64, False, SMS)
