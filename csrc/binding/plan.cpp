// The dispatch plan (plan.h): every rule that picks a launch, each threshold a named constant.

#include "plan.h"

#include <algorithm>
#include <iterator>
#include <string>

#include <c10/util/Exception.h>

#include "device.h"
#include "static_switch.h"

namespace flash_epilogue {

namespace {

// store, sm_90, head dim 64: one CTA per tile (the 32 KB fp32 tiles are small enough for two CTAs per SM, which beat
// streaming). With cu_seqlens and sequences of at least this many rows on average, store's 64-row tiles, one CTA
// each, are faster still; batched, or with shorter sequences, FA3's 128-row tiles.
constexpr int64_t kStoreRows64MinAverageRows = 2048;

// store, sm_90, head dim 192/256: up to this many output tiles (dK's and dV's) per SM, one CTA per tile: on one or
// two 72-80 KB tiles per SM the streaming driver's prologue is not paid back. Above it, streamed.
constexpr int64_t kStoreTilesPerSmUnstreamed = 2;

// store, sm_90, head dim 128: up to this many output tiles (dK's and dV's, of FA3's 128-row tile) per SM, store's
// 64-row tiles two CTAs to an SM: batched, one CTA per tile; with cu_seqlens, streamed. Above it, FA3's tiles
// streamed, one CTA per SM.
constexpr int64_t kStoreTilesPerSmRows64 = 1;

// The GQA ops on sm_90 at a d served by head dim 256 beside a dv of at most 128: dV on the FA3 tile serving dv (a
// launch of its own; an accumulator of that tile) once the problem has at least this many of dK's 80-row tiles
// (row tiles x KV heads x batch extent). The 256 columns of dK's tile would leave half of each stage and
// accumulator tile idle on dV's columns; below the gate the second launch costs more than it saves.
// gqa_accumulate and gqa_postprocess (one accumulator layout, so one gate): from about 2.7 tiles per SM.
constexpr int64_t kDvOwnTileMinTilesAccumulator = 352;
// gqa_reduce, whose dV launch saves only idle stage columns: from about 9 tiles per SM.
constexpr int64_t kDvOwnTileMinTilesReduce = 1152;
constexpr int kDvOwnTileSharedHeadDim = 256;  // dK's tile head dim the rule applies to
constexpr int kDvOwnTileMaxHeadDim = 128;     // the largest dv tile head dim it applies to

TileKey store_rows64_tile(int head_dim) {
  for (CompiledTileConfig const& c : compiled_tile_configs()) {
    if (!c.fa3 && c.arch == 90 && c.head_dim == head_dim && c.block_n == 64) { return {head_dim, 64}; }
  }
  C10_THROW_ERROR(Error, "flash_epilogue: internal: no 64-row store tile at head dim " + std::to_string(head_dim));
}

LaunchPlan plan_store(Problem const& p, LaunchPlan plan) {
  int const hd = plan.tile.head_dim;
  ProblemShape const& s = p.shape;
  int64_t const output_tiles = 2 * s.tiles(plan.tile.block_n);  // dK's and dV's, of FA3's tile
  int64_t const sms = std::max(p.num_sms, 1);
  if (p.arch < 90) {
    // one CTA per tile (no TMA)
  } else if (hd <= 64) {
    if (s.varlen && s.rows >= kStoreRows64MinAverageRows * s.batch) { plan.tile = store_rows64_tile(hd); }
  } else if (hd > 128 && output_tiles <= kStoreTilesPerSmUnstreamed * sms) {
    // one CTA per tile
  } else if (hd == 128 && output_tiles <= kStoreTilesPerSmRows64 * sms) {
    plan.tile = store_rows64_tile(hd);
    if (s.varlen) {
      plan.driver = Driver::kStream;
      plan.ctas_per_sm = kStreamSmallTileCtasPerSm;
    }
  } else {
    plan.driver = Driver::kStream;
    plan.ctas_per_sm = kStreamCtasPerSm;
  }
  if (plan.driver == Driver::kOneCtaPerTile) { plan.ctas_per_sm = kStoreTileCtasPerSm; }
  plan.dv_tile = plan.tile;
  return plan;
}

// dV's tile for the GQA ops (see kDvOwnTileMinTilesAccumulator and kDvOwnTileMinTilesReduce).
TileKey gqa_dv_tile(Problem const& p, TileKey shared) {
  if (p.arch < 90 || p.head_dim_v == 0 || shared.head_dim != kDvOwnTileSharedHeadDim) { return shared; }
  if (serving_head_dim(p.head_dim_v) > kDvOwnTileMaxHeadDim || !head_dim_built(p.head_dim_v)) { return shared; }
  int64_t const gate = p.op == Op::kGqaReduce ? kDvOwnTileMinTilesReduce : kDvOwnTileMinTilesAccumulator;
  return p.shape.tiles(shared.block_n) >= gate ? fa3_tile(p.head_dim_v, p.arch) : shared;
}

}  // namespace

std::vector<std::pair<char const*, int64_t>> plan_thresholds() {
  return {{"store_rows64_min_average_rows", kStoreRows64MinAverageRows},
          {"store_tiles_per_sm_unstreamed", kStoreTilesPerSmUnstreamed},
          {"store_tiles_per_sm_rows64", kStoreTilesPerSmRows64},
          {"dv_own_tile_min_tiles_accumulator", kDvOwnTileMinTilesAccumulator},
          {"dv_own_tile_min_tiles_reduce", kDvOwnTileMinTilesReduce},
          {"dv_own_tile_shared_head_dim", kDvOwnTileSharedHeadDim},
          {"dv_own_tile_max_head_dim", kDvOwnTileMaxHeadDim}};
}

int serving_head_dim(int64_t width) {
  for (int hd : {FLASH_EPILOGUE_ALL_HEAD_DIMS}) {
    if (width <= hd) { return hd; }
  }
  return 0;
}

bool head_dim_built(int64_t d) {
  return std::count(std::begin(kFlashEpilogueHeadDims), std::end(kFlashEpilogueHeadDims), serving_head_dim(d)) > 0;
}

CompiledTileConfig const& tile_config(TileKey key, int arch) {
  for (CompiledTileConfig const& c : compiled_tile_configs()) {
    if (c.arch == arch && c.head_dim == key.head_dim && c.block_n == key.block_n) { return c; }
  }
  C10_THROW_ERROR(Error, "flash_epilogue: internal: no tile of head dim " + std::to_string(key.head_dim) + " and " +
                             std::to_string(key.block_n) + " rows on the sm_" + std::to_string(arch) + " path");
}

TileKey fa3_tile(int64_t width, int arch) {
  int const hd = serving_head_dim(width);
  for (CompiledTileConfig const& c : compiled_tile_configs()) {
    if (c.fa3 && c.arch == arch && c.head_dim == hd) { return {c.head_dim, c.block_n}; }
  }
  C10_THROW_ERROR(Error, "flash_epilogue: internal: no tile for head dim " + std::to_string(width) + " on sm_" +
                             std::to_string(arch));
}

int code_path(int64_t requested, std::optional<std::pair<int, int>> capability) {
  if (requested != 0) { return static_cast<int>(requested); }
  if (!capability) { return 90; }
  return *capability == std::pair{9, 0} && compiled_for("sm_90a") ? 90 : 80;
}

LaunchPlan plan(Problem const& p) {
  LaunchPlan plan;
  plan.arch = p.arch;
  plan.num_sms = p.num_sms;
  plan.tile = fa3_tile(std::max(p.head_dim, p.head_dim_v), p.arch);
  plan.dv_tile = plan.tile;
  // Rows predicated per sequence with sequence metadata, and always on the sm_80 path (compiled predicated only).
  plan.predicated = p.arch < 90 || p.shape.varlen || p.seqused;
  switch (p.op) {
    case Op::kStore:
      return plan_store(p, plan);
    case Op::kStoreZero:  // the sm_80 collective's predicated zeros on every path
      plan.ctas_per_sm = kStoreZeroCtasPerSm;
      plan.predicated = true;
      return plan;
    case Op::kGqaAccumToDense:
      plan.ctas_per_sm = gqa_tile_ctas_per_sm(tile_config(plan.tile, p.arch).num_threads, /*staged=*/false);
      return plan;
    case Op::kGqaAccumulate:
      plan.dv_tile = gqa_dv_tile(p, plan.tile);
      if (p.arch >= 90) {  // whole groups summed in head order by one CTA: ordered in both modes, no semaphores
        plan.driver = Driver::kStream;
        plan.ctas_per_sm = kStreamCtasPerSm;
      } else {  // atomic adds per query head; deterministic: in head order on semaphores
        plan.driver = Driver::kPerQueryHead;
        plan.ctas_per_sm = gqa_tile_ctas_per_sm(tile_config(plan.tile, p.arch).num_threads, /*staged=*/false);
        plan.ordered = p.deterministic;
      }
      return plan;
    case Op::kGqaPostprocess:
      plan.dv_tile = gqa_dv_tile(p, plan.tile);
      plan.ctas_per_sm = gqa_tile_ctas_per_sm(tile_config(plan.tile, p.arch).num_threads, /*staged=*/false);
      return plan;
    case Op::kGqaReduce:
      plan.dv_tile = gqa_dv_tile(p, plan.tile);
      if (p.arch >= 90) {
        plan.driver = Driver::kStream;
        plan.ctas_per_sm = kStreamCtasPerSm;
      } else {  // the swapAB tiles stage their rows through shared memory
        CompiledTileConfig const& c = tile_config(plan.tile, p.arch);
        plan.ctas_per_sm = gqa_tile_ctas_per_sm(c.num_threads, /*staged=*/c.swap_ab);
      }
      return plan;
  }
  C10_THROW_ERROR(Error, "flash_epilogue: internal: no plan for this op");
}

AccumLayout accum_layout(Problem const& p, int64_t d, int64_t dv) {
  LaunchPlan const lp = plan(p);
  auto const tiles = [&](TileKey key, int64_t width) {
    CompiledTileConfig const& c = tile_config(key, p.arch);
    return AccumLayout::Tiles{c.head_dim, c.block_n, p.shape.row_tiles(c.block_n),
                              c.accum_tile_elems_for(static_cast<int>(width))};
  };
  AccumLayout layout{p.arch, p.shape.batch_extent(), p.shape.num_heads_kv, {tiles(lp.tile, d), tiles(lp.dv_tile, dv)}};
  if (p.arch < 90) { layout.semaphore_numel = SemaphoreWorkspace::of(p.shape, lp.tile.block_n).numel(); }
  return layout;
}

}  // namespace flash_epilogue
