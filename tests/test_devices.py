"""Devices: every op refuses a tensor argument on another device than the others' (meta among CUDA or CPU tensors,
CPU among CUDA ones), whichever argument it is, naming the argument and both devices, and writes nothing; the expected
device is the first CUDA tensor's (in the schema's order), else the first tensor's. All-meta calls run the fake kernel
(torch's convention). Another GPU's tensor: test_bad_inputs.
"""
import pytest
import torch

import flash_epilogue as fe
from conftest import CALLS, HAVE_SM90, assert_same, autograd_problem, clone_problem, op_call

pytestmark = pytest.mark.skipif(not fe.kernels_available(), reason=f"no extension: {fe.UNAVAILABLE_REASON}")
DEVICE = "cuda" if HAVE_SM90 else "cpu"  # the problem's


def on(device, t):
    """t's metadata (meta) or contents (cpu) on `device`."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") if device == "meta" else t.to(device)


@pytest.mark.parametrize("other", ["meta", "cpu"])
def test_a_tensor_on_another_device_is_refused_naming_both(other):
    if DEVICE == other:
        pytest.skip("needs an sm_90 GPU: the problem is on the CPU here")
    t = autograd_problem(DEVICE)
    before = clone_problem(t)[0]
    for case in CALLS:
        op, kwargs, _, _ = op_call(case, t)
        tensors = [name for name, v in kwargs.items() if isinstance(v, torch.Tensor)]
        for name in tensors:
            ref = next(n for n in tensors if n != name)  # the expected device: the first other tensor's
            want = rf"flash_epilogue\.{op.__name__}: {name}: device: expected {DEVICE}(:0)? \(the device of {ref}\)"
            with pytest.raises(ValueError, match=f"{want}, got {other}"):
                op(**kwargs | {name: on(other, kwargs[name])})
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert_same(t, before)  # nothing written


def test_the_wrappers_raise_the_package_error():
    t = autograd_problem(DEVICE)
    with pytest.raises(fe.FlashEpilogueInputError, match=rf"flash_epilogue\.store: dv: device: expected {DEVICE}"
                       rf"(:0)? \(the device of dk_accum\), got meta"):
        fe.store(t["ak"], t["av"], t["dk"], on("meta", t["dv"]))
    with pytest.raises(fe.FlashEpilogueInputError, match=r"flash_epilogue\.gqa_reduce: dk_partial: device: expected "
                       rf"{DEVICE}(:0)? \(the device of dv_partial\), got meta"):
        fe.gqa_reduce(on("meta", t["rpk"]), t["rpv"], num_heads_kv=2)


def test_all_meta_calls_run_the_fake_kernels():
    t = autograd_problem("cpu")
    for case in CALLS:
        op, kwargs, _, _ = op_call(case, t)
        assert op(**{k: on("meta", v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}) is None
    x = torch.empty(2, 2, 8, 64, device="meta")
    assert fe.repeat_kv(x, 3).shape == (2, 6, 8, 64) and fe.repeat_kv(x, 3).device.type == "meta"
    assert fe.gqa_reduce(on("meta", t["rpk"]), num_heads_kv=2).device.type == "meta"
