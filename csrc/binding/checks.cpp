// The argument checks (checks.h).

#include "checks.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <c10/util/strides.h>

#include "device.h"
#include "format.h"
#include "overlap.h"
#include "static_switch.h"

namespace flash_epilogue {

Named named(char const* name, OptArg t) { return {name, t.has_value() ? &*t : nullptr}; }

bool head_dim_supported(int64_t d) { return d > 0 && d % 8 == 0 && d <= 256; }

bool within_grid_limits(int64_t rows, int64_t heads, int64_t batch) {
  return rows < (int64_t(1) << 31) && heads < 65536 && batch < 65536;
}

Checker::Checker(char const* op, OptArg cu_seqlens, OptArg seqused, int64_t arch)
    : cu(named("cu_seqlens", cu_seqlens)), used(named("seqused", seqused)), op_(op), varlen_(cu.t), arch_(arch) {}

void Checker::fail(std::string const& arg, std::string const& expected, std::string const& got,
                   bool type_error) const {
  std::string const m = "flash_epilogue." + std::string(op_) + ": " + arg + ": expected " + expected + ", got " + got;
  if (type_error) { C10_THROW_ERROR(TypeError, m); }
  C10_THROW_ERROR(ValueError, m);
}

void Checker::fail(Named n, char const* what, std::string const& expected, std::string const& got) const {
  fail(std::string(n.name) + ": " + what, expected, got);
}

void Checker::fail_dtype(Named n, std::string const& expected) const {
  fail(std::string(n.name) + ": dtype", expected, dtype_name(n->scalar_type()), true);
}

void Checker::defined(Names ts) const {
  for (auto const& n : ts) {
    if (!n->defined()) { fail(n.name, "a torch.Tensor", "NoneType", true); }
  }
}

void Checker::float32(Names ts) const {
  for (auto const& n : ts) {
    if (n->scalar_type() != at::kFloat) { fail_dtype(n, "torch.float32"); }
  }
}

void Checker::half(Named k, Named v) const {
  if (k->scalar_type() != at::kHalf && k->scalar_type() != at::kBFloat16) {
    fail_dtype(k, "torch.float16 or torch.bfloat16");
  }
  same_dtype(v, k);
}

void Checker::same_dtype(Named n, Named ref) const {
  if (n.t && n->scalar_type() != ref->scalar_type()) {
    fail_dtype(n, dtype_name(ref->scalar_type()) + " (the dtype of " + ref.name + ")");
  }
}

void Checker::ranks(Names ts, bool accum) const {
  for (auto const& n : ts) {
    if (n->dim() == (accum || !varlen_ ? 4 : 3)) { continue; }
    fail(n, "rank",
         accum    ? "4 dims (batch_extent, heads_kv, num_tiles, tile_elems)"
         : varlen_ ? "3 dims (total_tokens, heads, headdim) because cu_seqlens is given"
                  : "4 dims (batch, seqlen, heads, headdim) because cu_seqlens is None",
         rank_got(*n.t));
  }
}

// n (None: no check) has ref's shape but at dim (-1: the head dim; -2: the heads, h_k against h_q), named `which`
void Checker::shape_but(Named n, Named ref, int64_t dim, char const* which) const {
  if (!n.t) { return; }
  int64_t const star = ref->dim() + dim;
  bool same = n->dim() == ref->dim();
  for (int64_t i = 0; same && i < n->dim(); ++i) { same = i == star || n->size(i) == ref->size(i); }
  if (!same) {
    fail(n, "shape", seq(ref->sizes(), star) + " (" + ref.name + "'s shape but the " + which + " dim)",
         num(n->sizes()));
  }
}

void Checker::head_dim(char const* name, int64_t d) const {
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

void Checker::kv_shapes(Named k, Named v) const {
  shape_but(v, k, -1, "last");
  head_dim(k.name, k->size(-1));
  if (v.t) { head_dim(v.name, v->size(-1)); }
}

// h_k >= 1 and h_q a positive multiple of h_k (query head j belongs to KV head j // (h_q / h_k))
void Checker::group(int64_t num_heads_q, char const* kv_name, int64_t num_heads_kv, char const* kv_src) const {
  if (num_heads_kv < 1) {
    fail(std::string(kv_name) + ": heads", ">= 1 (" + std::string(kv_src) + ", the number of KV heads)", num(num_heads_kv));
  }
  if (num_heads_q < 1 || num_heads_q % num_heads_kv != 0) {
    fail("dk_partial: heads",
         "a positive multiple of the " + num(num_heads_kv) + " KV heads (" + kv_src +
             "): every KV head serves h_q / h_k query heads",
         num(num_heads_q) + " query heads (dk_partial.shape[-2])");
  }
}

// The last dim contiguous, then every other stride a non-negative multiple of 16 bytes (dims of size <= 1 ignored;
// an empty tensor touches no memory: the kernels return early).
void Checker::layouts(Names ts) const {
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

void Checker::alignments(Names ts) const {
  for (auto const& n : ts) {
    int64_t const ptr = n->numel() > 0 ? address(*n.t) : 0;
    if (ptr % 16 != 0) {
      fail(n, "data_ptr", "a 16-byte aligned address", hex_str(ptr) + " (address % 16 = " + num(ptr % 16) + ")");
    }
  }
}

void Checker::contiguous(Names ts) const {
  for (auto const& n : ts) {
    if (n->numel() == 0 || n->is_contiguous()) { continue; }
    fail(n, "strides", num(c10::contiguous_strides(n->sizes())) + " (contiguous)", num(n->strides()));
  }
}

// No two elements of a written tensor at one address: its dims of size > 1 sorted by |stride|, each stride must
// exceed the farthest offset the smaller ones reach (sufficient, as torch's check of outputs).
void Checker::no_self_overlap(Named n) const {
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

void Checker::no_overlap(Named t, Named other) const {
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

void Checker::disjoint(Names written, Names read) const {
  for (auto const& w : written) {
    for (auto const& r : read) { no_overlap(w, r); }
  }
}

void Checker::no_overlaps(Names written, Names read) const {
  for (auto const& w : written) { no_self_overlap(w); }
  for (size_t i = 0; i < written.size(); ++i) {
    for (size_t j = 0; j < i; ++j) { no_overlap(written[i], written[j]); }
  }
  disjoint(written, read);
}

void Checker::written_pair(Names all, Named k, Named v, Names read, Named t) {
  layouts(all);
  alignments(all);
  no_overlaps({k, v}, read);
  seqlens(t);
}

void Checker::index_tensor(Named n, char const* rank) const {
  if (!n.t) { return; }
  if (n->scalar_type() != at::kInt) { fail_dtype(n, "torch.int32"); }
  if (n->dim() != 1) { fail(n, "rank", rank, rank_got(*n.t)); }
  if (n->numel() > 1 && n->stride(0) != 1) { fail(n, "stride(0)", "1 (contiguous)", num(n->stride(0))); }
}

// cu_seqlens/seqused; the batch (t.shape[0], varlen: cu_seqlens.numel() - 1) and rows (seqlen or total tokens)
void Checker::seqlens(Named t) {
  batch_ = t->size(0);
  if (varlen_) {
    index_tensor(cu, "1 dim (batch + 1,)");
    if (cu->numel() < 2) { fail(cu, "numel", "batch + 1 >= 2 (at least one sequence)", num(cu->numel())); }
    batch_ = cu->numel() - 1;
  }
  index_tensor(used);
  if (used.t && used->numel() != batch_) {
    std::string const src = varlen_ ? "cu_seqlens.numel() - 1" : std::string(t.name) + ".shape[0]";
    fail(used, "numel", num(batch_) + " (batch = " + src + ")", num(used->numel()));
  }
  rows_ = t->size(varlen_ ? 0 : 1);
}

void Checker::arch_value(int64_t requested, char const* name) const {
  if (requested != 0 && requested != 80 && requested != 90) {
    fail(name, "0 (the device's path), 80 or 90", num(requested));
  }
}

void Checker::scalars(double scale_dk, double scale_dv) const {
  double const max = std::numeric_limits<float>::max();
  for (auto const& [name, v] : {std::pair{"scale_dk", scale_dk}, std::pair{"scale_dv", scale_dv}}) {
    if (std::isfinite(v) && std::abs(v) > max) {
      fail(name, "a float in fp32's range (|scale| <= " + repr(max) + "; inf and nan pass)", repr(v));
    }
  }
  arch_value(arch_);
}

// One CUDA device for every tensor, the first CUDA tensor's: one elsewhere (CPU, another GPU) names both devices.
// (Meta tensors among CUDA ones reach the fake kernels, which refuse them the same way.)
at::Device Checker::devices(Names ts) const {
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

// The code path: 90 on an sm_90 GPU (sm_90a kernels), 80 on an sm_8x GPU when the build has sm_80 code; _arch = 80
// forces the sm_80 path on an sm_90 GPU (a testing knob), where the build has that path. After devices().
int Checker::resolve_arch(at::Device device) const {
  arch_value(arch_);
  std::pair<int, int> const capability = device_capability(device.index());
  std::string const name = "sm_" + num(capability.first) + num(capability.second);
  bool const sm90 = capability == std::pair{9, 0} && compiled_for("sm_90a");
  if (!has_kernels(capability)) {
    std::string archs;
    for (auto const& a : compiled_archs()) { archs += (archs.empty() ? "" : ", ") + a; }
    fail("device", "a GPU of compute capability sm_90 (compiled for " + archs + ")",
         device.str() + " with compute capability " + name);
  }
  if (arch_ == 90 && !sm90) { fail("_arch", "0 or 80 on " + device.str() + " (compute capability " + name + ")", "90"); }
  int const path = code_path(arch_, capability);
  if (path == 80 && !kFlashEpilogueSm80Path) {
    fail("_arch", "0 or 90: this build has no sm_80 code path (FLASH_EPILOGUE_SM80_PATH=1 builds it)", "80");
  }
  return path;
}

ProblemShape Checker::shape(int64_t num_heads_kv) const {
  return {static_cast<int>(rows_), static_cast<int>(batch_), static_cast<int>(num_heads_kv), varlen_};
}

AccumLayout Checker::accum_side(Op op, Named t, Names written, Names accums, Names aligned, int64_t num_heads_kv,
                                int64_t d, int64_t dv) {
  seqlens(t);
  std::optional<std::pair<int, int>> capability;
  if (t->is_cuda()) { capability = device_capability(t->device().index()); }
  Problem problem{op, code_path(arch_, capability), shape(num_heads_kv), used.t != nullptr,
                  static_cast<int>(d), static_cast<int>(dv)};
  AccumLayout const layout = accum_layout(problem, d, dv);
  for (int i = 0; i < static_cast<int>(accums.size()); ++i) {
    Named const n = accums[i];
    std::vector<int64_t> const expected = layout.shape(i);
    if (n->sizes() == c10::IntArrayRef(expected)) { continue; }
    std::string const what = varlen_ ? num(batch_) + " sequences of " + num(rows_) + " total tokens"
                                     : "batch " + num(batch_) + ", seqlen " + num(rows_);
    fail(n, "shape",
         num(expected) + " (the accumulator of " + what + ", " + num(num_heads_kv) + " KV heads and head dim " +
             num(i ? dv : d) + " in the tile of head dim " + num(layout.tiles[i].head_dim) + " on the sm_" +
             num(layout.arch) + " path: allocate it with flash_epilogue.gqa_accumulator)",
         num(n->sizes()));
  }
  layouts(written);
  contiguous(accums);
  alignments(aligned);
  return layout;
}

Call Checker::finish(Op op, Named t, int64_t heads, int64_t num_heads_kv, int64_t d, int64_t dv, Names ts,
                     bool deterministic) const {
  if (!within_grid_limits(rows_, heads, batch_)) {
    fail(t, "shape", "rows < 2^31 and heads, batch < 65536", num(t->sizes()));
  }
  at::Device const device = devices(ts);
  Call call;
  call.device = device;
  call.problem = {op, resolve_arch(device), shape(num_heads_kv), used.t != nullptr, static_cast<int>(d),
                  static_cast<int>(dv), deterministic, multiprocessor_count(device.index())};
  static_cast<ProblemShape&>(call.geometry) = call.problem.shape;
  call.geometry.cu_seqlens = varlen_ ? cu->const_data_ptr<int>() : nullptr;
  call.geometry.seqused = used.t ? used->const_data_ptr<int>() : nullptr;
  return call;
}

}  // namespace flash_epilogue
