// The only translation unit that includes torch: op schemas (TORCH_LIBRARY), the implementations
// (argument checks, device guard, current stream, dispatch to the generated instantiations) and the
// pybind11 module flash_epilogue._C (build info, compiled configs).
//
// Argument checks. Every op checks its arguments here with the same checks, in the same order and
// with the same messages as flash_epilogue/validation.py (tests/test_cpp_parity.py runs the Python
// validation suites against the ops): the Python wrappers call the op first and run the Python
// validation only when the op raises (host time), so whatever the Python validation rejects must be
// rejected here too, before anything reaches a kernel. Bad values raise ValueError in Python (a
// wrong dtype TypeError), a launch the kernel refuses RuntimeError. The device checks come last,
// as in Python; the ops are also registered for CPU tensors, where every metadata check runs and
// the device check then says that a CUDA tensor is needed. Messages are built only on failure.

#include <torch/extension.h>
#include <torch/library.h>
#include <torch/version.h>

#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <cutlass/version.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
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
std::string num(c10::IntArrayRef sizes) {  // as Python prints a tuple: (), (3,), (2, 3)
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) { s += (i ? ", " : "") + std::to_string(sizes[i]); }
  return s + (sizes.size() == 1 ? ",)" : ")");
}
std::string hex_str(int64_t v) {  // as Python's f"{v:#x}"
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

// The archs of the build ("sm_90a", or "sm_80" and "sm_90a"), parsed once.
std::vector<std::string> const& compiled_archs() {
  static std::vector<std::string> const archs = [] {
    std::vector<std::string> out;
    std::string const all = FLASH_EPILOGUE_COMPILED_ARCHS;
    size_t start = 0;
    while (start < all.size()) {
      size_t const end = all.find(',', start);
      out.push_back(all.substr(start, end == std::string::npos ? std::string::npos : end - start));
      if (end == std::string::npos) { break; }
      start = end + 1;
    }
    return out;
  }();
  return archs;
}

bool compiled_for(char const* arch) {
  for (auto const& a : compiled_archs()) {
    if (a == arch) { return true; }
  }
  return false;
}

// Whether a build for `archs` has kernels for a GPU of compute capability (major, minor): an sm_90
// GPU with sm_90a code, or an sm_8x GPU with sm_80 code (validation.py's rule).
bool has_kernels_for(int major, int minor, std::vector<std::string> const& archs) {
  auto const has = [&](char const* arch) { return std::find(archs.begin(), archs.end(), arch) != archs.end(); };
  return (major == 9 && minor == 0 && has("sm_90a")) || (major == 8 && has("sm_80"));
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

// ---- Argument checks (flash_epilogue/validation.py, function by function)

using OptTensor = std::optional<at::Tensor>;

// A tensor argument and its name; t null: the argument is None.
struct Named {
  char const* name;
  at::Tensor const* t;
};
Named named(char const* name, OptTensor const& t) { return {name, t.has_value() ? &*t : nullptr}; }

[[noreturn]] void fail(char const* op, std::string const& arg, std::string const& expected, std::string const& got) {
  C10_THROW_ERROR(ValueError, "flash_epilogue." + std::string(op) + ": " + arg + ": expected " + expected + ", got " + got);
}
[[noreturn]] void fail_dtype(char const* op, std::string const& name, std::string const& expected, at::ScalarType got);

std::string dtype_name(at::ScalarType t) {  // as Python prints a torch.dtype
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kDouble: return "torch.float64";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return std::string("torch.") + c10::toString(t);
  }
}

void fail_dtype(char const* op, std::string const& name, std::string const& expected, at::ScalarType got) {
  C10_THROW_ERROR(TypeError, "flash_epilogue." + std::string(op) + ": " + name + ": dtype: expected " + expected +
                                 ", got " + dtype_name(got));
}

// The schema lets None through for a Tensor argument as an undefined tensor.
void check_defined(char const* op, std::initializer_list<Named> tensors) {
  for (auto const& n : tensors) {
    if (!n.t->defined()) { C10_THROW_ERROR(TypeError, "flash_epilogue." + std::string(op) + ": " + n.name + ": expected a torch.Tensor, got NoneType"); }
  }
}

std::string rank_got(at::Tensor const& t) { return num(t.dim()) + " dims, shape " + num(t.sizes()); }

// A shape as Python prints a tuple with '*' at `star`: (2, 16, '*', 64).
std::string shape_with_star(c10::IntArrayRef sizes, size_t star) {
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) {
    s += (i ? ", " : "") + (i == star ? std::string("'*'") : std::to_string(sizes[i]));
  }
  return s + (sizes.size() == 1 ? ",)" : ")");
}

void check_float32(char const* op, char const* name, at::Tensor const& t) {
  if (t.scalar_type() != at::kFloat) { fail_dtype(op, name, "torch.float32", t.scalar_type()); }
}

void check_half(char const* op, char const* name, at::Tensor const& t) {
  if (t.scalar_type() != at::kHalf && t.scalar_type() != at::kBFloat16) {
    fail_dtype(op, name, "torch.float16 or torch.bfloat16", t.scalar_type());
  }
}

void check_same_dtype(char const* op, char const* name, at::Tensor const& t, char const* ref_name, at::Tensor const& ref) {
  if (t.scalar_type() != ref.scalar_type()) {
    fail_dtype(op, name, dtype_name(ref.scalar_type()) + " (the dtype of " + ref_name + ")", t.scalar_type());
  }
}

void check_rank(char const* op, char const* name, at::Tensor const& t, bool varlen) {
  if (t.dim() != (varlen ? 3 : 4)) {
    fail(op, std::string(name) + ": rank",
         varlen ? "3 dims (total_tokens, heads, headdim) because cu_seqlens is given"
                : "4 dims (batch, seqlen, heads, headdim) because cu_seqlens is None",
         rank_got(t));
  }
}

void check_same_shape(char const* op, char const* name, at::Tensor const& t, char const* ref_name, at::Tensor const& ref) {
  if (t.sizes() != ref.sizes()) {
    fail(op, std::string(name) + ": shape", num(ref.sizes()) + " (the shape of " + ref_name + ")", num(t.sizes()));
  }
}

// t and ref agree on every dim but the last (dv may have its own head dim).
void check_same_leading_shape(char const* op, char const* name, at::Tensor const& t, char const* ref_name,
                              at::Tensor const& ref) {
  if (t.sizes().slice(0, t.dim() - 1) != ref.sizes().slice(0, ref.dim() - 1)) {
    fail(op, std::string(name) + ": shape",
         shape_with_star(ref.sizes(), ref.dim() - 1) + " (" + ref_name + "'s shape but the last dim)", num(t.sizes()));
  }
}

// t is ref with another number of heads (dim -2): (..., h_k, d) against (..., h_q, d).
void check_reduced_shape(char const* op, char const* name, at::Tensor const& t, char const* ref_name,
                         at::Tensor const& ref) {
  if (t.sizes().slice(0, t.dim() - 2) != ref.sizes().slice(0, ref.dim() - 2) || t.size(-1) != ref.size(-1)) {
    fail(op, std::string(name) + ": shape",
         shape_with_star(ref.sizes(), ref.dim() - 2) + " (" + ref_name + "'s shape but the heads dim)", num(t.sizes()));
  }
}

// The head dims the kernels take (a compiled config rounds up to the next of kCompiledHeadDims).
bool head_dim_supported(int64_t d) { return d > 0 && d % 8 == 0 && d <= 256; }

void check_head_dim(char const* op, std::string const& name, int64_t d) {
  if (!head_dim_supported(d)) { fail(op, name + ": head dim", "a multiple of 8 in [8, 256]", num(d)); }
}

void check_last_stride(char const* op, char const* name, at::Tensor const& t) {
  if (t.dim() > 0 && t.stride(-1) != 1) {
    fail(op, std::string(name) + ": stride(-1)", "1 (last dim contiguous)",
         num(t.stride(-1)) + " (strides " + num(t.strides()) + ")");
  }
}

int64_t stride_multiple(at::Tensor const& t) { return std::max<int64_t>(16 / t.element_size(), 1); }

