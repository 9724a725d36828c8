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

// (head dim, arch) -> the instantiation of a dtype-independent launcher (the GQA accumulator side).
template <template <int, int> class Launcher, class Args>
char const* dispatch_no_dtype(int head_dim, int arch, Args const& args, cudaStream_t stream) {
  auto by_head_dim = [&](auto arch_tag) -> char const* {
    constexpr int kArch = decltype(arch_tag)::value;
    switch (head_dim) {
      case 64: return Launcher<64, kArch>::run(args, stream);
      case 96: return Launcher<96, kArch>::run(args, stream);
      case 128: return Launcher<128, kArch>::run(args, stream);
      case 192: return Launcher<192, kArch>::run(args, stream);
      case 256: return Launcher<256, kArch>::run(args, stream);
      default: return "no compiled head dim";
    }
  };
  return arch == 90 ? by_head_dim(std::integral_constant<int, 90>{}) : by_head_dim(std::integral_constant<int, 80>{});
}

template <int kHeadDim, int kArch>
struct GqaAccumulateLauncher {
  static char const* run(GqaAccumulateLaunchArgs const& a, cudaStream_t s) { return launch_gqa_accumulate<kHeadDim, kArch>(a, s); }
};
template <int kHeadDim, int kArch>
struct GqaDenseLauncher {
  static char const* run(GqaDenseLaunchArgs const& a, cudaStream_t s) { return launch_gqa_accum_to_dense<kHeadDim, kArch>(a, s); }
};
template <OutputDType kDType, int kHeadDim, int kArch>
struct GqaPostprocessLauncher {
  static char const* run(GqaPostprocessLaunchArgs const& a, cudaStream_t s) {
    return launch_gqa_postprocess<kDType, kHeadDim, kArch>(a, s);
  }
};
template <OutputDType kDType, int kHeadDim, int kArch>
struct GqaReduceLauncher {
  static char const* run(GqaReduceLaunchArgs const& a, cudaStream_t s) { return launch_gqa_reduce<kDType, kHeadDim, kArch>(a, s); }
};

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


// ---- GQA

// The accumulator's expected geometry for a problem: (batch_extent, h_k, num_tiles, tile_elems).
struct AccumGeometry {
  int64_t batch_extent, heads, num_tiles, tile_elems;
};

AccumGeometry accum_geometry(int head_dim, int path, bool varlen, int64_t rows, int64_t heads_kv, int64_t batch) {
  int64_t const block_n = gqa_block_n(head_dim, path);
  int64_t const tiles = varlen ? (rows + batch * block_n) / block_n : (rows + block_n - 1) / block_n;
  return {varlen ? 1 : batch, heads_kv, tiles, gqa_accum_tile_elems(head_dim, path)};
}

AccumDesc check_accum(char const* op, char const* name, at::Tensor const& t, AccumGeometry const& g,
                      at::Device device) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "flash_epilogue.", op, ": ", name, ": expected dtype torch.float32, got ",
              t.scalar_type());
  std::vector<int64_t> const expected = {g.batch_extent, g.heads, g.num_tiles, g.tile_elems};
  TORCH_CHECK(t.sizes() == c10::IntArrayRef(expected), "flash_epilogue.", op, ": ", name, ": expected shape ",
              num(c10::IntArrayRef(expected)), " (an accumulator of this problem's config), got ", num(t.sizes()));
  TORCH_CHECK(t.is_contiguous(), "flash_epilogue.", op, ": ", name, ": expected a contiguous tensor");
  TORCH_CHECK(t.device() == device, "flash_epilogue.", op, ": ", name, ": expected device ", device.str(), ", got ",
              t.device().str());
  TORCH_CHECK(t.numel() == 0 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "flash_epilogue.", op, ": ", name,
              ": expected a 16-byte aligned data pointer");
  return {t.data_ptr<float>(), t.stride(1), t.stride(0), static_cast<int>(g.num_tiles)};
}

// Partials (batch, seqlen, h_q, d) / varlen (total, h_q, d): same rows and batch as `like`.
void check_partial(char const* op, char const* name, at::Tensor const& t, at::ScalarType dtype, at::Tensor const& like,
                   bool varlen) {
  int const rank = varlen ? 3 : 4;
  check_head_dim(op, name, t.dim() == rank ? t.size(-1) : 8);
  check_tensor(op, name, t, dtype, rank, like.device());
  bool const same_rows = varlen ? t.size(0) == like.size(0) : (t.size(0) == like.size(0) && t.size(1) == like.size(1));
  TORCH_CHECK(same_rows, "flash_epilogue.", op, ": ", name, ": expected the rows of ", num(like.sizes()), ", got ",
              num(t.sizes()));
}

