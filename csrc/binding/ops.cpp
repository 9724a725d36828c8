// The ops' kernels: the mutating ops (every argument check, then one launch on the tensors' device and its current
// stream through the one (dtype, head dim, arch path) dispatch to csrc/instantiations/), their place in torch's
// in-place machinery, repeat_kv; last their registration.
// The checks, in one order for every op: None, dtypes, ranks, shapes and head dims, strides, alignment, overlaps (of a
// written tensor with itself, another written one, a read one), cu_seqlens/seqused, grid limits, last the devices (CPU
// tensors fail only there) and the code path. Messages are built on failure only.

#include "binding.h"
#include "static_switch.h"

#include <ATen/Context.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/SmallVector.h>
#include <c10/util/strides.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace flash_epilogue {

std::vector<std::string> const& compiled_archs() {
  static std::vector<std::string> const archs = [] {
    std::vector<std::string> out(1);  // from setup.py's comma-separated list
    for (char c : std::string_view(FLASH_EPILOGUE_COMPILED_ARCHS)) { c == ',' ? out.emplace_back() : out.back() += c; }
    return out;
  }();
  return archs;
}

namespace {

// Numbers are formatted here, never streamed (the extension's own ostream integer insertion crashes on the H200 image).
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

template <class... A>
std::string chars(A... a) {  // std::to_chars(a...) as a string
  std::array<char, 32> buf;
  return std::string(buf.data(), std::to_chars(buf.data(), buf.data() + buf.size(), a...).ptr);
}
std::string hex_str(int64_t v) { return "0x" + chars(static_cast<uint64_t>(v), 16); }  // Python's f"{v:#x}"
std::string repr(double v) { return chars(v); }  // Python's repr of a float: the shortest round trip
std::string dtype_name(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }
std::string rank_got(TensorArg t) { return num(t.dim()) + " dims, shape " + num(t.sizes()); }
int64_t address(TensorArg t) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.const_data_ptr())); }

bool compiled_for(char const* arch) { return std::count(compiled_archs().begin(), compiled_archs().end(), arch) > 0; }
bool has_kernels(int major, int minor) {  // an sm_90 GPU with sm_90a code, an sm_8x GPU with sm_80 code
  return (major == 9 && minor == 0 && compiled_for("sm_90a")) || (major == 8 && compiled_for("sm_80"));
}

std::pair<int, int> device_capability(int device) {  // (major, minor), read once per device
  static std::mutex mutex;
  static std::map<int, std::pair<int, int>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto const it = cache.find(device); it != cache.end()) { return it->second; }
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return cache[device] = {major, minor};
}

// The head dims the kernels take (a config serves those up to its own); rows are 32-bit, grid y and z 16-bit.
bool head_dim_supported(int64_t d) { return d > 0 && d % 8 == 0 && d <= 256; }
bool within_grid_limits(int64_t rows, int64_t heads, int64_t batch) {
  return rows < (int64_t(1) << 31) && heads < 65536 && batch < 65536;
}

// The tile serving head dims up to width: the smallest tile head dim >= width, as FA3 picks it (it fixes the GQA
// accumulator's order), whether or not this build has it (FLASH_EPILOGUE_HEAD_DIMS may leave it out).
int64_t serving_head_dim(int64_t width) {
  for (int64_t hd : {FLASH_EPILOGUE_ALL_HEAD_DIMS}) {
    if (width <= hd) { return hd; }
  }
  return 0;
}
bool head_dim_built(int64_t d) {
  return std::count(std::begin(kFlashEpilogueHeadDims), std::end(kFlashEpilogueHeadDims), serving_head_dim(d)) > 0;
}

CompiledTileConfig const& tile_config(int64_t width, int arch) {  // the one serving head dims up to width
  for (CompiledTileConfig const& c : compiled_tile_configs()) {
    if (c.arch == arch && c.head_dim == serving_head_dim(width)) { return c; }
  }
  C10_THROW_ERROR(Error, "flash_epilogue: internal: no tile config for head dim " + num(width) + " on sm_" + num(arch));
}

// Row tiles of n rows per (batch extent, head). Batched: ceil(rows / n) per sequence. Varlen (rows: total tokens):
// batch_extent 1 and (rows + batch * n) // n tiles, so that sequence b starts at ((cu_seqlens[b] + b * n) // n).
int64_t tiles_per_head(bool varlen, int64_t batch, int64_t rows, int64_t n) {
  return varlen ? (rows + batch * n) / n : (rows + n - 1) / n;
}

// The head dim of the tile dV runs on: that serving max(d, dv), except on sm_90 for a dv of at most 128 beside a d
// served by head dim 256 in a problem of at least 512 of those 80-row tiles (about four per SM): their 256 columns
// would leave half of each stage and accumulator tile idle on dV's, so dV runs in launches of its own on the tile
// compiled for dv (gqa_reduce) and has an accumulator of that tile (gqa_accumulate, gqa_postprocess). In smaller
// problems the second launch costs more than it saves (measured in docs/design.md). The bits are the same either way.
int64_t dv_tile_head_dim(int arch, bool varlen, int64_t batch, int64_t rows, int64_t heads, int64_t d, int64_t dv) {
  int64_t const shared = serving_head_dim(std::max(d, dv)), own = serving_head_dim(dv);
  if (arch < 90 || shared != 256 || own > 128 || !head_dim_built(dv)) { return shared; }
  int64_t const dk_tiles = tiles_per_head(varlen, batch, rows, tile_config(shared, arch).block_n) * heads;
  return dk_tiles * (varlen ? 1 : batch) >= 512 ? own : shared;
}

// dK's accumulator takes the tile of the config serving max(d, dv), dV's that of dv_tile_head_dim; each of the slabs
// covering its own head dim.
AccumLayout accum_layout(int arch, bool varlen, int64_t batch, int64_t rows, int64_t heads_kv, int64_t d, int64_t dv) {
  auto const tiles = [&](int64_t width, int64_t tile_width) {
    CompiledTileConfig const& c = tile_config(tile_width, arch);
    return AccumLayout::Tiles{c.head_dim, c.block_n, tiles_per_head(varlen, batch, rows, c.block_n),
                              c.accum_tile_elems_for(static_cast<int>(width))};
  };
  int64_t const dv_tile = dv_tile_head_dim(arch, varlen, batch, rows, heads_kv, d, dv);
  return {arch, varlen ? 1 : batch, heads_kv, {tiles(d, std::max(d, dv)), tiles(dv, dv_tile)}};
}

// The path of a GQA call's accumulators, before the device checks: `requested`, else the device's (sm_8x: 80, else 90)
int accum_path(at::Device device, int64_t requested) {
  if (requested != 0) { return static_cast<int>(requested); }
  if (!device.is_cuda()) { return 90; }
  return device_capability(device.has_index() ? device.index() : c10::cuda::current_device()).first == 8 ? 80 : 90;
}

int64_t floor_div(int64_t a, int64_t b) { return a / b - (a % b < 0); }  // Python's a // b (b > 0)

// Whether an element of `t` and one of `other` (starting delta_bytes after t) share memory: exact for equal element
// sizes (a bounded search over the strides tells packed dk = kv[:, :, 0], dv = kv[:, :, 1] apart), else true.
bool elements_coincide(TensorArg t, TensorArg other, int64_t delta_bytes) {
  int64_t const size = t.element_size();
  if (other.element_size() != size || delta_bytes % size != 0) { return true; }
  // sum over dims of x_d * stride_d == delta, x_d in [0, n-1] for t and [-(n-1), 0] for other
  std::map<int64_t, std::array<int64_t, 2>> terms;  // |stride| -> (lo, hi)
  for (auto const& [x, sign] : {std::pair{&t, 1}, std::pair{&other, -1}}) {
    for (int64_t d = 0; d < x->dim(); ++d) {
      int64_t const n = x->size(d), s = x->stride(d), reach = (n - 1) * ((sign > 0) == (s > 0) ? 1 : -1);
      if (n > 1 && s != 0) { terms[std::abs(s)][reach < 0 ? 0 : 1] += reach; }
    }
  }
  // from the smallest stride: (stride, lo, hi, least and most offset of it and the smaller ones); first a zero sentinel
  std::vector<std::array<int64_t, 5>> items(1);
  int64_t least = 0, most = 0;
  for (auto const& [s, r] : terms) { items.push_back({s, r[0], r[1], least += r[0] * s, most += r[1] * s}); }
  int64_t budget = 100000;
  auto reachable = [&](auto&& self, size_t k, int64_t rem) -> bool {  // largest stride first
    if (k == 0) { return rem == 0; }
    if (--budget < 0) { return true; }  // too many candidates to rule out: assume they coincide
    int64_t const s = items[k][0], lo = items[k][1], hi = items[k][2];
    int64_t const first = std::max(lo, -floor_div(items[k - 1][4] - rem, s));
    int64_t const last = std::min(hi, floor_div(rem - items[k - 1][3], s));
    for (int64_t x = first; x <= last; ++x) {
      if (self(self, k - 1, rem - x * s)) { return true; }
    }
    return false;
  };
  return reachable(reachable, items.size() - 1, delta_bytes / size);
}