// Every stride but the last: a non-negative multiple of 16 bytes; dims of size <= 1 ignored.
void check_strides(char const* op, char const* name, at::Tensor const& t) {
  if (t.numel() == 0) { return; }  // no memory is touched: the kernels return early
  int64_t const multiple = stride_multiple(t);
  for (int64_t i = 0; i + 1 < t.dim(); ++i) {
    int64_t const s = t.stride(i);
    if (t.size(i) > 1 && (s < 0 || s % multiple != 0)) {
      fail(op, std::string(name) + ": stride(" + num(i) + ")",
           "a non-negative multiple of " + num(multiple) + " elements (16 bytes)",
           num(s) + " (shape " + num(t.sizes()) + ", strides " + num(t.strides()) + ")");
    }
  }
}

int64_t address(at::Tensor const& t) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.const_data_ptr())); }

void check_alignment(char const* op, char const* name, at::Tensor const& t) {
  if (t.numel() == 0) { return; }
  int64_t const ptr = address(t);
  if (ptr % 16 != 0) {
    fail(op, std::string(name) + ": data_ptr", "a 16-byte aligned address",
         hex_str(ptr) + " (address % 16 = " + num(ptr % 16) + ")");
  }
}

std::string contiguous_strides_str(c10::IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t acc = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = acc;
    acc *= std::max<int64_t>(sizes[i], 1);
  }
  return num(strides);
}

void check_contiguous(char const* op, char const* name, at::Tensor const& t) {
  if (t.numel() > 0 && !t.is_contiguous()) {
    fail(op, std::string(name) + ": strides", contiguous_strides_str(t.sizes()) + " (contiguous)", num(t.strides()));
  }
}

// ---- Overlaps (validation._byte_range, _elements_coincide, _check_no_overlap)

struct ByteRange {
  at::Device device;
  int64_t begin, end;
};

ByteRange byte_range(at::Tensor const& t) {
  int64_t extent = 1;
  for (int64_t i = 0; i < t.dim(); ++i) { extent += (t.size(i) - 1) * t.stride(i); }
  int64_t const begin = address(t);
  return {t.device(), begin, begin + extent * t.element_size()};
}

int64_t floor_div(int64_t a, int64_t b) {  // Python's a // b (b > 0)
  int64_t const q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}

// Whether some element of `t` and one of `other` (which starts delta_bytes after t) share memory:
// exact for equal element sizes (a bounded search over the strides, so packed layouts such as
// dk = kv[:, :, 0], dv = kv[:, :, 1] are told apart), conservative (true) otherwise.
bool elements_coincide(at::Tensor const& t, at::Tensor const& other, int64_t delta_bytes) {
  int64_t const size = t.element_size();
  if (other.element_size() != size || delta_bytes % size != 0) { return true; }
  // sum over dims of x_d * stride_d == delta, x_d in [0, n-1] for t and [-(n-1), 0] for other
  std::map<int64_t, std::array<int64_t, 2>> terms;  // |stride| -> (lo, hi)
  auto add = [&](at::Tensor const& x, int sign) {
    for (int64_t d = 0; d < x.dim(); ++d) {
      int64_t const n = x.size(d), s = x.stride(d);
      if (n > 1 && s != 0) {
        auto& lo_hi = terms[std::abs(s)];
        int64_t const reach = (n - 1) * (((sign > 0) == (s > 0)) ? 1 : -1);
        lo_hi[reach < 0 ? 0 : 1] += reach;
      }
    }
  };
  add(t, 1);
  add(other, -1);
  std::vector<std::array<int64_t, 3>> items;  // (stride, lo, hi), largest stride first
  for (auto it = terms.rbegin(); it != terms.rend(); ++it) { items.push_back({it->first, it->second[0], it->second[1]}); }
  size_t const k_end = items.size();
  std::vector<int64_t> suffix_lo(k_end + 1, 0), suffix_hi(k_end + 1, 0);
  for (size_t k = k_end; k-- > 0;) {
    suffix_lo[k] = suffix_lo[k + 1] + items[k][1] * items[k][0];
    suffix_hi[k] = suffix_hi[k + 1] + items[k][2] * items[k][0];
  }
  int64_t budget = 100000;
  auto reachable = [&](auto&& self, size_t k, int64_t rem) -> bool {
    if (k == k_end) { return rem == 0; }
    if (--budget < 0) { return true; }  // too many candidates to rule out: assume they coincide
    auto const [s, lo, hi] = items[k];
    int64_t const first = std::max(lo, -floor_div(suffix_hi[k + 1] - rem, s));
    int64_t const last = std::min(hi, floor_div(rem - suffix_lo[k + 1], s));
    for (int64_t x = first; x <= last; ++x) {
      if (self(self, k + 1, rem - x * s)) { return true; }
    }
    return false;
  };
  return reachable(reachable, 0, delta_bytes / size);
}

// `t` (written) shares no element with `other`.
void check_no_overlap(char const* op, Named t, Named other) {
  if (!t.t || !other.t || t.t->numel() == 0 || other.t->numel() == 0) { return; }
  ByteRange const a = byte_range(*t.t), b = byte_range(*other.t);
  if (a.device == b.device && a.begin < b.end && b.begin < a.end && elements_coincide(*t.t, *other.t, b.begin - a.begin)) {
    fail(op, std::string(t.name) + ": memory", std::string("no overlap with ") + other.name,
         "bytes [" + hex_str(a.begin) + ", " + hex_str(a.end) + ") overlapping " + other.name + "'s [" + hex_str(b.begin) + ", " +
             hex_str(b.end) + ")");
  }
}

// No written tensor shares an element with another written one or with a read one.
void check_no_overlaps(char const* op, std::initializer_list<Named> written, std::initializer_list<Named> read) {
  for (auto i = written.begin(); i != written.end(); ++i) {
    for (auto j = written.begin(); j != i; ++j) { check_no_overlap(op, *i, *j); }
  }
  for (auto const& w : written) {
    for (auto const& r : read) { check_no_overlap(op, w, r); }
  }
}

// ---- cu_seqlens, seqused and the other int32 vectors

// An int32, 1-D, contiguous tensor of `numel` elements (any number when numel < 0).
void check_index_tensor(char const* op, char const* name, at::Tensor const& t, int64_t numel,
                        std::string const& numel_why) {
  if (t.scalar_type() != at::kInt) { fail_dtype(op, name, "torch.int32", t.scalar_type()); }
  if (t.dim() != 1) { fail(op, std::string(name) + ": rank", "1 dim", rank_got(t)); }
  if (t.numel() > 1 && t.stride(0) != 1) { fail(op, std::string(name) + ": stride(0)", "1 (contiguous)", num(t.stride(0))); }
  if (numel >= 0 && t.numel() != numel) {
    fail(op, std::string(name) + ": numel", num(numel) + " (" + numel_why + ")", num(t.numel()));
  }
}

// Metadata of cu_seqlens/seqused; returns the batch size (batch_dim, batch_name's shape[0], in the
// batched layout; cu_seqlens.numel() - 1 >= 1 in varlen).
int64_t check_seqlens_meta(char const* op, OptTensor const& cu_seqlens, OptTensor const& seqused, int64_t batch_dim,
                           char const* batch_name) {
  int64_t batch = batch_dim;
  std::string why;
  if (cu_seqlens.has_value()) {
    at::Tensor const& cu = *cu_seqlens;
    if (cu.scalar_type() != at::kInt) { fail_dtype(op, "cu_seqlens", "torch.int32", cu.scalar_type()); }
    if (cu.dim() != 1) { fail(op, "cu_seqlens: rank", "1 dim (batch + 1,)", rank_got(cu)); }
    if (cu.numel() > 1 && cu.stride(0) != 1) { fail(op, "cu_seqlens: stride(0)", "1 (contiguous)", num(cu.stride(0))); }
    if (cu.numel() < 2) { fail(op, "cu_seqlens: numel", "batch + 1 >= 2 (at least one sequence)", num(cu.numel())); }
    batch = cu.numel() - 1;
    why = "batch = cu_seqlens.numel() - 1";
  } else {
    why = std::string("batch = ") + batch_name + ".shape[0]";
  }
  if (seqused.has_value()) { check_index_tensor(op, "seqused", *seqused, batch, why); }
  return batch;
}

