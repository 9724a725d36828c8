// The op schemas (their one definition; ops.cpp registers the kernels) and the pybind11 module flash_epilogue._C
// (build info, the compiled configs and tile table, the GQA accumulator's geometry).

#include <cuda_runtime_api.h>
#include <cutlass/version.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <torch/version.h>

#include <string>
#include <vector>

#include "binding.h"
#include "flash_epilogue/version.h"
#include "static_switch.h"

TORCH_LIBRARY(flash_epilogue, m) {
  m.def("store(Tensor dk_accum, Tensor dv_accum, Tensor(a!) dk, Tensor(b!) dv, *, Tensor? cu_seqlens=None, "
        "Tensor? seqused=None, int _arch=0) -> ()");
  m.def("store_zero(Tensor(a!) dk, Tensor(b!) dv, *, Tensor? cu_seqlens=None, Tensor? seqused=None, "
        "Tensor? batch_idx=None, Tensor? head_idx=None, int row_start=0, int? row_end=None, int _arch=0) -> ()");
  m.def("gqa_accumulate(Tensor dk_partial, Tensor dv_partial, Tensor(a!) dk_accum, Tensor(b!) dv_accum, "
        "Tensor(c!)? semaphores=None, *, Tensor? cu_seqlens=None, Tensor? seqused=None, bool deterministic=False, "
        "int _arch=0) -> ()");
  m.def("gqa_postprocess(Tensor dk_accum, Tensor dv_accum, Tensor(a!) dk, Tensor(b!) dv, *, float scale_dk=1.0, "
        "float scale_dv=1.0, Tensor? cu_seqlens=None, Tensor? seqused=None, int _arch=0) -> ()");
  m.def("gqa_accum_to_dense(Tensor accum, Tensor(a!) out, *, int head_dim, Tensor? cu_seqlens=None, "
        "Tensor? seqused=None, int _arch=0) -> ()");
  m.def("gqa_reduce(Tensor dk_partial, Tensor? dv_partial, Tensor(a!) dk, Tensor(b!)? dv, *, Tensor? cu_seqlens=None, "
        "Tensor? seqused=None, float scale_dk=1.0, float scale_dv=1.0, int _arch=0) -> ()");
  m.def("repeat_kv(Tensor x, int n_rep, int dim) -> Tensor");
  m.def("repeat_kv_backward(Tensor grad, int n_rep, int dim, int[] layout) -> Tensor");
}

namespace {

using namespace pybind11::literals;
using flash_epilogue::compiled_archs;
using flash_epilogue::compiled_tile_configs;

// Every (op, dtype, head dim, path) with a kernel. path: sm90 (TMA collectives) or sm80 (the Ampere collectives,
// compiled for every arch of the build); archs: the GPU code the build holds.
std::vector<py::dict> compiled_configs() {
  std::vector<py::dict> configs;
  for (char const* op : {"store", "store_zero", "gqa_accumulate", "gqa_postprocess", "gqa_reduce"}) {
    for (char const* dtype : {"bfloat16", "float16"}) {
      for (auto const& t : compiled_tile_configs()) {
        bool const sm90 = t.arch == 90;
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
                         "slab_elems"_a = t.slab_elems);
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
                  "semaphore_numel"_a = l.semaphore_numel(), "arch"_a = l.arch, "block_n"_a = l.tiles[0].block_n,
                  "tile_head_dims"_a = py::make_tuple(l.tiles[0].head_dim, l.tiles[1].head_dim));
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
      "compiled_head_dims"_a = std::vector<int>(std::begin(kFlashEpilogueHeadDims), std::end(kFlashEpilogueHeadDims)));
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
  m.def("build_info", &build_info, "the versions and archs this build was made with");
  m.def("_set_debug_sync", &flash_epilogue::set_debug_sync,
        "FLASH_EPILOGUE_DEBUG for the C++ paths (repeat_kv's backward): synchronize after the launch");
  m.def("_debug_sync", &flash_epilogue::debug_sync_enabled,
        "whether the C++ paths synchronize after their launches (FLASH_EPILOGUE_DEBUG)");
}