struct Named {  // a tensor argument and its name; t null: None
  char const* name;
  at::Tensor const* t;
  at::Tensor const* operator->() const { return t; }
};
Named named(char const* name, OptArg t) { return {name, t.has_value() ? &*t : nullptr}; }
using Names = c10::ArrayRef<Named>;

struct Problem {  // what an op launches for once its arguments passed
  char const* op = nullptr;
  bool varlen = false;
  int rows = 0, heads = 0, heads_q = 0, batch = 0;  // heads: of dk/dv (h_k on the GQA side)
  int head_dim = 0;                                 // the compiled config serving the head dims
  AccumLayout accum;                                // the GQA ops' accumulators
  at::Device device = at::kCPU;
  int arch = 90;  // the code path: 90 (sm_90, TMA) or 80 (sm_80 collectives)
};

struct Checker {
  char const* op;
  Named cu, used;               // cu_seqlens, seqused
  bool varlen;                  // cu_seqlens given
  int64_t arch;                 // the requested code path (_arch)
  int64_t batch = 0, rows = 0;  // seqlens()'s: sequences, rows (seqlen or total tokens)
  explicit Checker(char const* op, OptArg cu_seqlens = {}, OptArg seqused = {}, int64_t arch = 0)
      : op(op), cu(named("cu_seqlens", cu_seqlens)), used(named("seqused", seqused)), varlen(cu.t), arch(arch) {}
  [[noreturn]] void fail(std::string const& arg, std::string const& expected, std::string const& got,
                         bool type_error = false) const {
    std::string const m = "flash_epilogue." + std::string(op) + ": " + arg + ": expected " + expected + ", got " + got;
    if (type_error) { C10_THROW_ERROR(TypeError, m); }
    C10_THROW_ERROR(ValueError, m);
  }
  [[noreturn]] void fail(Named n, char const* what, std::string const& expected, std::string const& got) const {
    fail(std::string(n.name) + ": " + what, expected, got);
  }
  [[noreturn]] void fail_dtype(Named n, std::string const& expected) const {
    fail(std::string(n.name) + ": dtype", expected, dtype_name(n->scalar_type()), true);
  }
  void defined(Names ts) const {  // the schema passes None for a Tensor as an undefined tensor
    for (auto const& n : ts) {
      if (!n->defined()) { fail(n.name, "a torch.Tensor", "NoneType", true); }
    }
  }
  void float32(Names ts) const {
    for (auto const& n : ts) {
      if (n->scalar_type() != at::kFloat) { fail_dtype(n, "torch.float32"); }
    }
  }
  void half(Named k, Named v) const {  // k 16-bit, v (when given) of k's dtype
    if (k->scalar_type() != at::kHalf && k->scalar_type() != at::kBFloat16) {
      fail_dtype(k, "torch.float16 or torch.bfloat16");
    }
    same_dtype(v, k);
  }
  void same_dtype(Named n, Named ref) const {
    if (n.t && n->scalar_type() != ref->scalar_type()) {
      fail_dtype(n, dtype_name(ref->scalar_type()) + " (the dtype of " + ref.name + ")");
    }
  }
  void ranks(Names ts, bool accum = false) const {  // accum: the GQA accumulators' 4 dims
    for (auto const& n : ts) {
      if (n->dim() == (accum || !varlen ? 4 : 3)) { continue; }
      fail(n, "rank",
           accum    ? "4 dims (batch_extent, heads_kv, num_tiles, tile_elems)"
           : varlen ? "3 dims (total_tokens, heads, headdim) because cu_seqlens is given"
                    : "4 dims (batch, seqlen, heads, headdim) because cu_seqlens is None",
           rank_got(*n.t));
    }
  }
  // n (None: no check) has ref's shape but at dim (-1: the head dim; -2: the heads, h_k against h_q), named `which`
  void shape_but(Named n, Named ref, int64_t dim, char const* which) const {
    if (!n.t) { return; }
    int64_t const star = ref->dim() + dim;
    bool same = n->dim() == ref->dim();
    for (int64_t i = 0; same && i < n->dim(); ++i) { same = i == star || n->size(i) == ref->size(i); }
    if (!same) {
      fail(n, "shape", seq(ref->sizes(), star) + " (" + ref.name + "'s shape but the " + which + " dim)",
           num(n->sizes()));
    }
  }
  void head_dim(char const* name, int64_t d) const {
    if (!head_dim_supported(d)) { fail(std::string(name) + ": head dim", "a multiple of 8 in [8, 256]", num(d)); }
    if (head_dim_built(d)) { return; }
    std::string built;  // "64;128": this build's, as FLASH_EPILOGUE_HEAD_DIMS spells them
    for (int hd : kFlashEpilogueHeadDims) { built += (built.empty() ? "" : ";") + std::to_string(hd); }
    fail(std::string(name) + ": head dim",
         "a head dim this build has kernels for: " + num(d) + " runs on the tile of head dim " +
             num(serving_head_dim(d)) + ", which this build leaves out (FLASH_EPILOGUE_HEAD_DIMS=" + built +
             "); rebuild with it in FLASH_EPILOGUE_HEAD_DIMS",
         num(d));
  }
  void kv_shapes(Named k, Named v) const {  // v (or None) has k's shape but the head dim; the head dims supported
    shape_but(v, k, -1, "last");
    head_dim(k.name, k->size(-1));
    if (v.t) { head_dim(v.name, v->size(-1)); }
  }
  // h_k >= 1 and h_q a positive multiple of h_k (query head j belongs to KV head j // (h_q / h_k))
  void group(int64_t h_q, char const* kv_name, int64_t h_k, char const* kv_src) const {
    if (h_k < 1) {
      fail(std::string(kv_name) + ": heads", ">= 1 (" + std::string(kv_src) + ", the number of KV heads)", num(h_k));
    }
    if (h_q < 1 || h_q % h_k != 0) {
      fail("dk_partial: heads",
           "a positive multiple of the " + num(h_k) + " KV heads (" + kv_src +
               "): every KV head serves h_q / h_k query heads",
           num(h_q) + " query heads (dk_partial.shape[-2])");
    }
  }

  // The last dim contiguous, then every other stride a non-negative multiple of 16 bytes (dims of size <= 1 ignored;
  // an empty tensor touches no memory: the kernels return early).
  void layouts(Names ts) const {
    for (auto const& n : ts) {
      if (n->dim() > 0 && n->stride(-1) != 1) {
        fail(n, "stride(-1)", "1 (last dim contiguous)", num(n->stride(-1)) + " (strides " + num(n->strides()) + ")");
      }
    }
    for (auto const& n : ts) {
      int64_t const multiple = std::max<int64_t>(16 / n->element_size(), 1);
      for (int64_t i = 0; n->numel() > 0 && i + 1 < n->dim(); ++i) {
        if (n->size(i) > 1 && (n->stride(i) < 0 || n->stride(i) % multiple != 0)) {
          fail(std::string(n.name) + ": stride(" + num(i) + ")",
               "a non-negative multiple of " + num(multiple) + " elements (16 bytes)",
               num(n->stride(i)) + " (shape " + num(n->sizes()) + ", strides " + num(n->strides()) + ")");
        }
      }
    }
  }
  void alignments(Names ts) const {
    for (auto const& n : ts) {
      int64_t const ptr = n->numel() > 0 ? address(*n.t) : 0;
      if (ptr % 16 != 0) {
        fail(n, "data_ptr", "a 16-byte aligned address", hex_str(ptr) + " (address % 16 = " + num(ptr % 16) + ")");
      }
    }
  }
  void contiguous(Names ts) const {
    for (auto const& n : ts) {
      if (n->numel() == 0 || n->is_contiguous()) { continue; }
      fail(n, "strides", num(c10::contiguous_strides(n->sizes())) + " (contiguous)", num(n->strides()));
    }
  }