// What the kernels index with 32-bit ints (the grid's y and z with 16 bits). Not a check of the
// Python validation: inputs past these limits raise this op's message through the wrappers.
bool within_grid_limits(int64_t rows, int64_t heads, int64_t batch) {
  return rows < (int64_t(1) << 31) && heads < 65536 && batch < 65536;
}

void check_limits(char const* op, char const* name, at::Tensor const& t, int64_t rows, int64_t heads, int64_t batch) {
  if (!within_grid_limits(rows, heads, batch)) {
    fail(op, std::string(name) + ": shape", "rows < 2^31 and heads, batch < 65536", num(t.sizes()));
  }
}

// ---- Devices (last): every tensor on one CUDA device, a GPU this build has kernels for

at::Device check_devices(char const* op, std::initializer_list<Named> tensors) {
  Named const* ref = nullptr;
  for (auto const& n : tensors) {
    if (n.t && !n.t->is_cuda()) {
      fail(op, std::string(n.name) + ": device", "a CUDA tensor", "a tensor on " + n.t->device().str());
    }
  }
  for (auto const& n : tensors) {
    if (!n.t) { continue; }
    if (!ref) {
      ref = &n;
    } else if (n.t->device() != ref->t->device()) {
      fail(op, std::string(n.name) + ": device", ref->t->device().str() + " (the device of " + ref->name + ")",
           n.t->device().str());
    }
  }
  return ref->t->device();
}

void check_arch_value(char const* op, int64_t requested) {
  if (requested != 0 && requested != 80 && requested != 90) {
    fail(op, "_arch", "0 (the device's path), 80 or 90", num(requested));
  }
}

// The code path an op runs: 90 on an sm_90 GPU (sm_90a kernels), 80 on an sm_8x GPU when the build
// has sm_80 code; `requested` = 80 forces the sm_80 path on an sm_90 GPU (a testing knob: the
// sm_80 collectives are compiled for every arch of the build). After check_devices.
int resolve_arch(char const* op, at::Device device, int64_t requested) {
  check_arch_value(op, requested);
  auto const [major, minor] = device_capability(device.index());
  std::string const capability = "sm_" + num(major) + num(minor);
  bool const sm90 = major == 9 && minor == 0;
  bool const hopper = sm90 && compiled_for("sm_90a");
  if (!has_kernels_for(major, minor, compiled_archs())) {
    std::string archs;
    for (auto const& a : compiled_archs()) { archs += (archs.empty() ? "" : ", ") + a; }
    fail(op, "device", "a GPU of compute capability sm_90 (compiled for " + archs + ")",
         device.str() + " with compute capability " + capability);
  }
  if (requested == 90 && !sm90) {
    fail(op, "_arch", "0 or 80 on " + device.str() + " (compute capability " + capability + ")", num(requested));
  }
  return hopper && requested != 80 ? 90 : 80;
}

// The path whose accumulator layout a GQA call expects, before the device checks (validation's
// resolve_arch): `requested`, else the device's own (80 on sm_8x, otherwise 90).
int accum_path(at::Device device, int64_t requested) {
  if (requested != 0) { return static_cast<int>(requested); }
  return device.is_cuda() && device_capability(device.index()).first == 8 ? 80 : 90;
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


// What store, store_zero, gqa_postprocess and gqa_reduce launch for: dk/dv (16-bit, batched or varlen).
struct OutputProblem {
  bool varlen;
  int64_t rows, heads, batch;
  int head_dim;  // the compiled head dim serving max(d, dv)
};

OutputProblem output_problem(at::Tensor const& dk, at::Tensor const& dv, bool varlen, int64_t batch) {
  return {varlen, varlen ? dk.size(0) : dk.size(1), dk.size(-2), batch,
          compiled_head_dim_for(static_cast<int>(std::max(dk.size(-1), dv.size(-1))))};
}

// The device, stream and CUDA context a launch runs with. Ops may be called from any host thread
// (the autograd engine's device threads, a user's Python threads). A thread that has made no CUDA
// runtime call has no current context, and c10's guard skips cudaSetDevice when the device index
// already matches (device 0 reads as current there), so the driver call that encodes the TMA
// descriptors (cuTensorMapEncodeTiled, made before the first runtime launch could bind a context)
// failed in such a thread, and CUTLASS's error path crashed the process (H200, 48359c1 and
// 2fc97fc). cudaSetDevice binds the device's primary context: once per thread and device.
void bind_primary_context(int device) {
  thread_local uint64_t bound = 0;  // bit d: this thread has bound device d's primary context
  uint64_t const bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (bound & bit) != 0) { return; }
  C10_CUDA_CHECK(cudaSetDevice(device));
  bound |= bit;
}

struct LaunchScope {
  c10::cuda::CUDAGuard guard;
  cudaStream_t stream;
  explicit LaunchScope(at::Device device) : guard(device) {
    bind_primary_context(device.index());
    stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  }
};

