// Every argument check of the ops. They run before anything reaches a kernel, in one order for
// every op: None tensors, dtypes, ranks, shapes and head dims, strides (last dim, then the others),
// alignment, overlaps (of a written tensor with itself, with another written one, with a read
// one), cu_seqlens/seqused metadata, grid limits and last the devices and the code path. The ops
// are also registered for CPU tensors, where every metadata check runs and the device check then
// says that a CUDA tensor is needed. Messages are built only on failure.

#include "checks.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <mutex>

#ifndef FLASH_EPILOGUE_COMPILED_ARCHS
#define FLASH_EPILOGUE_COMPILED_ARCHS "sm_90a"
#endif

namespace flash_epilogue {

std::vector<std::string> const& compiled_archs() {
  static std::vector<std::string> const archs = [] {
    std::vector<std::string> out(1);
    for (char c : std::string(FLASH_EPILOGUE_COMPILED_ARCHS)) {
      if (c == ',') {
        out.emplace_back();
      } else {
        out.back() += c;
      }
    }
    return out;
  }();
  return archs;
}

namespace {

using c10::ScalarType;

// ---- Messages. Numbers are formatted here, never by streaming them into TORCH_CHECK: on some
// toolchains (the H200 image: GCC 13 with -Bsymbolic-functions from Python's LDSHARED) an
// extension's own copy of ostream's integer insertion crashes. std::to_string has no locale.

std::string num(int64_t v) { return std::to_string(v); }

// As Python prints a tuple ((), (3,), (2, 3); '*' at index `star`) or, with `list`, a list.
std::string seq(c10::IntArrayRef v, int64_t star = -1, bool list = false) {
  std::string s = list ? "[" : "(";
  for (size_t i = 0; i < v.size(); ++i) {
    s += (i ? ", " : "") + (static_cast<int64_t>(i) == star ? std::string("'*'") : std::to_string(v[i]));
  }
  return s + (list ? "]" : v.size() == 1 ? ",)" : ")");
}
std::string num(c10::IntArrayRef v) { return seq(v); }

std::string hex_str(int64_t v) {  // as Python's f"{v:#x}"
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string repr(double v) {  // as Python's repr of a float: the shortest round trip
  std::array<char, 32> buf;
  return std::string(buf.data(), std::to_chars(buf.data(), buf.data() + buf.size(), v).ptr);
}

std::string message(char const* op, std::string const& arg, std::string const& expected, std::string const& got) {
  return "flash_epilogue." + std::string(op) + ": " + arg + ": expected " + expected + ", got " + got;
}

[[noreturn]] void fail(char const* op, std::string const& arg, std::string const& expected, std::string const& got) {
  C10_THROW_ERROR(ValueError, message(op, arg, expected, got));
}

std::string dtype_name(ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

[[noreturn]] void fail_dtype(char const* op, std::string const& name, std::string const& expected, ScalarType got) {
  C10_THROW_ERROR(TypeError, message(op, name + ": dtype", expected, dtype_name(got)));
}

// ---- The build, the GPU, the tile table

bool compiled_for(char const* arch) {
  auto const& archs = compiled_archs();
  return std::find(archs.begin(), archs.end(), arch) != archs.end();
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

int device_index(at::Device device) { return device.has_index() ? device.index() : c10::cuda::current_device(); }

// This build has kernels for an sm_90 GPU with sm_90a code, or an sm_8x GPU with sm_80 code.
bool has_kernels(int major, int minor) {
  return (major == 9 && minor == 0 && compiled_for("sm_90a")) || (major == 8 && compiled_for("sm_80"));
}

// The head dims the kernels take (a compiled config rounds up to the next compiled head dim), and
// what they index with 32-bit ints (the grid's y and z with 16 bits).
bool head_dim_supported(int64_t d) { return d > 0 && d % 8 == 0 && d <= 256; }
bool within_grid_limits(int64_t rows, int64_t heads, int64_t batch) {
  return rows < (int64_t(1) << 31) && heads < 65536 && batch < 65536;
}

// The compiled tile config serving head dims up to `width` (head_dim_supported) on path `arch`.
CompiledTileConfig const& tile_config(int64_t width, int arch) {
  for (CompiledTileConfig const& c : compiled_tile_configs()) {
    if (c.arch == arch && width <= c.head_dim) { return c; }
  }
  C10_THROW_ERROR(Error, "flash_epilogue: internal: no tile config for head dim " + num(width) + " on sm_" + num(arch));
}

// Batched: one tile row per (batch, ceil(rows / block_n) tiles). Varlen (rows = total tokens):
// batch_extent 1 and (rows + batch * block_n) // block_n tiles, enough for every sequence to start
// at its block_n-aligned offset ((cu_seqlens[b] + b * block_n) // block_n) * block_n.
AccumLayout accum_layout(int arch, bool varlen, int64_t batch, int64_t rows, int64_t heads_kv, int64_t d, int64_t dv) {
  CompiledTileConfig const& c = tile_config(std::max(d, dv), arch);
  int64_t const n = c.block_n;
  int64_t const tiles = varlen ? (rows + batch * n) / n : (rows + n - 1) / n;
  return {arch, c.block_n, varlen ? 1 : batch, heads_kv, tiles, c.accum_tile_elems};
}

// ---- Tensors

// A tensor argument and its name; t null: the argument is None.
struct Named {
  char const* name;
  at::Tensor const* t;
};
Named named(char const* name, OptTensor const& t) { return {name, t.has_value() ? &*t : nullptr}; }

// The schema lets None through for a Tensor argument as an undefined tensor.
void check_defined(char const* op, c10::ArrayRef<Named> tensors) {
  for (auto const& n : tensors) {
    if (!n.t->defined()) { C10_THROW_ERROR(TypeError, message(op, n.name, "a torch.Tensor", "NoneType")); }
  }
}

void check_float32(char const* op, Named n) {
  if (n.t->scalar_type() != at::kFloat) { fail_dtype(op, n.name, "torch.float32", n.t->scalar_type()); }
}

void check_half(char const* op, Named n) {
  if (n.t->scalar_type() != at::kHalf && n.t->scalar_type() != at::kBFloat16) {
    fail_dtype(op, n.name, "torch.float16 or torch.bfloat16", n.t->scalar_type());
  }
}

void check_same_dtype(char const* op, Named n, Named ref) {
  if (n.t && n.t->scalar_type() != ref.t->scalar_type()) {
    fail_dtype(op, n.name, dtype_name(ref.t->scalar_type()) + " (the dtype of " + ref.name + ")", n.t->scalar_type());
  }
}

std::string rank_got(at::Tensor const& t) { return num(t.dim()) + " dims, shape " + num(t.sizes()); }

void check_rank(char const* op, Named n, bool varlen) {
  if (n.t->dim() != (varlen ? 3 : 4)) {
    fail(op, std::string(n.name) + ": rank",
         varlen ? "3 dims (total_tokens, heads, headdim) because cu_seqlens is given"
                : "4 dims (batch, seqlen, heads, headdim) because cu_seqlens is None",
         rank_got(*n.t));
  }
}

void check_same_shape(char const* op, Named n, Named ref) {
  if (n.t->sizes() != ref.t->sizes()) {
    fail(op, std::string(n.name) + ": shape", num(ref.t->sizes()) + " (the shape of " + ref.name + ")",
         num(n.t->sizes()));
  }
}

// n has ref's shape but at dim (-1: the last dim, dv's own head dim; -2: the heads dim, h_k
// against h_q), where `which` names it.
void check_shape_but(char const* op, Named n, Named ref, int64_t dim, char const* which) {
  int64_t const star = ref.t->dim() + dim;
  bool same = n.t->dim() == ref.t->dim();
  for (int64_t i = 0; same && i < n.t->dim(); ++i) { same = i == star || n.t->size(i) == ref.t->size(i); }
  if (!same) {
    fail(op, std::string(n.name) + ": shape",
         seq(ref.t->sizes(), star) + " (" + ref.name + "'s shape but the " + which + " dim)", num(n.t->sizes()));
  }
}

void check_head_dim(char const* op, std::string const& name, int64_t d) {
  if (!head_dim_supported(d)) { fail(op, name + ": head dim", "a multiple of 8 in [8, 256]", num(d)); }
}

// v (dV's side) has k's shape but the head dim; both head dims supported.
void check_kv_shapes(char const* op, Named k, Named v) {
  check_shape_but(op, v, k, -1, "last");
  check_head_dim(op, k.name, k.t->size(-1));
  check_head_dim(op, v.name, v.t->size(-1));
}

// The last dim contiguous, then every other stride a non-negative multiple of 16 bytes (dims of
// size <= 1 ignored; an empty tensor touches no memory: the kernels return early).
void check_layouts(char const* op, c10::ArrayRef<Named> tensors) {
  for (auto const& n : tensors) {
    if (n.t->dim() > 0 && n.t->stride(-1) != 1) {
      fail(op, std::string(n.name) + ": stride(-1)", "1 (last dim contiguous)",
           num(n.t->stride(-1)) + " (strides " + num(n.t->strides()) + ")");
    }
  }
  for (auto const& n : tensors) {
    at::Tensor const& t = *n.t;
    int64_t const multiple = std::max<int64_t>(16 / t.element_size(), 1);
    for (int64_t i = 0; t.numel() > 0 && i + 1 < t.dim(); ++i) {
      if (t.size(i) > 1 && (t.stride(i) < 0 || t.stride(i) % multiple != 0)) {
        fail(op, std::string(n.name) + ": stride(" + num(i) + ")",
             "a non-negative multiple of " + num(multiple) + " elements (16 bytes)",
             num(t.stride(i)) + " (shape " + num(t.sizes()) + ", strides " + num(t.strides()) + ")");
      }
    }
  }
}

int64_t address(at::Tensor const& t) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.const_data_ptr())); }

void check_alignments(char const* op, c10::ArrayRef<Named> tensors) {
  for (auto const& n : tensors) {
    int64_t const ptr = n.t->numel() > 0 ? address(*n.t) : 0;
    if (ptr % 16 != 0) {
      fail(op, std::string(n.name) + ": data_ptr", "a 16-byte aligned address",
           hex_str(ptr) + " (address % 16 = " + num(ptr % 16) + ")");
    }
  }
}

void check_contiguous(char const* op, Named n) {
  at::Tensor const& t = *n.t;
  if (t.numel() == 0 || t.is_contiguous()) { return; }
  std::vector<int64_t> strides(t.dim());
  int64_t acc = 1;
  for (int64_t i = t.dim(); i-- > 0;) {
    strides[i] = acc;
    acc *= std::max<int64_t>(t.size(i), 1);
  }
  fail(op, std::string(n.name) + ": strides", num(strides) + " (contiguous)", num(t.strides()));
}

// ---- Overlaps

// No two elements of a written tensor at one address (an expanded output would race): its dims of
// size > 1 sorted by |stride|, each stride must exceed the farthest offset the smaller ones reach.
// Sufficient, as torch's own check of outputs.
void check_no_self_overlap(char const* op, Named n) {
  if (!n.t || n.t->numel() <= 1 || n.t->is_non_overlapping_and_dense()) { return; }
  at::Tensor const& t = *n.t;
  c10::SmallVector<std::pair<int64_t, int64_t>, 6> dims;  // (|stride|, size)
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (t.size(i) > 1) { dims.emplace_back(std::abs(t.stride(i)), t.size(i)); }
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;
  for (auto const& [stride, size] : dims) {
    if (stride <= reach) {
      fail(op, std::string(n.name) + ": memory",
           "no two elements at one address (no stride 0 or overlapping strides on a dim of size > 1)",
           "shape " + num(t.sizes()) + ", strides " + num(t.strides()));
    }
    reach += (size - 1) * stride;
  }
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
  for (auto it = terms.rbegin(); it != terms.rend(); ++it) {
    items.push_back({it->first, it->second[0], it->second[1]});
  }
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
  auto const range = [](at::Tensor const& x) {  // [first byte, past the last)
    int64_t extent = 1;
    for (int64_t i = 0; i < x.dim(); ++i) { extent += (x.size(i) - 1) * x.stride(i); }
    return std::array<int64_t, 2>{address(x), address(x) + extent * x.element_size()};
  };
  auto const [a0, a1] = range(*t.t);
  auto const [b0, b1] = range(*other.t);
  if (t.t->device() == other.t->device() && a0 < b1 && b0 < a1 && elements_coincide(*t.t, *other.t, b0 - a0)) {
    fail(op, std::string(t.name) + ": memory", std::string("no overlap with ") + other.name,
         "bytes [" + hex_str(a0) + ", " + hex_str(a1) + ") overlapping " + other.name + "'s [" + hex_str(b0) + ", " +
             hex_str(b1) + ")");
  }
}

// No written tensor shares an element with a read one.
void check_disjoint(char const* op, c10::ArrayRef<Named> written, c10::ArrayRef<Named> read) {
  for (auto const& w : written) {
    for (auto const& r : read) { check_no_overlap(op, w, r); }
  }
}

// No written tensor overlaps itself, another written one or a read one.
void check_no_overlaps(char const* op, c10::ArrayRef<Named> written, c10::ArrayRef<Named> read) {
  for (auto const& w : written) { check_no_self_overlap(op, w); }
  for (size_t i = 0; i < written.size(); ++i) {
    for (size_t j = 0; j < i; ++j) { check_no_overlap(op, written[i], written[j]); }
  }
  check_disjoint(op, written, read);
}

// ---- cu_seqlens, seqused and the other int32 vectors

// An int32, 1-D, contiguous tensor of `numel` elements (any number when numel < 0).
void check_index_tensor(char const* op, char const* name, at::Tensor const& t, int64_t numel,
                        std::string const& numel_why, char const* rank = "1 dim") {
  if (t.scalar_type() != at::kInt) { fail_dtype(op, name, "torch.int32", t.scalar_type()); }
  if (t.dim() != 1) { fail(op, std::string(name) + ": rank", rank, rank_got(t)); }
  if (t.numel() > 1 && t.stride(0) != 1) {
    fail(op, std::string(name) + ": stride(0)", "1 (contiguous)", num(t.stride(0)));
  }
  if (numel >= 0 && t.numel() != numel) {
    fail(op, std::string(name) + ": numel", num(numel) + " (" + numel_why + ")", num(t.numel()));
  }
}

struct Extents {
  int64_t batch, rows;
};

// Metadata of cu_seqlens/seqused and the problem's extents: the batch size (t's shape[0] in the
// batched layout; cu_seqlens.numel() - 1 >= 1 in varlen) and the rows (seqlen, or total tokens).
Extents check_seqlens(char const* op, OptTensor const& cu_seqlens, OptTensor const& seqused, Named t, bool varlen) {
  int64_t batch = t.t->size(0);
  if (varlen) {
    check_index_tensor(op, "cu_seqlens", *cu_seqlens, -1, "", "1 dim (batch + 1,)");
    if (cu_seqlens->numel() < 2) {
      fail(op, "cu_seqlens: numel", "batch + 1 >= 2 (at least one sequence)", num(cu_seqlens->numel()));
    }
    batch = cu_seqlens->numel() - 1;
  }
  if (seqused.has_value()) {
    check_index_tensor(
        op, "seqused", *seqused, batch,
        varlen ? std::string("batch = cu_seqlens.numel() - 1") : "batch = " + std::string(t.name) + ".shape[0]");
  }
  return {batch, t.t->size(varlen ? 0 : 1)};
}

// ---- Scalars

void check_arch_value(char const* op, char const* name, int64_t requested) {
  if (requested != 0 && requested != 80 && requested != 90) {
    fail(op, name, "0 (the device's path), 80 or 90", num(requested));
  }
}

// A double the kernels take as a float: inf and nan pass (they are fp32 values), a finite value
// outside fp32's range does not.
void check_scale(char const* op, char const* name, double v) {
  double const max = std::numeric_limits<float>::max();
  if (std::isfinite(v) && std::abs(v) > max) {
    fail(op, name, "a float in fp32's range (|scale| <= " + repr(max) + "; inf and nan pass)", repr(v));
  }
}

// ---- Devices and code paths

at::Device check_devices(char const* op, c10::ArrayRef<Named> tensors) {
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

// The code path an op runs: 90 on an sm_90 GPU (sm_90a kernels), 80 on an sm_8x GPU when the build
// has sm_80 code; `requested` = 80 forces the sm_80 path on an sm_90 GPU (a testing knob: the
// sm_80 collectives are compiled for every arch of the build). After check_devices.
int resolve_arch(char const* op, at::Device device, int64_t requested) {
  check_arch_value(op, "_arch", requested);
  auto const [major, minor] = device_capability(device.index());
  auto const capability = [major = major, minor = minor] { return "sm_" + num(major) + num(minor); };
  bool const sm90 = major == 9 && minor == 0;
  if (!has_kernels(major, minor)) {
    std::string archs;
    for (auto const& a : compiled_archs()) { archs += (archs.empty() ? "" : ", ") + a; }
    fail(op, "device", "a GPU of compute capability sm_90 (compiled for " + archs + ")",
         device.str() + " with compute capability " + capability());
  }
  if (requested == 90 && !sm90) {
    fail(op, "_arch", "0 or 80 on " + device.str() + " (compute capability " + capability() + ")", num(requested));
  }
  return sm90 && compiled_for("sm_90a") && requested != 80 ? 90 : 80;
}

// The path whose accumulator layout a GQA call expects, before the device checks: `requested`,
// else the device's own (80 on sm_8x, otherwise 90, also for a device the checks reject later).
int accum_path(at::Device device, int64_t requested) {
  if (requested != 0) { return static_cast<int>(requested); }
  return device.is_cuda() && device_capability(device_index(device)).first == 8 ? 80 : 90;
}

// The launch's extents once they are within the grid's limits (checked on `t`): rows, heads (the
// larger head count, h_q on the GQA side) and batch; the config serving head dims up to `width`.
Problem problem(char const* op, Named t, bool varlen, Extents e, int64_t heads, int64_t width) {
  if (!within_grid_limits(e.rows, heads, e.batch)) {
    fail(op, std::string(t.name) + ": shape", "rows < 2^31 and heads, batch < 65536", num(t.t->sizes()));
  }
  Problem p;
  p.varlen = varlen;
  p.rows = static_cast<int>(e.rows);
  p.heads = p.heads_q = static_cast<int>(heads);
  p.batch = static_cast<int>(e.batch);
  p.head_dim = tile_config(width, 90).head_dim;
  return p;
}

// The devices (last), then the code path: p, placed.
Problem place(Problem p, char const* op, c10::ArrayRef<Named> tensors, int64_t arch) {
  p.device = check_devices(op, tensors);
  p.arch = resolve_arch(op, p.device, arch);
  TORCH_CHECK(p.accum.block_n == 0 || p.arch == p.accum.arch, "flash_epilogue.", op, ": internal: arch paths disagree");
  return p;
}

// ---- GQA

void check_accum_rank(char const* op, Named n) {
  if (n.t->dim() != 4) {
    fail(op, std::string(n.name) + ": rank", "4 dims (batch_extent, heads_kv, num_tiles, tile_elems)", rank_got(*n.t));
  }
}

// The accumulators' layout for a problem on the path of `device` and `arch`; each of `accums` has
// its shape.
AccumLayout check_accum_shapes(char const* op, c10::ArrayRef<Named> accums, at::Device device, int64_t arch,
                               bool varlen, Extents e, int64_t heads_kv, int64_t d, int64_t dv) {
  AccumLayout const layout = accum_layout(accum_path(device, arch), varlen, e.batch, e.rows, heads_kv, d, dv);
  std::vector<int64_t> const expected = layout.shape();
  for (auto const& n : accums) {
    if (n.t->sizes() == c10::IntArrayRef(expected)) { continue; }
    std::string const what = varlen ? num(e.batch) + " sequences of " + num(e.rows) + " total tokens"
                                    : "batch " + num(e.batch) + ", seqlen " + num(e.rows);
    fail(op, std::string(n.name) + ": shape",
         num(expected) + " (the accumulator of " + what + ", " + num(heads_kv) + " KV heads, head dims (" + num(d) +
             ", " + num(dv) + ") on the sm_" + num(layout.arch) +
             " path: allocate it with flash_epilogue.gqa_accumulator)",
         num(n.t->sizes()));
  }
  return layout;
}

// h_k >= 1 and h_q a positive multiple of h_k (query head j belongs to KV head j // (h_q / h_k)).
void check_group(char const* op, char const* q_name, int64_t h_q, char const* kv_name, int64_t h_k,
                 char const* kv_src) {
  if (h_k < 1) {
    fail(op, std::string(kv_name) + ": heads", ">= 1 (" + std::string(kv_src) + ", the number of KV heads)", num(h_k));
  }
  if (h_q < 1 || h_q % h_k != 0) {
    fail(op, std::string(q_name) + ": heads",
         "a positive multiple of the " + num(h_k) + " KV heads (" + kv_src +
             "): every KV head serves h_q / h_k query heads",
         num(h_q) + " query heads (" + q_name + ".shape[-2])");
  }
}

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

}  // namespace

AccumLayout gqa_accum_layout(int64_t num_heads_kv, int64_t head_dim, int64_t head_dim_v, int64_t batch, int64_t rows,
                             bool varlen, int64_t arch, at::Device device) {
  constexpr char const* op = "gqa_accumulator";
  if (num_heads_kv < 1 || num_heads_kv > 65535) { fail(op, "num_heads_kv", "an int in [1, 65535]", num(num_heads_kv)); }
  check_head_dim(op, "head_dim", head_dim);
  check_head_dim(op, "head_dim_v", head_dim_v);
  if (batch < 0) { fail(op, "batch", "an int >= 0", num(batch)); }
  if (rows < 0) { fail(op, "rows", "an int >= 0", num(rows)); }
  if (batch >= 65536) { fail(op, "batch", "an int < 65536 (the kernels' grid limit)", num(batch)); }
  if (rows >= (int64_t(1) << 31)) { fail(op, "rows", "an int < 2^31 (the kernels' row index)", num(rows)); }
  check_arch_value(op, "arch", arch);
  int path = 90;
  try {
    path = accum_path(device, arch);
  } catch (c10::Error const&) {  // a device that cannot be queried: allocating on it says why
  }
  return accum_layout(path, varlen, batch, rows, num_heads_kv, head_dim, head_dim_v);
}

Problem check_store(at::Tensor const& dk_accum, at::Tensor const& dv_accum, at::Tensor const& dk, at::Tensor const& dv,
                    OptTensor const& cu_seqlens, OptTensor const& seqused, int64_t arch) {
  constexpr char const* op = "store";
  bool const varlen = cu_seqlens.has_value();
  Named const cu = named("cu_seqlens", cu_seqlens), used = named("seqused", seqused);
  Named const k_in{"dk_accum", &dk_accum}, v_in{"dv_accum", &dv_accum}, k{"dk", &dk}, v{"dv", &dv};
  Named const four[] = {k_in, v_in, k, v};
  check_defined(op, four);
  check_float32(op, k_in);
  check_float32(op, v_in);
  check_half(op, k);
  check_same_dtype(op, v, k);
  for (auto const& n : four) { check_rank(op, n, varlen); }
  check_same_shape(op, k_in, k);
  check_same_shape(op, v_in, v);
  check_kv_shapes(op, k, v);
  check_layouts(op, four);
  check_alignments(op, four);
  check_no_overlaps(op, {k, v}, {k_in, v_in});
  Extents const e = check_seqlens(op, cu_seqlens, seqused, k, varlen);
  check_disjoint(op, {k, v}, {cu, used});
  return place(problem(op, k, varlen, e, dk.size(-2), std::max(dk.size(-1), dv.size(-1))), op,
               {k_in, v_in, k, v, cu, used}, arch);
}

Problem check_store_zero(at::Tensor const& dk, at::Tensor const& dv, OptTensor const& cu_seqlens,
                         OptTensor const& seqused, OptTensor const& batch_idx, OptTensor const& head_idx,
                         int64_t row_start, std::optional<int64_t> row_end, int64_t arch) {
  constexpr char const* op = "store_zero";
  bool const varlen = cu_seqlens.has_value();
  Named const cu = named("cu_seqlens", cu_seqlens), used = named("seqused", seqused);
  Named const k{"dk", &dk}, v{"dv", &dv};
  check_defined(op, {k, v});
  check_half(op, k);
  check_same_dtype(op, v, k);
  check_rank(op, k, varlen);
  check_rank(op, v, varlen);
  check_kv_shapes(op, k, v);
  check_layouts(op, {k, v});
  check_alignments(op, {k, v});
  check_no_overlaps(op, {k, v}, {});
  Extents const e = check_seqlens(op, cu_seqlens, seqused, k, varlen);
  Named const selections[] = {named("batch_idx", batch_idx), named("head_idx", head_idx)};
  for (auto const& n : selections) {
    if (n.t) { check_index_tensor(op, n.name, *n.t, -1, ""); }
  }
  check_disjoint(op, {k, v}, {cu, used, selections[0], selections[1]});
  for (auto const& n : selections) {  // the kernel reads the selections with 16-bit grid dims
    if (n.t && n.t->numel() >= 65536) {
      fail(op, std::string(n.name) + ": numel", "fewer than 65536 entries", num(n.t->numel()));
    }
  }
  int64_t constexpr int_max = std::numeric_limits<int>::max();  // the kernel's row window is int
  if (row_start < 0 || row_start > int_max) { fail(op, "row_start", "an int in [0, 2147483647]", num(row_start)); }
  if (row_end.has_value() && (*row_end < row_start || *row_end > int_max)) {
    fail(op, "row_end", "None or an int in [row_start = " + num(row_start) + ", 2147483647]", num(*row_end));
  }
  return place(problem(op, k, varlen, e, dk.size(-2), std::max(dk.size(-1), dv.size(-1))), op,
               {k, v, cu, used, selections[0], selections[1]}, arch);
}

Problem check_gqa_accumulate(at::Tensor const& dk_partial, at::Tensor const& dv_partial, at::Tensor const& dk_accum,
                             at::Tensor const& dv_accum, OptTensor const& semaphores, OptTensor const& cu_seqlens,
                             OptTensor const& seqused, bool deterministic, int64_t arch) {
  constexpr char const* op = "gqa_accumulate";
  bool const varlen = cu_seqlens.has_value();
  Named const cu = named("cu_seqlens", cu_seqlens), used = named("seqused", seqused);
  Named const k{"dk_partial", &dk_partial}, v{"dv_partial", &dv_partial};
  Named const accums[] = {{"dk_accum", &dk_accum}, {"dv_accum", &dv_accum}}, four[] = {k, v, accums[0], accums[1]};
  check_defined(op, four);
  check_arch_value(op, "_arch", arch);
  for (auto const& n : four) { check_float32(op, n); }
  check_rank(op, k, varlen);
  check_rank(op, v, varlen);
  for (auto const& n : accums) { check_accum_rank(op, n); }
  check_kv_shapes(op, k, v);
  int64_t const h_q = dk_partial.size(-2), h_k = dk_accum.size(1);
  check_group(op, "dk_partial", h_q, "dk_accum", h_k, "dk_accum.shape[1]");
  Extents const e = check_seqlens(op, cu_seqlens, seqused, k, varlen);
  AccumLayout const layout = check_accum_shapes(op, accums, dk_partial.device(), arch, varlen, e, h_k,
                                                dk_partial.size(-1), dv_partial.size(-1));
  check_layouts(op, {k, v});
  for (auto const& n : accums) { check_contiguous(op, n); }
  check_alignments(op, four);
  int64_t const counters = layout.semaphore_numel();
  if (!semaphores.has_value() && deterministic) {
    fail(op, "semaphores",
         "an int32 tensor of >= " + num(counters) +
             " entries because deterministic=True (allocate the accumulator with "
             "flash_epilogue.gqa_accumulator(..., deterministic=True))",
         "None");
  }
  if (semaphores.has_value()) {
    check_index_tensor(op, "semaphores", *semaphores, -1, "");
    if (semaphores->numel() < counters) {
      fail(op, "semaphores: numel",
           ">= " + num(counters) + " (2 * batch_extent * num_tiles * heads_kv + 1 for accumulators of shape " +
               num(layout.shape()) + ")",
           num(semaphores->numel()));
    }
  }
  Named const sem = named("semaphores", semaphores);
  check_no_overlaps(op, {accums[0], accums[1], sem}, {k, v, cu, used});
  Problem p = problem(op, k, varlen, e, h_q, std::max(dk_partial.size(-1), dv_partial.size(-1)));
  p.heads = static_cast<int>(h_k);
  p.accum = layout;
  return place(p, op, {k, v, accums[0], accums[1], sem, cu, used}, arch);
}

Problem check_gqa_postprocess(at::Tensor const& dk_accum, at::Tensor const& dv_accum, at::Tensor const& dk,
                              at::Tensor const& dv, double scale_dk, double scale_dv, OptTensor const& cu_seqlens,
                              OptTensor const& seqused, int64_t arch) {
  constexpr char const* op = "gqa_postprocess";
  bool const varlen = cu_seqlens.has_value();
  Named const cu = named("cu_seqlens", cu_seqlens), used = named("seqused", seqused);
  Named const accums[] = {{"dk_accum", &dk_accum}, {"dv_accum", &dv_accum}}, k{"dk", &dk}, v{"dv", &dv};
  Named const four[] = {accums[0], accums[1], k, v};
  check_defined(op, four);
  check_scale(op, "scale_dk", scale_dk);
  check_scale(op, "scale_dv", scale_dv);
  check_arch_value(op, "_arch", arch);
  for (auto const& n : accums) { check_float32(op, n); }
  check_half(op, k);
  check_same_dtype(op, v, k);
  for (auto const& n : accums) { check_accum_rank(op, n); }
  check_rank(op, k, varlen);
  check_rank(op, v, varlen);
  check_kv_shapes(op, k, v);
  Extents const e = check_seqlens(op, cu_seqlens, seqused, k, varlen);
  AccumLayout const layout =
      check_accum_shapes(op, accums, dk.device(), arch, varlen, e, dk.size(-2), dk.size(-1), dv.size(-1));
  check_layouts(op, {k, v});
  for (auto const& n : accums) { check_contiguous(op, n); }
  check_alignments(op, four);
  check_no_overlaps(op, {k, v}, {accums[0], accums[1], cu, used});
  Problem p = problem(op, k, varlen, e, dk.size(-2), std::max(dk.size(-1), dv.size(-1)));
  p.accum = layout;
  return place(p, op, {accums[0], accums[1], k, v, cu, used}, arch);
}

Problem check_gqa_accum_to_dense(at::Tensor const& accum, at::Tensor const& out, int64_t head_dim,
                                 OptTensor const& cu_seqlens, OptTensor const& seqused, int64_t arch) {
  constexpr char const* op = "gqa_accum_to_dense";
  bool const varlen = cu_seqlens.has_value();
  Named const cu = named("cu_seqlens", cu_seqlens), used = named("seqused", seqused);
  Named const in{"accum", &accum}, dense{"out", &out};
  check_defined(op, {in, dense});
  check_arch_value(op, "_arch", arch);
  check_float32(op, in);
  check_float32(op, dense);
  check_accum_rank(op, in);
  check_rank(op, dense, varlen);
  check_head_dim(op, "head_dim", head_dim);
  int64_t const w = out.size(-1);
  check_head_dim(op, "out", w);
  if (w > head_dim) { fail(op, "out: head dim", "<= head_dim = " + num(head_dim), num(w)); }
  Extents const e = check_seqlens(op, cu_seqlens, seqused, dense, varlen);
  AccumLayout const layout =
      check_accum_shapes(op, {in}, out.device(), arch, varlen, e, out.size(-2), head_dim, head_dim);
  check_layouts(op, {dense});
  check_contiguous(op, in);
  check_alignments(op, {in, dense});
  check_no_overlaps(op, {dense}, {in, cu, used});
  Problem p = problem(op, dense, varlen, e, out.size(-2), head_dim);
  p.accum = layout;
  return place(p, op, {in, dense, cu, used}, arch);
}

Problem check_gqa_reduce(at::Tensor const& dk_partial, OptTensor const& dv_partial, at::Tensor const& dk,
                         OptTensor const& dv, OptTensor const& cu_seqlens, OptTensor const& seqused, double scale_dk,
                         double scale_dv, int64_t arch) {
  constexpr char const* op = "gqa_reduce";
  bool const varlen = cu_seqlens.has_value();
  Named const cu = named("cu_seqlens", cu_seqlens), used = named("seqused", seqused);
  bool const has_dv = dv_partial.has_value();
  // dv_partial and dv: null when not given
  Named const k_in{"dk_partial", &dk_partial}, v_in = named("dv_partial", dv_partial);
  Named const k{"dk", &dk}, v = named("dv", dv);
  check_defined(op, {k_in, k});
  if (!has_dv && dv.has_value()) { fail(op, "dv", "None because dv_partial is None", "Tensor"); }
  if (has_dv && !dv.has_value()) { fail(op, "dv", "a torch.Tensor because dv_partial is given", "NoneType"); }
  check_scale(op, "scale_dk", scale_dk);
  check_scale(op, "scale_dv", scale_dv);
  check_arch_value(op, "_arch", arch);
  check_half(op, k);
  check_same_dtype(op, v, k);
  if (dk_partial.scalar_type() != at::kFloat && dk_partial.scalar_type() != dk.scalar_type()) {
    fail_dtype(op, "dk_partial", "torch.float32 or " + dtype_name(dk.scalar_type()) + " (the dtype of dk)",
               dk_partial.scalar_type());
  }
  check_same_dtype(op, v_in, k_in);
  std::array<Named, 4> const given = {k_in, has_dv ? v_in : k, k, v};
  c10::ArrayRef<Named> const all(given.data(), has_dv ? 4 : 2);  // the tensors given, partials first
  for (auto const& n : all) { check_rank(op, n, varlen); }
  if (has_dv) { check_shape_but(op, v_in, k_in, -1, "last"); }
  check_shape_but(op, k, k_in, -2, "heads");
  if (has_dv) {
    check_shape_but(op, v, v_in, -2, "heads");
    check_shape_but(op, v, k, -1, "last");
  }
  check_head_dim(op, "dk", dk.size(-1));
  if (has_dv) { check_head_dim(op, "dv", dv->size(-1)); }
  int64_t const h_q = dk_partial.size(-2), h_k = dk.size(-2);
  check_group(op, "dk_partial", h_q, "dk", h_k, "dk.shape[-2]");
  check_layouts(op, all);
  check_alignments(op, all);
  check_no_overlaps(op, {k, v}, {k_in, v_in});
  Extents const e = check_seqlens(op, cu_seqlens, seqused, k_in, varlen);
  check_disjoint(op, {k, v}, {cu, used});
  Problem p = problem(op, k_in, varlen, e, h_q, std::max(dk.size(-1), has_dv ? dv->size(-1) : 0));
  p.heads = static_cast<int>(h_k);
  return place(p, op, {k_in, v_in, k, v, cu, used}, arch);
}

int64_t check_repeat_kv(at::Tensor const& x, int64_t n_rep, int64_t dim) {
  dim = check_repeat_kv_args("repeat_kv", "x", "kv_heads", x, n_rep, dim);
  if (x.size(dim) > std::numeric_limits<int64_t>::max() / n_rep) {
    fail("repeat_kv", "n_rep", "a positive int with x.shape[dim] * n_rep < 2^63", num(n_rep));
  }
  return dim;
}

int64_t check_repeat_kv_backward(at::Tensor const& grad, int64_t n_rep, int64_t dim, c10::IntArrayRef layout) {
  constexpr char const* op = "repeat_kv_backward";
  dim = check_repeat_kv_args(op, "grad", "heads", grad, n_rep, dim);
  if (grad.size(dim) % n_rep != 0) {
    fail(op, "grad: heads", "a multiple of n_rep = " + num(n_rep) + " in dim " + num(dim),
         num(grad.size(dim)) + " (shape " + num(grad.sizes()) + ")");
  }
  std::array<int64_t, 3> const dims = {0, 1, 2};
  if (layout.size() != 3 || !std::is_permutation(layout.begin(), layout.end(), dims.begin())) {
    fail(op, "layout", "a permutation of [0, 1, 2]", seq(layout, -1, true));
  }
  return dim;
}

bool gqa_reduce_takes(at::Tensor const& partial) {
  ScalarType const dtype = partial.scalar_type();
  if (!partial.is_cuda() || (dtype != at::kBFloat16 && dtype != at::kHalf)) { return false; }
  auto const [major, minor] = device_capability(partial.get_device());
  return head_dim_supported(partial.size(3)) && partial.numel() > 0 &&
         within_grid_limits(partial.size(1), partial.size(2), partial.size(0)) && has_kernels(major, minor);
}

bool gqa_reduce_reads_in_place(at::Tensor const& partial) {
  int64_t const multiple = 16 / partial.element_size();
  if (partial.size(3) > 1 && partial.stride(3) != 1) { return false; }
  for (int64_t i = 0; i < 3; ++i) {
    if (partial.size(i) > 1 && (partial.stride(i) < 0 || partial.stride(i) % multiple != 0)) { return false; }
  }
  return address(partial) % 16 == 0;
}

}  // namespace flash_epilogue