  // No two elements of a written tensor at one address: its dims of size > 1 sorted by |stride|, each stride must
  // exceed the farthest offset the smaller ones reach (sufficient, as torch's check of outputs).
  void no_self_overlap(Named n) const {
    if (!n.t || n->numel() <= 1 || n->is_non_overlapping_and_dense()) { return; }
    c10::SmallVector<std::pair<int64_t, int64_t>, 6> dims;  // (|stride|, size)
    for (int64_t i = 0; i < n->dim(); ++i) {
      if (n->size(i) > 1) { dims.emplace_back(std::abs(n->stride(i)), n->size(i)); }
    }
    std::sort(dims.begin(), dims.end());
    int64_t reach = 0;
    for (auto const& [stride, size] : dims) {
      if (stride <= reach) {
        fail(n, "memory", "no two elements at one address (no stride 0 or overlapping strides on a dim of size > 1)",
             "shape " + num(n->sizes()) + ", strides " + num(n->strides()));
      }
      reach += (size - 1) * stride;
    }
  }
  void no_overlap(Named t, Named other) const {  // t (written) shares no element with other
    if (!t.t || !other.t || t->numel() == 0 || other->numel() == 0) { return; }
    auto const range = [](at::Tensor const& x) {  // [first byte, past the last)
      int64_t extent = 1;
      for (int64_t i = 0; i < x.dim(); ++i) { extent += (x.size(i) - 1) * x.stride(i); }
      return std::array<int64_t, 2>{address(x), address(x) + extent * x.element_size()};
    };
    auto const [a0, a1] = range(*t.t);
    auto const [b0, b1] = range(*other.t);
    if (t->device() == other->device() && a0 < b1 && b0 < a1 && elements_coincide(*t.t, *other.t, b0 - a0)) {
      fail(t, "memory", std::string("no overlap with ") + other.name,
           "bytes [" + hex_str(a0) + ", " + hex_str(a1) + ") overlapping " + other.name + "'s [" + hex_str(b0) + ", " +
               hex_str(b1) + ")");
    }
  }
  void disjoint(Names written, Names read) const {
    for (auto const& w : written) {
      for (auto const& r : read) { no_overlap(w, r); }
    }
  }
  void no_overlaps(Names written, Names read) const {  // with itself, another written one, a read one
    for (auto const& w : written) { no_self_overlap(w); }
    for (size_t i = 0; i < written.size(); ++i) {
      for (size_t j = 0; j < i; ++j) { no_overlap(written[i], written[j]); }
    }
    disjoint(written, read);
  }
  void written_pair(Names all, Named k, Named v, Names read, Named t) {  // k, v written; seqlens(t)
    layouts(all);
    alignments(all);
    no_overlaps({k, v}, read);
    seqlens(t);
  }
  void index_tensor(Named n, char const* rank = "1 dim") const {  // None, or int32, 1-D, contiguous
    if (!n.t) { return; }
    if (n->scalar_type() != at::kInt) { fail_dtype(n, "torch.int32"); }
    if (n->dim() != 1) { fail(n, "rank", rank, rank_got(*n.t)); }
    if (n->numel() > 1 && n->stride(0) != 1) { fail(n, "stride(0)", "1 (contiguous)", num(n->stride(0))); }
  }
  // cu_seqlens/seqused; the batch (t.shape[0], varlen: cu_seqlens.numel() - 1) and rows (seqlen or total tokens)
  void seqlens(Named t) {
    batch = t->size(0);
    if (varlen) {
      index_tensor(cu, "1 dim (batch + 1,)");
      if (cu->numel() < 2) { fail(cu, "numel", "batch + 1 >= 2 (at least one sequence)", num(cu->numel())); }
      batch = cu->numel() - 1;
    }
    index_tensor(used);
    if (used.t && used->numel() != batch) {
      std::string const src = varlen ? "cu_seqlens.numel() - 1" : std::string(t.name) + ".shape[0]";
      fail(used, "numel", num(batch) + " (batch = " + src + ")", num(used->numel()));
    }
    rows = t->size(varlen ? 0 : 1);
  }
  void arch_value(int64_t requested, char const* name = "_arch") const {
    if (requested != 0 && requested != 80 && requested != 90) {
      fail(name, "0 (the device's path), 80 or 90", num(requested));
    }
  }
  void scalars(double scale_dk, double scale_dv) const {  // scales as floats: inf and nan pass
    double const max = std::numeric_limits<float>::max();
    for (auto const& [name, v] : {std::pair{"scale_dk", scale_dk}, std::pair{"scale_dv", scale_dv}}) {
      if (std::isfinite(v) && std::abs(v) > max) {
        fail(name, "a float in fp32's range (|scale| <= " + repr(max) + "; inf and nan pass)", repr(v));
      }
    }
    arch_value(arch);
  }
  // One CUDA device for every tensor, the first CUDA tensor's: one elsewhere (CPU, another GPU) names both devices.
  // (Meta tensors among CUDA ones reach the fake kernels, which refuse them the same way.)
  at::Device devices(Names ts) const {
    Named const* ref = nullptr;
    for (auto const& n : ts) { ref = ref || !n.t || !n->is_cuda() ? ref : &n; }
    for (auto const& n : ts) {
      if (n.t && ref == nullptr) { fail(n, "device", "a CUDA tensor", "a tensor on " + n->device().str()); }
      if (n.t && n->device() != (*ref)->device()) {
        fail(n, "device", (*ref)->device().str() + " (the device of " + ref->name + ")", n->device().str());
      }
    }
    return (*ref)->device();
  }
  // The code path: 90 on an sm_90 GPU (sm_90a kernels), 80 on an sm_8x GPU when the build has sm_80 code;
  // `requested` = 80 forces the sm_80 path on an sm_90 GPU (a testing knob). After devices().
  int resolve_arch(at::Device device, int64_t requested) const {
    arch_value(requested);
    auto const [major, minor] = device_capability(device.index());
    auto const capability = [major = major, minor = minor] { return "sm_" + num(major) + num(minor); };
    bool const sm90 = major == 9 && minor == 0;
    if (!has_kernels(major, minor)) {
      std::string archs;
      for (auto const& a : compiled_archs()) { archs += (archs.empty() ? "" : ", ") + a; }
      fail("device", "a GPU of compute capability sm_90 (compiled for " + archs + ")",
           device.str() + " with compute capability " + capability());
    }
    if (requested == 90 && !sm90) {
      fail("_arch", "0 or 80 on " + device.str() + " (compute capability " + capability() + ")", num(requested));
    }
    return sm90 && compiled_for("sm_90a") && requested != 80 ? 90 : 80;
  }
  // seqlens(t), the accumulators' layout on the path of t's device (accums[i] of shape(i): dK's of head dim d,
  // dV's of dv), strides, alignment
  AccumLayout accum_side(Named t, Names written, Names accums, Names aligned, int64_t heads_kv, int64_t d, int64_t dv) {
    seqlens(t);
    AccumLayout const layout = accum_layout(accum_path(t->device(), arch), varlen, batch, rows, heads_kv, d, dv);
    for (int i = 0; i < static_cast<int>(accums.size()); ++i) {
      Named const n = accums[i];
      std::vector<int64_t> const shape = layout.shape(i);
      if (n->sizes() == c10::IntArrayRef(shape)) { continue; }
      std::string const what = varlen ? num(batch) + " sequences of " + num(rows) + " total tokens"
                                      : "batch " + num(batch) + ", seqlen " + num(rows);
      fail(n, "shape",
           num(shape) + " (the accumulator of " + what + ", " + num(heads_kv) + " KV heads and head dim " +
               num(i ? dv : d) + " in the tile of head dim " + num(layout.tiles[i].head_dim) + " on the sm_" +
               num(layout.arch) + " path: allocate it with flash_epilogue.gqa_accumulator)",
           num(n->sizes()));
    }
    layouts(written);
    contiguous(accums);
    alignments(aligned);
    return layout;
  }
  // The launch: grid limits (on t), tile config, devices, code path; heads: h_q on the GQA side, heads_kv: dk/dv's
  Problem finish(Named t, int64_t heads, int64_t width, Names ts, int64_t heads_kv = 0,
                 AccumLayout const& accum = {}) const {
    if (!within_grid_limits(rows, heads, batch)) {
      fail(t, "shape", "rows < 2^31 and heads, batch < 65536", num(t->sizes()));
    }
    auto const i32 = [](int64_t v) { return static_cast<int>(v); };
    int const hd = tile_config(width, 90).head_dim;
    Problem p{op, varlen, i32(rows), i32(heads_kv ? heads_kv : heads), i32(heads), i32(batch), hd, accum, devices(ts)};
    p.arch = resolve_arch(p.device, arch);
    TORCH_CHECK(!accum.tiles[0].block_n || p.arch == accum.arch, "flash_epilogue.", op,
                ": internal: arch paths disagree");
    return p;
  }
};

