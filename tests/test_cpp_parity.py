"""CPU tests of the C++ argument checks and of the wrappers' fast path (op first, Python validation
only when the op raises).

The ops are registered for CPU tensors too: they run every metadata check and then refuse the
device, so the checks in csrc/bindings.cpp can be compared with flash_epilogue/validation.py
without a GPU (tests/cpp_parity.py). What needs a GPU (capability checks, a launch) is not here.
"""
import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cpp_parity
import flash_epilogue as fe
import flash_epilogue.validation as V
from flash_epilogue import ops as fe_ops
from flash_epilogue._config import gqa_accum_shape, gqa_semaphore_numel
from flash_epilogue.validation import FlashEpilogueInputError

ROOT = Path(__file__).resolve().parent.parent
F16, BF16, F32, I32 = torch.float16, torch.bfloat16, torch.float32, torch.int32

_CPU_CHECKS, _WHY_NOT = cpp_parity.cpu_checks_available()
requires_cpu_checks = pytest.mark.skipif(not _CPU_CHECKS, reason=_WHY_NOT)
OPS = torch.ops.flash_epilogue


def cu(*vals):
    return torch.tensor(vals, dtype=I32)


def _store_args(b=2, s=16, h=4, d=64):
    return (torch.zeros(b, s, h, d), torch.zeros(b, s, h, d), torch.zeros(b, s, h, d, dtype=BF16),
            torch.zeros(b, s, h, d, dtype=BF16))


def _device_error(op, first):
    return pytest.raises(ValueError, match="^" + re.escape(f"flash_epilogue.{op}: {first}: device: expected a CUDA "
                                                           "tensor, got a tensor on cpu") + "$")


# ---------------------------------------------------------------------------------------------
# the validation suites, with every validator call compared against the op


@requires_cpu_checks
def test_validation_suites_agree_with_the_ops(tmp_path):
    log = tmp_path / "parity.jsonl"
    env = dict(os.environ, FLASH_EPILOGUE_TEST_CPP_PARITY=str(log))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_validation.py",
                          "tests/test_gqa_validation.py"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    counts = collections.Counter(r["outcome"] for r in rows)
    assert counts["mismatch"] == 0, [r for r in rows if r["outcome"] == "mismatch"]
    # not vacuous: most rejections are compared message for message, and valid calls reach the device check
    assert counts["identical"] >= 150 and counts["valid"] >= 50 and counts["schema"] >= 10, counts
    # every op is compared
    assert {r["validator"] for r in rows if r["outcome"] == "identical"} == set(cpp_parity.SPECS), counts


# ---------------------------------------------------------------------------------------------
# the op's own behaviour on CPU tensors


@requires_cpu_checks
def test_op_error_types():
    a, b, k, v = _store_args()
    with pytest.raises(TypeError, match=r"^flash_epilogue\.store: dk_accum: dtype: expected torch\.float32, "
                                        r"got torch\.float16$") as e:
        OPS.store(a.half(), b, k, v)
    assert not isinstance(e.value, FlashEpilogueInputError)
    with pytest.raises(ValueError, match=r"^flash_epilogue\.store: dv: memory: expected no overlap with dk"):
        OPS.store(a, b, k, k)
    with pytest.raises(TypeError, match=r"^flash_epilogue\.store: dk: expected a torch\.Tensor, got NoneType$"):
        OPS.store(a, b, None, v)
    with _device_error("store", "dk_accum"):
        OPS.store(a, b, k, v)


@requires_cpu_checks
def test_op_accepts_packed_outputs_and_strided_layouts():
    # element-exact overlap checks: interleaved dk/dv in one buffer share no element
    kv = torch.zeros(2, 16, 2, 4, 64, dtype=BF16)
    acc = torch.zeros(2, 16, 4, 64)
    with _device_error("store", "dk_accum"):
        OPS.store(acc, acc.clone(), kv[:, :, 0], kv[:, :, 1])
    both = torch.zeros(2, 16, 4, 128, dtype=BF16)
    with _device_error("store_zero", "dk"):
        OPS.store_zero(both[..., :64], both[..., 64:])
    with pytest.raises(ValueError, match=r"^flash_epilogue\.store_zero: dv: memory: expected no overlap with dk"):
        OPS.store_zero(both[..., :64], both[..., 56:120])
    # (batch, heads, seqlen, d) storage seen as (batch, seqlen, heads, d); size-1 dims with odd strides
    t = torch.zeros(2, 4, 16, 64, dtype=BF16).transpose(1, 2)
    with _device_error("store_zero", "dk"):
        OPS.store_zero(t, torch.zeros(2, 16, 4, 64, dtype=BF16))
    odd = torch.zeros(16 * 64, dtype=BF16).as_strided((1, 16, 1, 64), (7, 64, 3, 1))
    with _device_error("store_zero", "dk"):
        OPS.store_zero(odd, torch.zeros(1, 16, 1, 64, dtype=BF16))


