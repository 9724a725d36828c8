#!/usr/bin/env python3
"""flash_epilogue inside CUTLASS's Hopper FMHA (examples/88_hopper_fmha): build its backward twice and compare.

    python scripts/cutlass_fmha_check.py [--cutlass DIR] [--work DIR] [--out FILE] [--jobs N] [--build-only]
                                         [--gqa | --gqa-only]

DIR is a CUTLASS source tree with examples/88_hopper_fmha, examples/common, tools/util/include and include (default:
the nvidia-cutlass wheel's cutlass_library/source, found through `import cutlass_library`). The check copies example
88 under --work once per build and patches the copies' runner (88_hopper_fmha.cu, as bwd_only.cu):
  * the forward calls are gone, so only the backward kernels instantiate, and FE_BWD_HDIM picks one head dim's
    kernels per binary (three binaries per build, compiled concurrently);
  * after its timed runs, the backward runner writes dK then dV (raw fp16) to $FE_DKV_DUMP/dkv_<tile>.bin.
The `ours` copy also stores dK/dV through csrc/include/flash_epilogue/cutlass_fmha/epilogue_bwd.hpp: the one line of
device/fmha_device_bwd.hpp that names FmhaBwdEpilogueKV names flash_epilogue::cutlass_fmha::EpilogueBwdKV instead,
beside its include. The adapter needs the kernel to run its warpgroups' epilogues one after the other (see the
header); the check refuses a checkout whose kernel no longer does.

Each build runs `--bwd --verify` (the example's reference check: max |diff| < 1e-2, mean < 1e-3 for dQ, dK and dV)
at head dims 32, 64, 96 (the d-128 kernel on a narrower head) and 128, masks no, causal and residual, and several
(b, h, q, k), ragged k among them, one process per case and build on the example's seeded inputs (both builds see
the same). Pass: every kernel verified in both builds, and dK/dV bitwise equal between them. Then the backward time
(the example's own: the mean of --iterations runs per process) of each build, processes interleaved
orig, ours, ours, orig, ...; the median over --repeats processes per build; ours / orig within --max-ratio.
With --gqa, a third build (`gqa`) runs the backward with fewer K/V heads than query heads (the runner's new
--h_kv): the smallest change to the example's mainloop and device layer (K/V TMA descriptors over h_kv heads, K/V
loads from head h / G, a K/V head count in the arguments, fp32 accumulators zeroed beside dQ's) and dK/dV added per
K/V head by the adapter's EpilogueBwdKVGQA (CollectiveEpilogueBwdGQA), then converted by its GqaPostprocess. The
runner's --deterministic picks the ordered mode (the group's query heads add in head order, through semaphores
zeroed beside the accumulators; the kernel takes its tiles from the adapter's TicketTileScheduler) over unordered
bulk reduce-adds. Cases: groups 1, 2, 4, 8 at head dims 32, 64, 128, masks no and causal, in both modes. Pass:
verified against the example's MHA reference run on K/V expanded to H heads, its dK/dV summed over each group in fp32
(the example's tolerances times the group size: the reference rounds each head's dK/dV to fp16 before the sum); in
deterministic mode also dK/dV bitwise equal over three processes. --gqa-only builds and runs the `gqa` build alone.
Writes a JSON summary (--out) and exits 1 if any build, case or timing fails. --build-only builds and stops (no GPU
needed).
"""
import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INCLUDE = REPO / "csrc" / "include"
ADAPTER = INCLUDE / "flash_epilogue" / "cutlass_fmha" / "epilogue_bwd.hpp"
EXAMPLE = Path("examples") / "88_hopper_fmha"
RUNNER = "88_hopper_fmha.cu"
BUILDS = ("orig", "ours")
KERNEL_HDIMS = (32, 64, 128)  # the example's backward instantiations: d <= 32, <= 64, <= 128
MASKS = ("no", "causal", "residual")
NVCC_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "--expt-relaxed-constexpr", "--use_fast_math",
              "-O3", "-DNDEBUG"]

# ---------------------------------------------------------------- the patches (anchor, replacement, count)

# Prepended to the runner: what the inserted lines use.
PRELUDE = """// flash_epilogue's check (scripts/cutlass_fmha_check.py): backward only, one head dim per binary,
// dK/dV dumps.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#ifndef FE_BWD_HDIM
#define FE_BWD_HDIM 0  // 0: every head dim
#endif
"""

# Inserted into BwdRunner::run after the timed runs, before the reference check: dK then dV as raw bytes.
DUMP = """    if (char const* fe_dir = std::getenv("FE_DKV_DUMP")) {  // flash_epilogue's check: dK, then dV, raw bytes
      std::string fe_path = std::string(fe_dir) + "/dkv_" + std::to_string(int(cute::get<0>(TileShape{}))) +
          "x" + std::to_string(int(cute::get<1>(TileShape{}))) + "x" + std::to_string(int(cute::get<2>(TileShape{}))) +
          ".bin";
      std::vector<Element> fe_host(block_dK.size() + block_dV.size());
      block_dK.copy_to_host(fe_host.data());
      block_dV.copy_to_host(fe_host.data() + block_dK.size());
      FILE* fe_file = std::fopen(fe_path.c_str(), "wb");
      bool fe_ok = fe_file && std::fwrite(fe_host.data(), sizeof(Element), fe_host.size(), fe_file) == fe_host.size();
      if (fe_file) { std::fclose(fe_file); }
      std::cout << (fe_ok ? "FE_DUMP " : "FE_DUMP_FAILED ") << fe_path << std::endl;
    }
"""
VERIFY_ANCHOR = "    // Verify that the result is correct\n"


def runner_patches():
    """(anchor, replacement) pairs for the runner, each anchor found exactly once (after `struct BwdRunner` for the
    dump)."""
    out = [(f"run_fwd_{d}(fusion, options, hw_info);",
            'std::cout << "forward not built (flash_epilogue check)" << std::endl;') for d in (32, 64, 128, 256)]
    out += [(f"run_bwd_{d}(fusion, options, hw_info);",
             f"if constexpr (FE_BWD_HDIM == 0 || FE_BWD_HDIM == {d}) {{ run_bwd_{d}(fusion, options, hw_info); }} "
             f'else {{ std::cout << "backward d<={d} not built in this binary" << std::endl; }}')
            for d in KERNEL_HDIMS]
    return out


