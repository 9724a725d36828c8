"""AOTInductor: a package of every op (test_ecosystem.every_op, repeat_kv and repeat_kv_backward) gives bitwise
eager's results (outputs and every tensor it writes) in this process and in a fresh one that imports flash_epilogue
(which registers the ops) before loading it. On the CPU the stand-in kernels serve only this process's ops, so the
fresh process only loads the package there.

A package is first loaded in a fresh process: a broken one kills the loading process. Where a package of `a + 1` (no
flash_epilogue op) fails to load too, the compiler AOTInductor used is at fault (docs/semantics.md: a C++ compiler that
links libstdc++ statically gives model libraries whose std::regex crashes beside the shared libstdc++): the test skips.
"""
import subprocess
import sys
import textwrap

import pytest
import torch

import flash_epilogue as fe
from conftest import same
from test_ecosystem import cpu_kernels, device as device  # noqa: F401 (fixtures: the device, its CPU stand-in kernels)
from test_ecosystem import OPS, assert_same_problem, clone_problem, every_op, make_problem

pytestmark = pytest.mark.skipif(not fe.kernels_available(), reason=f"no extension: {fe.UNAVAILABLE_REASON}")

LOAD = textwrap.dedent("""
    import sys
    import torch
    import flash_epilogue  # registers the ops the package calls
    package, inputs, outputs = sys.argv[1:]
    model = torch._inductor.aoti_load_package(package)
    if inputs != "-":
        args = torch.load(inputs)
        torch.save((model(*args), args), outputs)
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


def in_fresh_process(pkg, tmp_path, args=None):
    """(rc, stderr tail, (result, args) or None): the package loaded, and run on `args` if given, in a new process."""
    inputs = "-"
    if args is not None:
        inputs = str(tmp_path / "inputs.pt")
        torch.save(args, inputs)
    proc = subprocess.run([sys.executable, "-c", LOAD, pkg, inputs, str(tmp_path / "outputs.pt")],
                          capture_output=True, text=True, timeout=600)
    got = torch.load(tmp_path / "outputs.pt") if proc.returncode == 0 and args is not None else None
    return proc.returncode, proc.stderr[-2000:], got


def skip_if_no_package_loads(device, tmp_path):
    """Called once ours failed to load: skip where a package of `a + 1` cannot load either (the environment's)."""
    rc, err, _ = in_fresh_process(package(AddOne(), (torch.arange(4.0, device=device),), tmp_path / "add_one.pt2"),
                                  tmp_path)
    if rc != 0:
        pytest.skip(f"AOTInductor cannot load a package of `a + 1` (no flash_epilogue op) on {device} here: exit "
                    f"code {rc} with C++ compiler {torch._inductor.config.cpp.cxx[1]} (docs/semantics.md, "
                    f"AOTInductor); {err[-300:]}")


def test_a_package_of_every_op_runs_as_eager(device, tmp_path):
    t, acc, sizes = make_problem(device)
    module = EveryOp(sizes["d"])
    pkg = package(module, (clone_problem(t, acc)[0], acc.dk_accum.clone(), acc.dv_accum.clone(),
                           acc.semaphores.clone()), tmp_path / "every_op.pt2")
    t_eager, acc_eager = clone_problem(t, acc)
    want = module(t_eager, acc_eager.dk_accum, acc_eager.dv_accum, acc_eager.semaphores)

    t_fresh, acc_fresh = clone_problem(t, acc)
    fresh_args = (t_fresh, acc_fresh.dk_accum, acc_fresh.dv_accum, acc_fresh.semaphores) if device == "cuda" else None
    rc, err, result = in_fresh_process(pkg, tmp_path, fresh_args)
    if rc != 0:
        skip_if_no_package_loads(device, tmp_path)
    assert rc == 0, err
    if result is not None:
        got, (t_fresh, dk_accum, dv_accum, _) = result
        acc_fresh.dk_accum.copy_(dk_accum)
        acc_fresh.dv_accum.copy_(dv_accum)
        assert_same_results(got, want)
        assert_same_problem(t_fresh, acc_fresh, t_eager, acc_eager)

    t_aoti, acc_aoti = clone_problem(t, acc)
    got = torch._inductor.aoti_load_package(pkg)(t_aoti, acc_aoti.dk_accum, acc_aoti.dv_accum, acc_aoti.semaphores)
    assert_same_results(got, want)
    assert_same_problem(t_aoti, acc_aoti, t_eager, acc_eager)


def assert_same_results(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert same(g, w)