void finish_launch(char const* op, char const* why) {
  TORCH_CHECK(why == nullptr, "flash_epilogue.", op, ": arguments rejected by the kernel: ", why);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// validation.validate_store
void store_cuda(at::Tensor const& dk_accum, at::Tensor const& dv_accum, at::Tensor const& dk, at::Tensor const& dv,
                OptTensor const& cu_seqlens, OptTensor const& seqused, int64_t arch) {
  constexpr char const* op = "store";
  bool const varlen = cu_seqlens.has_value();
  Named const four[] = {{"dk_accum", &dk_accum}, {"dv_accum", &dv_accum}, {"dk", &dk}, {"dv", &dv}};
  check_defined(op, {four[0], four[1], four[2], four[3]});  // a
  check_float32(op, "dk_accum", dk_accum);  // b
  check_float32(op, "dv_accum", dv_accum);
  check_half(op, "dk", dk);
  check_same_dtype(op, "dv", dv, "dk", dk);
  for (auto const& n : four) { check_rank(op, n.name, *n.t, varlen); }  // c
  check_same_shape(op, "dk_accum", dk_accum, "dk", dk);  // d
  check_same_shape(op, "dv_accum", dv_accum, "dv", dv);
  check_same_leading_shape(op, "dv", dv, "dk", dk);
  check_head_dim(op, "dk", dk.size(-1));  // e
  check_head_dim(op, "dv", dv.size(-1));
  for (auto const& n : four) { check_last_stride(op, n.name, *n.t); }  // f
  for (auto const& n : four) { check_strides(op, n.name, *n.t); }  // g
  for (auto const& n : four) { check_alignment(op, n.name, *n.t); }  // h
  check_no_overlaps(op, {four[2], four[3]}, {four[0], four[1]});  // i
  int64_t const batch = check_seqlens_meta(op, cu_seqlens, seqused, dk.size(0), "dk");  // j
  check_no_overlaps(op, {four[2], four[3]}, {named("cu_seqlens", cu_seqlens), named("seqused", seqused)});
  OutputProblem const p = output_problem(dk, dv, varlen, batch);
  check_limits(op, "dk", dk, p.rows, p.heads, p.batch);
  at::Device const device = check_devices(op, {four[0], four[1], four[2], four[3], named("cu_seqlens", cu_seqlens),
                                               named("seqused", seqused)});  // k
  int const path = resolve_arch(op, device, arch);
  if (dk.numel() == 0) { return; }  // batch 0, seqlen 0, heads 0: nothing to launch

  LaunchScope const scope(device);
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
  finish_launch(op, dispatch<StoreLauncher>(dk.scalar_type(), p.head_dim, path, args, scope.stream));
}

// validation.validate_store_zero
void store_zero_cuda(at::Tensor const& dk, at::Tensor const& dv, OptTensor const& cu_seqlens, OptTensor const& seqused,
                     OptTensor const& batch_idx, OptTensor const& head_idx, int64_t row_start,
                     std::optional<int64_t> row_end, int64_t arch) {
  constexpr char const* op = "store_zero";
  bool const varlen = cu_seqlens.has_value();
  Named const outputs[] = {{"dk", &dk}, {"dv", &dv}};
  check_defined(op, {outputs[0], outputs[1]});  // a
  check_half(op, "dk", dk);  // b
  check_same_dtype(op, "dv", dv, "dk", dk);
  for (auto const& n : outputs) { check_rank(op, n.name, *n.t, varlen); }  // c
  check_same_leading_shape(op, "dv", dv, "dk", dk);  // d
  check_head_dim(op, "dk", dk.size(-1));  // e
  check_head_dim(op, "dv", dv.size(-1));
  for (auto const& n : outputs) { check_last_stride(op, n.name, *n.t); }  // f
  for (auto const& n : outputs) { check_strides(op, n.name, *n.t); }  // g
  for (auto const& n : outputs) { check_alignment(op, n.name, *n.t); }  // h
  check_no_overlap(op, outputs[1], outputs[0]);  // i
  int64_t const batch = check_seqlens_meta(op, cu_seqlens, seqused, dk.size(0), "dk");  // j
  Named const selections[] = {named("batch_idx", batch_idx), named("head_idx", head_idx)};
  for (auto const& n : selections) {
    if (n.t) { check_index_tensor(op, n.name, *n.t, -1, ""); }
  }
  check_no_overlaps(op, {outputs[0], outputs[1]},
                    {named("cu_seqlens", cu_seqlens), named("seqused", seqused), selections[0], selections[1]});
  for (auto const& n : selections) {  // the kernel reads the selections with 16-bit grid dims
    if (n.t && n.t->numel() >= 65536) {
      fail(op, std::string(n.name) + ": numel", "fewer than 65536 entries", num(n.t->numel()));
    }
  }
  if (row_start < 0) { fail(op, "row_start", ">= 0", num(row_start)); }  // k
  if (row_end.has_value() && *row_end < row_start) {
    fail(op, "row_end", "None or >= row_start = " + num(row_start), num(*row_end));
  }
  OutputProblem const p = output_problem(dk, dv, varlen, batch);
  check_limits(op, "dk", dk, p.rows, p.heads, p.batch);
  at::Device const device = check_devices(op, {outputs[0], outputs[1], named("cu_seqlens", cu_seqlens),
                                               named("seqused", seqused), selections[0], selections[1]});  // l
  int const path = resolve_arch(op, device, arch);
  int64_t const end = std::min<int64_t>(row_end.value_or(p.rows), p.rows);
  bool const empty_selection = (batch_idx.has_value() && batch_idx->numel() == 0) ||
                               (head_idx.has_value() && head_idx->numel() == 0);
  if (dk.numel() == 0 || empty_selection || row_start >= end) { return; }

  LaunchScope const scope(device);
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
  finish_launch(op, dispatch<StoreZeroLauncher>(dk.scalar_type(), p.head_dim, path, args, scope.stream));
}


// ---- GQA

// The accumulator's expected geometry for a problem: (batch_extent, h_k, num_tiles, tile_elems).
struct AccumGeometry {
  int64_t batch_extent, heads, num_tiles, tile_elems;
  std::string why;  // for messages (validation._accum_why)

  std::vector<int64_t> shape() const { return {batch_extent, heads, num_tiles, tile_elems}; }
};

// validation._check_accum_geometry's shape: gqa_accum_shape(batch, rows, h_k, d, dv, arch, varlen).
AccumGeometry accum_geometry(int path, bool varlen, int64_t batch, int64_t rows, int64_t heads_kv, int64_t d,
                             int64_t dv) {
  int const head_dim = compiled_head_dim_for(static_cast<int>(std::max(d, dv)));
  int64_t const block_n = gqa_block_n(head_dim, path);
  int64_t const tiles = varlen ? (rows + batch * block_n) / block_n : (rows + block_n - 1) / block_n;
  std::string const what = varlen ? num(batch) + " sequences of " + num(rows) + " total tokens"
                                  : "batch " + num(batch) + ", seqlen " + num(rows);
  return {varlen ? 1 : batch, heads_kv, tiles, gqa_accum_tile_elems(head_dim, path),
          "the accumulator of " + what + ", " + num(heads_kv) + " KV heads, head dims (" + num(d) + ", " + num(dv) +
              ") on the sm_" + num(path) + " path: allocate it with flash_epilogue.gqa_accumulator"};
}

void check_accum_rank(char const* op, char const* name, at::Tensor const& t) {
  if (t.dim() != 4) { fail(op, std::string(name) + ": rank", "4 dims (batch_extent, heads_kv, num_tiles, tile_elems)", rank_got(t)); }
}

void check_accum_shape(char const* op, char const* name, at::Tensor const& t, AccumGeometry const& g) {
  std::vector<int64_t> const expected = g.shape();
  if (t.sizes() != c10::IntArrayRef(expected)) {
    fail(op, std::string(name) + ": shape", num(expected) + " (" + g.why + ")", num(t.sizes()));
  }
}

// h_k >= 1 and h_q a positive multiple of h_k (query head j belongs to KV head j // (h_q / h_k)).
void check_group(char const* op, char const* q_name, int64_t h_q, char const* kv_name, int64_t h_k, char const* kv_src) {
  if (h_k < 1) { fail(op, std::string(kv_name) + ": heads", ">= 1 (" + std::string(kv_src) + ", the number of KV heads)", num(h_k)); }
  if (h_q < 1 || h_q % h_k != 0) {
    fail(op, std::string(q_name) + ": heads",
         "a positive multiple of the " + num(h_k) + " KV heads (" + kv_src +
             "): every KV head serves h_q / h_k query heads",
         num(h_q) + " query heads (" + q_name + ".shape[-2])");
  }
}

AccumDesc accum_desc(at::Tensor const& t, AccumGeometry const& g) {
  return {t.data_ptr<float>(), t.stride(1), t.stride(0), static_cast<int>(g.num_tiles)};
}

// validation.validate_gqa_accumulate
void gqa_accumulate_cuda(at::Tensor const& dk_partial, at::Tensor const& dv_partial, at::Tensor const& dk_accum,
                         at::Tensor const& dv_accum, OptTensor const& semaphores, OptTensor const& cu_seqlens,
                         OptTensor const& seqused, bool deterministic, int64_t arch) {
  constexpr char const* op = "gqa_accumulate";
  bool const varlen = cu_seqlens.has_value();
  Named const partials[] = {{"dk_partial", &dk_partial}, {"dv_partial", &dv_partial}};
  Named const accums[] = {{"dk_accum", &dk_accum}, {"dv_accum", &dv_accum}};
  Named const four[] = {partials[0], partials[1], accums[0], accums[1]};
  check_defined(op, {four[0], four[1], four[2], four[3]});  // a
  check_arch_value(op, arch);
  for (auto const& n : four) { check_float32(op, n.name, *n.t); }  // b
  for (auto const& n : partials) { check_rank(op, n.name, *n.t, varlen); }  // c
  for (auto const& n : accums) { check_accum_rank(op, n.name, *n.t); }
  check_same_leading_shape(op, "dv_partial", dv_partial, "dk_partial", dk_partial);  // d
  int64_t const d = dk_partial.size(-1), dv_dim = dv_partial.size(-1);
  check_head_dim(op, "dk_partial", d);
  check_head_dim(op, "dv_partial", dv_dim);
  int64_t const h_q = dk_partial.size(-2), h_k = dk_accum.size(1);
  check_group(op, "dk_partial", h_q, "dk_accum", h_k, "dk_accum.shape[1]");
  int64_t const batch = check_seqlens_meta(op, cu_seqlens, seqused, dk_partial.size(0), "dk_partial");  // j
  int64_t const rows = varlen ? dk_partial.size(0) : dk_partial.size(1);
  AccumGeometry const geo = accum_geometry(accum_path(dk_partial.device(), arch), varlen, batch, rows, h_k, d, dv_dim);
  for (auto const& n : accums) { check_accum_shape(op, n.name, *n.t, geo); }
  for (auto const& n : partials) { check_last_stride(op, n.name, *n.t); }  // f, g
  for (auto const& n : partials) { check_strides(op, n.name, *n.t); }
  for (auto const& n : accums) { check_contiguous(op, n.name, *n.t); }
  for (auto const& n : four) { check_alignment(op, n.name, *n.t); }  // h
  int64_t const counters = 2 * geo.batch_extent * geo.num_tiles * geo.heads + 1;
  if (!semaphores.has_value() && deterministic) {
    fail(op, "semaphores",
         "an int32 tensor of >= " + num(counters) + " entries because deterministic=True (allocate the accumulator "
             "with flash_epilogue.gqa_accumulator(..., deterministic=True))",
         "None");
  }
  if (semaphores.has_value()) {
    check_index_tensor(op, "semaphores", *semaphores, -1, "");
    if (semaphores->numel() < counters) {
      fail(op, "semaphores: numel",
           ">= " + num(counters) + " (2 * batch_extent * num_tiles * heads_kv + 1 for accumulators of shape " +
               num(geo.shape()) + ")",
           num(semaphores->numel()));
    }
  }
  Named const sem = named("semaphores", semaphores), cu = named("cu_seqlens", cu_seqlens), used = named("seqused", seqused);
  check_no_overlaps(op, {accums[0], accums[1], sem}, {partials[0], partials[1], cu, used});  // i
  check_limits(op, "dk_partial", dk_partial, rows, h_q, batch);
  at::Device const device = check_devices(op, {four[0], four[1], four[2], four[3], sem, cu, used});  // k
  int const path = resolve_arch(op, device, arch);
  TORCH_CHECK(path == accum_path(device, arch), "flash_epilogue.gqa_accumulate: internal: arch paths disagree");
  if (dk_partial.numel() == 0 || dk_accum.numel() == 0) { return; }

  LaunchScope const scope(device);
  GqaAccumulateLaunchArgs args;
  args.dk_accum = accum_desc(dk_accum, geo);
  args.dv_accum = accum_desc(dv_accum, geo);
  args.dk_partial = describe(dk_partial, varlen);
  args.dv_partial = describe(dv_partial, varlen);
  args.rows = static_cast<int>(rows);
  args.num_heads_q = static_cast<int>(h_q);
  args.num_heads_kv = static_cast<int>(h_k);
  args.batch = static_cast<int>(batch);
  args.cu_seqlens = varlen ? cu_seqlens->data_ptr<int>() : nullptr;
  args.seqused = seqused.has_value() ? seqused->data_ptr<int>() : nullptr;
  args.semaphores = deterministic ? semaphores->data_ptr<int>() : nullptr;
  int const head_dim = compiled_head_dim_for(static_cast<int>(std::max(d, dv_dim)));
  finish_launch(op, dispatch_no_dtype<GqaAccumulateLauncher>(head_dim, path, args, scope.stream));
}

// validation.validate_gqa_postprocess
void gqa_postprocess_cuda(at::Tensor const& dk_accum, at::Tensor const& dv_accum, at::Tensor const& dk,
                          at::Tensor const& dv, double scale_dk, double scale_dv, OptTensor const& cu_seqlens,
                          OptTensor const& seqused, int64_t arch) {
  constexpr char const* op = "gqa_postprocess";
  bool const varlen = cu_seqlens.has_value();
  Named const accums[] = {{"dk_accum", &dk_accum}, {"dv_accum", &dv_accum}};
  Named const outputs[] = {{"dk", &dk}, {"dv", &dv}};
  Named const four[] = {accums[0], accums[1], outputs[0], outputs[1]};
  check_defined(op, {four[0], four[1], four[2], four[3]});  // a
  check_arch_value(op, arch);
  for (auto const& n : accums) { check_float32(op, n.name, *n.t); }  // b
  check_half(op, "dk", dk);
  check_same_dtype(op, "dv", dv, "dk", dk);
  for (auto const& n : accums) { check_accum_rank(op, n.name, *n.t); }  // c
  for (auto const& n : outputs) { check_rank(op, n.name, *n.t, varlen); }
  check_same_leading_shape(op, "dv", dv, "dk", dk);  // d
  int64_t const d = dk.size(-1), dv_dim = dv.size(-1);
  check_head_dim(op, "dk", d);
  check_head_dim(op, "dv", dv_dim);
  int64_t const h_k = dk.size(-2);
  int64_t const batch = check_seqlens_meta(op, cu_seqlens, seqused, dk.size(0), "dk");  // j
  int64_t const rows = varlen ? dk.size(0) : dk.size(1);
  AccumGeometry const geo = accum_geometry(accum_path(dk.device(), arch), varlen, batch, rows, h_k, d, dv_dim);
  for (auto const& n : accums) { check_accum_shape(op, n.name, *n.t, geo); }
  for (auto const& n : outputs) { check_last_stride(op, n.name, *n.t); }  // f, g
  for (auto const& n : outputs) { check_strides(op, n.name, *n.t); }
  for (auto const& n : accums) { check_contiguous(op, n.name, *n.t); }
  for (auto const& n : four) { check_alignment(op, n.name, *n.t); }  // h
  Named const cu = named("cu_seqlens", cu_seqlens), used = named("seqused", seqused);
  check_no_overlaps(op, {outputs[0], outputs[1]}, {accums[0], accums[1], cu, used});  // i
  OutputProblem const p = output_problem(dk, dv, varlen, batch);
  check_limits(op, "dk", dk, p.rows, p.heads, p.batch);
  at::Device const device = check_devices(op, {four[0], four[1], four[2], four[3], cu, used});  // k
  int const path = resolve_arch(op, device, arch);
  TORCH_CHECK(path == accum_path(device, arch), "flash_epilogue.gqa_postprocess: internal: arch paths disagree");
  if (dk.numel() == 0) { return; }

  LaunchScope const scope(device);
  GqaPostprocessLaunchArgs args;
  args.dk_accum = accum_desc(dk_accum, geo);
  args.dv_accum = accum_desc(dv_accum, geo);
  args.dk = describe(dk, p.varlen);
  args.dv = describe(dv, p.varlen);
  args.rows = static_cast<int>(p.rows);
  args.num_heads_kv = static_cast<int>(p.heads);
  args.batch = static_cast<int>(p.batch);
  args.cu_seqlens = p.varlen ? cu_seqlens->data_ptr<int>() : nullptr;
  args.seqused = seqused.has_value() ? seqused->data_ptr<int>() : nullptr;
  args.scale_dk = static_cast<float>(scale_dk);
  args.scale_dv = static_cast<float>(scale_dv);
  finish_launch(op, dispatch<GqaPostprocessLauncher>(dk.scalar_type(), p.head_dim, path, args, scope.stream));
}

// validation.validate_gqa_accum_to_dense
void gqa_accum_to_dense_cuda(at::Tensor const& accum, at::Tensor const& out, int64_t head_dim, OptTensor const& cu_seqlens,
                             OptTensor const& seqused, int64_t arch) {
  constexpr char const* op = "gqa_accum_to_dense";
  bool const varlen = cu_seqlens.has_value();
  Named const both[] = {{"accum", &accum}, {"out", &out}};
  check_defined(op, {both[0], both[1]});  // a
  check_arch_value(op, arch);
  for (auto const& n : both) { check_float32(op, n.name, *n.t); }  // b
  check_accum_rank(op, "accum", accum);  // c
  check_rank(op, "out", out, varlen);
  check_head_dim(op, "head_dim", head_dim);  // d
  int64_t const w = out.size(-1);
  check_head_dim(op, "out", w);
  if (w > head_dim) { fail(op, "out: head dim", "<= head_dim = " + num(head_dim), num(w)); }
  int64_t const h_k = out.size(-2);
  int64_t const batch = check_seqlens_meta(op, cu_seqlens, seqused, out.size(0), "out");  // j
  int64_t const rows = varlen ? out.size(0) : out.size(1);
  AccumGeometry const geo = accum_geometry(accum_path(out.device(), arch), varlen, batch, rows, h_k, head_dim, head_dim);
  check_accum_shape(op, "accum", accum, geo);
  check_last_stride(op, "out", out);  // f, g
  check_strides(op, "out", out);
  check_contiguous(op, "accum", accum);
  for (auto const& n : both) { check_alignment(op, n.name, *n.t); }  // h
  Named const cu = named("cu_seqlens", cu_seqlens), used = named("seqused", seqused);
  check_no_overlaps(op, {both[1]}, {both[0], cu, used});  // i
  check_limits(op, "out", out, rows, h_k, batch);
  at::Device const device = check_devices(op, {both[0], both[1], cu, used});  // k
  int const path = resolve_arch(op, device, arch);
  TORCH_CHECK(path == accum_path(device, arch), "flash_epilogue.gqa_accum_to_dense: internal: arch paths disagree");
  if (out.numel() == 0) { return; }

  LaunchScope const scope(device);
  GqaDenseLaunchArgs args;
  args.accum = accum_desc(accum, geo);
  args.out = describe(out, varlen);
  args.rows = static_cast<int>(rows);
  args.num_heads_kv = static_cast<int>(h_k);
  args.batch = static_cast<int>(batch);
  args.cu_seqlens = varlen ? cu_seqlens->data_ptr<int>() : nullptr;
  args.seqused = seqused.has_value() ? seqused->data_ptr<int>() : nullptr;
  int const config = compiled_head_dim_for(static_cast<int>(head_dim));
  finish_launch(op, dispatch_no_dtype<GqaDenseLauncher>(config, path, args, scope.stream));
}

// validation.validate_gqa_reduce
void gqa_reduce_cuda(at::Tensor const& dk_partial, OptTensor const& dv_partial, at::Tensor const& dk, OptTensor const& dv,
                     OptTensor const& cu_seqlens, OptTensor const& seqused, double scale_dk, double scale_dv,
                     int64_t arch) {
  constexpr char const* op = "gqa_reduce";
  bool const varlen = cu_seqlens.has_value();
  bool const has_dv = dv_partial.has_value();
  check_defined(op, {{"dk_partial", &dk_partial}, {"dk", &dk}});  // a
  if (!has_dv && dv.has_value()) { fail(op, "dv", "None because dv_partial is None", "Tensor"); }  // a
  if (has_dv && !dv.has_value()) { fail(op, "dv", "a torch.Tensor because dv_partial is given", "NoneType"); }
  check_arch_value(op, arch);
  // partials and outputs, without dv_partial/dv when not given
  std::vector<Named> partials = {{"dk_partial", &dk_partial}}, outputs = {{"dk", &dk}};
  if (has_dv) {
    partials.push_back({"dv_partial", &*dv_partial});
    outputs.push_back({"dv", &*dv});
  }
  std::vector<Named> all = partials;
  all.insert(all.end(), outputs.begin(), outputs.end());
  check_half(op, "dk", dk);  // b
  if (has_dv) { check_same_dtype(op, "dv", *dv, "dk", dk); }
  if (dk_partial.scalar_type() != at::kFloat && dk_partial.scalar_type() != dk.scalar_type()) {
    fail_dtype(op, "dk_partial", "torch.float32 or " + dtype_name(dk.scalar_type()) + " (the dtype of dk)",
               dk_partial.scalar_type());
  }
  if (has_dv) { check_same_dtype(op, "dv_partial", *dv_partial, "dk_partial", dk_partial); }
  for (auto const& n : all) { check_rank(op, n.name, *n.t, varlen); }  // c
  if (has_dv) { check_same_leading_shape(op, "dv_partial", *dv_partial, "dk_partial", dk_partial); }  // d
  check_reduced_shape(op, "dk", dk, "dk_partial", dk_partial);
  if (has_dv) {
    check_reduced_shape(op, "dv", *dv, "dv_partial", *dv_partial);
    check_same_leading_shape(op, "dv", *dv, "dk", dk);
  }
  int64_t const d = dk.size(-1), dv_dim = has_dv ? dv->size(-1) : d;
  check_head_dim(op, "dk", d);
  if (has_dv) { check_head_dim(op, "dv", dv_dim); }
  int64_t const h_q = dk_partial.size(-2), h_k = dk.size(-2);
  check_group(op, "dk_partial", h_q, "dk", h_k, "dk.shape[-2]");
  for (auto const& n : all) { check_last_stride(op, n.name, *n.t); }  // f, g, h
  for (auto const& n : all) { check_strides(op, n.name, *n.t); }
  for (auto const& n : all) { check_alignment(op, n.name, *n.t); }
  Named const none{"", nullptr};
  Named const out_dk = outputs[0], out_dv = has_dv ? outputs[1] : none;
  Named const in_dk = partials[0], in_dv = has_dv ? partials[1] : none;
  check_no_overlaps(op, {out_dk, out_dv}, {in_dk, in_dv});  // i
  int64_t const batch = check_seqlens_meta(op, cu_seqlens, seqused, dk_partial.size(0), "dk_partial");  // j
  Named const cu = named("cu_seqlens", cu_seqlens), used = named("seqused", seqused);
  for (Named const& out : {out_dk, out_dv}) {
    for (Named const& in : {cu, used}) { check_no_overlap(op, out, in); }
  }
  OutputProblem const p = output_problem(dk, has_dv ? *dv : dk, varlen, batch);
  check_limits(op, "dk_partial", dk_partial, p.rows, h_q, p.batch);
  at::Device const device = check_devices(op, {in_dk, in_dv, out_dk, out_dv, cu, used});  // k
  int const path = resolve_arch(op, device, arch);
  if (dk.numel() == 0) { return; }

  LaunchScope const scope(device);
  GqaReduceLaunchArgs args;
  args.dk_partial = describe(dk_partial, p.varlen);
  if (has_dv) {
    args.dv_partial = describe(*dv_partial, p.varlen);
    args.dv = describe(*dv, p.varlen);
  }
  args.partial_fp32 = dk_partial.scalar_type() == at::kFloat;
  args.dk = describe(dk, p.varlen);
  args.rows = static_cast<int>(p.rows);
  args.num_heads_q = static_cast<int>(h_q);
  args.num_heads_kv = static_cast<int>(p.heads);
  args.batch = static_cast<int>(p.batch);
  args.cu_seqlens = p.varlen ? cu_seqlens->data_ptr<int>() : nullptr;
  args.seqused = seqused.has_value() ? seqused->data_ptr<int>() : nullptr;
  args.scale_dk = static_cast<float>(scale_dk);
  args.scale_dv = static_cast<float>(scale_dv);
  finish_launch(op, dispatch<GqaReduceLauncher>(dk.scalar_type(), p.head_dim, path, args, scope.stream));
}


// ---- repeat_kv (flash_epilogue/repeat_kv.py): the KV-head expand and its group-sum backward
//
// Both ops and their autograd are here so that a torch.autograd.grad through repeat_kv runs no
// Python: as torch.library custom ops with a Python register_autograd and the gqa_reduce wrapper
// they cost 124-139 us of host time per backward on the H200, more than the 92-97 us kernel
// (benchmarks/NOTES.md). The package keeps the public wrapper (its argument errors are
// FlashEpilogueInputError) and the fake kernels. The checks below are the ops' own, for direct
// callers of torch.ops.flash_epilogue.repeat_kv*.

// x (or grad) is 4-D, n_rep >= 1, dim names the heads dim; returns dim normalized to 1 or 2.
int64_t check_repeat_kv_args(char const* op, char const* name, char const* heads, at::Tensor const& t, int64_t n_rep,
                             int64_t dim) {
  if (t.dim() != 4) {
    fail(op, std::string(name) + ": rank",
         std::string("4 dims: (batch, ") + heads + ", seqlen, head_dim) for dim=1, (batch, seqlen, " + heads +
             ", head_dim) for dim=2",
         rank_got(t));
  }
  if (n_rep < 1) { fail(op, "n_rep", "a positive int", num(n_rep)); }
  if (dim != 1 && dim != 2 && dim != -3 && dim != -2) {
    fail(op, "dim", "1 (or -3) or 2 (or -2): the KV-head dim of a 4-D tensor", num(dim));
  }
  return dim < 0 ? dim + 4 : dim;
}

std::string list_str(c10::IntArrayRef values) {  // as Python prints a list: [0, 1, 2]
  std::string s = "[";
  for (size_t i = 0; i < values.size(); ++i) { s += (i ? ", " : "") + std::to_string(values[i]); }
  return s + "]";
}

// Test hooks (tests/test_repeat_kv.py, benchmarks/bench_repeat_kv.py). Which way each backward
// reduce went ("kernel", "kernel_copy", "reference"), recorded only while asked: otherwise a call
// pays one relaxed load. And a switch that lets CPU tensors take the kernel path, whose gqa_reduce
// call then goes through the dispatcher (a test registers a recording CPU kernel for it), so the
// CPU tests see the kernel path's decisions and arguments.
std::atomic<bool> record_reduce_paths{false};
std::atomic<bool> cpu_as_kernel_device{false};
std::mutex reduce_paths_mutex;
std::vector<std::string> reduce_paths;

void note_reduce_path(char const* path) {
  if (!record_reduce_paths.load(std::memory_order_relaxed)) { return; }
  std::lock_guard<std::mutex> lock(reduce_paths_mutex);
  reduce_paths.emplace_back(path);
}

// Whether gqa_reduce has kernels for tensors on `device` (see has_kernels_for).
bool repeat_kv_kernel_device(at::Device device) {
  if (device.is_cpu()) { return cpu_as_kernel_device.load(std::memory_order_relaxed); }
  if (!device.is_cuda()) { return false; }
  auto const [major, minor] = device_capability(device.has_index() ? device.index() : c10::cuda::current_device());
  return has_kernels_for(major, minor, compiled_archs());
}

// Whether gqa_reduce can sum `grad` (heads in dim 1 or 2): its dtype, head dim, grid limits and
// device (what gqa_reduce_cuda's check_head_dim and check_limits accept); a non-empty gradient.
bool repeat_kv_kernel_supports(at::Tensor const& grad, int64_t dim) {
  at::ScalarType const dtype = grad.scalar_type();
  int64_t const seqlen = grad.size(3 - dim);  // (b, h, s, d) for dim 1, (b, s, h, d) for dim 2
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && head_dim_supported(grad.size(3)) && grad.numel() > 0 &&
         within_grid_limits(seqlen, grad.size(dim), grad.size(0)) && repeat_kv_kernel_device(grad.device());
}

// gqa_reduce reads `t` (batch, seqlen, heads, d) in place: last dim contiguous, the other strides
// (of dims longer than 1) non-negative multiples of 16 bytes, a 16-byte aligned start.
bool kernel_layout_ok(at::Tensor const& t) {
  int64_t const multiple = 16 / t.element_size();
  if (t.size(3) > 1 && t.stride(3) != 1) { return false; }
  for (int64_t i = 0; i < 3; ++i) {
    if (t.size(i) > 1 && (t.stride(i) < 0 || t.stride(i) % multiple != 0)) { return false; }
  }
  return address(t) % 16 == 0;
}

// gqa_reduce's (batch, seqlen, heads, d) view of a tensor whose heads are in `dim`.
at::Tensor kernel_view(at::Tensor const& t, int64_t dim) { return dim == 1 ? t.transpose(1, 2) : t; }

// repeat_kv.group_sum_reference's arithmetic into `out`: for every KV head, 0 + g_0 + ... + g_{n-1}
// in fp32 (fp64 for fp64/complex128, the gradient's dtype if wider still) in head order, then one
// rounding to out's dtype. The same ATen calls in the same order, so the same bits.
void group_sum_reference(at::Tensor const& grad, int64_t n_rep, int64_t dim, at::Tensor const& out) {
  at::ScalarType const acc_dtype = at::promote_types(grad.scalar_type(), at::kFloat);
  at::Tensor acc = out.scalar_type() == acc_dtype ? out : at::empty(out.sizes(), grad.options().dtype(acc_dtype));
  acc.zero_();
  at::Tensor const grouped = grad.unflatten(dim, {out.size(dim), n_rep});
  for (int64_t j = 0; j < n_rep; ++j) { acc.add_(grouped.select(dim + 1, j)); }  // exact upcast, then an fp32 add
  if (!acc.is_same(out)) { out.copy_(acc); }  // round to nearest even, once
}

void call_gqa_reduce_op(at::Tensor const& partial, at::Tensor const& out) {
  static auto const op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flash_epilogue::gqa_reduce", "")
                             .typed<void(at::Tensor const&, OptTensor const&, at::Tensor const&, OptTensor const&,
                                         OptTensor const&, OptTensor const&, double, double, int64_t)>();
  op.call(partial, std::nullopt, out, std::nullopt, std::nullopt, std::nullopt, 1.0, 1.0, 0);
}

// FLASH_EPILOGUE_DEBUG as flash_epilogue.refresh_env_flags last read it (_C._set_debug_sync). The
// Python wrappers synchronize after their launches; repeat_kv's backward runs here, off them (in
// autograd's engine), so it waits for its kernel itself. Never under CUDA-graph capture, where a
// synchronize is an error.
std::atomic<bool> debug_sync_enabled{false};

void debug_sync(char const* op, at::Tensor const& t) {
  if (!debug_sync_enabled.load(std::memory_order_relaxed)) { return; }
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) { return; }
  cudaError_t const err = cudaStreamSynchronize(c10::cuda::getCurrentCUDAStream(t.get_device()).stream());
  TORCH_CHECK(err == cudaSuccess, "flash_epilogue.", op, ": the kernel failed on ", t.device(), ": ",
              cudaGetErrorString(err));
}

