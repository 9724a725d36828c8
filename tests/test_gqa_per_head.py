"""The GQA collective's sm_90 per-query-head adds (CollectiveEpilogueBwdGQA through GqaAccumulateKernel: what an
attention kernel calls) against the op, which adds whole groups per CTA on sm_90: deterministic bitwise, the
unordered bulk adds within fp32 reassociation. tests/header_library/gqa_per_head.cu, built with torch's JIT loader
(GPU only; about a minute)."""
from pathlib import Path

import pytest
import torch

import flash_epilogue as fe
from conftest import bits, cu_seqlens, rand

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def per_head(tmp_path_factory):
    from torch.utils.cpp_extension import load

    return load(name="fe_gqa_per_head", sources=[str(ROOT / "tests" / "header_library" / "gqa_per_head.cu")],
                extra_include_paths=[str(ROOT / "csrc" / "kernels"), *fe.get_include()],
                extra_cuda_cflags=["-std=c++20", "-O3", "--expt-relaxed-constexpr",
                                   "-gencode=arch=compute_90a,code=sm_90a"],
                extra_cflags=["-std=c++20"], build_directory=str(tmp_path_factory.mktemp("gqa_per_head")))


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_per_head_adds_match_the_op(per_head, d, varlen, deterministic):
    hk, group, batch, lens = 2, 4, 3, [300, 1, 517]
    gen = torch.Generator(device="cuda").manual_seed(d + 2 * varlen + deterministic)
    if varlen:
        cu = cu_seqlens(lens)
        shape, geometry = (sum(lens), hk * group, d), dict(cu_seqlens=cu, total_tokens=sum(lens))
    else:
        cu = None
        shape, geometry = (batch, 600, hk * group, d), dict(batch=batch, seqlen=600)
    pk, pv = rand(shape, gen), rand(shape, gen)
    accs = [fe.gqa_accumulator(hk, d, deterministic=deterministic, device="cuda", **geometry) for _ in range(3)]
    start = torch.randn(accs[0].dk_accum.shape, generator=gen, device="cuda")
    for acc in accs[:2]:  # the same non-zero start: the adds go onto earlier calls' sums
        acc.dk_accum.copy_(start)
        acc.dv_accum.copy_(start)
    fe.gqa_accumulate(pk, pv, accs[0], cu_seqlens=cu)
    # |start| + sum |partials|: two orders of the group + 1 additions differ by at most 2 * group * 2^-24 of it
    accs[2].dk_accum.copy_(start.abs())
    accs[2].dv_accum.copy_(start.abs())
    fe.gqa_accumulate(pk.abs(), pv.abs(), accs[2], cu_seqlens=cu)
    per_head.accumulate_per_head(pk, pv, accs[1].dk_accum, accs[1].dv_accum,
                                 accs[1].semaphores if deterministic else None, cu, batch)
    torch.cuda.synchronize()
    for name in ("dk_accum", "dv_accum"):
        ours, theirs = getattr(accs[0], name), getattr(accs[1], name)
        if deterministic:
            assert torch.equal(bits(ours), bits(theirs)), name
        else:
            bound = 2 * group * 2.0**-24 * getattr(accs[2], name)
            assert ((ours - theirs).abs() <= bound).all(), name
