// The pybind11 module flash_epilogue._C: build info, the compiled configs and the tile table, the dispatch plan and
// the GQA accumulators' geometry. The ops themselves are torch.ops.flash_epilogue.* (registration.cpp).

#include <cuda_runtime_api.h>
#include <cutlass/version.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include <map>
#include <string>
#include <vector>

#include "device.h"
#include "flash_epilogue/version.h"
#include "ops.h"
#include "plan.h"
#include "repeat_kv.h"
#include "static_switch.h"

namespace {

using namespace pybind11::literals;
using flash_epilogue::compiled_archs;
using flash_epilogue::compiled_tile_configs;

// Every (op, dtype, head dim, path) with a kernel. path: sm90 (TMA collectives) or, where the build has it, sm80 (the
// Ampere collectives, compiled for every arch of the build); archs: the GPU code the build holds.
std::vector<py::dict> compiled_configs() {
  std::vector<py::dict> configs;
  for (char const* op : {"store", "store_zero", "gqa_accumulate", "gqa_postprocess", "gqa_reduce"}) {
    for (char const* dtype : {"bfloat16", "float16"}) {
      for (auto const& t : compiled_tile_configs()) {
        if (!t.fa3) { continue; }  // store's other tiles serve the same head dims
        bool const sm90 = t.arch == 90;
        if (!sm90 && !kFlashEpilogueSm80Path) { continue; }  // a build without the sm_80 path
        configs.emplace_back("op"_a = op, "dtype"_a = dtype, "head_dim"_a = t.head_dim,
                             "path"_a = sm90 ? "sm90" : "sm80",
                             "archs"_a = sm90 ? std::vector<std::string>{"sm_90a"} : compiled_archs());
      }
    }
  }
  return configs;
}

std::vector<py::dict> tile_configs() {
  std::vector<py::dict> configs;
  for (auto const& t : compiled_tile_configs()) {
    configs.emplace_back("head_dim"_a = t.head_dim, "arch"_a = t.arch, "block_n"_a = t.block_n,
                         "num_threads"_a = t.num_threads, "swap_ab"_a = t.swap_ab, "atom_layout_n"_a = t.atom_layout_n,
                         "accum_tile_elems"_a = t.accum_tile_elems, "slab_cols"_a = t.slab_cols,
                         "slab_elems"_a = t.slab_elems, "fa3"_a = t.fa3);
  }
  return configs;
}

py::dict accum_layout(int64_t num_heads_kv, int64_t head_dim, int64_t head_dim_v, int64_t batch, int64_t rows,
                      bool varlen, int64_t arch, at::Device device) {
  flash_epilogue::AccumLayout l;
  try {
    l = flash_epilogue::gqa_accum_layout(num_heads_kv, head_dim, head_dim_v, batch, rows, varlen, arch, device);
  } catch (c10::ValueError const& e) { throw py::value_error(e.what_without_backtrace()); }
  return py::dict("shapes"_a = py::make_tuple(py::tuple(py::cast(l.shape(0))), py::tuple(py::cast(l.shape(1)))),
                  "semaphore_numel"_a = l.semaphore_numel, "arch"_a = l.arch, "block_n"_a = l.tiles[0].block_n,
                  "tile_head_dims"_a = py::make_tuple(l.tiles[0].head_dim, l.tiles[1].head_dim));
}

// The plan of a problem (plan.h): op by name; the arguments as Problem's. For tests and for reading the rules.
py::dict plan(std::string const& op, int arch, int rows, int batch, int num_heads_kv, bool varlen, bool seqused,
              int head_dim, int head_dim_v, bool deterministic, int num_sms) {
  using flash_epilogue::Op;
  static std::map<std::string, Op> const ops = {
      {"store", Op::kStore},   {"store_zero", Op::kStoreZero},         {"gqa_accumulate", Op::kGqaAccumulate},
      {"gqa_postprocess", Op::kGqaPostprocess}, {"gqa_accum_to_dense", Op::kGqaAccumToDense},
      {"gqa_reduce", Op::kGqaReduce}};
  auto const it = ops.find(op);
  if (it == ops.end()) { throw py::value_error("flash_epilogue._C.plan: op: expected an op name, got " + op); }
  if (arch != 80 && arch != 90) { throw py::value_error("flash_epilogue._C.plan: arch: expected 80 or 90"); }
  flash_epilogue::Problem const p{it->second, arch, {rows, batch, num_heads_kv, varlen}, seqused, head_dim,
                                  head_dim_v, deterministic, num_sms};
  flash_epilogue::LaunchPlan const l = flash_epilogue::plan(p);
  static char const* const drivers[] = {"one_cta_per_tile", "stream", "per_query_head"};
  return py::dict("arch"_a = l.arch, "tile"_a = py::make_tuple(l.tile.head_dim, l.tile.block_n),
                  "dv_tile"_a = py::make_tuple(l.dv_tile.head_dim, l.dv_tile.block_n),
                  "driver"_a = drivers[static_cast<int>(l.driver)], "ctas_per_sm"_a = l.ctas_per_sm,
                  "predicated"_a = l.predicated, "ordered"_a = l.ordered, "dv_own_launch"_a = l.dv_own_launch());
}

py::dict plan_thresholds() {
  py::dict out;
  for (auto const& [name, value] : flash_epilogue::plan_thresholds()) { out[py::str(name)] = value; }
  return out;
}

py::dict build_info() {
  auto const version = [](int major, int minor, int patch) {
    return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
  };
  return py::dict(
      "version"_a = version(FLASH_EPILOGUE_VERSION_MAJOR, FLASH_EPILOGUE_VERSION_MINOR, FLASH_EPILOGUE_VERSION_PATCH),
      "torch_version"_a = TORCH_VERSION, "cuda_runtime_version"_a = CUDART_VERSION,
      "cutlass_version"_a = version(CUTLASS_MAJOR, CUTLASS_MINOR, CUTLASS_PATCH),
      "compiled_archs"_a = compiled_archs(), "tile_head_dims"_a = std::vector<int>{FLASH_EPILOGUE_ALL_HEAD_DIMS},
      "compiled_head_dims"_a = std::vector<int>(std::begin(kFlashEpilogueHeadDims), std::end(kFlashEpilogueHeadDims)),
      "code_paths"_a = kFlashEpilogueSm80Path ? std::vector<int>{90, 80} : std::vector<int>{90});
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_epilogue CUDA kernels; the ops are registered as torch.ops.flash_epilogue.*";
  m.def("compiled_archs", &compiled_archs, "GPU architectures this build has kernels for");
  m.def("compiled_configs", &compiled_configs, "every (op, dtype, head dim, arch) this build has a kernel for");
  m.def("tile_configs", &tile_configs, "the tile table: every compiled (head dim, arch path) and its tile");
  m.def("gqa_accum_layout", &accum_layout, "num_heads_kv"_a, "head_dim"_a, "head_dim_v"_a, "batch"_a, "rows"_a,
        "varlen"_a, "arch"_a, "device"_a,
        "the GQA accumulators' shapes (dK's, dV's), semaphore count, code path (arch 0: the device's), dK's tile rows "
        "and the head dims of dK's and dV's tiles "
        "for a problem; raises ValueError (op gqa_accumulator) for bad arguments");
  m.def("plan", &plan, "op"_a, "arch"_a, "rows"_a, "batch"_a, "num_heads_kv"_a, "varlen"_a, "seqused"_a, "head_dim"_a,
        "head_dim_v"_a, "deterministic"_a, "num_sms"_a,
        "the dispatch plan of a problem: code path, dK's and dV's tiles (head dim, rows), driver, CTAs per SM, "
        "predication, ordering");
  m.def("plan_thresholds", &plan_thresholds, "the plan's named thresholds, by name");
  m.def("build_info", &build_info, "the versions and archs this build was made with");
  m.def("_set_debug_sync", &flash_epilogue::set_debug_sync,
        "FLASH_EPILOGUE_DEBUG for the C++ paths (repeat_kv's backward): synchronize after the launch");
  m.def("_debug_sync", &flash_epilogue::debug_sync_enabled,
        "whether the C++ paths synchronize after their launches (FLASH_EPILOGUE_DEBUG)");
}
