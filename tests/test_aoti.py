"""AOTInductor: one module calling every op (store batched and varlen, store_zero, deterministic gqa_accumulate twice
into an accumulator, gqa_postprocess, gqa_accum_to_dense, gqa_reduce, repeat_kv and repeat_kv_backward), exported and
packaged with torch._inductor.aoti_compile_and_package, loads with aoti_load_package and gives bitwise eager's
results (outputs and every tensor it writes): in this process, and on the GPU in a fresh process that imports
flash_epilogue (which registers the ops) before loading the package.

On the CPU (CI) the CPU stand-ins of test_ecosystem serve the ops: what is checked there is that the schemas go
through export, AOTInductor's proxy executor and the loaded package. Where AOTInductor cannot load any package here
(a module of one `a + 1` and no flash_epilogue op crashes the loading process), the tests skip and say so: that is
the environment's (seen with torch 2.11 on a GPU machine whose every package died in the model's std::regex
device-string parse, a libstdc++ mismatch), not something a package of ours can change.
"""
import functools
import subprocess
import sys
import textwrap

import pytest
import torch

import flash_epilogue as fe
from conftest import same
from test_ecosystem import cpu_kernels  # noqa: F401 (the fixture of the CPU stand-ins)
from test_ecosystem import DEVICES, OPS, assert_same_problem, clone_problem, device_setup, every_op, make_problem

pytestmark = pytest.mark.skipif(not fe.kernels_available(), reason=f"no extension: {fe.UNAVAILABLE_REASON}")

LOAD_AND_RUN = textwrap.dedent("""
    import sys
    import torch
    import flash_epilogue  # registers the ops the package calls
    package, inputs, outputs = sys.argv[1:]
    args = torch.load(inputs)
    result = torch._inductor.aoti_load_package(package)(*args)
    torch.save((result, args), outputs)
""")


class EveryOp(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.d = d

    def forward(self, t, dk_accum, dv_accum, semaphores):
        dense, ok = every_op(t, dk_accum, dv_accum, semaphores, self.d)
        y = OPS.repeat_kv(t["x"], 3, 1)
        gx = OPS.repeat_kv_backward(y * 2, 3, 1, [0, 2, 1])
        return dense, ok, y, gx


class AddOne(torch.nn.Module):
    def forward(self, a):
        return a + 1


def package(module, args, path) -> str:
    torch._dynamo.reset()
    return torch._inductor.aoti_compile_and_package(torch.export.export(module, args), package_path=str(path))


def load_in_fresh_process(pkg, args, tmp_path):
    """(rc, stderr tail, (result, args) or None): the package loaded and run in a new Python process."""
    torch.save(args, tmp_path / "inputs.pt")
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_RUN, pkg, str(tmp_path / "inputs.pt"),
                           str(tmp_path / "outputs.pt")], capture_output=True, text=True, timeout=600)
    got = torch.load(tmp_path / "outputs.pt") if proc.returncode == 0 else None
    return proc.returncode, proc.stderr[-2000:], got


@functools.cache
def aoti_loads_here(device: str, tmp: str) -> str | None:
    """None when a package without our ops loads and runs in a fresh process on `device`, else why not."""
    from pathlib import Path

    a = torch.arange(4.0, device=device)
    pkg = package(AddOne(), (a,), Path(tmp) / f"add_one_{device}.pt2")
    check = (f"import sys, torch; a = torch.arange(4.0, device='{device}'); "
             "assert torch.equal(torch._inductor.aoti_load_package(sys.argv[1])(a), a + 1)")
    proc = subprocess.run([sys.executable, "-c", check, pkg], capture_output=True, text=True, timeout=600)
    if proc.returncode == 0:
        return None
    return (f"AOTInductor cannot load a package of `a + 1` (no flash_epilogue op) on {device} here: the loading "
            f"process exited with {proc.returncode}; {proc.stderr[-300:]}")


@pytest.mark.parametrize("device", DEVICES)
def test_a_package_of_every_op_runs_as_eager(request, device, tmp_path_factory, tmp_path):
    device_setup(request, device)  # on the CPU: the stand-in kernels
    why = aoti_loads_here(device, str(tmp_path_factory.getbasetemp()))
    if why:
        pytest.skip(why)
    t, acc, sizes = make_problem(device)
    module = EveryOp(sizes["d"])
    args = (t, acc.dk_accum, acc.dv_accum, acc.semaphores)
    pkg = package(module, clone_args(args), tmp_path / "every_op.pt2")

    t_eager, acc_eager = clone_problem(t, acc)
    want = module(t_eager, acc_eager.dk_accum, acc_eager.dv_accum, acc_eager.semaphores)
    t_aoti, acc_aoti = clone_problem(t, acc)
    got = torch._inductor.aoti_load_package(pkg)(t_aoti, acc_aoti.dk_accum, acc_aoti.dv_accum, acc_aoti.semaphores)
    assert_same_results(got, want)
    assert_same_problem(t_aoti, acc_aoti, t_eager, acc_eager)

    if device == "cuda":  # a fresh process (the CPU stand-ins exist only in this one)
        t_fresh, acc_fresh = clone_problem(t, acc)
        rc, err, result = load_in_fresh_process(pkg, (t_fresh, acc_fresh.dk_accum, acc_fresh.dv_accum,
                                                      acc_fresh.semaphores), tmp_path)
        assert rc == 0, err
        got, (t_fresh, dk_accum, dv_accum, _) = result
        acc_fresh.dk_accum.copy_(dk_accum)
        acc_fresh.dv_accum.copy_(dv_accum)
        assert_same_results(got, want)
        assert_same_problem(t_fresh, acc_fresh, t_eager, acc_eager)


def clone_args(args):
    t, *rest = args
    return ({k: v.clone() for k, v in t.items()}, *(x.clone() for x in rest))


def assert_same_results(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert same(g, w)