// Sum the groups of `grad` into `out` (x's gradient): one gqa_reduce launch where the kernels take
// the gradient, else group_sum_reference. Bitwise the same either way.
void reduce_groups(at::Tensor const& grad, int64_t n_rep, int64_t dim, at::Tensor const& out) {
  if (!repeat_kv_kernel_supports(grad, dim)) {
    group_sum_reference(grad, n_rep, dim, out);
    note_reduce_path("reference");
    return;
  }
  at::Tensor partial = kernel_view(grad, dim);
  char const* path = "kernel";
  if (!kernel_layout_ok(partial)) {
    // e.g. the stride-0 gradient of a .sum(), or a misaligned start: one copy into a new (aligned,
    // contiguous) tensor, then the kernel; the result does not depend on it
    partial = kernel_view(grad.clone(at::MemoryFormat::Contiguous), dim);
    path = "kernel_copy";
  }
  at::Tensor const out_view = kernel_view(out, dim);
  if (partial.is_cuda()) {
    // straight to the implementation: the dispatcher and the Python wrapper cost host time, and
    // its checks still run (they are what keeps a bad descriptor from being built)
    gqa_reduce_cuda(partial, std::nullopt, out_view, std::nullopt, std::nullopt, std::nullopt, 1.0, 1.0, 0);
    debug_sync("repeat_kv_backward", partial);
  } else {
    call_gqa_reduce_op(partial, out_view);  // CPU tensors come here only under the test hook
  }
  note_reduce_path(path);
}

