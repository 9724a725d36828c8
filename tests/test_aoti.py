"""AOTInductor: a package of every op (conftest.every_op) gives bitwise eager's results (outputs and every tensor
it writes) in this process and in a fresh one that imports flash_epilogue (which registers the ops) before loading it.
On the CPU the stand-in kernels serve only this process's ops, so the fresh process only loads the package there.

A package is first loaded in a fresh process: a broken one kills the loading process. Where a package of `a + 1` (no
flash_epilogue op) fails to load too, the compiler AOTInductor used is at fault (docs/semantics.md: a C++ compiler that
links libstdc++ statically gives model libraries whose std::regex crashes beside the shared libstdc++): the test skips.
"""
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import Module, assert_same, clone_problem, every_op, make_problem, problem_args

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


def package(fn, args, path) -> str:
    torch._dynamo.reset()
    return torch._inductor.aoti_compile_and_package(torch.export.export(Module(fn), args), package_path=str(path))


def in_fresh_process(pkg, tmp_path, inputs="-"):
    """The package loaded, and run on the arguments saved in `inputs` ("-": none), in a new process."""
    return subprocess.run([sys.executable, "-c", LOAD, pkg, inputs, str(tmp_path / "outputs.pt")],
                          capture_output=True, text=True, timeout=600)


def test_a_package_of_every_op_runs_as_eager(device, tmp_path):
    t, acc, _ = make_problem(device)
    pkg = package(every_op, problem_args(*clone_problem(t, acc)), tmp_path / "every_op.pt2")
    eager = problem_args(*clone_problem(t, acc))
    want = every_op(*eager)

    inputs = str(tmp_path / "inputs.pt") if device == "cuda" else "-"
    if device == "cuda":
        torch.save(problem_args(*clone_problem(t, acc)), inputs)
    proc = in_fresh_process(pkg, tmp_path, inputs)
    if proc.returncode != 0:  # skip where a package of `a + 1` cannot load either (the environment's fault)
        add_one = package(lambda a: a + 1, (torch.arange(4.0, device=device),), tmp_path / "add_one.pt2")
        add_one = in_fresh_process(add_one, tmp_path)
        if add_one.returncode != 0:
            pytest.skip(f"AOTInductor cannot load a package of `a + 1` (no flash_epilogue op) on {device} here: exit "
                        f"code {add_one.returncode} with C++ compiler {torch._inductor.config.cpp.cxx[1]} "
                        f"(docs/semantics.md, AOTInductor); {add_one.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = [torch.load(tmp_path / "outputs.pt")] if device == "cuda" else []  # (outputs, the arguments after)
    args = problem_args(*clone_problem(t, acc))
    runs.append((torch._inductor.aoti_load_package(pkg)(*args), args))
    for got in runs:
        assert_same(got, (want, eager))