@requires_cpu_checks
def test_op_checks_semaphores_even_when_not_deterministic():
    # the validation checks a given workspace whatever the mode; so does the op
    shape = gqa_accum_shape(2, 16, 2, 64)
    p, acc = torch.zeros(2, 16, 4, 64), torch.zeros(shape)
    short = torch.zeros(gqa_semaphore_numel(shape) - 1, dtype=I32)
    with pytest.raises(ValueError, match=r"^flash_epilogue\.gqa_accumulate: semaphores: numel: expected >= 9 "):
        OPS.gqa_accumulate(p, p.clone(), acc, acc.clone(), short, deterministic=False)


def test_fake_kernels_refuse_mixed_devices():
    # a real tensor mixed with meta ones is dispatched to the fake kernel: it must not accept it
    a, b, k, v = _store_args()
    with pytest.raises(FlashEpilogueInputError, match=r"^flash_epilogue\.store: dv: device: expected cpu \(the "
                                                      r"device of dk_accum\), got meta$"):
        OPS.store(a, b, k, v.to("meta"))
    OPS.store(a.to("meta"), b.to("meta"), k.to("meta"), v.to("meta"))  # all meta: fine (shape inference only)


# ---------------------------------------------------------------------------------------------
# the wrappers' fast path, forced on for CPU tensors (on a GPU it is taken for plain CUDA tensors)


@pytest.fixture
def fast(monkeypatch):
    """The wrappers treat CPU tensors like CUDA ones: the op is called first."""
    real = fe_ops._op_checks_first

    def on_cpu(t, check_inputs):
        if check_inputs is None:
            check_inputs = fe_ops._CHECK_INPUTS
        return not check_inputs and type(t) is torch.Tensor and t.device.type == "cpu"

    monkeypatch.setattr(fe_ops, "_op_checks_first", on_cpu)
    return real


class Counter:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _count_validators(monkeypatch):
    counters = {}
    for name in cpp_parity.SPECS:
        counters[name] = Counter(getattr(V, name))
        monkeypatch.setattr(V, name, counters[name])
    return counters


def test_fast_path_skips_validation_when_the_op_succeeds(fast, sm90, monkeypatch):
    counters = _count_validators(monkeypatch)
    recorded = collections.Counter()

    def recorder(name):
        return lambda *args, **kwargs: recorded.update([name])

    for name in ("store", "store_zero", "gqa_accumulate", "gqa_postprocess", "gqa_reduce"):
        monkeypatch.setattr(torch.ops.flash_epilogue, name, recorder(name))
    a, b, k, v = _store_args()
    fe.store(a, b, k, v)
    fe.store_zero(k, v, batch_idx=cu(0), row_start=1, row_end=5)
    acc = fe.gqa_accumulator(2, 64, batch=2, seqlen=16, device="cpu", deterministic=True)
    fe.gqa_accumulate(a, b, acc)
    fe.gqa_postprocess(acc, k[:, :, :2], v[:, :, :2], scale_dk=0.5, scale_dv=2)
    fe.gqa_reduce(a, b, num_heads_kv=2)
    fe.gqa_reduce(a, num_heads_kv=2, out=k[:, :, :2])
    assert recorded == {"store": 1, "store_zero": 1, "gqa_accumulate": 1, "gqa_postprocess": 1, "gqa_reduce": 2}
    assert all(c.calls == 0 for c in counters.values()), {n: c.calls for n, c in counters.items()}
    # content checks asked for: validated first, as before
    fe.store(a, b, k, v, check_inputs=True)
    assert counters["validate_store"].calls == 1
    # Python scalars the op's schema would coerce: validated first
    with pytest.raises(FlashEpilogueInputError, match=r"row_start: expected an int, got bool"):
        fe.store_zero(k, v, row_start=True)
    with pytest.raises(FlashEpilogueInputError, match=r"scale_dk: expected a float, got bool"):
        fe.gqa_postprocess(acc, k[:, :, :2], v[:, :, :2], scale_dk=True)
    with pytest.raises(FlashEpilogueInputError, match=r"deterministic: expected a bool, got int"):
        fe.gqa_accumulate(a, b, acc, deterministic=1)
    # an accumulator sized for another problem (same tensor shapes): named by the wrapper
    acc72 = fe.gqa_accumulator(2, 72, batch=2, seqlen=16, device="cpu")
    with pytest.raises(FlashEpilogueInputError, match=r"acc\.head_dim: expected 80 \(dk_partial\.shape\[-1\]\), got 72"):
        fe.gqa_accumulate(torch.zeros(2, 16, 4, 80), torch.zeros(2, 16, 4, 72), acc72)
    with pytest.raises(FlashEpilogueInputError, match=r"num_heads_kv: expected 2 \(the heads of out"):
        fe.gqa_reduce(a, num_heads_kv=4, out=k[:, :, :2])
    assert recorded["gqa_accumulate"] == 1 and recorded["gqa_reduce"] == 2