// repeat_kv: x repeated n_rep times along dim as a new contiguous tensor (one copy, as the
// original's expand + reshape makes).
at::Tensor repeat_kv_impl(at::Tensor const& x, int64_t n_rep, int64_t dim) {
  dim = check_repeat_kv_args("repeat_kv", "x", "kv_heads", x, n_rep, dim);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end()), expanded = shape;
  shape[dim] *= n_rep;
  expanded.insert(expanded.begin() + dim + 1, n_rep);
  at::Tensor out = at::empty(shape, x.options());
  out.view(expanded).copy_(x.unsqueeze(dim + 1).expand(expanded));
  return out;
}

// repeat_kv_backward: the group sum of grad (heads in dim), allocated with its first three dims in
// memory in the order `layout` (outermost first; x's layout, see layout_of), dense, the last dim
// contiguous (repeat_kv.py's _empty_in_layout).
at::Tensor repeat_kv_backward_impl(at::Tensor const& grad, int64_t n_rep, int64_t dim, c10::IntArrayRef layout) {
  constexpr char const* op = "repeat_kv_backward";
  dim = check_repeat_kv_args(op, "grad", "heads", grad, n_rep, dim);
  std::array<int64_t, 4> shape = {grad.size(0), grad.size(1), grad.size(2), grad.size(3)};
  if (shape[dim] % n_rep != 0) {
    fail(op, "grad: heads", "a multiple of n_rep = " + num(n_rep) + " in dim " + num(dim),
         num(shape[dim]) + " (shape " + num(grad.sizes()) + ")");
  }
  shape[dim] /= n_rep;
  std::array<bool, 3> seen = {false, false, false};
  bool permutation = layout.size() == 3;
  for (int64_t i : layout) {
    permutation = permutation && 0 <= i && i < 3 && !seen[i];
    if (permutation) { seen[i] = true; }
  }
  if (!permutation) { fail(op, "layout", "a permutation of [0, 1, 2]", list_str(layout)); }
  // the strides at::empty gives the permuted shape (a size-0 dim counts as 1), permuted back
  std::array<int64_t, 4> const order = {layout[0], layout[1], layout[2], 3};
  std::array<int64_t, 4> strides;
  int64_t stride = 1;
  for (int i = 3; i >= 0; --i) {
    strides[order[i]] = stride;
    stride *= std::max<int64_t>(shape[order[i]], 1);
  }
  at::Tensor out = at::empty_strided(shape, strides, grad.options());
  reduce_groups(grad, n_rep, dim, out);
  return out;
}