int64_t check_group(char const* op, int64_t heads_q, int64_t heads_kv) {
  TORCH_CHECK(heads_kv > 0 && heads_q % heads_kv == 0, "flash_epilogue.", op,
              ": num_heads_q: expected a multiple of num_heads_kv = ", num(heads_kv), ", got ", num(heads_q));
  return heads_q / heads_kv;
}

void gqa_accumulate_cuda(at::Tensor const& dk_partial, at::Tensor const& dv_partial, at::Tensor const& dk_accum,
                         at::Tensor const& dv_accum, std::optional<at::Tensor> const& semaphores,
                         std::optional<at::Tensor> const& cu_seqlens, std::optional<at::Tensor> const& seqused,
                         bool deterministic, int64_t arch) {
  constexpr char const* op = "gqa_accumulate";
  bool const varlen = cu_seqlens.has_value();
  int const rank = varlen ? 3 : 4;
  at::Device const device = dk_partial.device();
  TORCH_CHECK(device.is_cuda(), "flash_epilogue.gqa_accumulate: dk_partial: expected a CUDA tensor, got device ",
              device.str());
  check_partial(op, "dk_partial", dk_partial, at::kFloat, dk_partial, varlen);
  check_partial(op, "dv_partial", dv_partial, at::kFloat, dk_partial, varlen);
  TORCH_CHECK(dv_partial.size(rank - 2) == dk_partial.size(rank - 2), "flash_epilogue.gqa_accumulate: dv_partial: ",
              "expected ", num(dk_partial.size(rank - 2)), " heads (dk_partial's), got ", num(dv_partial.size(rank - 2)));
  TORCH_CHECK(dk_accum.dim() == 4, "flash_epilogue.gqa_accumulate: dk_accum: expected rank 4, got ", num(dk_accum.dim()));
  int64_t const batch = varlen ? cu_seqlens->numel() - 1 : dk_partial.size(0);
  TORCH_CHECK(!varlen || batch >= 1, "flash_epilogue.gqa_accumulate: cu_seqlens: expected at least 2 entries");
  check_seqlens(op, cu_seqlens, "cu_seqlens", batch + 1, device);
  check_seqlens(op, seqused, "seqused", batch, device);
  int64_t const rows = varlen ? dk_partial.size(0) : dk_partial.size(1);
  int64_t const heads_q = dk_partial.size(rank - 2);
  int64_t const heads_kv = dk_accum.size(1);
  check_group(op, heads_q, heads_kv);
  TORCH_CHECK(rows < (int64_t(1) << 31) && heads_q < 65536 && batch < 65536, "flash_epilogue.gqa_accumulate: ",
              "dk_partial: expected rows < 2^31 and heads, batch < 65536, got ", num(dk_partial.sizes()));
  int const path = resolve_arch(op, device, arch);
  int const head_dim = compiled_head_dim_for(static_cast<int>(std::max(dk_partial.size(-1), dv_partial.size(-1))));
  AccumGeometry const geo = accum_geometry(head_dim, path, varlen, rows, heads_kv, batch);
  GqaAccumulateLaunchArgs args;
  args.dk_accum = check_accum(op, "dk_accum", dk_accum, geo, device);
  args.dv_accum = check_accum(op, "dv_accum", dv_accum, geo, device);
  int64_t const counters = 2 * geo.batch_extent * geo.num_tiles * geo.heads + 1;
  if (deterministic) {
    TORCH_CHECK(semaphores.has_value(), "flash_epilogue.gqa_accumulate: semaphores: expected an int32 workspace of ",
                num(counters), " entries for deterministic=True, got None");
    TORCH_CHECK(semaphores->scalar_type() == at::kInt && semaphores->is_contiguous() &&
                    semaphores->numel() >= counters && semaphores->device() == device,
                "flash_epilogue.gqa_accumulate: semaphores: expected a contiguous int32 tensor of at least ", num(counters),
                " entries on ", device.str(), ", got ", semaphores->scalar_type(), " ", num(semaphores->sizes()), " on ",
                semaphores->device().str());
  }
  if (dk_partial.numel() == 0 || dk_accum.numel() == 0) { return; }

  c10::cuda::CUDAGuard const guard(device);
  args.dk_partial = describe(dk_partial, varlen);
  args.dv_partial = describe(dv_partial, varlen);
  args.rows = static_cast<int>(rows);
  args.num_heads_q = static_cast<int>(heads_q);
  args.num_heads_kv = static_cast<int>(heads_kv);
  args.batch = static_cast<int>(batch);
  args.cu_seqlens = varlen ? cu_seqlens->data_ptr<int>() : nullptr;
  args.seqused = seqused.has_value() ? seqused->data_ptr<int>() : nullptr;
  args.semaphores = deterministic ? semaphores->data_ptr<int>() : nullptr;
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  finish_launch(op, dispatch_no_dtype<GqaAccumulateLauncher>(head_dim, path, args, stream));
}