@requires_cpu_checks
def test_fast_path_names_the_bad_argument(fast, sm90):
    """The real op raises; the Python validation then raises its own message (the op's error is
    not chained into it)."""
    a, b, k, v = _store_args()
    with pytest.raises(FlashEpilogueInputError, match=r"^flash_epilogue\.store: dk_accum: dtype: expected "
                                                      r"torch\.float32, got torch\.float16$") as e:
        fe.store(a.half(), b, k, v)
    assert e.value.__suppress_context__ and isinstance(e.value.__context__, TypeError)
    with pytest.raises(FlashEpilogueInputError, match=r"^flash_epilogue\.store: dv_accum: expected a "
                                                      r"torch\.Tensor, got list$"):
        fe.store(a, [1.0], k, v)  # the op's schema refuses it
    with pytest.raises(FlashEpilogueInputError, match=r"^flash_epilogue\.store_zero: row_end: expected None or "
                                                      r">= row_start = 5, got 4$"):
        fe.store_zero(k, v, batch_idx=[0], row_start=5, row_end=4)
    acc = fe.gqa_accumulator(2, 64, batch=2, seqlen=16, device="cpu", deterministic=True)
    with pytest.raises(FlashEpilogueInputError, match=r"^flash_epilogue\.gqa_accumulate: dv_partial: stride\(-1\)"):
        fe.gqa_accumulate(a, torch.zeros(2, 16, 4, 128)[..., ::2], acc)
    with pytest.raises(FlashEpilogueInputError, match=r"^flash_epilogue\.gqa_postprocess: dv: memory: expected no "
                                                      r"overlap with dk"):
        fe.gqa_postprocess(acc, k[:, :, :2], k[:, :, :2])
    with pytest.raises(FlashEpilogueInputError, match=r"^flash_epilogue\.gqa_reduce: dk_partial: dtype: expected "
                                                      r"torch\.float32 or torch\.bfloat16 \(the dtype of dk\), got "
                                                      r"torch\.float64$"):
        fe.gqa_reduce(a.double(), num_heads_kv=2)


@requires_cpu_checks
def test_fast_path_reraises_the_op_error_when_validation_passes(fast, sm90):
    # with the device hooks patched the Python validation accepts CPU tensors; the op does not, and
    # its own error reaches the caller unchanged
    a, b, k, v = _store_args()
    acc = fe.gqa_accumulator(2, 64, batch=2, seqlen=16, device="cpu", deterministic=True)
    calls = [
        ("store", "dk_accum", lambda: fe.store(a, b, k, v)),
        ("store_zero", "dk", lambda: fe.store_zero(k, v, head_idx=[1, 2])),
        ("gqa_accumulate", "dk_partial", lambda: fe.gqa_accumulate(a, b, acc)),
        ("gqa_postprocess", "dk_accum", lambda: fe.gqa_postprocess(acc, k[:, :, :2], v[:, :, :2])),
        ("gqa_reduce", "dk_partial", lambda: fe.gqa_reduce(a, b, num_heads_kv=2)),
    ]
    for op, first, call in calls:
        with _device_error(op, first) as e:
            call()
        assert type(e.value) is ValueError


def test_env_flags_are_read_at_import_and_refreshed(monkeypatch):
    monkeypatch.setenv("FLASH_EPILOGUE_DEBUG", "1")
    assert not fe_ops._DEBUG  # not re-read on every call (host time)
    fe.refresh_env_flags()
    assert fe_ops._DEBUG and fe_ops._CHECK_INPUTS
    C = fe._extension._C
    if C is not None:
        assert C._debug_sync()  # repeat_kv's backward synchronizes in C++
    monkeypatch.setenv("FLASH_EPILOGUE_DEBUG", "0")
    monkeypatch.setenv("FLASH_EPILOGUE_CHECK_INPUTS", "1")
    fe.refresh_env_flags()
    assert not fe_ops._DEBUG and fe_ops._CHECK_INPUTS
    if C is not None:
        assert not C._debug_sync()
    # conftest re-reads them before each test, once monkeypatch has restored the environment


def test_fast_path_only_for_plain_cuda_tensors_in_eager(fast):
    real = fast
    assert not real(torch.zeros(1), None)  # CPU: the Python validation first (the op would refuse it anyway)
    assert not real(torch.zeros(1, device="meta"), None)  # meta: the fake kernel does not validate
    assert not real([1.0], None)

    class Sub(torch.Tensor):
        pass

    assert not real(torch.zeros(1).as_subclass(Sub), None)  # subclasses (FakeTensor is one)