// The order of x's first three dims in memory, outermost first (repeat_kv.py's _layout_of): x's
// gradient is allocated in this order. Ties (size-1 dims, equal strides) keep the logical order.
// Symbolic strides (torch.compile, dynamic shapes) are compared through guards.
std::vector<int64_t> layout_of(at::Tensor const& x) {
  c10::SymIntArrayRef const strides = x.sym_strides();
  std::vector<int64_t> order = {0, 1, 2};
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
  return order;
}

// The ops called through the dispatcher from autograd (traced by torch.compile, differentiated
// again under create_graph).
at::Tensor call_repeat_kv(at::Tensor const& x, int64_t n_rep, int64_t dim) {
  static auto const op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flash_epilogue::repeat_kv", "")
                             .typed<at::Tensor(at::Tensor const&, int64_t, int64_t)>();
  return op.call(x, n_rep, dim);
}

at::Tensor call_repeat_kv_backward(at::Tensor const& grad, int64_t n_rep, int64_t dim, c10::IntArrayRef layout) {
  static auto const op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flash_epilogue::repeat_kv_backward", "")
                             .typed<at::Tensor(at::Tensor const&, int64_t, int64_t, c10::IntArrayRef)>();
  return op.call(grad, n_rep, dim, layout);
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// repeat_kv's backward is repeat_kv_backward into x's layout.
struct RepeatKvFunction : torch::autograd::Function<RepeatKvFunction> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor const& x, int64_t n_rep, int64_t dim) {
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      out = call_repeat_kv(x, n_rep, dim);  // checks x's rank before layout_of reads three strides
    }
    ctx->saved_data["n_rep"] = n_rep;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["layout"] = layout_of(x);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    int64_t const n_rep = ctx->saved_data["n_rep"].toInt(), dim = ctx->saved_data["dim"].toInt();
    std::vector<int64_t> const layout = ctx->saved_data["layout"].toIntVector();
    return {call_repeat_kv_backward(grads[0], n_rep, dim, layout), at::Tensor(), at::Tensor()};
  }
};

