"""Bad inputs outside the table of test_bad_inputs.py: a deterministic accumulate past its work items, accumulators of
two head dims, the content-check switches, a package without its extension or built for another torch.
"""
import dataclasses
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import flash_epilogue as fe
from conftest import BF16, D, DKV, I32, INPUT, acc_shape, assert_healthy, dense, run_checked

OPS = torch.ops.flash_epilogue


@pytest.mark.ops
def test_deterministic_accumulate_past_its_work_items():
    # the sm_80 deterministic mode's 1-D grid and int tickets hold (row tiles x batch x 2 x h_q) < 2^31 work items:
    # varlen, 16385 sequences over 128 tokens, 65535 query heads of one KV head (partials expanded, accumulators
    # untouched). The sm_90 path has no such limit (it reaches the device check).
    batch, h_q, rows = 16385, 65535, 128
    layout = fe._extension._C.gqa_accum_layout(1, D, D, batch, rows, True, 80, torch.device("cpu"))
    part = torch.zeros(rows, 1, D).expand(rows, h_q, D)
    acc = [torch.empty(shape) for shape in layout["shapes"]]
    sem, cu = torch.zeros(layout["semaphore_numel"], dtype=I32), torch.zeros(batch + 1, dtype=I32)
    with pytest.raises(ValueError, match=r"flash_epilogue\.gqa_accumulate: dk_partial: shape: expected at most "
                       r"2\^31 - 1 \(row tiles x batch x 2 x h_q\) work items in deterministic mode, got 2147713020"):
        OPS.gqa_accumulate(part, part, *acc, sem, cu_seqlens=cu, deterministic=True, _arch=80)
    with pytest.raises(ValueError, match=r"dk_partial: device: expected a CUDA tensor"):  # atomic mode: no such limit
        OPS.gqa_accumulate(part, part, *acc, None, cu_seqlens=cu, deterministic=False, _arch=80)


@pytest.mark.ops
@pytest.mark.parametrize("d,seqlen,want,tile_v", [
    (192, 40, ((1, 2, 1, 18432), (1, 2, 1, 12288)), 192),
    (256, 80 * 256, ((1, 2, 256, 20480), (1, 2, 160, 16384)), 128)])
def test_accumulators_of_two_head_dims_are_checked_each_against_its_own(d, seqlen, want, tile_v):
    # (d, 128) on sm_90 where dV's accumulator is not dK's: at hdim 192 its tiles hold two of the tile's three slabs;
    # at hdim 256 at the plan's own-tile gate it has the hdim-128 tile (128 rows). A dV accumulator of dK's
    # shape is another problem's, in gqa_accumulate, gqa_postprocess and to_dense alike; the right one passes
    acc = fe.gqa_accumulator(2, d, 128, batch=1, seqlen=seqlen, device="cpu", arch=90)
    assert (tuple(acc.dk_accum.shape), tuple(acc.dv_accum.shape)) == want
    pk, pv, wrong = torch.empty(1, seqlen, 4, d), torch.empty(1, seqlen, 4, 128), torch.empty(want[0])
    msg = acc_shape(want[0], want[1], d=128, c=tile_v, of=f"batch 1, seqlen {seqlen}")
    with pytest.raises(ValueError, match=r"flash_epilogue\.gqa_accumulate: dv_accum: " + msg):
        OPS.gqa_accumulate(pk, pv, acc.dk_accum, wrong, None, deterministic=False, _arch=90)
    with pytest.raises(ValueError, match=r"flash_epilogue\.gqa_postprocess: dv_accum: " + msg):
        OPS.gqa_postprocess(acc.dk_accum, wrong, pk[:, :, :2].to(BF16), pv[:, :, :2].to(BF16), _arch=90)
    with pytest.raises(ValueError, match=r"flash_epilogue\.gqa_accum_to_dense: accum: " + msg):
        OPS.gqa_accum_to_dense(wrong, pv[:, :, :2].clone(), head_dim=tile_v, _arch=90)
    with pytest.raises(ValueError, match="dv_accum: " + msg):  # and through the wrapper
        fe.gqa_accumulate(pk, pv, dataclasses.replace(acc, dv_accum=wrong))
    with pytest.raises(ValueError, match=r"dk_partial: device: expected a CUDA tensor"):
        OPS.gqa_accumulate(pk, pv, acc.dk_accum, acc.dv_accum, None, deterministic=False, _arch=90)