// (rows, d, heads, batch) view of a batched (batch, seqlen, heads, d) or varlen (total, heads, d) tensor. TMA needs
// a 16-byte multiple also as the stride of a size-1 dim (torch's is arbitrary): the tensor's largest extent.
TensorDesc describe(TensorArg t, bool varlen) {
  int64_t span = t.size(-1);
  for (int i = 0; i + 1 < t.dim(); ++i) {
    if (t.size(i) > 1) { span = std::max(span, t.stride(i) * t.size(i)); }
  }
  int const elems_per_16b = 16 / static_cast<int>(t.element_size());
  span = (span + elems_per_16b - 1) / elems_per_16b * elems_per_16b;
  auto const stride_of = [&](int dim) { return t.size(dim) > 1 ? t.stride(dim) : span; };
  return {t.data_ptr(), stride_of(varlen ? 0 : 1), stride_of(varlen ? 1 : 2), varlen ? span : stride_of(0),
          static_cast<int>(t.size(-1))};
}

AccumDesc accum_desc(TensorArg t) {  // t: of the checked shape
  return {t.data_ptr<float>(), t.stride(1), t.stride(0), static_cast<int>(t.size(2)), static_cast<int>(t.size(3))};
}

// Of a launch's arguments, those it has of: extents, heads, cu_seqlens/seqused, the outputs dk/dv (dv null: dK only).
template <class Args>
Args args_for(Problem const& p, OptArg cu_seqlens, OptArg seqused, at::Tensor const* dk = nullptr,
              at::Tensor const* dv = nullptr) {
  Args args;
  args.rows = p.rows;
  args.batch = p.batch;
  args.cu_seqlens = p.varlen ? cu_seqlens->const_data_ptr<int>() : nullptr;
  args.seqused = seqused.has_value() ? seqused->const_data_ptr<int>() : nullptr;
  auto const has_heads = [](auto& a) -> decltype((void)a.num_heads) {};  // C++17 member tests; else num_heads_kv
  auto const has_heads_q = [](auto& a) -> decltype((void)a.num_heads_q) {};
  auto const has_dk = [](auto& a) -> decltype((void)a.dk) {};
  if constexpr (std::is_invocable_v<decltype(has_heads), Args&>) { args.num_heads = p.heads; }
  if constexpr (!std::is_invocable_v<decltype(has_heads), Args&>) { args.num_heads_kv = p.heads; }
  if constexpr (std::is_invocable_v<decltype(has_heads_q), Args&>) { args.num_heads_q = p.heads_q; }
  if constexpr (std::is_invocable_v<decltype(has_dk), Args&>) {
    args.dk = describe(*dk, p.varlen);
    if (dv != nullptr) { args.dv = describe(*dv, p.varlen); }
  }
  return args;
}

// Once per host thread and device: a thread without a CUDA runtime call has no current context (c10's guard skips
// cudaSetDevice for a matching index), and encoding the TMA descriptors there crashes (docs/design.md).
void bind_primary_context(int device) {
  thread_local uint64_t bound = 0;  // bit d: device d bound
  uint64_t const bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (bound & bit) != 0) { return; }
  C10_CUDA_CHECK(cudaSetDevice(device));
  bound |= bit;
}