SWAP_ANCHOR = ("using Epilogue = cutlass::fmha::collective::FmhaBwdEpilogueKV<Element, ElementAccumulator, "
               "typename Mainloop::TileShapePV>;")
SWAP = ("using Epilogue = flash_epilogue::cutlass_fmha::EpilogueBwdKV<Element, ElementAccumulator, "
        "typename Mainloop::TileShapePV>;")
INCLUDE_ANCHOR = '#include "../collective/fmha_epilogue_bwd.hpp"\n'
SWAP_INCLUDE = '#include "flash_epilogue/cutlass_fmha/epilogue_bwd.hpp"\n'
DEVICE_BWD = Path("device") / "fmha_device_bwd.hpp"
KERNEL = Path("kernel") / "fmha_kernel_tma_warpspecialized.hpp"
# The adapter's requirement: the kernel's ordered barrier around the epilogue call, made unconditional by the stray
# `;` after `if constexpr (kIsEpilogueLocked)`.
SERIALISED = [re.compile(r"if constexpr \(kIsEpilogueLocked\)\s*;\s*math_wg_order_barrier\.wait\(\);"),
              re.compile(r"if constexpr \(kIsEpilogueLocked\)\s*;\s*math_wg_order_barrier\.arrive\(\);")]


class PatchError(RuntimeError):
    pass


def replace_anchor(text, anchor, replacement, where, count=1, start=0):
    """text with anchor replaced at or after `start`; PatchError unless it occurs there exactly `count` times."""
    n = text.count(anchor, start)
    if n != count:
        times = "once" if count == 1 else f"{count} times"
        raise PatchError(f"{where}: expected the line {anchor.strip()!r} {times}, found it {n} times: this CUTLASS "
                         "checkout's example 88 differs from the one the check knows")
    return text[:start] + text[start:].replace(anchor, replacement)


def patch_runner(text):
    """The runner as bwd_only.cu: backward only, FE_BWD_HDIM, the dK/dV dump."""
    for anchor, replacement in runner_patches():
        text = replace_anchor(text, anchor, replacement, RUNNER)
    start = text.find("struct BwdRunner {")
    if start < 0:
        raise PatchError(f"{RUNNER}: no `struct BwdRunner {{`")
    text = replace_anchor(text, VERIFY_ANCHOR, DUMP + VERIFY_ANCHOR, f"{RUNNER} (BwdRunner)", start=start)
    return PRELUDE + text


def check_serialised(kernel_text):
    """Why the adapter cannot run in this kernel, or None."""
    missing = [p.pattern for p in SERIALISED if not p.search(kernel_text)]
    if missing:
        return (f"{KERNEL}: the warpgroups' epilogues are no longer serialised (no {missing[0]!r}); "
                "flash_epilogue/cutlass_fmha/epilogue_bwd.hpp must not be used as it is (see its header)")
    return None


def patch_device_ours(text):
    """device/fmha_device_bwd.hpp storing dK/dV through the adapter."""
    text = replace_anchor(text, SWAP_ANCHOR, SWAP, str(DEVICE_BWD))
    return replace_anchor(text, INCLUDE_ANCHOR, INCLUDE_ANCHOR + SWAP_INCLUDE, str(DEVICE_BWD))


# ---------------------------------------------------------------- the `gqa` build's patches

# Fewer KV heads than query heads: the kernel's K/V descriptors over h_kv heads, K/V loads from head h / G, a KV head
# count in the arguments, accumulators zeroed beside dQ's, the postprocess after the kernel; the runner's K/V,
# dK/dV over h_kv heads (--h_kv), verified against the MHA reference on K/V expanded to H heads, group-summed.
MAINLOOP = Path("collective") / "fmha_collective_bwd_tma_warpspecialized.hpp"
MAINLOOP_PATCHES = [
    ("    cute::tuple<int, int, int, _1> dDQ;\n  };",
     "    cute::tuple<int, int, int, _1> dDQ;\n"
     "    int num_heads_kv = 0;  // flash_epilogue's check: K/V heads (0: H)\n  };", 1),
    ("    float scale_softmax_log2;\n  };",
     "    float scale_softmax_log2;\n"
     "    int kv_group = 1;  // flash_epilogue's check: query heads per K/V head\n  };", 1),
    ("    TMA_LSE tma_load_lse = make_tma_copy(",
     "    // flash_epilogue's check: K and V descriptors over their own heads\n"
     "    int const fe_h_kv = args.num_heads_kv > 0 ? args.num_heads_kv : get<1>(problem_size);\n"
     "    auto fe_problem_kv = make_shape(get<3>(problem_size), get<2>(problem_size), get<4>(problem_size),\n"
     "                                    make_shape(get<0>(problem_size), fe_h_kv));\n"
     "    auto fe_k = CollectiveMmaNM::to_underlying_arguments(fe_problem_kv,\n"
     "        typename CollectiveMmaNM::Arguments{args.ptr_K, dK, args.ptr_Q, dQ}, nullptr);\n"
     "    auto fe_v = CollectiveMmaNM::to_underlying_arguments(fe_problem_kv,\n"
     "        typename CollectiveMmaNM::Arguments{args.ptr_V, dV, args.ptr_dO, dDO}, nullptr);\n\n"
     "    TMA_LSE tma_load_lse = make_tma_copy(", 1),
    ("        params_nm_kq.tma_load_a,\n        params_nm_vdo.tma_load_a,",
     "        fe_k.tma_load_a,\n        fe_v.tma_load_a,", 1),
    ("        (float) (std::log2(std::exp(1.0)) / std::sqrt(get<4>(problem_size)))\n    };",
     "        (float) (std::log2(std::exp(1.0)) / std::sqrt(get<4>(problem_size))),\n"
     "        get<1>(problem_size) / fe_h_kv\n    };", 1),
    ("  template<bool kLoadOuter, class BlkCoord, class ProblemShape, class LoadWarpBarrier>",
     "  // flash_epilogue's check: the K/V tile of a query head's block is its K/V head's, h / kv_group.\n"
     "  template<class BlkCoord>\n"
     "  CUTLASS_DEVICE static auto fe_kv_coord(BlkCoord const& blk_coord, Params const& params) {\n"
     "    return make_coord(get<0>(blk_coord), get<1>(blk_coord),\n"
     "                      make_coord(get<2,0>(blk_coord), get<2,1>(blk_coord) / params.kv_group));\n"
     "  }\n\n"
     "  template<bool kLoadOuter, class BlkCoord, class ProblemShape, class LoadWarpBarrier>", 1),
    ("load_k.init_state(_0{}, problem_size, TileShapeNM{}, blk_coord, outer_tile_count);",
     "load_k.init_state(_0{}, problem_size, TileShapeNM{}, fe_kv_coord(blk_coord, params), outer_tile_count);", 2),
    ("load_v.init_state(_0{}, problem_size, TileShapeNM{}, blk_coord, outer_tile_count);",
     "load_v.init_state(_0{}, problem_size, TileShapeNM{}, fe_kv_coord(blk_coord, params), outer_tile_count);", 2),
]

