// The GQA ops (gqa_accumulate, gqa_postprocess, gqa_accum_to_dense, gqa_reduce) and the accumulators' layout:
// their checks, then the plan's launches.

#include <algorithm>
#include <array>
#include <limits>

#include <ATen/Context.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include "device.h"
#include "format.h"
#include "launch.h"
#include "ops.h"

namespace flash_epilogue {

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
  int64_t const num_heads_q = dk_partial.size(-2), num_heads_kv = dk_accum.size(1);
  int64_t const d = dk_partial.size(-1), dv = dv_partial.size(-1);
  c.group(num_heads_q, "dk_accum", num_heads_kv, "dk_accum.shape[1]");
  AccumLayout const layout = c.accum_side(Op::kGqaAccumulate, k, {k, v}, accums, all, num_heads_kv, d, dv);
  // Only the sm_80 path has an unordered mode: deterministic there adds a group's members in head order on the
  // semaphores. The sm_90 path sums whole groups per CTA, deterministic whatever the flag, with no semaphores.
  bool const ordered_path = layout.arch < 90;
  int64_t const counters = layout.semaphore_numel;
  if (ordered_path && deterministic && !sem.t) {
    c.fail("semaphores",
           "an int32 tensor of >= " + num(counters) +
               " entries because deterministic=True on the sm_80 path (allocate the accumulator with "
               "flash_epilogue.gqa_accumulator(..., deterministic=True))",
           "None");
  }
  // The ordered mode's 1-D grid and int tickets: one work item per (row tile, batch, tensor, query head).
  int64_t const work_items = 2 * layout.tiles[0].num_tiles * layout.batch_extent * num_heads_q;
  if (ordered_path && deterministic && work_items > std::numeric_limits<int32_t>::max()) {
    c.fail("dk_partial: shape", "at most 2^31 - 1 (row tiles x batch x 2 x h_q) work items in deterministic mode",
           num(work_items));
  }
  c.index_tensor(sem);
  if (sem.t && sem.t->numel() < counters) {
    c.fail("semaphores: numel",
           ">= " + num(counters) + " (2 * batch_extent * num_tiles * num_heads_kv + 1 for dk_accum of shape " +
               num(layout.shape(0)) + ")",
           num(sem.t->numel()));
  }
  c.no_overlaps({accums[0], accums[1], sem}, {k, v, c.cu, c.used});
  Call const call = c.finish(Op::kGqaAccumulate, k, num_heads_q, num_heads_kv, d, dv,
                             {k, v, accums[0], accums[1], sem, c.cu, c.used}, deterministic);
  LaunchPlan const plan = flash_epilogue::plan(call.problem);
  // unordered atomic adds vary from run to run: under torch.use_deterministic_algorithms(True), torch's error (with
  // warn_only=True the Python wrapper warns: a C++ warning of a torch.ops call would only reach stderr)
  at::Context& ctx = at::globalContext();
  if (plan.driver == Driver::kPerQueryHead && !plan.ordered && ctx.deterministicAlgorithms() &&
      !ctx.deterministicAlgorithmsWarnOnly()) {
    ctx.alertNotDeterministic("flash_epilogue.gqa_accumulate(deterministic=False) on the sm_80 path");
  }
  if (dk_partial.numel() == 0 || dk_accum.numel() == 0) { return; }
  bool const varlen = call.geometry.varlen;
  GqaAccumulateLaunchArgs const args{
      .geometry = call.geometry,
      .plan = plan,
      .num_heads_q = static_cast<int>(num_heads_q),
      .tensors = {{describe(dk_partial, varlen), accum_desc(dk_accum)},
                  {describe(dv_partial, varlen), accum_desc(dv_accum)}},
      .semaphores = plan.ordered ? semaphores->data_ptr<int>() : nullptr};
  launch_per_tile("gqa_accumulate", call.device, at::kFloat, args,
                  [](auto, auto d, auto a) { return &launch_gqa_accumulate<d, a>; });
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
  int64_t const num_heads_kv = dk.size(-2), d = dk.size(-1), dv_dim = dv.size(-1);
  c.accum_side(Op::kGqaPostprocess, k, {k, v}, accums, all, num_heads_kv, d, dv_dim);
  c.no_overlaps({k, v}, {accums[0], accums[1], c.cu, c.used});
  Call const call = c.finish(Op::kGqaPostprocess, k, num_heads_kv, num_heads_kv, d, dv_dim,
                             {accums[0], accums[1], k, v, c.cu, c.used});
  if (dk.numel() == 0) { return; }
  bool const varlen = call.geometry.varlen;
  GqaPostprocessLaunchArgs const args{
      .geometry = call.geometry,
      .plan = plan(call.problem),
      .tensors = {{accum_desc(dk_accum), describe(dk, varlen), static_cast<float>(scale_dk)},
                  {accum_desc(dv_accum), describe(dv, varlen), static_cast<float>(scale_dv)}}};
  launch_per_tile("gqa_postprocess", call.device, dk.scalar_type(), args,
                  [](auto t, auto d, auto a) { return &launch_gqa_postprocess<t, d, a>; });
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
  int64_t const num_heads_kv = out.size(-2);
  c.accum_side(Op::kGqaAccumToDense, dense, {dense}, {in}, {in, dense}, num_heads_kv, out.size(-1), head_dim);
  c.no_overlaps({dense}, {in, c.cu, c.used});
  Call const call = c.finish(Op::kGqaAccumToDense, dense, num_heads_kv, num_heads_kv, out.size(-1), head_dim,
                             {in, dense, c.cu, c.used});
  if (out.numel() == 0) { return; }
  GqaDenseLaunchArgs const args{.geometry = call.geometry,
                                .plan = plan(call.problem),
                                .accum = accum_desc(accum),
                                .out = describe(out, call.geometry.varlen)};
  launch("gqa_accum_to_dense", call.device, at::kFloat, args,
         [](auto, auto d, auto a) { return &launch_gqa_accum_to_dense<d, a>; });
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
  int64_t const num_heads_q = dk_partial.size(-2), num_heads_kv = dk.size(-2);
  c.group(num_heads_q, "dk", num_heads_kv, "dk.shape[-2]");
  c.written_pair(all, k, v, {k_in, v_in}, k_in);
  c.disjoint({k, v}, {c.cu, c.used});
  Call const call = c.finish(Op::kGqaReduce, k_in, num_heads_q, num_heads_kv, dk.size(-1), has_dv ? dv->size(-1) : 0,
                             {k_in, v_in, k, v, c.cu, c.used});
  if (dk.numel() == 0) { return; }
  bool const varlen = call.geometry.varlen;
  GqaReduceLaunchArgs args{.geometry = call.geometry,
                           .plan = plan(call.problem),
                           .num_heads_q = static_cast<int>(num_heads_q),
                           .partial_fp32 = dk_partial.scalar_type() == at::kFloat,
                           .tensors = {{describe(dk_partial, varlen), describe(dk, varlen), static_cast<float>(scale_dk)}},
                           .num_tensors = has_dv ? 2 : 1};
  if (has_dv) { args.tensors[1] = {describe(*dv_partial, varlen), describe(*dv, varlen), static_cast<float>(scale_dv)}; }
  launch_per_tile("gqa_reduce", call.device, dk.scalar_type(), args,
                  [](auto t, auto d, auto a) { return &launch_gqa_reduce<t, d, a>; });
}

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
  std::optional<std::pair<int, int>> capability;
  try {
    if (device.is_cuda()) { capability = device_capability(device.has_index() ? device.index() : c10::cuda::current_device()); }
  } catch (c10::Error const&) {}  // a device that cannot be queried: allocating on it says why
  Problem const problem{Op::kGqaAccumulate, code_path(arch, capability),
                        ProblemShape{static_cast<int>(rows), static_cast<int>(batch), static_cast<int>(num_heads_kv),
                                     varlen},
                        false, static_cast<int>(head_dim), static_cast<int>(head_dim_v)};
  return accum_layout(problem, head_dim, head_dim_v);
}

}  // namespace flash_epilogue
