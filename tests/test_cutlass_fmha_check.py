"""CUTLASS's example 88 (Hopper FMHA) storing its backward dK/dV through flash_epilogue
(csrc/include/flash_epilogue/cutlass_fmha/epilogue_bwd.hpp, checked by scripts/cutlass_fmha_check.py). On the CPU,
CI included: the script's patches apply to the example the nvidia-cutlass wheel ships (every anchor found once), the
GQA build's included (both modes), a kernel that no longer serialises its warpgroups' epilogues or builds its tile
scheduler after touching shared memory is refused, and (where nvcc is) the swapped example compiles:
tests/header_library/cutlass_fmha_interface.cu (two backward kernels, the shared-memory sizes of all five, and the
GQA build's deterministic path: ticket scheduler and ordered adds), and its main, run on the CPU, shows each host
refusal of the adapters with its reason. The whole check (both builds of the backward, then runs on an sm_90 GPU,
minutes) runs when FLASH_EPILOGUE_CUTLASS_FMHA_CHECK=1."""
import functools
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

import flash_epilogue
from conftest import nvcc, run_checked

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "cutlass_fmha_check.py"
INTERFACE = ROOT / "tests" / "header_library" / "cutlass_fmha_interface.cu"


@functools.cache
def check():
    """scripts/cutlass_fmha_check.py as a module, loaded by path."""
    spec = importlib.util.spec_from_file_location("cutlass_fmha_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def example():
    """The wheel's CUTLASS source tree (its example 88), or a skip."""
    library = pytest.importorskip("cutlass_library", reason="the nvidia-cutlass wheel is not installed")
    root = Path(library.__file__).resolve().parent / "source"
    if not (root / check().EXAMPLE / check().RUNNER).is_file():
        pytest.skip(f"{root} has no examples/88_hopper_fmha")
    return root


@pytest.fixture
def example_copy(example, tmp_path):
    """A copy of the wheel's example 88, to break."""
    copy = tmp_path / "88_hopper_fmha"
    shutil.copytree(example / check().EXAMPLE, copy)
    return copy


def test_the_patches_apply_to_the_wheels_example(example):
    c = check()
    sources = c.patched_sources(example / c.EXAMPLE)
    runner = sources["orig"]["bwd_only.cu"]
    assert sources["ours"]["bwd_only.cu"] == runner  # both builds run the same runner
    for d in (32, 64, 128, 256):
        assert f"run_fwd_{d}(fusion, options, hw_info);" not in runner  # no forward kernel instantiates
    for d in c.KERNEL_HDIMS:
        assert f"FE_BWD_HDIM == {d}) {{ run_bwd_{d}(fusion, options, hw_info); }}" in runner
    bwd_runner = runner[runner.index("struct BwdRunner {"):]
    assert bwd_runner.index('std::getenv("FE_DKV_DUMP")') < bwd_runner.index(c.VERIFY_ANCHOR)
    device = sources["ours"][str(c.DEVICE_BWD)]
    assert c.SWAP in device and c.SWAP_ANCHOR not in device and c.SWAP_INCLUDE in device
    assert "FmhaBwdEpilogueKV" not in device.split("using Epilogue", 1)[1].split(";", 1)[0]
    gqa = sources["gqa"]  # every anchor of the GQA build found as often as expected (patched_sources raises else)
    assert "EpilogueBwdKVGQA" in gqa[str(c.DEVICE_BWD)] and "Postprocess::run" in gqa[str(c.DEVICE_BWD)]
    assert gqa[str(c.MAINLOOP)].count("fe_kv_coord(blk_coord, params)") == 4
    assert 'get_cmd_line_argument("h_kv"' in gqa["bwd_only.cu"] and "fe_gqa_reference" in gqa["bwd_only.cu"]
    # the deterministic mode: the runner's flag reaches the device layer, which takes its tiles by ticket, hands
    # the epilogue its semaphores and the kernel its ticket counter, both zeroed with the accumulators
    assert 'check_cmd_line_flag("deterministic")' in gqa["bwd_only.cu"]
    assert "hw_info, h_kv, options.deterministic" in gqa["bwd_only.cu"]
    device = gqa[str(c.DEVICE_BWD)]
    assert c.SCHEDULER_ANCHOR not in device
    assert "TileSchedulerBwdAdapter<flash_epilogue::cutlass_fmha::TicketTileScheduler>" in device
    assert "{ dK_accum, dV_accum, kv_heads(args), semaphores }" in device
    assert "fe_op.tile_scheduler.ticket = params.ticket;" in device and "params.op.run(stream)" not in device
    assert "Epilogue::num_semaphores(" in device and "sync_ints(args) * sizeof(int)" in device


def test_gqa_cases_run_both_modes(example):
    c = check()
    cases = c.gqa_cases()
    assert {case["mode"] for case in cases} == {"atomic", "deterministic"}
    for mode in c.GQA_MODES:
        of_mode = [case for case in cases if case["mode"] == mode]
        assert {case["h"] // case["h_kv"] for case in of_mode} == {1, 2, 4, 8}
        assert {case["d"] for case in of_mode} == set(c.KERNEL_HDIMS)
        assert {case["mask"] for case in of_mode} == {"no", "causal"}
    assert len({case["name"] for case in cases}) == len(cases)
    assert c.GQA_REPEATS >= 3


def test_causal_cases_stay_where_the_example_ends():
    """Example 88's causal backward does not end when k passes q by two 128-row tiles (either epilogue), and it
    visits q / 128 query tiles rounding down: every causal case keeps q a multiple of 128 and k < q + 128."""
    c = check()
    causal = [case for case in c.cases([32, 64, 96, 128]) + c.gqa_cases() if case["mask"] == "causal"]
    assert causal
    for case in causal:
        assert case["q"] % 128 == 0 and case["k"] < case["q"] + 128, case["name"]
    assert any(case["k"] % 64 for case in causal)  # ragged k still covered


def test_a_kernel_that_builds_its_scheduler_late_is_refused(example_copy):
    c, copy = check(), example_copy
    kernel = copy / c.KERNEL
    text = kernel.read_text()
    assert c.check_ticket_scheduler(text) is None
    late = text.replace(c.SCHEDULER_CONSTRUCTED, "").replace(
        "    CollectiveMainloop collective_mainloop;\n",
        "    CollectiveMainloop collective_mainloop;\n    " + c.SCHEDULER_CONSTRUCTED + "\n")
    assert late.count(c.SCHEDULER_CONSTRUCTED) == 1
    kernel.write_text(late)
    with pytest.raises(c.PatchError, match="TicketTileScheduler"):
        c.patched_sources(copy)


def test_a_kernel_whose_epilogues_overlap_is_refused(example_copy):
    c, copy = check(), example_copy
    kernel = copy / c.KERNEL
    text = kernel.read_text()
    assert c.check_serialised(text) is None
    kernel.write_text(text.replace("if constexpr (kIsEpilogueLocked) ;", "if constexpr (kIsEpilogueLocked)"))
    with pytest.raises(c.PatchError, match="no longer serialised"):
        c.patched_sources(copy)


def test_a_missing_anchor_is_named(example_copy):
    c, copy = check(), example_copy
    device = copy / c.DEVICE_BWD
    device.write_text(device.read_text().replace("FmhaBwdEpilogueKV<Element,", "FmhaBwdEpilogueKV< Element,"))
    with pytest.raises(c.PatchError, match="using Epilogue = cutlass::fmha::collective::FmhaBwdEpilogueKV"):
        c.patched_sources(copy)


@pytest.mark.skipif(nvcc() is None, reason="no nvcc")
@pytest.mark.parametrize("tiles", ["two", pytest.param("all", marks=[pytest.mark.gpu, pytest.mark.slow])])
def test_the_swapped_example_compiles(example, tmp_path, tiles):
    """Two of the five tiles in CI (under a minute on 2 cores); all five where the GPU suite runs. Its main runs the
    adapters' host checks on the CPU: every refusal names its reason, and to_underlying_arguments throws it."""
    c = check()
    trees = c.prepare(example, tmp_path, {"ours": c.patched_sources(example / c.EXAMPLE)["ours"]})
    binary = tmp_path / "cutlass_fmha_interface"
    run_checked([nvcc(), "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr", "-O3",
                 "-DNDEBUG", *(["-DFE_ALL_TILES"] if tiles == "all" else []), str(INTERFACE), "-o", str(binary),
                 f"-I{trees['ours']}", *[f"-I{d}" for d in flash_epilogue.get_include()]])
    lines = run_checked([str(binary)]).stdout.splitlines()
    cases = [("mha", None), ("mha head dim 100", "head dim must be a multiple of 8 (16-byte vectors)"),
             ("mha misaligned", "tensor start must be 16-byte aligned"), ("gqa", None),
             ("gqa no accumulators", "dK and dV accumulators are needed"),
             ("gqa 3 kv heads of 4", "num_heads_q must be a multiple of num_heads_kv")]
    want = []
    for name, why in cases:
        adapter = "EpilogueBwdKVGQA" if name.startswith("gqa") else "EpilogueBwdKV"
        want += [f"{name}: {why}", f"{name}: thrown: flash_epilogue::cutlass_fmha::{adapter}: {why}"] if why else \
            [f"{name}: ok"]
    assert lines == want


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FLASH_EPILOGUE_CUTLASS_FMHA_CHECK"),
                    reason="FLASH_EPILOGUE_CUTLASS_FMHA_CHECK=1 runs the whole check (two builds, minutes)")
@pytest.mark.skipif(nvcc() is None, reason="no nvcc")
def test_the_whole_check(example, tmp_path):
    run_checked([sys.executable, str(SCRIPT), "--cutlass", str(example), "--work", str(tmp_path)])