GQA_EPILOGUE = ("using Epilogue = flash_epilogue::cutlass_fmha::EpilogueBwdKVGQA<Element, ElementAccumulator, "
                "typename Mainloop::TileShapePV>;\n"
                "  using Postprocess = flash_epilogue::cutlass_fmha::GqaPostprocess<Element, "
                "typename Mainloop::TileShapePV, typename Mainloop::TiledMmaPV>;")
SCHEDULER_ANCHOR = "cutlass::fmha::kernel::TileSchedulerBwdAdapter<cutlass::fmha::kernel::IndividualTileScheduler>"
DEVICE_GQA_PATCHES = [
    (SWAP_ANCHOR, GQA_EPILOGUE, 1),
    (INCLUDE_ANCHOR, INCLUDE_ANCHOR + SWAP_INCLUDE, 1),
    (SCHEDULER_ANCHOR,
     "cutlass::fmha::kernel::TileSchedulerBwdAdapter<flash_epilogue::cutlass_fmha::TicketTileScheduler>", 1),
    ("    cutlass::KernelHardwareInfo hw_info;\n  };",
     "    cutlass::KernelHardwareInfo hw_info;\n"
     "    int num_heads_kv = 0;  // flash_epilogue's check: K/V heads (0: H)\n"
     "    bool deterministic = false;  // flash_epilogue's check: dK/dV added in head order (semaphores, ticket)\n"
     "  };", 1),
    ("    size_t dQ_acc_size;\n  };",
     "    size_t dQ_acc_size;\n"
     "    ElementAccumulator* dKV_accum;  // flash_epilogue's check: dK's, dV's, then the deterministic mode's ints\n"
     "    size_t dKV_accum_size;\n    typename Postprocess::Params post;\n"
     "    int* ticket;  // deterministic: the tile scheduler's ticket counter; else null\n  };", 1),
    ("  Params params_;\n",
     "  Params params_;\n\n  static int kv_heads(Arguments const& args) {\n"
     "    return args.num_heads_kv > 0 ? args.num_heads_kv : get<1>(args.problem_size);\n  }\n"
     "  static size_t accum_elems(Arguments const& args) {\n"
     "    return size_t(Epilogue::Layout::of(args.problem_size, kv_heads(args)).elems);\n  }\n"
     "  // deterministic: the epilogue's semaphores, then the ticket counter (zeroed with the accumulators)\n"
     "  static size_t sync_ints(Arguments const& args) {\n"
     "    return args.deterministic ? size_t(Epilogue::num_semaphores(args.problem_size, kv_heads(args))) + 1 : 0;\n"
     "  }\n", 1),
    ("      ElementAccumulator* dQ_acc = nullptr, cute::tuple<int, int, int, _1> const& stride_dQ = {}\n  ) {",
     "      ElementAccumulator* dQ_acc = nullptr, cute::tuple<int, int, int, _1> const& stride_dQ = {},\n"
     "      ElementAccumulator* dK_accum = nullptr, ElementAccumulator* dV_accum = nullptr, int* semaphores = nullptr\n"
     "  ) {", 1),
    ("        dQ_acc, stride_dQ },\n      { args.ptr_dK, args.stride_dK,\n        args.ptr_dV, args.stride_dV },",
     "        dQ_acc, stride_dQ, kv_heads(args) },\n      { dK_accum, dV_accum, kv_heads(args), semaphores },", 1),
    ("    workspace_bytes += B*H*Q*D * sizeof(ElementAccumulator);\n",
     "    workspace_bytes += B*H*Q*D * sizeof(ElementAccumulator);\n"
     "    workspace_bytes += 2 * accum_elems(args) * sizeof(ElementAccumulator) + sync_ints(args) * sizeof(int);\n", 1),
    ("    auto args_bwd = to_bwd_arguments(args, sum_OdO, args_sum_OdO.stride_sum_OdO, dQ_acc, "
     "args_convert.stride_src_dQ);",
     "    ElementAccumulator* dK_accum = dQ_acc + size_t(B)*H*Q*D;  // after dQ's, as get_workspace_size counts\n"
     "    ElementAccumulator* dV_accum = dK_accum + accum_elems(args);\n"
     "    int* semaphores = args.deterministic ? reinterpret_cast<int*>(dV_accum + accum_elems(args)) : nullptr;\n"
     "    params_.ticket = args.deterministic ? semaphores + (sync_ints(args) - 1) : nullptr;\n"
     "    params_.dKV_accum = dK_accum;\n"
     "    params_.dKV_accum_size =\n"
     "        2 * accum_elems(args) * sizeof(ElementAccumulator) + sync_ints(args) * sizeof(int);\n"
     "    params_.post = Postprocess::to_underlying_arguments(args.problem_size, kv_heads(args), dK_accum, dV_accum,\n"
     "        args.ptr_dK, args.stride_dK, args.ptr_dV, args.stride_dV);\n"
     "    auto args_bwd = to_bwd_arguments(args, sum_OdO, args_sum_OdO.stride_sum_OdO, dQ_acc, "
     "args_convert.stride_src_dQ,\n        dK_accum, dV_accum, semaphores);", 1),
    ("    auto cuda_result = cudaMemsetAsync(params.dQ_acc, 0, params.dQ_acc_size, stream);\n",
     "    auto cuda_result = cudaMemsetAsync(params.dQ_acc, 0, params.dQ_acc_size, stream);\n"
     "    if (cuda_result == cudaSuccess) {\n"
     "      cuda_result = cudaMemsetAsync(params.dKV_accum, 0, params.dKV_accum_size, stream);\n    }\n", 1),
    ("    result = params.op.run(stream);\n",
     "    auto fe_op = params.op.params();  // flash_epilogue's check: the kernel's Params with the ticket counter\n"
     "    fe_op.tile_scheduler.ticket = params.ticket;\n"
     "    result = Operation::run(fe_op, stream);\n", 1),
    ("    result = params.op_convert.run(stream);\n",
     "    if (Postprocess::run(params.post, stream) != cudaSuccess) {\n      return Status::kErrorInternal;\n    }\n\n"
     "    result = params.op_convert.run(stream);\n", 1),
]