@pytest.mark.gpu
@pytest.mark.parametrize("env", ["FLASH_EPILOGUE_CHECK_INPUTS", "FLASH_EPILOGUE_DEBUG"])
def test_env_switches_turn_on_the_content_checks(env, monkeypatch):
    fe.store_zero(**dense("cuda", *DKV), batch_idx=4)  # unchecked by default: an out-of-range entry is skipped
    monkeypatch.setenv(env, "1")
    fe.refresh_env_flags()  # read at import (host time); conftest re-reads them before each test
    with pytest.raises(INPUT, match=r"batch_idx\[0\]: expected a value in \[0, 2\) \(the batch size\), got 4"):
        fe.store_zero(**dense("cuda", *DKV), batch_idx=4)
    fe.store_zero(**dense("cuda", *DKV), batch_idx=4, check_inputs=False)  # an explicit argument wins
    assert_healthy()


def run(code, cwd=Path(__file__).resolve().parent.parent, **env):
    return run_checked([sys.executable, "-c", code], cwd=cwd, env={**os.environ, **env}).stdout


def test_without_the_extension_every_op_names_the_reason():
    # every op raises FlashEpilogueBuildError naming the reason; the references and repeat_kv (plain torch) work
    out = run("""
import sys
sys.modules["flash_epilogue._C"] = None  # importing it raises ImportError
import torch, flash_epilogue as fe
assert not fe.kernels_available() and fe.UNAVAILABLE_REASON
a, o, p = torch.zeros(1, 8, 2, 64), torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16), torch.zeros(1, 8, 4, 64)
for f in (lambda: fe.store(a, a.clone(), o, o.clone()), lambda: fe.store_zero(o, o.clone()),
          lambda: fe.gqa_accumulator(2, 64, batch=1, seqlen=8, device="cpu"), lambda: fe.gqa_reduce(p, num_heads_kv=2)):
    try:
        f()
    except fe.FlashEpilogueBuildError as e:
        print("RAISED", e, isinstance(e, RuntimeError))
ops = torch.ops.flash_epilogue  # every op exists, with its schema, and raises the same
for schema in fe._extension.schemas():
    name = schema.split("(")[0]
    assert getattr(ops, name).default._schema == torch._C.parse_schema("flash_epilogue::" + schema), name
calls = {"store": lambda: ops.store(a, a, o, o.clone()), "gqa_reduce": lambda: ops.gqa_reduce(p, None, o, None),
         "repeat_kv": lambda: ops.repeat_kv(a, 2, 1)}
for name, call in calls.items():
    try:
        call()
    except fe.FlashEpilogueBuildError as e:
        print("OPS RAISED", e)
fe.reference.store_reference(a, a, o, o.clone())
x = torch.randn(1, 2, 8, 64, requires_grad=True)
y = fe.repeat_kv(x, 3)
assert torch.equal(y, x.repeat_interleave(3, 1))
assert torch.equal(torch.autograd.grad(y, x, y)[0], fe.reference.group_sum_reference(y.detach(), 3))
print("REFERENCE OK")
""")
    for name in ("store", "store_zero", "gqa_accumulator", "gqa_reduce"):
        assert re.search(rf"RAISED flash_epilogue\.{name}: the CUDA kernels are not available: .*\. The ops run on an "
                         r"sm_90 GPU \(H100, H200\); on any device, flash_epilogue\.reference computes each of them "
                         r"in plain PyTorch, with the same bits True\n", out), out
    for name in ("store", "gqa_reduce", "repeat_kv"):
        assert f"OPS RAISED flash_epilogue.{name}: the CUDA kernels are not available" in out, out
    assert "REFERENCE OK" in out


@pytest.mark.skipif(not fe.kernels_available(), reason="needs the extension")
def test_the_extension_registers_the_schemas_of_schema_inc():
    # their one definition: the extension's registration includes the list Python defines them from without it
    for schema in fe._extension.schemas():
        op = getattr(torch.ops.flash_epilogue, schema.split("(")[0]).default
        assert op._schema == torch._C.parse_schema("flash_epilogue::" + schema)


def test_a_build_for_another_torch_is_named(tmp_path):
    src = Path(fe.__file__).parent
    info = src / "_build_info.py"
    if not info.exists() or "TORCH_VERSION" not in info.read_text():
        pytest.skip("not built here")
    shutil.copytree(src, tmp_path / "flash_epilogue", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    copy = tmp_path / "flash_epilogue" / "_build_info.py"
    copy.write_text(re.sub(r"TORCH_VERSION\s*=.*", 'TORCH_VERSION = "1.0.0+other"', copy.read_text()))
    out = run("import flash_epilogue as fe; print(fe.__file__, fe.UNAVAILABLE_REASON)", cwd=tmp_path,
              PYTHONPATH=str(tmp_path), FLASH_EPILOGUE_DISABLE_KERNELS="0")
    assert str(tmp_path) in out and "built against torch 1.0.0+other" in out, out
    assert f"torch {torch.__version__} is running" in out, out
