"""CPU tests of the op surface: schemas, fake kernels, the no-kernel fallback, the build files."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_epilogue as fe
from flash_epilogue import _schemas

ROOT = Path(__file__).resolve().parent.parent


def test_every_schema_is_registered_as_defined():
    for name, schema in _schemas.SCHEMAS.items():
        op = getattr(torch.ops.flash_epilogue, name).default
        # compared as torch prints them (a float default 1.0 prints as "1.")
        assert str(op._schema) == str(torch._C.parse_schema(f"flash_epilogue::{schema}"))


def test_fallback_schemas_match_and_raise_clear_error():
    # A process where the kernels are unavailable defines the same schemas in Python, and
    # calling an op says why instead of "no kernel image" or an undefined symbol.
    code = (
        "import torch, flash_epilogue as fe\n"
        "from flash_epilogue import _schemas\n"
        "assert not fe.kernels_available()\n"
        "for n, s in _schemas.SCHEMAS.items():\n"
        "    want = str(torch._C.parse_schema('flash_epilogue::' + s))\n"
        "    assert str(getattr(torch.ops.flash_epilogue, n).default._schema) == want\n"
        "a = torch.randn(1, 8, 1, 64); o = torch.empty(1, 8, 1, 64, dtype=torch.bfloat16)\n"
        "try:\n"
        "    torch.ops.flash_epilogue.store(a, a, o, o.clone())\n"
        "except fe.FlashEpilogueBuildError as e:\n"
        "    print('RAISED', e)\n"
    )
    env = dict(os.environ, FLASH_EPILOGUE_DISABLE_KERNELS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "RAISED flash_epilogue.store: the CUDA kernels are not available: disabled by FLASH_EPILOGUE_DISABLE_KERNELS" in out.stdout


def test_wrapper_reports_missing_kernels(monkeypatch):
    from flash_epilogue import _extension, validation

    monkeypatch.setattr(_extension, "_C", None)
    monkeypatch.setattr(validation, "_is_cuda_device", lambda device: True)
    a = torch.randn(1, 8, 1, 64)
    o = torch.empty(1, 8, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(fe.FlashEpilogueBuildError, match="installed without its CUDA kernels"):
        fe.store(a, a, o, o.clone())


@pytest.mark.parametrize("varlen", [False, True])
def test_store_fake_kernel(varlen):
    with FakeTensorMode():
        shape = (100, 4, 128) if varlen else (2, 50, 4, 128)
        acc = torch.empty(shape, device="cuda" if torch.cuda.is_available() else "cpu")
        dk = torch.empty(shape, dtype=torch.bfloat16, device=acc.device)
        dv = torch.empty(shape, dtype=torch.bfloat16, device=acc.device)
        kw = {"cu_seqlens": torch.tensor([0, 40, 100], dtype=torch.int32, device=acc.device)} if varlen else {}
        # dispatches to the fake kernel (no data, no device needed) and returns nothing
        assert torch.ops.flash_epilogue.store(acc, acc, dk, dv, **kw) is None
        fe.store(acc, acc, dk, dv, **kw) if torch.cuda.is_available() else None


def test_store_fake_is_registered():
    from torch._library.simple_registry import singleton

    assert singleton.find("flash_epilogue::store").fake_impl.kernel is not None


_STALE_BUILD = pytest.mark.skipif(not hasattr(torch.ops.flash_epilogue, "store_zero"),
                                  reason="the loaded extension was built before store_zero existed")


@_STALE_BUILD
@pytest.mark.parametrize("varlen", [False, True])
def test_store_zero_fake_kernel(varlen):
    with FakeTensorMode():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        shape = (100, 4, 128) if varlen else (2, 50, 4, 128)
        dk = torch.empty(shape, dtype=torch.bfloat16, device=device)
        dv = torch.empty(shape[:-1] + (64,), dtype=torch.bfloat16, device=device)
        kw = {"cu_seqlens": torch.tensor([0, 40, 100], dtype=torch.int32, device=device)} if varlen else {}
        idx = torch.tensor([1], dtype=torch.int32, device=device)
        assert torch.ops.flash_epilogue.store_zero(dk, dv, batch_idx=idx, head_idx=idx, row_start=3, row_end=9,
                                                   **kw) is None
        assert torch.ops.flash_epilogue.store_zero(dk, dv, **kw) is None
        fe.store_zero(dk, dv, batch_idx=[0, 1], head_idx=2, **kw) if torch.cuda.is_available() else None


@_STALE_BUILD
def test_store_zero_fake_is_registered():
    from torch._library.simple_registry import singleton

    assert singleton.find("flash_epilogue::store_zero").fake_impl.kernel is not None


def test_instantiations_are_up_to_date():
    out = subprocess.run([sys.executable, "scripts/generate_instantiations.py", "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_build_info_and_configs_listed():
    from flash_epilogue.info import info

    d = info()
    assert d["flash_epilogue"] == fe.__version__
    if fe.kernels_available():
        assert "sm_90a" in d["compiled_archs"]
        got = {(c["op"], c["dtype"], c["head_dim"], c["path"]) for c in d["compiled_configs"]}
        assert got == {(op, dt, hd, path) for op in ("store", "store_zero", "gqa_accumulate", "gqa_postprocess", "gqa_reduce")
                       for dt in ("bfloat16", "float16")
                       for hd in fe.COMPILED_HEAD_DIMS for path in ("sm90", "sm80")}


def test_info_and_main_run():
    for module in ("flash_epilogue.info", "flash_epilogue"):
        out = subprocess.run([sys.executable, "-m", module], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


def test_debug_switch_turns_on_content_checks(monkeypatch):
    from flash_epilogue import ops

    monkeypatch.delenv("FLASH_EPILOGUE_CHECK_INPUTS", raising=False)
    monkeypatch.delenv("FLASH_EPILOGUE_DEBUG", raising=False)
    ops.refresh_env_flags()
    assert not ops._want_content_checks(None)
    assert ops._want_content_checks(True)
    monkeypatch.setenv("FLASH_EPILOGUE_DEBUG", "1")
    assert not ops._want_content_checks(None)  # read at import (host time), until refreshed
    ops.refresh_env_flags()
    assert ops._want_content_checks(None)
    assert not ops._want_content_checks(False)  # an explicit argument wins
    ops._debug_sync("store", torch.device("cpu"))  # nothing to wait for off the GPU


def test_build_for_another_torch_is_named(monkeypatch):
    # an extension built against another torch fails with an undefined symbol when loaded; the
    # versions recorded at build time let the package say so by name instead
    from flash_epilogue import _extension

    if _extension._build_info is None or not _extension._build_info.CUDA_KERNELS:
        pytest.skip("no CUDA build here")
    monkeypatch.delenv("FLASH_EPILOGUE_DISABLE_KERNELS", raising=False)  # that switch is checked first
    monkeypatch.setattr(_extension._build_info, "TORCH_VERSION", "1.0.0+other")
    monkeypatch.setattr(_extension, "_C", None)
    monkeypatch.setattr(_extension, "UNAVAILABLE_REASON", None)
    _extension._load()
    assert _extension._C is None
    assert "built against torch 1.0.0+other" in _extension.UNAVAILABLE_REASON
    assert f"torch {torch.__version__} is running" in _extension.UNAVAILABLE_REASON