# The runner's BwdRunner: members and helpers inserted after block_ref_dV.
GQA_RUNNER_MEMBERS = """
  // flash_epilogue's check (GQA): the kernel's K, V, dK, dV over h_kv heads (the c blocks); block_K and block_V
  // hold their expansion to H heads, on which the example's MHA references run, and the reference dK/dV are
  // summed over each group (fp32, then rounded) into block_ref_dKc/dVc.
  int h_kv = 0;
  StrideK stride_Kc;
  cutlass::DeviceAllocation<Element> block_Kc, block_Vc, block_dKc, block_dVc, block_ref_dKc, block_ref_dVc;

  void fe_gqa_init(int B, int H, int K, int D) {
    size_t const head = size_t(K) * D;
    int const group = H / h_kv;
    stride_Kc = cute::compact_row_major(cute::make_shape(B, h_kv, K, D));
    for (auto* block : {&block_Kc, &block_Vc, &block_dKc, &block_dVc, &block_ref_dKc, &block_ref_dVc}) {
      block->reset(size_t(B) * h_kv * head);
    }
    for (auto [full, kv] : {std::make_pair(&block_K, &block_Kc), std::make_pair(&block_V, &block_Vc)}) {
      for (int b = 0; b < B; ++b) {
        for (int k = 0; k < h_kv; ++k) {  // K/V head k: query head k * group's random values
          cudaMemcpy(kv->get() + (size_t(b) * h_kv + k) * head, full->get() + (size_t(b) * H + k * group) * head,
                     head * sizeof(Element), cudaMemcpyDeviceToDevice);
        }
        for (int h = 0; h < H; ++h) {  // every query head of a group sees its K/V head
          cudaMemcpy(full->get() + (size_t(b) * H + h) * head, kv->get() + (size_t(b) * h_kv + h / group) * head,
                     head * sizeof(Element), cudaMemcpyDeviceToDevice);
        }
      }
    }
  }

  void fe_gqa_reference(ProblemShapeType const& problem_size) {
    auto [B, H, Q, K, D] = problem_size;
    size_t const head = size_t(K) * cutlass::round_up(D, 8);
    int const group = H / h_kv;
    std::vector<Element> per_head(size_t(B) * H * head), summed(size_t(B) * h_kv * head);
    for (auto [src, dst] : {std::make_pair(&block_ref_dK, &block_ref_dKc),
                            std::make_pair(&block_ref_dV, &block_ref_dVc)}) {
      src->copy_to_host(per_head.data());
      for (int b = 0; b < B; ++b) {
        for (int k = 0; k < h_kv; ++k) {
          for (size_t i = 0; i < head; ++i) {
            float sum = 0.f;
            for (int g = 0; g < group; ++g) { sum += float(per_head[(size_t(b) * H + k * group + g) * head + i]); }
            summed[(size_t(b) * h_kv + k) * head + i] = Element(sum);
          }
        }
      }
      dst->copy_from_host(summed.data());
    }
  }
"""


def gqa_runner_patches(text):
    """The runner (already patch_runner's) with --h_kv, --deterministic and the GQA BwdRunner."""
    text = replace_anchor(text, "  bool bwd;\n",
                        "  bool bwd;\n  int h_kv = 0;  // flash_epilogue's check: K/V heads (0: h)\n"
                        "  bool deterministic = false;  // flash_epilogue's check: dK/dV added in head order\n", RUNNER)
    parse = '    bwd = cmd.check_cmd_line_flag("bwd");\n'
    text = replace_anchor(text, parse, parse + '    cmd.get_cmd_line_argument("h_kv", h_kv, 0);\n'
                        '    deterministic = cmd.check_cmd_line_flag("deterministic");\n', RUNNER)
    start = text.index("struct BwdRunner {")
    where = f"{RUNNER} (BwdRunner)"
    for anchor, replacement in [
            ("  cutlass::DeviceAllocation<Element> block_ref_dV;\n",
             "  cutlass::DeviceAllocation<Element> block_ref_dV;\n" + GQA_RUNNER_MEMBERS),
            ("    initialize(problem_size);\n",
             "    h_kv = options.h_kv > 0 ? options.h_kv : options.h;\n    initialize(problem_size);\n"),
            ("    initialize_block(block_dO, seed + 2020, false);\n",
             "    initialize_block(block_dO, seed + 2020, false);\n    fe_gqa_init(B, H, K, D);\n"),
            ("      block_K.get(), stride_K,\n      block_V.get(), stride_V,\n",
             "      block_Kc.get(), stride_Kc,\n      block_Vc.get(), stride_Kc,\n"),
            ("      block_dK.get(), stride_dK,\n      block_dV.get(), stride_dV,\n      hw_info\n",
             "      block_dKc.get(), stride_Kc,\n      block_dVc.get(), stride_Kc,\n"
             "      hw_info, h_kv, options.deterministic\n"),
            ("    reference_abs_diff(block_dK, block_ref_dK, max_diff, mean_diff);\n"
             "    bool passed_dK = (max_diff < 1e-2) && (mean_diff < 1e-3);",
             "    fe_gqa_reference(problem_size);  // a sum of H / h_kv terms: tolerances scaled by it\n"
             "    double const fe_group = double(get<1>(problem_size)) / h_kv;\n"
             "    reference_abs_diff(block_dKc, block_ref_dKc, max_diff, mean_diff);\n"
             "    bool passed_dK = (max_diff < 1e-2 * fe_group) && (mean_diff < 1e-3 * fe_group);"),
            ("    reference_abs_diff(block_dV, block_ref_dV, max_diff, mean_diff);\n"
             "    bool passed_dV = (max_diff < 1e-2) && (mean_diff < 1e-3);",
             "    reference_abs_diff(block_dVc, block_ref_dVc, max_diff, mean_diff);\n"
             "    bool passed_dV = (max_diff < 1e-2 * fe_group) && (mean_diff < 1e-3 * fe_group);"),
            ("      std::vector<Element> fe_host(block_dK.size() + block_dV.size());\n"
             "      block_dK.copy_to_host(fe_host.data());\n"
             "      block_dV.copy_to_host(fe_host.data() + block_dK.size());\n",
             "      std::vector<Element> fe_host(block_dKc.size() + block_dVc.size());\n"
             "      block_dKc.copy_to_host(fe_host.data());\n"
             "      block_dVc.copy_to_host(fe_host.data() + block_dKc.size());\n")]:
        text = replace_anchor(text, anchor, replacement, where, start=start)
    return text