void gqa_postprocess_cuda(at::Tensor const& dk_accum, at::Tensor const& dv_accum, at::Tensor const& dk,
                          at::Tensor const& dv, double scale_dk, double scale_dv,
                          std::optional<at::Tensor> const& cu_seqlens, std::optional<at::Tensor> const& seqused,
                          int64_t arch) {
  constexpr char const* op = "gqa_postprocess";
  OutputProblem const p = check_outputs(op, dk, dv, cu_seqlens, seqused);
  int const path = resolve_arch(op, dk.device(), arch);
  AccumGeometry const geo = accum_geometry(p.head_dim, path, p.varlen, p.rows, p.heads, p.batch);
  GqaPostprocessLaunchArgs args;
  args.dk_accum = check_accum(op, "dk_accum", dk_accum, geo, dk.device());
  args.dv_accum = check_accum(op, "dv_accum", dv_accum, geo, dk.device());
  if (dk.numel() == 0) { return; }
  c10::cuda::CUDAGuard const guard(dk.device());
  args.dk = describe(dk, p.varlen);
  args.dv = describe(dv, p.varlen);
  args.rows = static_cast<int>(p.rows);
  args.num_heads_kv = static_cast<int>(p.heads);
  args.batch = static_cast<int>(p.batch);
  args.cu_seqlens = p.varlen ? cu_seqlens->data_ptr<int>() : nullptr;
  args.seqused = seqused.has_value() ? seqused->data_ptr<int>() : nullptr;
  args.scale_dk = static_cast<float>(scale_dk);
  args.scale_dv = static_cast<float>(scale_dv);
  args.use_tma = !p.varlen && !seqused.has_value();
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream(dk.device().index()).stream();
  finish_launch(op, dispatch<GqaPostprocessLauncher>(dk.scalar_type(), p.head_dim, path, args, stream));
}

void gqa_accum_to_dense_cuda(at::Tensor const& accum, at::Tensor const& out, int64_t head_dim,
                             std::optional<at::Tensor> const& cu_seqlens, std::optional<at::Tensor> const& seqused,
                             int64_t arch) {
  constexpr char const* op = "gqa_accum_to_dense";
  bool const varlen = cu_seqlens.has_value();
  int const rank = varlen ? 3 : 4;
  at::Device const device = out.device();
  TORCH_CHECK(device.is_cuda(), "flash_epilogue.gqa_accum_to_dense: out: expected a CUDA tensor, got device ",
              device.str());
  check_head_dim(op, "head_dim", head_dim);
  check_tensor(op, "out", out, at::kFloat, rank, device);
  TORCH_CHECK(out.size(-1) <= head_dim, "flash_epilogue.gqa_accum_to_dense: out: expected a last dim <= head_dim = ",
              num(head_dim), ", got ", num(out.size(-1)));
  int64_t const batch = varlen ? cu_seqlens->numel() - 1 : out.size(0);
  TORCH_CHECK(!varlen || batch >= 1, "flash_epilogue.gqa_accum_to_dense: cu_seqlens: expected at least 2 entries");
  check_seqlens(op, cu_seqlens, "cu_seqlens", batch + 1, device);
  check_seqlens(op, seqused, "seqused", batch, device);
  int64_t const rows = varlen ? out.size(0) : out.size(1);
  int64_t const heads = out.size(rank - 2);
  int const path = resolve_arch(op, device, arch);
  int const config = compiled_head_dim_for(static_cast<int>(head_dim));
  AccumGeometry const geo = accum_geometry(config, path, varlen, rows, heads, batch);
  GqaDenseLaunchArgs args;
  args.accum = check_accum(op, "accum", accum, geo, device);
  if (out.numel() == 0) { return; }
  c10::cuda::CUDAGuard const guard(device);
  args.out = describe(out, varlen);
  args.rows = static_cast<int>(rows);
  args.num_heads_kv = static_cast<int>(heads);
  args.batch = static_cast<int>(batch);
  args.cu_seqlens = varlen ? cu_seqlens->data_ptr<int>() : nullptr;
  args.seqused = seqused.has_value() ? seqused->data_ptr<int>() : nullptr;
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  finish_launch(op, dispatch_no_dtype<GqaDenseLauncher>(config, path, args, stream));
}