// The one dispatch: fn(kDType, kHeadDim, kArch), std::integral_constants of the outputs' dtype (ignored on the
// accumulator side), the compiled head dim and the code path, gives the launch. One the kernel refuses: RuntimeError.
template <class Args, class Fn>
void launch(Problem const& p, at::ScalarType dtype, Args const& args, Fn fn) {
  c10::cuda::CUDAGuard const guard(p.device);
  bind_primary_context(p.device.index());
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream(p.device.index()).stream();
  char const* const why = BOOL_SWITCH(dtype == at::kBFloat16, kBF16, [&] {
    return ARCH_SWITCH(p.arch, kArch, [&] {
      return HEADDIM_SWITCH(p.head_dim, kHeadDim, [&] {
        using DType = std::integral_constant<OutputDType, kBF16 ? OutputDType::kBFloat16 : OutputDType::kFloat16>;
        return fn(DType{}, std::integral_constant<int, kHeadDim>{}, std::integral_constant<int, kArch>{})(args, stream);
      });
    });
  });
  TORCH_CHECK(why == nullptr, "flash_epilogue.", p.op, ": arguments rejected by the kernel: ", why);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// launch(), or where dV runs on a tile of its own (dv_head_dim, from dv_tile_head_dim, not p's): dK's half on p's tile,
// then dV's in a launch of its own on its tile. `fields`: the Args' (dK's, dV's) member pairs, dV's moved into dK's.
template <class Args, class Fn, class... Fields>
void launch_per_tile(Problem const& p, int64_t dv_head_dim, at::ScalarType dtype, Args args, Fn fn, Fields... fields) {
  if (dv_head_dim == p.head_dim) { return launch(p, dtype, args, fn); }
  Args dv_only = args;
  ((dv_only.*fields.first = std::exchange(args.*fields.second, {}), dv_only.*fields.second = {}), ...);
  Problem dv_problem = p;
  dv_problem.head_dim = static_cast<int>(dv_head_dim);
  launch(p, dtype, args, fn);
  launch(dv_problem, dtype, dv_only, fn);
}

void store(TensorArg dk_accum, TensorArg dv_accum, TensorArg dk, TensorArg dv, OptArg cu_seqlens, OptArg seqused,
           int64_t arch) {
  Checker c("store", cu_seqlens, seqused, arch);
  Named const k_in{"dk_accum", &dk_accum}, v_in{"dv_accum", &dv_accum}, k{"dk", &dk}, v{"dv", &dv};
  Named const all[] = {k_in, v_in, k, v};
  c.defined(all);
  c.float32({k_in, v_in});
  c.half(k, v);
  c.ranks(all);
  for (auto const& [n, ref] : {std::pair{k_in, k}, std::pair{v_in, v}}) {
    if (n->sizes() != ref->sizes()) {
      c.fail(n, "shape", num(ref->sizes()) + " (the shape of " + ref.name + ")", num(n->sizes()));
    }
  }
  c.kv_shapes(k, v);
  c.written_pair(all, k, v, {k_in, v_in}, k);
  c.disjoint({k, v}, {c.cu, c.used});
  Problem const p = c.finish(k, dk.size(-2), std::max(dk.size(-1), dv.size(-1)), {k_in, v_in, k, v, c.cu, c.used});
  if (dk.numel() == 0) { return; }  // batch 0, seqlen 0, heads 0: nothing to launch
  auto args = args_for<StoreLaunchArgs>(p, cu_seqlens, seqused, &dk, &dv);
  args.dk_accum = describe(dk_accum, p.varlen);
  args.dv_accum = describe(dv_accum, p.varlen);
  launch(p, dk.scalar_type(), args, [](auto t, auto d, auto a) { return &launch_store<t, d, a>; });
}

void store_zero(TensorArg dk, TensorArg dv, OptArg cu_seqlens, OptArg seqused, OptArg batch_idx, OptArg head_idx,
                int64_t row_start, std::optional<int64_t> row_end, int64_t arch) {
  Checker c("store_zero", cu_seqlens, seqused, arch);
  Named const k{"dk", &dk}, v{"dv", &dv}, sel[] = {named("batch_idx", batch_idx), named("head_idx", head_idx)};
  c.defined({k, v});
  c.half(k, v);
  c.ranks({k, v});
  c.kv_shapes(k, v);
  c.written_pair({k, v}, k, v, {}, k);
  for (auto const& n : sel) { c.index_tensor(n); }
  c.disjoint({k, v}, {c.cu, c.used, sel[0], sel[1]});
  for (auto const& n : sel) {  // the kernel reads the selections with 16-bit grid dims
    if (n.t && n->numel() >= 65536) { c.fail(n, "numel", "fewer than 65536 entries", num(n->numel())); }
  }
  int64_t constexpr int_max = std::numeric_limits<int>::max();  // the kernel's row window is int
  if (row_start < 0 || row_start > int_max) { c.fail("row_start", "an int in [0, 2147483647]", num(row_start)); }
  if (row_end.has_value() && (*row_end < row_start || *row_end > int_max)) {
    c.fail("row_end", "None or an int in [row_start = " + num(row_start) + ", 2147483647]", num(*row_end));
  }
  Problem const p = c.finish(k, dk.size(-2), std::max(dk.size(-1), dv.size(-1)), {k, v, c.cu, c.used, sel[0], sel[1]});
  int64_t const end = std::min<int64_t>(row_end.value_or(p.rows), p.rows);
  auto const empty = [](OptArg t) { return t.has_value() && t->numel() == 0; };  // an empty selection
  if (dk.numel() == 0 || empty(batch_idx) || empty(head_idx) || row_start >= end) { return; }
  auto args = args_for<StoreZeroLaunchArgs>(p, cu_seqlens, seqused, &dk, &dv);
  args.batch_idx = batch_idx.has_value() ? batch_idx->const_data_ptr<int>() : nullptr;
  args.num_batch_idx = batch_idx.has_value() ? static_cast<int>(batch_idx->numel()) : 0;
  args.head_idx = head_idx.has_value() ? head_idx->const_data_ptr<int>() : nullptr;
  args.num_head_idx = head_idx.has_value() ? static_cast<int>(head_idx->numel()) : 0;
  args.row_begin = static_cast<int>(row_start);
  args.row_end = static_cast<int>(end);
  launch(p, dk.scalar_type(), args, [](auto t, auto d, auto a) { return &launch_store_zero<t, d, a>; });
}

void gqa_accumulate(TensorArg dk_partial, TensorArg dv_partial, TensorArg dk_accum, TensorArg dv_accum,
                    OptArg semaphores, OptArg cu_seqlens, OptArg seqused, bool deterministic, int64_t arch) {
  Checker c("gqa_accumulate", cu_seqlens, seqused, arch);
  Named const k{"dk_partial", &dk_partial}, v{"dv_partial", &dv_partial}, sem = named("semaphores", semaphores);
  Named const accums[] = {{"dk_accum", &dk_accum}, {"dv_accum", &dv_accum}}, all[] = {k, v, accums[0], accums[1]};
  c.defined(all);
  c.arch_value(arch);
  c.float32(all);
  c.ranks({k, v});
  c.ranks(accums, true);
  c.kv_shapes(k, v);
  int64_t const h_q = dk_partial.size(-2), h_k = dk_accum.size(1), d = dk_partial.size(-1), dv = dv_partial.size(-1);
  c.group(h_q, "dk_accum", h_k, "dk_accum.shape[1]");
  AccumLayout const layout = c.accum_side(k, {k, v}, accums, all, h_k, d, dv);
  int64_t const counters = layout.semaphore_numel();
  if (!sem.t && deterministic) {
    c.fail("semaphores",
           "an int32 tensor of >= " + num(counters) +
               " entries because deterministic=True (allocate the accumulator with "
               "flash_epilogue.gqa_accumulator(..., deterministic=True))",
           "None");
  }
  // The sm_80 deterministic mode's 1-D grid and int tickets: one work item per (row tile, batch, tensor, query
  // head). The sm_90 path adds whole groups per CTA, with no ticket.
  if (deterministic && layout.arch < 90 && (counters - 1) / h_k * h_q > std::numeric_limits<int32_t>::max()) {
    c.fail("dk_partial: shape", "at most 2^31 - 1 (row tiles x batch x 2 x h_q) work items in deterministic mode",
           num((counters - 1) / h_k * h_q));
  }
  c.index_tensor(sem);
  if (sem.t && sem.t->numel() < counters) {
    c.fail("semaphores: numel",
           ">= " + num(counters) + " (2 * batch_extent * num_tiles * heads_kv + 1 for dk_accum of shape " +
               num(layout.shape(0)) + ")",
           num(sem.t->numel()));
  }
  c.no_overlaps({accums[0], accums[1], sem}, {k, v, c.cu, c.used});
  Problem const p = c.finish(k, h_q, std::max(d, dv), {k, v, accums[0], accums[1], sem, c.cu, c.used}, h_k, layout);
  // the atomic adds' order varies from run to run: under torch.use_deterministic_algorithms(True), torch's error
  // (with warn_only=True the Python wrapper warns: a C++ warning of a torch.ops call would only reach stderr)
  at::Context& ctx = at::globalContext();
  if (!deterministic && ctx.deterministicAlgorithms() && !ctx.deterministicAlgorithmsWarnOnly()) {
    ctx.alertNotDeterministic("flash_epilogue.gqa_accumulate(deterministic=False)");
  }
  if (dk_partial.numel() == 0 || dk_accum.numel() == 0) { return; }
  auto args = args_for<GqaAccumulateLaunchArgs>(p, cu_seqlens, seqused);
  args.dk_accum = accum_desc(dk_accum);
  args.dv_accum = accum_desc(dv_accum);
  args.dk_partial = describe(dk_partial, p.varlen);
  args.dv_partial = describe(dv_partial, p.varlen);
  args.semaphores = deterministic ? semaphores->data_ptr<int>() : nullptr;
  using A = GqaAccumulateLaunchArgs;
  launch_per_tile(p, layout.tiles[1].head_dim, at::kFloat, args,
                  [](auto, auto d, auto a) { return &launch_gqa_accumulate<d, a>; },
                  std::pair{&A::dk_partial, &A::dv_partial}, std::pair{&A::dk_accum, &A::dv_accum});
}

void gqa_postprocess(TensorArg dk_accum, TensorArg dv_accum, TensorArg dk, TensorArg dv, double scale_dk,
                     double scale_dv, OptArg cu_seqlens, OptArg seqused, int64_t arch) {
  Checker c("gqa_postprocess", cu_seqlens, seqused, arch);
  Named const accums[] = {{"dk_accum", &dk_accum}, {"dv_accum", &dv_accum}}, k{"dk", &dk}, v{"dv", &dv};
  Named const all[] = {accums[0], accums[1], k, v};
  c.defined(all);
  c.scalars(scale_dk, scale_dv);
  c.float32(accums);
  c.half(k, v);
  c.ranks(accums, true);
  c.ranks({k, v});
  c.kv_shapes(k, v);
  int64_t const h_k = dk.size(-2), d = dk.size(-1);
  AccumLayout const layout = c.accum_side(k, {k, v}, accums, all, h_k, d, dv.size(-1));
  c.no_overlaps({k, v}, {accums[0], accums[1], c.cu, c.used});
  Problem const p = c.finish(k, h_k, std::max(d, dv.size(-1)), {accums[0], accums[1], k, v, c.cu, c.used}, 0, layout);
  if (dk.numel() == 0) { return; }
  auto args = args_for<GqaPostprocessLaunchArgs>(p, cu_seqlens, seqused, &dk, &dv);
  args.dk_accum = accum_desc(dk_accum);
  args.dv_accum = accum_desc(dv_accum);
  args.scale_dk = static_cast<float>(scale_dk);
  args.scale_dv = static_cast<float>(scale_dv);
  using A = GqaPostprocessLaunchArgs;
  launch_per_tile(p, layout.tiles[1].head_dim, dk.scalar_type(), args,
                  [](auto t, auto d, auto a) { return &launch_gqa_postprocess<t, d, a>; },
                  std::pair{&A::dk_accum, &A::dv_accum}, std::pair{&A::dk, &A::dv},
                  std::pair{&A::scale_dk, &A::scale_dv});
}

void gqa_accum_to_dense(TensorArg accum, TensorArg out, int64_t head_dim, OptArg cu_seqlens, OptArg seqused,
                        int64_t arch) {
  Checker c("gqa_accum_to_dense", cu_seqlens, seqused, arch);
  Named const in{"accum", &accum}, dense{"out", &out};
  c.defined({in, dense});
  c.arch_value(arch);
  c.float32({in, dense});
  c.ranks({in}, true);
  c.ranks({dense});
  c.head_dim("head_dim", head_dim);
  c.head_dim("out", out.size(-1));
  if (out.size(-1) > head_dim) { c.fail("out: head dim", "<= head_dim = " + num(head_dim), num(out.size(-1))); }
  // the accumulator of out's head dim (as dK's) in the tile serving head_dim (as dV's would name it)
  AccumLayout const layout = c.accum_side(dense, {dense}, {in}, {in, dense}, out.size(-2), out.size(-1), head_dim);
  c.no_overlaps({dense}, {in, c.cu, c.used});
  Problem const p = c.finish(dense, out.size(-2), head_dim, {in, dense, c.cu, c.used}, 0, layout);
  if (out.numel() == 0) { return; }
  auto args = args_for<GqaDenseLaunchArgs>(p, cu_seqlens, seqused);
  args.accum = accum_desc(accum);
  args.out = describe(out, p.varlen);
  launch(p, at::kFloat, args, [](auto, auto d, auto a) { return launch_gqa_accum_to_dense<d, a>; });
}

void gqa_reduce(TensorArg dk_partial, OptArg dv_partial, TensorArg dk, OptArg dv, OptArg cu_seqlens, OptArg seqused,
                double scale_dk, double scale_dv, int64_t arch) {
  Checker c("gqa_reduce", cu_seqlens, seqused, arch);
  bool const has_dv = dv_partial.has_value();
  Named const k_in{"dk_partial", &dk_partial}, v_in = named("dv_partial", dv_partial);  // v_in, v: null when None
  Named const k{"dk", &dk}, v = named("dv", dv);
  c.defined({k_in, k});
  if (!has_dv && v.t) { c.fail("dv", "None because dv_partial is None", "Tensor"); }
  if (has_dv && !v.t) { c.fail("dv", "a torch.Tensor because dv_partial is given", "NoneType"); }
  c.scalars(scale_dk, scale_dv);
  c.half(k, v);
  if (dk_partial.scalar_type() != at::kFloat && dk_partial.scalar_type() != dk.scalar_type()) {
    c.fail_dtype(k_in, "torch.float32 or " + dtype_name(dk.scalar_type()) + " (the dtype of dk)");
  }
  c.same_dtype(v_in, k_in);
  std::array<Named, 4> const given = {k_in, has_dv ? v_in : k, k, v};
  Names const all(given.data(), has_dv ? 4 : 2);  // the tensors given, partials first
  c.ranks(all);
  c.shape_but(v_in, k_in, -1, "last");
  c.shape_but(k, k_in, -2, "heads");
  c.shape_but(v, v_in, -2, "heads");
  c.kv_shapes(k, v);
  int64_t const h_q = dk_partial.size(-2), h_k = dk.size(-2);
  c.group(h_q, "dk", h_k, "dk.shape[-2]");
  c.written_pair(all, k, v, {k_in, v_in}, k_in);
  c.disjoint({k, v}, {c.cu, c.used});
  int64_t const width = std::max(dk.size(-1), has_dv ? dv->size(-1) : 0);
  Problem const p = c.finish(k_in, h_q, width, {k_in, v_in, k, v, c.cu, c.used}, h_k);
  if (dk.numel() == 0) { return; }
  auto args = args_for<GqaReduceLaunchArgs>(p, cu_seqlens, seqused, &dk, dv.has_value() ? &*dv : nullptr);
  args.dk_partial = describe(dk_partial, p.varlen);
  if (dv_partial.has_value()) { args.dv_partial = describe(*dv_partial, p.varlen); }
  args.partial_fp32 = dk_partial.scalar_type() == at::kFloat;
  args.scale_dk = static_cast<float>(scale_dk);
  args.scale_dv = static_cast<float>(scale_dv);
  using A = GqaReduceLaunchArgs;
  int64_t const dv_head_dim =
      has_dv ? dv_tile_head_dim(p.arch, p.varlen, p.batch, p.rows, p.heads, dk.size(-1), dv->size(-1)) : p.head_dim;
  launch_per_tile(p, dv_head_dim, dk.scalar_type(), args,
                  [](auto t, auto d, auto a) { return &launch_gqa_reduce<t, d, a>; },
                  std::pair{&A::dk_partial, &A::dv_partial}, std::pair{&A::dk, &A::dv},
                  std::pair{&A::scale_dk, &A::scale_dv});
}

// The ops' kernels: their implementations for CPU and CUDA, and their place in torch's in-place machinery: an
// ADInplaceOrView and an Autograd kernel per op, unboxed (no IValue stack per call) and with the rules torch's
// generated kernels of in-place ops apply. torch's autogradNotImplementedFallback() and its ADInplaceOrView partner
// bump the versions of written *returns* only: these schemas return nothing, so those (boxed) fallbacks would miss
// every written tensor.
//
// ADInplaceOrView: the kernel, then a version bump of every written tensor (a tensor saved for backward and then
// overwritten makes backward raise "modified by an inplace operation"). An inference tensor outside InferenceMode
// gets torch's own error from that bump, raised before the kernel so that nothing is written.
// Autograd: the ops are steps of an attention backward and have no derivative. With grad mode on, a written tensor
// goes through torch's check_inplace (leaves and views that require grad), then any tensor argument that requires
// grad raises a RuntimeError naming the op and the argument (one eager error, where torch's not-implemented
// convention would defer it to backward). A forward-mode tangent raises the same way whatever the grad mode; grad
// mode off (inside a backward without create_graph, under torch.no_grad()) checks nothing else.

// Each tensor argument of a call (an optional one if given) as f(argument index, tensor), in schema order.
template <class F, class T>
void visit_arg(F& f, int i, T const& a) {
  if constexpr (std::is_same_v<T, at::Tensor>) { f(i, a); }
  if constexpr (std::is_same_v<T, std::optional<at::Tensor>>) {
    if (a.has_value()) { f(i, *a); }
  }
}
template <class F, class... Args>
void for_each_tensor(F&& f, Args const&... args) {
  int i = 0;
  (visit_arg(f, i++, args), ...);  // left to right
}

bool has_tangent(TensorArg t) {  // a forward-mode AD dual tensor (only a tensor with autograd meta can be one)
  return t.unsafeGetTensorImpl()->autograd_meta() != nullptr && t._fw_grad(/*level=*/0).defined();
}

// The kernels of one op: kSchema its registered name, kFn its implementation, and kBackwardOfRepeatKv
// (bit i: argument i is a gradient whose derivative repeat_kv owns: gqa_reduce's partials). Argument names and
// Tensor(x!) positions come from the registered schema (module.cpp); typing the handle checks kFn's signature against
// it.
template <char const* kSchema, auto kFn, uint32_t kBackwardOfRepeatKv = 0>
struct InplaceKernels;

template <char const* kSchema, uint32_t kBackwardOfRepeatKv, class... Args, void (*kFn)(Args...)>
struct InplaceKernels<kSchema, kFn, kBackwardOfRepeatKv> {
  static c10::TypedOperatorHandle<void(Args...)> const& op() {
    static auto const h = c10::Dispatcher::singleton().findSchemaOrThrow(kSchema, "").template typed<void(Args...)>();
    return h;
  }
  static bool writes(int i) {  // argument i is a Tensor(x!)
    c10::AliasInfo const* const alias = op().schema().arguments()[i].alias_info();
    return alias != nullptr && alias->isWrite();
  }
  static char const* name() { return kSchema + sizeof("flash_epilogue::") - 1; }  // the op's own name
  static constexpr auto implementation = kFn;

  static void inplace_or_view(c10::DispatchKeySet ks, Args... args) {
    if (!c10::InferenceMode::is_enabled()) {
      for_each_tensor([](int i, TensorArg t) {
        if (writes(i) && t.is_inference()) { torch::autograd::increment_version(t); }  // raises torch's error
      }, args...);
    }
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      op().redispatch(ks & c10::after_ADInplaceOrView_keyset, args...);
    }
    for_each_tensor([](int i, TensorArg t) {
      if (writes(i)) { torch::autograd::increment_version(t); }
    }, args...);
  }

  static void autograd(c10::DispatchKeySet ks, Args... args) {
    bool const grad_mode = at::GradMode::is_enabled();
    if (grad_mode) {  // torch's in-place rules first (its messages), as its generated kernels check
      for_each_tensor([](int i, TensorArg t) {
        if (writes(i) && t.requires_grad()) { torch::autograd::check_inplace(t, /*requires_grad=*/true); }
      }, args...);
    }
    for_each_tensor([grad_mode](int i, TensorArg t) {
      bool const requires_grad = grad_mode && t.requires_grad();
      if (!requires_grad && !has_tangent(t)) { return; }
      TORCH_CHECK(false, "flash_epilogue.", name(), ": ", op().schema().arguments()[i].name(), ": ",
                  requires_grad ? "requires grad" : "has a forward-mode tangent", ", but ", name(),
                  (kBackwardOfRepeatKv >> i & 1u) != 0
                      ? " has no derivative: it is itself the backward of repeat_kv (the group sum of the expanded "
                        "heads' gradient). To differentiate through a KV-head expand use flash_epilogue.repeat_kv, "
                        "whose backward runs this reduce (double backward included); else call it under "
                        "torch.no_grad() or on detached partials"
                      : " has no derivative (a step of an attention backward): call it with grad mode off (inside a "
                        "backward without create_graph, or under torch.no_grad()) or on detached tensors");
    }, args...);
    at::AutoDispatchBelowAutograd guard;
    op().redispatch(ks & c10::after_autograd_keyset, args...);
  }
};