# TicketTileScheduler's requirement (see the adapter's header): every thread of the CTA constructs the scheduler
# before the kernel first writes its shared memory (the pipelines' initialisation).
SCHEDULER_CONSTRUCTED = "TileScheduler tile_scheduler{params.tile_scheduler};"
FIRST_SMEM_WRITE = "MainloopPipelineOuter pipeline_outer("


def check_ticket_scheduler(kernel_text):
    """Why TicketTileScheduler cannot run in this kernel, or None."""
    i, j = kernel_text.find(SCHEDULER_CONSTRUCTED), kernel_text.find(FIRST_SMEM_WRITE)
    if kernel_text.count(SCHEDULER_CONSTRUCTED) != 1 or j < 0 or i > j:
        return (f"{KERNEL}: the tile scheduler is no longer constructed once, before {FIRST_SMEM_WRITE!r}; "
                "flash_epilogue::cutlass_fmha::TicketTileScheduler must not be used as it is (see its comment)")
    return None


def gqa_sources(example_dir, runner):
    """The `gqa` build's patched files (runner: patch_runner's)."""
    example_dir = Path(example_dir)
    if why := check_ticket_scheduler((example_dir / KERNEL).read_text()):
        raise PatchError(why)
    out = {"bwd_only.cu": gqa_runner_patches(runner)}
    for rel, patches in ((MAINLOOP, MAINLOOP_PATCHES), (DEVICE_BWD, DEVICE_GQA_PATCHES)):
        text = (example_dir / rel).read_text()
        for anchor, replacement, count in patches:
            text = replace_anchor(text, anchor, replacement, str(rel), count)
        out[str(rel)] = text
    return out


def patched_sources(example_dir):
    """{build: {relative path: patched text}} of example 88 in example_dir; PatchError where an anchor is missing."""
    example_dir = Path(example_dir)
    runner = patch_runner((example_dir / RUNNER).read_text())
    kernel_text = (example_dir / KERNEL).read_text()
    if why := check_serialised(kernel_text):
        raise PatchError(why)
    device = patch_device_ours((example_dir / DEVICE_BWD).read_text())
    return {"orig": {"bwd_only.cu": runner}, "ours": {"bwd_only.cu": runner, str(DEVICE_BWD): device},
            "gqa": gqa_sources(example_dir, runner)}


# ---------------------------------------------------------------- the toolchain

def cutlass_root(arg):
    if arg:
        root = Path(arg).expanduser().resolve()
    else:
        try:
            import cutlass_library
        except ImportError:
            sys.exit("no --cutlass and no nvidia-cutlass wheel (`pip install --no-deps nvidia-cutlass==4.2.0.0`, or "
                     "pass --cutlass with a CUTLASS source tree)")
        root = Path(cutlass_library.__file__).resolve().parent / "source"
    need = [EXAMPLE / RUNNER, Path("examples") / "common", Path("tools") / "util" / "include",
            Path("include") / "cute" / "tensor.hpp"]
    if missing := [str(p) for p in need if not (root / p).exists()]:
        sys.exit(f"--cutlass {root}: missing {', '.join(missing)} (expected a CUTLASS source tree with example 88)")
    return root


