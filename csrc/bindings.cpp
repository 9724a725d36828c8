// The only translation unit that includes torch: op schemas (TORCH_LIBRARY), the CUDA
// implementations (argument checks, device guard, current stream, dispatch to the generated
// instantiations) and the pybind11 module flash_epilogue._C (build info, compiled configs).
//
// The Python wrappers validate everything first with messages meant for users
// (flash_epilogue/validation.py); the TORCH_CHECKs here are the backstop for callers that go
// through torch.ops directly, and they never let a bad argument reach a kernel.

#include <torch/extension.h>
#include <torch/library.h>
#include <torch/version.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <cutlass/version.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "flash_epilogue/version.h"
#include "launch_args.h"

#ifndef FLASH_EPILOGUE_COMPILED_ARCHS
#define FLASH_EPILOGUE_COMPILED_ARCHS "sm_90a"
#endif

namespace flash_epilogue {
namespace {

constexpr std::array<int, 5> kCompiledHeadDims = {64, 96, 128, 192, 256};

// Numbers in error messages are formatted here, never by streaming them into TORCH_CHECK: on
// some toolchains (the H200 image: GCC 13 with -Bsymbolic-functions from Python's LDSHARED) an
// extension's own copy of ostream's integer insertion crashes. std::to_string has no locale.
std::string num(int64_t v) { return std::to_string(v); }
std::string num(c10::IntArrayRef sizes) {
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) { s += (i ? ", " : "") + std::to_string(sizes[i]); }
  return s + (sizes.size() == 1 ? ",)" : ")");
}
std::string num(void const* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

std::vector<std::string> compiled_archs() {
  std::vector<std::string> archs;
  std::string const all = FLASH_EPILOGUE_COMPILED_ARCHS;
  size_t start = 0;
  while (start < all.size()) {
    size_t const end = all.find(',', start);
    archs.push_back(all.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) { break; }
    start = end + 1;
  }
  return archs;
}

// (major, minor) per device, read once (op calls stay free of driver queries).
std::pair<int, int> device_capability(int device) {
  static std::mutex mutex;
  static std::vector<std::pair<int, int>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  if (device >= static_cast<int>(cache.size())) { cache.resize(device + 1, {-1, -1}); }
  if (cache[device].first < 0) {
    int major = 0, minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    cache[device] = {major, minor};
  }
  return cache[device];
}

bool compiled_for(char const* arch) {
  for (auto const& a : compiled_archs()) {
    if (a == arch) { return true; }
  }
  return false;
}

// The code path an op runs: 90 on an sm_90 GPU (sm_90a kernels), 80 on an sm_8x GPU when the build
// has sm_80 code; `requested` = 80 forces the sm_80 path on an sm_90 GPU (a testing knob: the
// sm_80 collectives are compiled for every arch of the build).
int resolve_arch(char const* op, at::Device device, int64_t requested) {
  TORCH_CHECK(requested == 0 || requested == 80 || requested == 90, "flash_epilogue.", op,
              ": _arch: expected 0 (auto), 80 or 90, got ", num(requested));
  auto const [major, minor] = device_capability(device.index());
  bool const hopper = major == 9 && minor == 0 && compiled_for("sm_90a");
  bool const ampere = major == 8 && compiled_for("sm_80");
  TORCH_CHECK(hopper || ampere, "flash_epilogue.", op, ": device: expected a GPU this build has kernels for (",
              FLASH_EPILOGUE_COMPILED_ARCHS, "), got ", device.str(), " with compute capability sm_",
              num(major * 10 + minor));
  TORCH_CHECK(requested != 90 || hopper, "flash_epilogue.", op, ": _arch: expected 0 or 80 on ", device.str(),
              ", got 90");
  return hopper && requested != 80 ? 90 : 80;
}

void check_tensor(char const* op, char const* name, at::Tensor const& t, at::ScalarType dtype, int rank,
                  at::Device device) {
  TORCH_CHECK(t.scalar_type() == dtype, "flash_epilogue.", op, ": ", name, ": expected dtype ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == rank, "flash_epilogue.", op, ": ", name, ": expected rank ", num(rank), ", got ", num(t.dim()));
  TORCH_CHECK(t.device() == device, "flash_epilogue.", op, ": ", name, ": expected device ", device.str(), ", got ",
              t.device().str());
  TORCH_CHECK(t.numel() == 0 || t.stride(-1) == 1, "flash_epilogue.", op, ": ", name,
              ": expected last-dim stride 1, got ", num(t.stride(-1)));
  int const elems_per_16b = 16 / static_cast<int>(t.element_size());
  for (int i = 0; i + 1 < t.dim() && t.numel() > 0; ++i) {
    TORCH_CHECK(t.size(i) == 1 || t.stride(i) % elems_per_16b == 0, "flash_epilogue.", op, ": ", name,
                ": expected stride(", num(i), ") to be a multiple of ", num(elems_per_16b),
                " elements (16 bytes), got ", num(t.stride(i)));
  }
  TORCH_CHECK(t.numel() == 0 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "flash_epilogue.", op, ": ", name,
              ": expected a 16-byte aligned data pointer, got ", num(t.data_ptr()));
}

void check_head_dim(char const* op, char const* name, int64_t d) {
  TORCH_CHECK(d > 0 && d % 8 == 0 && d <= 256, "flash_epilogue.", op, ": ", name,
              ": expected a head dim that is a positive multiple of 8 and <= 256, got ", num(d));
}

void check_seqlens(char const* op, std::optional<at::Tensor> const& t, char const* name, int64_t numel,
                   at::Device device) {
  if (!t.has_value()) { return; }
  TORCH_CHECK(t->scalar_type() == at::kInt, "flash_epilogue.", op, ": ", name, ": expected dtype torch.int32, got ",
              t->scalar_type());
  TORCH_CHECK(t->dim() == 1 && t->numel() == numel, "flash_epilogue.", op, ": ", name, ": expected shape (", num(numel),
              ",), got ", num(t->sizes()));
  TORCH_CHECK(t->is_contiguous(), "flash_epilogue.", op, ": ", name, ": expected a contiguous tensor");
  TORCH_CHECK(t->device() == device, "flash_epilogue.", op, ": ", name, ": expected device ", device.str(), ", got ",
              t->device().str());
}

// (rows, d, heads, batch) view of a batched (batch, seqlen, heads, d) or varlen (total, heads, d)
// tensor. A size-1 dim's stride is meaningless to torch but not to TMA (it must be a 16-byte
// multiple): give it the tensor's largest extent, which always is one.
TensorDesc describe(at::Tensor const& t, bool varlen) {
  TensorDesc desc;
  desc.ptr = t.data_ptr();
  desc.head_dim = static_cast<int>(t.size(-1));
  int const row_dim = varlen ? 0 : 1, head_dim = varlen ? 1 : 2;
  int64_t span = t.size(-1);
  for (int i = 0; i + 1 < t.dim(); ++i) {
    if (t.size(i) > 1) { span = std::max(span, t.stride(i) * t.size(i)); }
  }
  int const elems_per_16b = 16 / static_cast<int>(t.element_size());
  span = (span + elems_per_16b - 1) / elems_per_16b * elems_per_16b;
  auto stride_of = [&](int dim) { return t.size(dim) > 1 ? t.stride(dim) : span; };
  desc.row_stride = stride_of(row_dim);
  desc.head_stride = stride_of(head_dim);
  desc.batch_stride = varlen ? span : stride_of(0);
  return desc;
}

// (dtype, head dim, arch) -> the instantiation of `launch` (launch_store or launch_store_zero).
template <template <OutputDType, int, int> class Launcher, class Args>
char const* dispatch(at::ScalarType dtype, int head_dim, int arch, Args const& args, cudaStream_t stream) {
  auto by_head_dim = [&](auto dtype_tag, auto arch_tag) -> char const* {
    constexpr OutputDType kDType = decltype(dtype_tag)::value;
    constexpr int kArch = decltype(arch_tag)::value;
    switch (head_dim) {
      case 64: return Launcher<kDType, 64, kArch>::run(args, stream);
      case 96: return Launcher<kDType, 96, kArch>::run(args, stream);
      case 128: return Launcher<kDType, 128, kArch>::run(args, stream);
      case 192: return Launcher<kDType, 192, kArch>::run(args, stream);
      case 256: return Launcher<kDType, 256, kArch>::run(args, stream);
      default: return "no compiled head dim";
    }
  };
  using BF16 = std::integral_constant<OutputDType, OutputDType::kBFloat16>;
  using FP16 = std::integral_constant<OutputDType, OutputDType::kFloat16>;
  using Sm90 = std::integral_constant<int, 90>;
  using Sm80 = std::integral_constant<int, 80>;
  bool const bf16 = dtype == at::kBFloat16;
  if (arch == 90) { return bf16 ? by_head_dim(BF16{}, Sm90{}) : by_head_dim(FP16{}, Sm90{}); }
  return bf16 ? by_head_dim(BF16{}, Sm80{}) : by_head_dim(FP16{}, Sm80{});
}

template <OutputDType kDType, int kHeadDim, int kArch>
struct StoreLauncher {
  static char const* run(StoreLaunchArgs const& a, cudaStream_t s) { return launch_store<kDType, kHeadDim, kArch>(a, s); }
};
template <OutputDType kDType, int kHeadDim, int kArch>
struct StoreZeroLauncher {
  static char const* run(StoreZeroLaunchArgs const& a, cudaStream_t s) {
    return launch_store_zero<kDType, kHeadDim, kArch>(a, s);
  }
};

int compiled_head_dim_for(int width) {
  for (int hd : kCompiledHeadDims) {
    if (width <= hd) { return hd; }
  }
  return -1;
}

// What store and store_zero share: dk/dv (16-bit, batched or varlen), cu_seqlens and seqused.
struct OutputProblem {
  bool varlen;
  int64_t rows, heads, batch;
  int head_dim;  // the compiled head dim serving max(d, dv)
};

OutputProblem check_outputs(char const* op, at::Tensor const& dk, at::Tensor const& dv,
                            std::optional<at::Tensor> const& cu_seqlens, std::optional<at::Tensor> const& seqused) {
  bool const varlen = cu_seqlens.has_value();
  int const rank = varlen ? 3 : 4;
  at::Device const device = dk.device();
  TORCH_CHECK(device.is_cuda(), "flash_epilogue.", op, ": dk: expected a CUDA tensor, got device ", device.str());
  TORCH_CHECK(dk.scalar_type() == at::kBFloat16 || dk.scalar_type() == at::kHalf, "flash_epilogue.", op,
              ": dk: expected dtype torch.bfloat16 or torch.float16, got ", dk.scalar_type());
  TORCH_CHECK(dk.dim() == rank && dv.dim() == rank, "flash_epilogue.", op, ": dk, dv: expected rank ", num(rank),
              ", got ", num(dk.dim()), " and ", num(dv.dim()));
  check_head_dim(op, "dk", dk.size(-1));
  check_head_dim(op, "dv", dv.size(-1));
  check_tensor(op, "dk", dk, dk.scalar_type(), rank, device);
  check_tensor(op, "dv", dv, dk.scalar_type(), rank, device);
  TORCH_CHECK(dk.sizes().slice(0, rank - 1) == dv.sizes().slice(0, rank - 1), "flash_epilogue.", op,
              ": dv: expected leading dims ", num(dk.sizes().slice(0, rank - 1)), " (dk's), got ",
              num(dv.sizes().slice(0, rank - 1)));
  int64_t const batch = varlen ? cu_seqlens->numel() - 1 : dk.size(0);
  TORCH_CHECK(!varlen || batch >= 1, "flash_epilogue.", op, ": cu_seqlens: expected at least 2 entries, got ",
              num(cu_seqlens->numel()));
  check_seqlens(op, cu_seqlens, "cu_seqlens", batch + 1, device);
  check_seqlens(op, seqused, "seqused", batch, device);
  int64_t const rows = varlen ? dk.size(0) : dk.size(1);
  int64_t const heads = varlen ? dk.size(1) : dk.size(2);
  TORCH_CHECK(rows < (int64_t(1) << 31) && heads < 65536 && batch < 65536, "flash_epilogue.", op,
              ": dk: expected rows < 2^31 and heads, batch < 65536, got ", num(dk.sizes()));
  return {varlen, rows, heads, batch, compiled_head_dim_for(static_cast<int>(std::max(dk.size(-1), dv.size(-1))))};
}

void finish_launch(char const* op, char const* why) {
  TORCH_CHECK(why == nullptr, "flash_epilogue.", op, ": arguments rejected by the kernel: ", why);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void store_cuda(at::Tensor const& dk_accum, at::Tensor const& dv_accum, at::Tensor const& dk, at::Tensor const& dv,
                std::optional<at::Tensor> const& cu_seqlens, std::optional<at::Tensor> const& seqused, int64_t arch) {
  constexpr char const* op = "store";
  OutputProblem const p = check_outputs(op, dk, dv, cu_seqlens, seqused);
  check_tensor(op, "dk_accum", dk_accum, at::kFloat, p.varlen ? 3 : 4, dk.device());
  check_tensor(op, "dv_accum", dv_accum, at::kFloat, p.varlen ? 3 : 4, dk.device());
  TORCH_CHECK(dk_accum.sizes() == dk.sizes(), "flash_epilogue.store: dk_accum: expected shape ", num(dk.sizes()),
              " (dk's), got ", num(dk_accum.sizes()));
  TORCH_CHECK(dv_accum.sizes() == dv.sizes(), "flash_epilogue.store: dv_accum: expected shape ", num(dv.sizes()),
              " (dv's), got ", num(dv_accum.sizes()));
  if (dk.numel() == 0) { return; }  // batch 0, seqlen 0, heads 0: nothing to launch
  int const path = resolve_arch(op, dk.device(), arch);

  c10::cuda::CUDAGuard const guard(dk.device());
  StoreLaunchArgs args;
  args.dk_accum = describe(dk_accum, p.varlen);
  args.dv_accum = describe(dv_accum, p.varlen);
  args.dk = describe(dk, p.varlen);
  args.dv = describe(dv, p.varlen);
  args.rows = static_cast<int>(p.rows);
  args.num_heads = static_cast<int>(p.heads);
  args.batch = static_cast<int>(p.batch);
  args.cu_seqlens = p.varlen ? cu_seqlens->data_ptr<int>() : nullptr;
  args.seqused = seqused.has_value() ? seqused->data_ptr<int>() : nullptr;
  args.use_tma = !p.varlen && !seqused.has_value();
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream(dk.device().index()).stream();
  finish_launch(op, dispatch<StoreLauncher>(dk.scalar_type(), p.head_dim, path, args, stream));
}

void store_zero_cuda(at::Tensor const& dk, at::Tensor const& dv, std::optional<at::Tensor> const& cu_seqlens,
                     std::optional<at::Tensor> const& seqused, std::optional<at::Tensor> const& batch_idx,
                     std::optional<at::Tensor> const& head_idx, int64_t row_start, std::optional<int64_t> row_end,
                     int64_t arch) {
  constexpr char const* op = "store_zero";
  OutputProblem const p = check_outputs(op, dk, dv, cu_seqlens, seqused);
  for (auto const* idx : {&batch_idx, &head_idx}) {
    if (!idx->has_value()) { continue; }
    char const* name = idx == &batch_idx ? "batch_idx" : "head_idx";
    at::Tensor const& t = idx->value();
    TORCH_CHECK(t.scalar_type() == at::kInt, "flash_epilogue.store_zero: ", name, ": expected dtype torch.int32, got ",
                t.scalar_type());
    TORCH_CHECK(t.dim() == 1 && (t.numel() <= 1 || t.stride(0) == 1), "flash_epilogue.store_zero: ", name,
                ": expected a contiguous 1-D tensor, got shape ", num(t.sizes()));
    TORCH_CHECK(t.device() == dk.device(), "flash_epilogue.store_zero: ", name, ": expected device ", dk.device().str(),
                ", got ", t.device().str());
    TORCH_CHECK(t.numel() < 65536, "flash_epilogue.store_zero: ", name, ": expected fewer than 65536 entries, got ",
                num(t.numel()));
  }
  TORCH_CHECK(row_start >= 0, "flash_epilogue.store_zero: row_start: expected >= 0, got ", num(row_start));
  TORCH_CHECK(!row_end.has_value() || *row_end >= row_start, "flash_epilogue.store_zero: row_end: expected None or >= ",
              "row_start = ", num(row_start), ", got ", num(row_end.value_or(0)));
  int64_t const end = std::min<int64_t>(row_end.value_or(p.rows), p.rows);
  bool const empty_selection = (batch_idx.has_value() && batch_idx->numel() == 0) ||
                               (head_idx.has_value() && head_idx->numel() == 0);
  if (dk.numel() == 0 || empty_selection || row_start >= end) { return; }
  int const path = resolve_arch(op, dk.device(), arch);

  c10::cuda::CUDAGuard const guard(dk.device());
  StoreZeroLaunchArgs args;
  args.dk = describe(dk, p.varlen);
  args.dv = describe(dv, p.varlen);
  args.rows = static_cast<int>(p.rows);
  args.num_heads = static_cast<int>(p.heads);
  args.batch = static_cast<int>(p.batch);
  args.cu_seqlens = p.varlen ? cu_seqlens->data_ptr<int>() : nullptr;
  args.seqused = seqused.has_value() ? seqused->data_ptr<int>() : nullptr;
  args.batch_idx = batch_idx.has_value() ? batch_idx->data_ptr<int>() : nullptr;
  args.num_batch_idx = batch_idx.has_value() ? static_cast<int>(batch_idx->numel()) : 0;
  args.head_idx = head_idx.has_value() ? head_idx->data_ptr<int>() : nullptr;
  args.num_head_idx = head_idx.has_value() ? static_cast<int>(head_idx->numel()) : 0;
  args.row_begin = static_cast<int>(row_start);
  args.row_end = static_cast<int>(end);
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream(dk.device().index()).stream();
  finish_launch(op, dispatch<StoreZeroLauncher>(dk.scalar_type(), p.head_dim, path, args, stream));
}

}  // namespace
}  // namespace flash_epilogue

// Keep in sync with flash_epilogue/_schemas.py (tests/test_schemas.py compares them).
TORCH_LIBRARY(flash_epilogue, m) {
  m.def("store(Tensor dk_accum, Tensor dv_accum, Tensor(a!) dk, Tensor(b!) dv, *, Tensor? cu_seqlens=None, "
        "Tensor? seqused=None, int _arch=0) -> ()");
  m.def("store_zero(Tensor(a!) dk, Tensor(b!) dv, *, Tensor? cu_seqlens=None, Tensor? seqused=None, "
        "Tensor? batch_idx=None, Tensor? head_idx=None, int row_start=0, int? row_end=None, int _arch=0) -> ()");
}

TORCH_LIBRARY_IMPL(flash_epilogue, CUDA, m) {
  m.impl("store", &flash_epilogue::store_cuda);
  m.impl("store_zero", &flash_epilogue::store_zero_cuda);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_epilogue CUDA kernels; the ops are registered as torch.ops.flash_epilogue.*";
  m.def("compiled_archs", &flash_epilogue::compiled_archs, "GPU architectures this build has kernels for");
  m.def(
      "compiled_configs",
      [] {
        std::vector<pybind11::dict> configs;
        // "path" is the code path (sm90: TMA collectives; sm80: the Ampere collectives, compiled
        // for every arch of the build), "archs" the GPU code the build holds.
        for (char const* op : {"store", "store_zero"}) {
          for (char const* dtype : {"bfloat16", "float16"}) {
            for (int hd : flash_epilogue::kCompiledHeadDims) {
              for (char const* path : {"sm90", "sm80"}) {
                pybind11::dict c;
                c["op"] = op;
                c["dtype"] = dtype;
                c["head_dim"] = hd;
                c["path"] = path;
                c["archs"] = std::string(path) == "sm90" ? std::vector<std::string>{"sm_90a"}
                                                         : flash_epilogue::compiled_archs();
                configs.push_back(c);
              }
            }
          }
        }
        return configs;
      },
      "every (op, dtype, head dim, arch) this build has a kernel for");
  m.def("build_info", [] {
    pybind11::dict info;
    info["version"] = std::to_string(FLASH_EPILOGUE_VERSION_MAJOR) + "." + std::to_string(FLASH_EPILOGUE_VERSION_MINOR) +
                      "." + std::to_string(FLASH_EPILOGUE_VERSION_PATCH);
    info["torch_version"] = TORCH_VERSION;
    info["cuda_runtime_version"] = CUDART_VERSION;
    info["cutlass_version"] = std::to_string(CUTLASS_MAJOR) + "." + std::to_string(CUTLASS_MINOR) + "." +
                              std::to_string(CUTLASS_PATCH);
    info["compiled_archs"] = flash_epilogue::compiled_archs();
    return info;
  });
}