constexpr char kStore[] = "flash_epilogue::store";
constexpr char kStoreZero[] = "flash_epilogue::store_zero";
constexpr char kGqaAccumulate[] = "flash_epilogue::gqa_accumulate";
constexpr char kGqaPostprocess[] = "flash_epilogue::gqa_postprocess";
constexpr char kGqaAccumToDense[] = "flash_epilogue::gqa_accum_to_dense";
constexpr char kGqaReduce[] = "flash_epilogue::gqa_reduce";

// The kernels of a list of ops, by key.
template <class... Kernels>
struct Register {
  static void implementation(torch::Library& m) { (m.impl(Kernels::name(), TORCH_FN(Kernels::implementation)), ...); }
  static void inplace_or_view(torch::Library& m) { (m.impl(Kernels::name(), TORCH_FN(Kernels::inplace_or_view)), ...); }
  static void autograd(torch::Library& m) { (m.impl(Kernels::name(), TORCH_FN(Kernels::autograd)), ...); }
};

// Every op with Tensor(x!) arguments.
using MutatingOps = Register<InplaceKernels<kStore, &store>, InplaceKernels<kStoreZero, &store_zero>,
                             InplaceKernels<kGqaAccumulate, &gqa_accumulate>,
                             InplaceKernels<kGqaPostprocess, &gqa_postprocess>,
                             InplaceKernels<kGqaAccumToDense, &gqa_accum_to_dense>,
                             InplaceKernels<kGqaReduce, &gqa_reduce, /*dk_partial, dv_partial*/ 0b11>>;

