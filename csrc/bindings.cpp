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

// (major, minor) per device, read once: the kernels are sm_90a code and nothing else runs them.
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

void check_arch(char const* op, at::Device device) {
  auto const [major, minor] = device_capability(device.index());
  TORCH_CHECK(major == 9 && minor == 0, "flash_epilogue.", op, ": device: expected an sm_90 GPU (Hopper: H100/H200), got ",
              device.str(), " with compute capability sm_", num(major * 10 + minor), "; this build has kernels for ",
              FLASH_EPILOGUE_COMPILED_ARCHS);
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

template <OutputDType kDType>
char const* dispatch_store_head_dim(int head_dim, StoreLaunchArgs const& args, cudaStream_t stream) {
  switch (head_dim) {
    case 64: return launch_store<kDType, 64>(args, stream);
    case 96: return launch_store<kDType, 96>(args, stream);
    case 128: return launch_store<kDType, 128>(args, stream);
    case 192: return launch_store<kDType, 192>(args, stream);
    case 256: return launch_store<kDType, 256>(args, stream);
    default: return "no compiled head dim";
  }
}

int compiled_head_dim_for(int width) {
  for (int hd : kCompiledHeadDims) {
    if (width <= hd) { return hd; }
  }
  return -1;
}

void store_cuda(at::Tensor const& dk_accum, at::Tensor const& dv_accum, at::Tensor const& dk, at::Tensor const& dv,
                std::optional<at::Tensor> const& cu_seqlens, std::optional<at::Tensor> const& seqused) {
  constexpr char const* op = "store";
  bool const varlen = cu_seqlens.has_value();
  int const rank = varlen ? 3 : 4;
  at::Device const device = dk.device();
  TORCH_CHECK(device.is_cuda(), "flash_epilogue.store: dk: expected a CUDA tensor, got device ", device.str());
  TORCH_CHECK(dk.scalar_type() == at::kBFloat16 || dk.scalar_type() == at::kHalf,
              "flash_epilogue.store: dk: expected dtype torch.bfloat16 or torch.float16, got ", dk.scalar_type());
  TORCH_CHECK(dk.dim() == rank && dv.dim() == rank, "flash_epilogue.store: dk, dv: expected rank ", num(rank), ", got ",
              num(dk.dim()), " and ", num(dv.dim()));
  check_head_dim(op, "dk", dk.size(-1));
  check_head_dim(op, "dv", dv.size(-1));
  check_tensor(op, "dk", dk, dk.scalar_type(), rank, device);
  check_tensor(op, "dv", dv, dk.scalar_type(), rank, device);
  check_tensor(op, "dk_accum", dk_accum, at::kFloat, rank, device);
  check_tensor(op, "dv_accum", dv_accum, at::kFloat, rank, device);
  TORCH_CHECK(dk_accum.sizes() == dk.sizes(), "flash_epilogue.store: dk_accum: expected shape ", num(dk.sizes()),
              " (dk's), got ", num(dk_accum.sizes()));
  TORCH_CHECK(dv_accum.sizes() == dv.sizes(), "flash_epilogue.store: dv_accum: expected shape ", num(dv.sizes()),
              " (dv's), got ", num(dv_accum.sizes()));
  TORCH_CHECK(dk.sizes().slice(0, rank - 1) == dv.sizes().slice(0, rank - 1), "flash_epilogue.store: dv: expected ",
              "leading dims ", num(dk.sizes().slice(0, rank - 1)), " (dk's), got ",
              num(dv.sizes().slice(0, rank - 1)));
  int64_t const batch = varlen ? cu_seqlens->numel() - 1 : dk.size(0);
  TORCH_CHECK(!varlen || batch >= 1, "flash_epilogue.store: cu_seqlens: expected at least 2 entries, got ",
              num(cu_seqlens->numel()));
  check_seqlens(op, cu_seqlens, "cu_seqlens", batch + 1, device);
  check_seqlens(op, seqused, "seqused", batch, device);
  TORCH_CHECK(dk.numel() < (int64_t(1) << 62), "flash_epilogue.store: dk: too large");
  int64_t const rows = varlen ? dk.size(0) : dk.size(1);
  int64_t const heads = varlen ? dk.size(1) : dk.size(2);
  TORCH_CHECK(rows < (int64_t(1) << 31) && heads < 65536 && batch < 65536,
              "flash_epilogue.store: dk: expected rows < 2^31 and heads, batch < 65536, got ", num(dk.sizes()));
  if (dk.numel() == 0 && dv.numel() == 0) { return; }  // batch 0, seqlen 0, heads 0: nothing to launch
  check_arch(op, device);

  c10::cuda::CUDAGuard const guard(device);
  StoreLaunchArgs args;
  args.dk_accum = describe(dk_accum, varlen);
  args.dv_accum = describe(dv_accum, varlen);
  args.dk = describe(dk, varlen);
  args.dv = describe(dv, varlen);
  args.rows = static_cast<int>(rows);
  args.num_heads = static_cast<int>(heads);
  args.batch = static_cast<int>(batch);
  args.cu_seqlens = varlen ? cu_seqlens->data_ptr<int>() : nullptr;
  args.seqused = seqused.has_value() ? seqused->data_ptr<int>() : nullptr;
  args.use_tma = !varlen && !seqused.has_value();
  int const head_dim = compiled_head_dim_for(static_cast<int>(std::max(dk.size(-1), dv.size(-1))));
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  char const* why = dk.scalar_type() == at::kBFloat16
                        ? dispatch_store_head_dim<OutputDType::kBFloat16>(head_dim, args, stream)
                        : dispatch_store_head_dim<OutputDType::kFloat16>(head_dim, args, stream);
  TORCH_CHECK(why == nullptr, "flash_epilogue.store: arguments rejected by the kernel: ", why);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace flash_epilogue

// Keep in sync with flash_epilogue/_schemas.py (tests/test_schemas.py compares them).
TORCH_LIBRARY(flash_epilogue, m) {
  m.def("store(Tensor dk_accum, Tensor dv_accum, Tensor(a!) dk, Tensor(b!) dv, *, Tensor? cu_seqlens=None, "
        "Tensor? seqused=None) -> ()");
}

TORCH_LIBRARY_IMPL(flash_epilogue, CUDA, m) { m.impl("store", &flash_epilogue::store_cuda); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_epilogue CUDA kernels; the ops are registered as torch.ops.flash_epilogue.*";
  m.def("compiled_archs", &flash_epilogue::compiled_archs, "GPU architectures this build has kernels for");
  m.def(
      "compiled_configs",
      [] {
        std::vector<pybind11::dict> configs;
        for (char const* op : {"store"}) {
          for (char const* dtype : {"bfloat16", "float16"}) {
            for (int hd : flash_epilogue::kCompiledHeadDims) {
              for (auto const& arch : flash_epilogue::compiled_archs()) {
                pybind11::dict c;
                c["op"] = op;
                c["dtype"] = dtype;
                c["head_dim"] = hd;
                c["arch"] = arch;
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
