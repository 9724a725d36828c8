#pragma once

// The package's only argument checks. A bad argument raises ValueError (TypeError for a wrong dtype or a None
// tensor) before any launch: `flash_epilogue.<op>: <arg>: expected <expected>, got <got>`. The checks, in one order
// for every op: None, dtypes, ranks, shapes and head dims, strides, alignment, overlaps (of a written tensor with
// itself, another written one, a read one), cu_seqlens/seqused, grid limits, last the devices (CPU tensors fail only
// there) and the code path. Messages are built on failure only.

#include <cstdint>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>

#include "geometry.h"
#include "plan.h"

namespace flash_epilogue {

using TensorArg = at::Tensor const&;  // the ops' argument types
using OptArg = std::optional<at::Tensor> const&;

struct Named {  // a tensor argument and its name; t null: None
  char const* name;
  at::Tensor const* t;
  at::Tensor const* operator->() const { return t; }
};
Named named(char const* name, OptArg t);
using Names = c10::ArrayRef<Named>;

// A call whose arguments passed: what the plan decides from, and what the launches take.
struct Call {
  Problem problem;
  Geometry geometry;
  at::Device device = at::kCPU;
};

class Checker {
 public:
  explicit Checker(char const* op, OptArg cu_seqlens = {}, OptArg seqused = {}, int64_t arch = 0);

  Named const cu, used;  // cu_seqlens, seqused

  [[noreturn]] void fail(std::string const& arg, std::string const& expected, std::string const& got,
                         bool type_error = false) const;
  [[noreturn]] void fail(Named n, char const* what, std::string const& expected, std::string const& got) const;
  [[noreturn]] void fail_dtype(Named n, std::string const& expected) const;

  void defined(Names ts) const;  // the schema passes None for a Tensor as an undefined tensor
  void float32(Names ts) const;
  void half(Named k, Named v) const;  // k 16-bit, v (when given) of k's dtype
  void same_dtype(Named n, Named ref) const;
  void ranks(Names ts, bool accum = false) const;  // accum: the GQA accumulators' 4 dims
  // n (None: no check) has ref's shape but at dim (-1: the head dim; -2: the heads), named `which`
  void shape_but(Named n, Named ref, int64_t dim, char const* which) const;
  void head_dim(char const* name, int64_t d) const;
  void kv_shapes(Named k, Named v) const;  // v (or None) has k's shape but the head dim; the head dims supported
  // num_heads_kv >= 1 and num_heads_q a positive multiple of it (query head j belongs to KV head j // group)
  void group(int64_t num_heads_q, char const* kv_name, int64_t num_heads_kv, char const* kv_src) const;
  void layouts(Names ts) const;     // last dim contiguous, other strides non-negative multiples of 16 bytes
  void alignments(Names ts) const;  // 16-byte aligned data
  void contiguous(Names ts) const;
  void no_overlaps(Names written, Names read) const;  // with itself, another written one, a read one
  void disjoint(Names written, Names read) const;
  void written_pair(Names all, Named k, Named v, Names read, Named t);  // k, v written; seqlens(t)
  void index_tensor(Named n, char const* rank = "1 dim") const;        // None, or int32, 1-D, contiguous
  // cu_seqlens/seqused; the batch (t.shape[0], varlen: cu_seqlens.numel() - 1) and rows (seqlen or total tokens)
  void seqlens(Named t);
  void arch_value(int64_t requested, char const* name = "_arch") const;
  void scalars(double scale_dk, double scale_dv) const;  // scales as floats: inf and nan pass; the path value
  // seqlens(t), then the accumulators `accums` (dK's of head dim d, then dV's of dv) against accum_layout for problem
  // `op` on the path of t's device; strides of `written`, accumulators contiguous, alignment of `aligned`.
  AccumLayout accum_side(Op op, Named t, Names written, Names accums, Names aligned, int64_t num_heads_kv, int64_t d,
                         int64_t dv);
  // The launch: grid limits (on t; heads: the most heads a grid spans), devices of ts, the code path, the plan's
  // problem and the geometry.
  Call finish(Op op, Named t, int64_t heads, int64_t num_heads_kv, int64_t d, int64_t dv, Names ts,
              bool deterministic = false) const;

 private:
  char const* op_;
  bool const varlen_;     // cu_seqlens given
  int64_t const arch_;    // the requested code path (_arch)
  int64_t batch_ = 0, rows_ = 0;  // seqlens()'s

  void no_self_overlap(Named n) const;
  void no_overlap(Named t, Named other) const;  // t (written) shares no element with other
  at::Device devices(Names ts) const;
  int resolve_arch(at::Device device) const;
  ProblemShape shape(int64_t num_heads_kv) const;
};

// Whether the kernels take head dim d (a config serves those up to its own): a positive multiple of 8 up to 256.
bool head_dim_supported(int64_t d);
// Rows are 32-bit, grid y and z 16-bit.
bool within_grid_limits(int64_t rows, int64_t heads, int64_t batch);

}  // namespace flash_epilogue