// repeat_kv: the KV-head expand, its group-sum backward, their autograd and registration, in C++ so that a backward
// through it runs no Python (docs/design.md: host time). The package keeps the public wrapper and fake kernels.

// repeat_kv's (x = t), with a layout repeat_kv_backward's (grad = t); returns dim as 1 or 2.
int64_t check_repeat_kv(TensorArg t, int64_t n_rep, int64_t dim, std::optional<c10::IntArrayRef> layout = {}) {
  Checker const c(layout ? "repeat_kv_backward" : "repeat_kv");
  char const* const heads = layout ? "heads" : "kv_heads";
  if (t.dim() != 4) {
    c.fail(layout ? "grad: rank" : "x: rank",
           std::string("4 dims: (batch, ") + heads + ", seqlen, head_dim) for dim=1, (batch, seqlen, " + heads +
               ", head_dim) for dim=2",
           rank_got(t));
  }
  if (n_rep < 1) { c.fail("n_rep", "a positive int", num(n_rep)); }
  if (dim != 1 && dim != 2 && dim != -3 && dim != -2) {
    c.fail("dim", "1 (or -3) or 2 (or -2): the KV-head dim of a 4-D tensor", num(dim));
  }
  dim = dim < 0 ? dim + 4 : dim;
  if (!layout && t.size(dim) > std::numeric_limits<int64_t>::max() / n_rep) {
    c.fail("n_rep", "a positive int with x.shape[dim] * n_rep < 2^63", num(n_rep));
  }
  if (layout && t.size(dim) % n_rep != 0) {
    c.fail("grad: heads", "a multiple of n_rep = " + num(n_rep) + " in dim " + num(dim),
           num(t.size(dim)) + " (shape " + num(t.sizes()) + ")");
  }
  std::array<int64_t, 3> const dims = {0, 1, 2};
  if (layout && (layout->size() != 3 || !std::is_permutation(layout->begin(), layout->end(), dims.begin()))) {
    c.fail("layout", "a permutation of [0, 1, 2]", seq(*layout, -1, true));
  }
  return dim;
}

// For repeat_kv's backward: whether gqa_reduce takes `partial` (batch, seqlen, heads, d) as dk_partial (dtype, head
// dim, grid limits, a GPU with kernels, not empty) and whether it reads it in place (strides, alignment).
bool gqa_reduce_takes(TensorArg partial) {
  at::ScalarType const dtype = partial.scalar_type();
  if (!partial.is_cuda() || (dtype != at::kBFloat16 && dtype != at::kHalf)) { return false; }
  auto const [major, minor] = device_capability(partial.get_device());
  return head_dim_supported(partial.size(3)) && head_dim_built(partial.size(3)) && partial.numel() > 0 &&
         within_grid_limits(partial.size(1), partial.size(2), partial.size(0)) && has_kernels(major, minor);
}

bool gqa_reduce_reads_in_place(TensorArg partial) {
  int64_t const multiple = 16 / partial.element_size();
  if (partial.size(3) > 1 && partial.stride(3) != 1) { return false; }
  for (int64_t i = 0; i < 3; ++i) {
    if (partial.size(i) > 1 && (partial.stride(i) < 0 || partial.stride(i) % multiple != 0)) { return false; }
  }
  return address(partial) % 16 == 0;
}

std::atomic<bool> debug_sync_on{false};

at::Tensor kernel_view(TensorArg t, int64_t dim) { return dim == 1 ? t.transpose(1, 2) : t; }  // (b, s, h, d)

// flash_epilogue.reference.group_sum_reference into `out`, the same ATen calls in the same order (the same bits):
// per KV head 0 + g_0 + ... + g_{n-1} in fp32 (or the gradient's wider dtype), then one rounding to out's dtype.
at::Tensor group_sum_reference(TensorArg grad, int64_t n_rep, int64_t dim, TensorArg out) {
  if (out.numel() == 0) { return out; }  // nothing to sum (and no n_rep-long loop over empty heads)
  at::ScalarType const acc_dtype = c10::promoteTypes(grad.scalar_type(), at::kFloat);
  at::Tensor acc = out.scalar_type() == acc_dtype ? out : at::empty(out.sizes(), grad.options().dtype(acc_dtype));
  acc.zero_();
  at::Tensor const grouped = grad.unflatten(dim, {out.size(dim), n_rep});
  for (int64_t j = 0; j < n_rep; ++j) { acc.add_(grouped.select(dim + 1, j)); }  // exact upcast, then an fp32 add
  if (!acc.is_same(out)) { out.copy_(acc); }                                     // round to nearest even, once
  return out;
}

// The order of x's first three dims in memory, outermost first (ties keep the logical order); symbolic strides
// (torch.compile, dynamic shapes) compare through guards.
std::array<int64_t, 3> layout_of(TensorArg x) {
  c10::SymIntArrayRef const strides = x.sym_strides();
  std::array<int64_t, 3> order = {0, 1, 2};
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
  return order;
}

// The op through the dispatcher (traced by torch.compile, differentiated again under create_graph): repeat_kv, or
// with a layout repeat_kv_backward.
at::Tensor call(TensorArg t, int64_t n_rep, int64_t dim, std::optional<c10::IntArrayRef> layout) {
  auto const schema = [](char const* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); };
  static auto const forward = schema("flash_epilogue::repeat_kv").typed<at::Tensor(TensorArg, int64_t, int64_t)>();
  static auto const backward = schema("flash_epilogue::repeat_kv_backward")
                                   .typed<at::Tensor(TensorArg, int64_t, int64_t, c10::IntArrayRef)>();
  return layout ? backward.call(t, n_rep, dim, *layout) : forward.call(t, n_rep, dim);
}