def cutlass_version(root):
    text = (root / "include" / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else "unknown"


def find_nvcc(arg):
    nvcc = arg or shutil.which("nvcc") or shutil.which(
        "nvcc", path=os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin"))
    if not nvcc:
        sys.exit("no nvcc: put it on PATH, set CUDA_HOME, or pass --nvcc")
    return nvcc


def curand_dirs(nvcc):
    """Where to look for curand_kernel.h (CUTLASS's device tensor fills include it): the CUDA toolkit's include dir,
    then pip's NVIDIA packages (nvidia/*/include) on sys.path."""
    dirs = []
    if os.environ.get("CUDA_HOME"):
        dirs.append(Path(os.environ["CUDA_HOME"]) / "include")
    dirs.append(Path(nvcc).resolve().parent.parent / "include")
    for p in sys.path:
        dirs += sorted(Path(p).glob("nvidia/*/include")) if p and Path(p).is_dir() else []
    return dirs


def curand_include(nvcc, work):
    """An include dir holding curand*.h alone (links to the first copy found), so that a pip package's other CUDA
    headers never shadow the toolkit's."""
    for d in curand_dirs(nvcc):
        if (d / "curand_kernel.h").is_file():
            out = work / "curand_include"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            for h in d.glob("curand*.h"):
                (out / h.name).symlink_to(h)
            return out, d
    sys.exit("curand_kernel.h not found (CUTLASS's tools/util/include/cutlass/util/reference/device/tensor_fill.h "
             "includes it). Looked in: " + ", ".join(map(str, curand_dirs(nvcc))) +
             ". Install cuRAND's headers: the toolkit's libcurand-dev package, or `pip install nvidia-curand-cu12` "
             "(CUDA 12) / `nvidia-curand` (CUDA 13)")


# ---------------------------------------------------------------- build

def prepare(root, work, sources):
    """work/<build>/88_hopper_fmha: a copy of the example with the build's patched files."""
    trees = {}
    for build, files in sources.items():
        dst = work / build / "88_hopper_fmha"
        shutil.copytree(root / EXAMPLE, dst, dirs_exist_ok=True)
        for rel, text in files.items():
            path = dst / rel
            if not path.is_file() or path.read_text() != text:  # unchanged files keep their mtimes
                path.write_text(text)
        trees[build] = dst
    return trees


def compile_commands(root, trees, curand, nvcc, work, builds):
    """{(build, hdim): (command, binary)}: one nvcc call per build and head dim."""
    cmds = {}
    for build in builds:
        tree = trees[build]
        incs = [root / "include", root / "tools" / "util" / "include", root / "examples" / "common", tree, curand]
        if build != "orig":
            incs.append(INCLUDE)
        for d in KERNEL_HDIMS:
            binary = binary_for(work, build, d)
            cmd = [nvcc, *NVCC_FLAGS, f"-DFE_BWD_HDIM={d}", *[f"-I{p}" for p in incs], str(tree / "bwd_only.cu"),
                   "-o", str(binary)]
            cmds[(build, d)] = (cmd, binary)
    return cmds


def stamp(cmd, tree, build):
    """What a binary is built from: the command and every source file it can include from the copy and our headers."""
    h = hashlib.sha256(" ".join(cmd).encode())
    files = sorted(p for p in tree.rglob("*") if p.is_file())
    if build != "orig":
        files += sorted(p for p in (INCLUDE / "flash_epilogue").rglob("*") if p.is_file())
    for p in files:
        h.update(str(p).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def build_all(cmds, trees, jobs, work):
    """Compile every (build, hdim) concurrently (jobs at a time); a binary whose stamp matches is kept."""
    def one(key):
        cmd, binary = cmds[key]
        build = key[0]
        st = stamp(cmd, trees[build], build)
        stamp_file = binary.with_suffix(".stamp")
        if binary.is_file() and stamp_file.is_file() and stamp_file.read_text() == st:
            return key, dict(ok=True, seconds=0.0, reused=True)
        log = work / build / f"build_d{key[1]}.log"
        t0 = time.monotonic()
        with open(log, "w") as f:
            f.write(" ".join(cmd) + "\n")
            f.flush()
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        seconds = time.monotonic() - t0
        if rc == 0:
            stamp_file.write_text(st)
        return key, dict(ok=rc == 0, seconds=round(seconds, 1), reused=False, log=str(log))

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = dict(pool.map(one, sorted(cmds, key=lambda k: -k[1])))  # the slowest (d 128) first
    for key, r in results.items():
        if not r["ok"]:
            print(f"build {key[0]} d{key[1]} failed; the end of {r['log']}:")
            print(Path(r["log"]).read_text()[-4000:])
    return {f"{b}_d{d}": r for (b, d), r in sorted(results.items())}


# ---------------------------------------------------------------- run

def cases(dims):
    """The verified cases: (b, h, q, k) per mask; the others take ragged q and k, causal takes q a multiple of 128
    (the example's causal backward visits q / BlockQO query tiles, rounding down) and k < q + 128: where k passes q
    by 256 or more its causal backward does not end, with either epilogue (seen on the H100 at q 512, k 768, 777
    and 1024)."""
    shapes = {"no": [(2, 4, 1024, 1024), (1, 3, 1000, 1000), (2, 2, 512, 777), (2, 2, 256, 40)],
              "residual": [(2, 4, 1024, 1024), (1, 3, 1000, 1000), (2, 2, 512, 777), (2, 2, 256, 40)],
              "causal": [(2, 4, 1024, 1024), (1, 3, 1024, 1000), (2, 2, 512, 600), (1, 2, 256, 40)]}
    out = []
    for d in dims:
        for mask in MASKS:
            for b, h, q, k in shapes[mask]:
                out.append(dict(name=f"d{d}_{mask}_b{b}h{h}q{q}k{k}", d=d, mask=mask, b=b, h=h, q=q, k=k))
    return out


def timing_cases(dims):
    return [dict(name=f"d{d}_{mask}_b2h16q2048k2048", d=d, mask=mask, b=2, h=16, q=2048, k=2048)
            for d in dims if d in KERNEL_HDIMS for mask in ("no", "causal")]


GQA_MODES = ("atomic", "deterministic")
GQA_REPEATS = 3  # processes per deterministic case, whose dK/dV must be the same bits


def gqa_cases():
    """The `gqa` build's cases: groups 1, 2, 4 and 8 (h_kv = h / group), head dims 32, 64 and 128, masks no and
    causal, ragged k; each in both modes."""
    shapes = [(2, 8, 4, 512, 512), (1, 8, 2, 1024, 777), (2, 8, 1, 256, 333), (1, 4, 4, 512, 300)]
    return [dict(name=f"gqa_{mode}_d{d}_{mask}_b{b}h{h}hkv{hkv}q{q}k{k}", mode=mode, d=d, mask=mask, b=b, h=h,
                 h_kv=hkv, q=q, k=k)
            for mode in GQA_MODES for d in KERNEL_HDIMS for mask in ("no", "causal") for b, h, hkv, q, k in shapes]


def run_gqa_cases(work, all_cases, repeats=GQA_REPEATS, timeout=60):
    """Pass: every kernel verified against the MHA reference on expanded K/V, group-summed; in deterministic mode
    also run `repeats` times in all (the first verified), every run's dK/dV bitwise equal to the first's. A run that
    does not end in `timeout` seconds (a wait that never ends) fails its case, and the deterministic cases after it
    fail unrun."""
    reports = []
    hung = None
    for c in all_cases:
        binary = binary_for(work, "gqa", c["d"])
        if hung and c["mode"] == "deterministic":  # keep the device time of a run that no longer ends for the rest
            reports.append(dict(c, ok=False, kernels={}, error=f"not run: {hung} did not end in {timeout} s"))
            print(f"  {c['name']}: FAILED (not run after {hung}'s timeout)", flush=True)
            continue
        if c["mode"] == "deterministic":
            dumps = [work / "dumps" / c["name"] / f"run{i}" for i in range(repeats)]
            runs = []
            for i in range(repeats):
                runs.append(run_example(binary, c, i == 0, 1, dumps[i], timeout=timeout))
                if runs[-1]["rc"] == -1:  # timed out: the repeats would too
                    break
        else:
            runs = [run_example(binary, c, True, 1, timeout=timeout)]
        first = runs[0]
        rep = dict(c, kernels={t: k["status"] for t, k in first["kernels"].items()})
        rep["ok"] = bool(first["kernels"]) and all(k["verified"] for k in first["kernels"].values())
        if c["mode"] == "deterministic":
            rep["repeats"] = repeats
            rep["bitwise_stable"] = {}
            for tile in first["kernels"]:
                ran = all(r["kernels"].get(tile, {}).get("status") in ("OK", "--") for r in runs)
                compared = [compare_dumps(dumps[0] / f"dkv_{tile}.bin", d / f"dkv_{tile}.bin") for d in dumps[1:]]
                rep["bitwise_stable"][tile] = ran and all(equal for equal, _, _ in compared)
                if not rep["bitwise_stable"][tile]:
                    rep.setdefault("differing_elements", {})[tile] = [diff for _, diff, _ in compared]
                    rep.setdefault("notes", {})[tile] = [note for _, _, note in compared if note]
            rep["ok"] &= all(rep["bitwise_stable"].values())
        if any(r["rc"] == -1 for r in runs) and c["mode"] == "deterministic":
            hung = c["name"]
        if not rep["ok"]:
            rep["output"] = [r["output"] for r in runs if r["rc"] != 0 or not r["kernels"]] or [first["output"]]
        stable = f" bitwise stable over {repeats} runs {rep['bitwise_stable']}" if "bitwise_stable" in rep else ""
        print(f"  {c['name']}: {'ok' if rep['ok'] else 'FAILED'} {rep['kernels']}{stable}", flush=True)
        reports.append(rep)
    return reports


def binary_for(work, build, d):
    hdim = next(h for h in KERNEL_HDIMS if d <= h)
    return work / build / f"ex88_bwd_d{hdim}"


RESULT = re.compile(r"^\s*\[(OK|FAIL|--)\]\s+(.*?)\s*:\s*(\S+) TFLOPS/s")
TIME = re.compile(r"t=([0-9.eE+-]+)ms")


def run_example(binary, case, verify, iterations, dump_dir=None, timeout=60):
    """One process: {tile: {status, verified, ms}} from the example's output, and the output."""
    args = [str(binary), "--bwd", "--verbose", f"--iterations={iterations}", f"--b={case['b']}", f"--h={case['h']}",
            f"--q={case['q']}", f"--k={case['k']}", f"--d={case['d']}", f"--mask={case['mask']}"]
    if "h_kv" in case:
        args.append(f"--h_kv={case['h_kv']}")
    if case.get("mode") == "deterministic":
        args.append("--deterministic")
    if verify:
        args.append("--verify")
    env = dict(os.environ)
    if dump_dir is not None:
        dump_dir.mkdir(parents=True, exist_ok=True)
        for f in dump_dir.glob("dkv_*.bin"):
            f.unlink()
        env["FE_DKV_DUMP"] = str(dump_dir)
    try:
        proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output, rc = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout} s", -1
    kernels, last = {}, None
    for line in output.splitlines():
        if m := RESULT.match(line):
            tile = re.search(r"(\d+x\d+x\d+)", m.group(2))
            last = tile.group(1) if tile else m.group(2)
            kernels[last] = dict(status=m.group(1), verified=m.group(1) == "OK" and verify, ms=None)
        elif last and (m := TIME.search(line)):
            kernels[last]["ms"] = float(m.group(1))
    return dict(rc=rc, kernels=kernels, output=output[-3000:])


def compare_dumps(a, b):
    """(bitwise equal, differing fp16 elements, note)."""
    if not a.is_file() or not b.is_file():
        return False, None, f"missing dump: {a if not a.is_file() else b}"
    x, y = a.read_bytes(), b.read_bytes()
    if len(x) != len(y):
        return False, None, f"sizes differ: {len(x)} vs {len(y)} bytes"
    if x == y:
        return True, 0, ""
    return False, sum(u != v for u, v in zip(memoryview(x).cast("H"), memoryview(y).cast("H"))), ""


def run_cases(work, all_cases, iterations):
    reports = []
    for c in all_cases:
        dumps = work / "dumps" / c["name"]
        runs = {b: run_example(binary_for(work, b, c["d"]), c, True, iterations, dumps / b) for b in BUILDS}
        rep = dict(c, ok=True, kernels={})
        tiles = sorted(set(runs["orig"]["kernels"]) | set(runs["ours"]["kernels"]))
        if not tiles:
            rep["ok"] = False
            rep["error"] = {b: runs[b]["output"] for b in BUILDS}
        for tile in tiles:
            k = {b: runs[b]["kernels"].get(tile, dict(status="missing", verified=False)) for b in BUILDS}
            equal, diff, note = compare_dumps(*(dumps / b / f"dkv_{tile}.bin" for b in BUILDS))
            k.update(bitwise_equal=equal, differing_elements=diff)
            if note:
                k["note"] = note
            k["ok"] = equal and all(k[b]["verified"] for b in BUILDS)
            rep["kernels"][tile] = k
            rep["ok"] &= k["ok"]
        if not rep["ok"]:
            rep["output"] = {b: runs[b]["output"] for b in BUILDS if runs[b]["rc"] != 0 or not rep["kernels"]
                             or any(not k[b]["verified"] for k in rep["kernels"].values())}
        status = "ok" if rep["ok"] else "FAILED"
        print(f"  {c['name']}: {status} " + " ".join(
            f"{t}(verify {k['orig']['status']}/{k['ours']['status']}, bitwise {k['bitwise_equal']})"
            for t, k in rep["kernels"].items()), flush=True)
        reports.append(rep)
    return reports


def run_timing(work, tcases, repeats, iterations, max_ratio):
    out = []
    order = [b for _ in range((repeats + 1) // 2) for b in ("orig", "ours", "ours", "orig")]
    for c in tcases:
        times = {b: {} for b in BUILDS}
        errors = []
        counts = {b: 0 for b in BUILDS}
        for build in order:
            if counts[build] >= repeats:
                continue
            counts[build] += 1
            r = run_example(binary_for(work, build, c["d"]), c, False, iterations)
            for tile, k in r["kernels"].items():
                if k["ms"] is not None and k["status"] != "FAIL":
                    times[build].setdefault(tile, []).append(k["ms"])
                else:
                    errors.append(f"{build} {tile}: {k['status']}")
            if not r["kernels"]:
                errors.append(f"{build}: no result (exit {r['rc']}): {r['output'][-500:]}")
        for tile in sorted(set(times["orig"]) & set(times["ours"])):
            med = {b: statistics.median(times[b][tile]) for b in BUILDS}
            ratio = med["ours"] / med["orig"]
            out.append(dict(c, tile=tile, orig_ms=med["orig"], ours_ms=med["ours"], ratio=ratio,
                            runs_ms={b: times[b][tile] for b in BUILDS}, ok=ratio <= max_ratio and not errors,
                            errors=errors))
            print(f"  {c['name']} {tile}: orig {med['orig']:.4f} ms, ours {med['ours']:.4f} ms, ratio {ratio:.4f}",
                  flush=True)
        if not set(times["orig"]) & set(times["ours"]):
            out.append(dict(c, ok=False, errors=errors or ["no timings"]))
    return out


def gpu_name():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cutlass", help="a CUTLASS source tree (default: the nvidia-cutlass wheel's)")
    ap.add_argument("--work", default="/tmp/cutlass_fmha_check", help="copies, builds and dumps (reused)")
    ap.add_argument("--out", help="the JSON summary (default: WORK/cutlass_fmha_check.json)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="concurrent nvcc processes")
    ap.add_argument("--nvcc", help="the nvcc to use (default: PATH, else CUDA_HOME/bin)")
    ap.add_argument("--build-only", "--compile-only", action="store_true", help="build both and stop (no GPU)")
    ap.add_argument("--dims", default="32,64,96,128", help="head dims of the verified cases")
    ap.add_argument("--iterations", type=int, default=20, help="timed runs per process")
    ap.add_argument("--repeats", type=int, default=5, help="timing processes per build and case")
    ap.add_argument("--max-ratio", type=float, default=1.01,
                    help="ours / orig backward time allowed (medians of --repeats processes)")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--gqa", action="store_true", help="also build and verify the GQA build (fewer K/V heads)")
    ap.add_argument("--gqa-only", action="store_true", help="build and verify the GQA build alone")
    args = ap.parse_args()
    args.gqa |= args.gqa_only
    builds_run = ("gqa",) if args.gqa_only else BUILDS + (("gqa",) if args.gqa else ())

    root = cutlass_root(args.cutlass)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    nvcc = find_nvcc(args.nvcc)
    curand, curand_from = curand_include(nvcc, work)
    try:
        sources = patched_sources(root / EXAMPLE)
    except PatchError as e:
        sys.exit(f"cannot patch example 88: {e}")
    trees = prepare(root, work, {b: sources[b] for b in builds_run})
    cmds = compile_commands(root, trees, curand, nvcc, work, builds_run)
    t0 = time.monotonic()
    builds = build_all(cmds, trees, args.jobs, work)
    each = ", ".join(f"{k} {v['seconds']} s" for k, v in builds.items())
    print(f"built {len(builds)} binaries in {time.monotonic() - t0:.0f} s ({each})", flush=True)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    summary = dict(commit=os.environ.get("FLASH_EPILOGUE_COMMIT", commit), date=str(datetime.date.today()),
                   cutlass=str(root), cutlass_version=cutlass_version(root), nvcc=nvcc, curand_headers=str(curand_from),
                   builds=builds)
    out_path = Path(args.out) if args.out else work / "cutlass_fmha_check.json"
    failed = [f"build {k}" for k, v in builds.items() if not v["ok"]]
    if args.build_only or failed:
        summary.update(failed=failed)
        out_path.write_text(json.dumps(summary, indent=1))
        print(("FAILED: " + ", ".join(failed)) if failed else "built (--build-only)")
        print(f"summary: {out_path}")
        return 1 if failed else 0

    dims = [int(d) for d in args.dims.split(",")]
    summary["gpu"] = gpu_name()
    print(f"cases on {summary['gpu']}:", flush=True)
    reports = [] if args.gqa_only else run_cases(work, cases(dims), iterations=1)
    timing = []
    if not args.no_timing and not args.gqa_only:
        print("timing:", flush=True)
        timing = run_timing(work, timing_cases(dims), args.repeats, args.iterations, args.max_ratio)
    gqa = []
    if args.gqa:
        print("gqa:", flush=True)
        gqa = run_gqa_cases(work, gqa_cases())
    failed += [r["name"] for r in reports + gqa if not r["ok"]]
    failed += [f"timing {t['name']} {t.get('tile', '')}".strip() for t in timing if not t["ok"]]
    summary.update(cases=len(reports), cases_passed=sum(r["ok"] for r in reports), timing=timing, failed=failed,
                   reports=reports, gqa_cases=len(gqa), gqa_passed=sum(r["ok"] for r in gqa), gqa=gqa)
    out_path.write_text(json.dumps(summary, indent=1))
    print(f"{summary['cases_passed']} of {len(reports)} cases passed (CUTLASS {summary['cutlass_version']}, "
          f"{summary['gpu']})")
    if args.gqa:
        print(f"{summary['gqa_passed']} of {len(gqa)} GQA cases passed")
    for name in failed:
        print("FAILED", name)
    print(f"summary: {out_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