// The reduce is linear: its adjoint repeats each KV head's gradient n_rep times (double backward).
struct RepeatKvBackwardFunction : torch::autograd::Function<RepeatKvBackwardFunction> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor const& grad, int64_t n_rep, int64_t dim,
                            c10::IntArrayRef layout) {
    ctx->saved_data["n_rep"] = n_rep;
    ctx->saved_data["dim"] = dim;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_repeat_kv_backward(grad, n_rep, dim, layout);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {call_repeat_kv(grads[0], ctx->saved_data["n_rep"].toInt(), ctx->saved_data["dim"].toInt()), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

// Without a gradient to record (a first-order backward runs with grad mode off, also no_grad
// forwards) the op runs without an autograd node, as generated autograd kernels do: no node to
// allocate and fill on the backward's path (0.5 us of the op's 4 us on a tiny CPU tensor here).
bool records_grad(at::Tensor const& t) { return at::GradMode::is_enabled() && t.requires_grad(); }

at::Tensor repeat_kv_autograd(at::Tensor const& x, int64_t n_rep, int64_t dim) {
  if (!records_grad(x)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_repeat_kv(x, n_rep, dim);
  }
  return RepeatKvFunction::apply(x, n_rep, dim);
}

at::Tensor repeat_kv_backward_autograd(at::Tensor const& grad, int64_t n_rep, int64_t dim, c10::IntArrayRef layout) {
  if (!records_grad(grad)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_repeat_kv_backward(grad, n_rep, dim, layout);
  }
  return RepeatKvBackwardFunction::apply(grad, n_rep, dim, layout);
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
  m.def("repeat_kv(Tensor x, int n_rep, int dim) -> Tensor");
  m.def("repeat_kv_backward(Tensor grad, int n_rep, int dim, int[] layout) -> Tensor");
}

// One registration per backend: CUDA tensors run the kernels; CPU tensors get every metadata check
// and then the device check's message (instead of "could not run ... with arguments from the 'CPU'
// backend"), which also lets the CPU tests run the checks.
static void register_impls(torch::Library& m) {
  m.impl("store", &flash_epilogue::store_cuda);
  m.impl("store_zero", &flash_epilogue::store_zero_cuda);
  m.impl("gqa_accumulate", &flash_epilogue::gqa_accumulate_cuda);
  m.impl("gqa_postprocess", &flash_epilogue::gqa_postprocess_cuda);
  m.impl("gqa_accum_to_dense", &flash_epilogue::gqa_accum_to_dense_cuda);
  m.impl("gqa_reduce", &flash_epilogue::gqa_reduce_cuda);
}

TORCH_LIBRARY_IMPL(flash_epilogue, CUDA, m) { register_impls(m); }
TORCH_LIBRARY_IMPL(flash_epilogue, CPU, m) { register_impls(m); }

// repeat_kv's kernels are plain ATen calls plus gqa_reduce on a GPU with kernels: one kernel for
// every backend (the Python fake kernels serve Meta and FakeTensor), and autograd in C++.
TORCH_LIBRARY_IMPL(flash_epilogue, CompositeExplicitAutograd, m) {
  m.impl("repeat_kv", &flash_epilogue::repeat_kv_impl);
  m.impl("repeat_kv_backward", &flash_epilogue::repeat_kv_backward_impl);
}
TORCH_LIBRARY_IMPL(flash_epilogue, Autograd, m) {
  m.impl("repeat_kv", &flash_epilogue::repeat_kv_autograd);
  m.impl("repeat_kv_backward", &flash_epilogue::repeat_kv_backward_autograd);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_epilogue CUDA kernels; the ops are registered as torch.ops.flash_epilogue.*";
  m.def("compiled_archs", [] { return flash_epilogue::compiled_archs(); }, "GPU architectures this build has kernels for");
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
  // repeat_kv's routing, for tests and benchmarks (flash_epilogue/repeat_kv.py wraps them)
  m.def("_has_kernels_for", &flash_epilogue::has_kernels_for, "whether a build for these archs has kernels for a GPU "
        "of compute capability (major, minor)");
  m.def("_repeat_kv_kernel_device", &flash_epilogue::repeat_kv_kernel_device,
        "whether repeat_kv's backward can run gqa_reduce for tensors on this device");
  m.def("_repeat_kv_kernel_supports", &flash_epilogue::repeat_kv_kernel_supports,
        "whether repeat_kv's backward runs gqa_reduce on this gradient (heads in dim 1 or 2)");
  m.def(
      "_set_debug_sync", [](bool on) { flash_epilogue::debug_sync_enabled.store(on); },
      "FLASH_EPILOGUE_DEBUG for the C++ paths (repeat_kv's backward): synchronize after the launch");
  m.def(
      "_debug_sync", [] { return flash_epilogue::debug_sync_enabled.load(); },
      "whether the C++ paths synchronize after their launches (FLASH_EPILOGUE_DEBUG)");
  m.def(
      "_repeat_kv_record_paths",
      [](bool on) {
        std::lock_guard<std::mutex> lock(flash_epilogue::reduce_paths_mutex);
        flash_epilogue::reduce_paths.clear();
        flash_epilogue::record_reduce_paths.store(on);
      },
      "start (True) or stop recording the paths repeat_kv's backward takes; clears the record");
  m.def(
      "_repeat_kv_paths",
      [] {
        std::lock_guard<std::mutex> lock(flash_epilogue::reduce_paths_mutex);
        return flash_epilogue::reduce_paths;
      },
      "the paths recorded so far, in call order: 'kernel', 'kernel_copy' or 'reference'");
  m.def(
      "_repeat_kv_cpu_as_kernel_device", [](bool on) { flash_epilogue::cpu_as_kernel_device.store(on); },
      "test hook: CPU tensors take repeat_kv's kernel path, its gqa_reduce call through the dispatcher");
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