// The autograd of both ops as torch's generated kernels have it: a graph node of our own (torch.func's grad and vjp
// take those, where they refuse a C++ torch::autograd::Function) and the forward-mode tangent set on the output
// (torch.autograd.forward_ad, torch.func.jvp). Each op is linear and the other's adjoint, so each derivative is a call
// of the other op (or of the op itself, for the tangent), through the dispatcher: differentiable again.
using torch::autograd::Node;
using torch::autograd::variable_list;

// A new node in torch's node handle: std::shared_ptr<Node> with its iterative deleter in older torch, intrusive_ptr in
// newer (deleteNode, found by argument-dependent lookup, exists only in the former).
template <class T>
auto new_node() {
  if constexpr (std::is_same_v<decltype(torch::autograd::Edge::function), std::shared_ptr<Node>>) {
    return std::shared_ptr<T>(new T(), [](T* n) { deleteNode(n); });
  } else {
    return c10::make_intrusive<T>();
  }
}

// The node of repeat_kv (layout: x's, its gradient's) or of repeat_kv_backward (no layout): the other op.
struct RepeatKvNode : Node {
  int64_t n_rep = 0, dim = 0;
  std::optional<std::array<int64_t, 3>> layout;
  std::string name() const override { return layout ? "RepeatKvBackward" : "RepeatKvBackwardBackward"; }
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined() || !should_compute_output(0)) { return {at::Tensor()}; }
    return {call(grads[0], n_rep, dim, layout ? std::optional<c10::IntArrayRef>(*layout) : std::nullopt)};
  }
};

// x repeated n_rep times along dim, a new contiguous tensor (one copy, as an expand + reshape makes).
at::Tensor repeat_kv(TensorArg x, int64_t n_rep, int64_t dim) {
  dim = check_repeat_kv(x, n_rep, dim);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end()), expanded = shape;
  shape[dim] *= n_rep;
  expanded.insert(expanded.begin() + dim + 1, n_rep);
  at::Tensor out = at::empty(shape, x.options());
  out.view(expanded).copy_(x.unsqueeze(dim + 1).expand(expanded));
  return out;
}

// The group sum of grad (heads in dim) into a tensor dense in the order `layout` (x's, outermost first; the last dim
// contiguous), the same bits either way: gqa_reduce where the kernels take grad (from a contiguous copy where they
// cannot read it in place: a .sum()'s stride 0, a misaligned start), else the reference.
at::Tensor repeat_kv_backward(TensorArg grad, int64_t n_rep, int64_t dim, c10::IntArrayRef layout) {
  dim = check_repeat_kv(grad, n_rep, dim, layout);
  std::array<int64_t, 4> shape = {grad.size(0), grad.size(1), grad.size(2), grad.size(3)};
  shape[dim] /= n_rep;
  // the strides at::empty gives the permuted shape (a size-0 dim counts as 1), permuted back
  std::array<int64_t, 4> const order = {layout[0], layout[1], layout[2], 3};
  c10::DimVector const dense = c10::contiguous_strides({shape[order[0]], shape[order[1]], shape[order[2]], shape[3]});
  std::array<int64_t, 4> strides;
  for (int i = 0; i < 4; ++i) { strides[order[i]] = dense[i]; }
  at::Tensor out = at::empty_strided(shape, strides, grad.options());
  at::Tensor partial = kernel_view(grad, dim);
  if (!gqa_reduce_takes(partial)) { return group_sum_reference(grad, n_rep, dim, out); }
  if (!gqa_reduce_reads_in_place(partial)) { partial = kernel_view(grad.clone(at::MemoryFormat::Contiguous), dim); }
  // the implementation itself (no dispatcher, no Python wrapper), its checks included
  gqa_reduce(partial, std::nullopt, kernel_view(out, dim), std::nullopt, std::nullopt, std::nullopt, 1.0, 1.0, 0);
  // FLASH_EPILOGUE_DEBUG: the backward (off the Python wrappers) waits for its kernel, except under graph capture
  if (debug_sync_on.load(std::memory_order_relaxed) &&
      c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
    cudaError_t const err = cudaStreamSynchronize(c10::cuda::getCurrentCUDAStream(partial.get_device()).stream());
    TORCH_CHECK(err == cudaSuccess, "flash_epilogue.repeat_kv_backward: the kernel failed on ", partial.device(), ": ",
                cudaGetErrorString(err));
  }
  return out;
}

// The Autograd kernels (layout given: repeat_kv_backward's): the op below autograd, then the output's grad_fn where
// the input's gradient is recorded (grad mode on and it requires grad), then its tangent where the input has one
// (whatever the grad mode).
at::Tensor differentiable(TensorArg t, int64_t n_rep, int64_t dim, std::optional<c10::IntArrayRef> layout) {
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = call(t, n_rep, dim, layout);  // checks t's rank before layout_of reads three strides
  }
  if (torch::autograd::compute_requires_grad(t)) {
    auto node = new_node<RepeatKvNode>();
    node->n_rep = n_rep;
    node->dim = dim;
    if (!layout) { node->layout = layout_of(t); }
    node->set_next_edges(torch::autograd::collect_next_edges(t));
    torch::autograd::set_history(out, node);
  }
  if (torch::autograd::isFwGradDefined(t)) {
    out._set_fw_grad(call(t._fw_grad(/*level=*/0), n_rep, dim, layout), /*level=*/0, /*is_inplace_op=*/false);
  }
  return out;
}
at::Tensor repeat_kv_autograd(TensorArg x, int64_t n_rep, int64_t dim) { return differentiable(x, n_rep, dim, {}); }
at::Tensor repeat_kv_backward_autograd(TensorArg grad, int64_t n_rep, int64_t dim, c10::IntArrayRef layout) {
  return differentiable(grad, n_rep, dim, layout);
}

// CPU tensors get every metadata check, then the device check's message (the CPU tests run the checks). repeat_kv:
// one kernel for every backend (the Python fake kernels serve Meta and FakeTensor), autograd in C++.
TORCH_LIBRARY_IMPL(flash_epilogue, CUDA, m) { MutatingOps::implementation(m); }
TORCH_LIBRARY_IMPL(flash_epilogue, CPU, m) { MutatingOps::implementation(m); }
TORCH_LIBRARY_IMPL(flash_epilogue, ADInplaceOrView, m) { MutatingOps::inplace_or_view(m); }
TORCH_LIBRARY_IMPL(flash_epilogue, CompositeExplicitAutograd, m) {
  m.impl("repeat_kv", &repeat_kv);
  m.impl("repeat_kv_backward", &repeat_kv_backward);
}
TORCH_LIBRARY_IMPL(flash_epilogue, Autograd, m) {
  MutatingOps::autograd(m);
  m.impl("repeat_kv", &repeat_kv_autograd);
  m.impl("repeat_kv_backward", &repeat_kv_backward_autograd);
}

}  // namespace

AccumLayout gqa_accum_layout(int64_t num_heads_kv, int64_t head_dim, int64_t head_dim_v, int64_t batch, int64_t rows,
                             bool varlen, int64_t arch, at::Device device) {
  Checker const c("gqa_accumulator");
  if (num_heads_kv < 1 || num_heads_kv > 65535) { c.fail("num_heads_kv", "an int in [1, 65535]", num(num_heads_kv)); }
  c.head_dim("head_dim", head_dim);
  c.head_dim("head_dim_v", head_dim_v);
  if (batch < 0) { c.fail("batch", "an int >= 0", num(batch)); }
  if (rows < 0) { c.fail("rows", "an int >= 0", num(rows)); }
  if (batch >= 65536) { c.fail("batch", "an int < 65536 (the kernels' grid limit)", num(batch)); }
  if (rows >= (int64_t(1) << 31)) { c.fail("rows", "an int < 2^31 (the kernels' row index)", num(rows)); }
  c.arch_value(arch, "arch");
  int path = 90;
  try {
    path = accum_path(device, arch);
  } catch (c10::Error const&) {}  // a device that cannot be queried: allocating on it says why
  return accum_layout(path, varlen, batch, rows, num_heads_kv, head_dim, head_dim_v);
}

void set_debug_sync(bool on) { debug_sync_on.store(on); }
bool debug_sync_enabled() { return debug_sync_on.load(); }

}  // namespace flash_epilogue
