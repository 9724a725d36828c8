// store and store_zero: their checks, then the plan's launch.

#include <algorithm>
#include <limits>
#include <utility>

#include "format.h"
#include "launch.h"
#include "ops.h"

namespace flash_epilogue {

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
  int64_t const num_heads_kv = dk.size(-2);
  Call const call =
      c.finish(Op::kStore, k, num_heads_kv, num_heads_kv, dk.size(-1), dv.size(-1), {k_in, v_in, k, v, c.cu, c.used});
  if (dk.numel() == 0) { return; }  // batch 0, seqlen 0, heads 0: nothing to launch
  bool const varlen = call.geometry.varlen;
  StoreLaunchArgs const args{.geometry = call.geometry,
                             .plan = plan(call.problem),
                             .tensors = {{describe(dk_accum, varlen), describe(dk, varlen)},
                                         {describe(dv_accum, varlen), describe(dv, varlen)}}};
  launch("store", call.device, dk.scalar_type(), args, [](auto t, auto d, auto a) { return &launch_store<t, d, a>; });
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
  int64_t const num_heads_kv = dk.size(-2);
  Call const call = c.finish(Op::kStoreZero, k, num_heads_kv, num_heads_kv, dk.size(-1), dv.size(-1),
                             {k, v, c.cu, c.used, sel[0], sel[1]});
  // No sequence is longer than the tensor's rows: the window ends there at the latest.
  int64_t const rows = call.geometry.rows, end = std::min(row_end.value_or(rows), rows);
  auto const empty = [](OptArg t) { return t.has_value() && t->numel() == 0; };  // an empty selection
  if (dk.numel() == 0 || empty(batch_idx) || empty(head_idx) || row_start >= end) { return; }
  bool const varlen = call.geometry.varlen;
  StoreZeroLaunchArgs const args{
      .geometry = call.geometry,
      .plan = plan(call.problem),
      .dk = describe(dk, varlen),
      .dv = describe(dv, varlen),
      .batch_idx = batch_idx.has_value() ? batch_idx->const_data_ptr<int>() : nullptr,
      .num_batch_idx = batch_idx.has_value() ? static_cast<int>(batch_idx->numel()) : 0,
      .head_idx = head_idx.has_value() ? head_idx->const_data_ptr<int>() : nullptr,
      .num_head_idx = head_idx.has_value() ? static_cast<int>(head_idx->numel()) : 0,
      .row_start = static_cast<int>(row_start),
      .row_end = static_cast<int>(end)};
  launch("store_zero", call.device, dk.scalar_type(), args,
         [](auto t, auto d, auto a) { return &launch_store_zero<t, d, a>; });
}

}  // namespace flash_epilogue