void gqa_reduce_cuda(at::Tensor const& dk_partial, std::optional<at::Tensor> const& dv_partial, at::Tensor const& dk,
                     std::optional<at::Tensor> const& dv, std::optional<at::Tensor> const& cu_seqlens,
                     std::optional<at::Tensor> const& seqused, double scale_dk, double scale_dv, int64_t arch) {
  constexpr char const* op = "gqa_reduce";
  TORCH_CHECK(dv_partial.has_value() == dv.has_value(), "flash_epilogue.gqa_reduce: dv: expected a tensor exactly ",
              "when dv_partial is given, got dv_partial ", dv_partial.has_value() ? "given" : "None", " and dv ",
              dv.has_value() ? "given" : "None");
  bool const has_dv = dv.has_value();
  OutputProblem const p = check_outputs(op, dk, has_dv ? *dv : dk, cu_seqlens, seqused);
  at::ScalarType const in_dtype = dk_partial.scalar_type();
  TORCH_CHECK(in_dtype == at::kFloat || in_dtype == dk.scalar_type(), "flash_epilogue.gqa_reduce: dk_partial: expected ",
              "dtype torch.float32 or dk's ", dk.scalar_type(), ", got ", in_dtype);
  check_partial(op, "dk_partial", dk_partial, in_dtype, dk, p.varlen);
  TORCH_CHECK(dk_partial.size(-1) == dk.size(-1), "flash_epilogue.gqa_reduce: dk_partial: expected head dim ",
              num(dk.size(-1)), " (dk's), got ", num(dk_partial.size(-1)));
  int const rank = p.varlen ? 3 : 4;
  int64_t const heads_q = dk_partial.size(rank - 2);
  check_group(op, heads_q, p.heads);
  if (has_dv) {
    check_partial(op, "dv_partial", *dv_partial, in_dtype, dk, p.varlen);
    TORCH_CHECK(dv_partial->size(-1) == dv->size(-1) && dv_partial->size(rank - 2) == heads_q,
                "flash_epilogue.gqa_reduce: dv_partial: expected ", num(heads_q), " heads of dim ", num(dv->size(-1)),
                ", got ", num(dv_partial->sizes()));
  }
  TORCH_CHECK(heads_q < 65536, "flash_epilogue.gqa_reduce: dk_partial: expected fewer than 65536 heads");
  if (dk.numel() == 0) { return; }
  int const path = resolve_arch(op, dk.device(), arch);
  c10::cuda::CUDAGuard const guard(dk.device());
  GqaReduceLaunchArgs args;
  args.dk_partial = describe(dk_partial, p.varlen);
  if (has_dv) {
    args.dv_partial = describe(*dv_partial, p.varlen);
    args.dv = describe(*dv, p.varlen);
  }
  args.partial_fp32 = in_dtype == at::kFloat;
  args.dk = describe(dk, p.varlen);
  args.rows = static_cast<int>(p.rows);
  args.num_heads_q = static_cast<int>(heads_q);
  args.num_heads_kv = static_cast<int>(p.heads);
  args.batch = static_cast<int>(p.batch);
  args.cu_seqlens = p.varlen ? cu_seqlens->data_ptr<int>() : nullptr;
  args.seqused = seqused.has_value() ? seqused->data_ptr<int>() : nullptr;
  args.scale_dk = static_cast<float>(scale_dk);
  args.scale_dv = static_cast<float>(scale_dv);
  args.use_tma = !p.varlen && !seqused.has_value();
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream(dk.device().index()).stream();
  finish_launch(op, dispatch<GqaReduceLauncher>(dk.scalar_type(), p.head_dim, path, args, stream));
}

}  // namespace
}  // namespace flash_epilogue

// Keep in sync with flash_epilogue/_schemas.py (tests/test_schemas.py compares them).
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
}

TORCH_LIBRARY_IMPL(flash_epilogue, CUDA, m) {
  m.impl("store", &flash_epilogue::store_cuda);
  m.impl("store_zero", &flash_epilogue::store_zero_cuda);
  m.impl("gqa_accumulate", &flash_epilogue::gqa_accumulate_cuda);
  m.impl("gqa_postprocess", &flash_epilogue::gqa_postprocess_cuda);
  m.impl("gqa_accum_to_dense", &flash_epilogue::gqa_accum_to_dense_cuda);
  m.impl("gqa_reduce", &flash_epilogue::gqa_reduce_cuda);
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
        for (char const* op : {"store", "store_zero", "gqa_accumulate", "gqa_postprocess", "gqa_reduce"}) {
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
