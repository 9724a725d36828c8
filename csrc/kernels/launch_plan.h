#pragma once

// What a launch runs, as the binding's plan (csrc/binding/plan.cpp, the one place its rules and thresholds live)
// decides it, and the CTAs per SM each driver is compiled for. No CUTLASS types: the host compiler includes it too.

namespace flash_epilogue {

// How a launch walks its tiles.
enum class Driver : int {
  kOneCtaPerTile = 0,  // a CTA per (tensor, row tile, head, batch extent), its tile loaded straight into registers
  kStream = 1,         // sm_90: persistent CTAs, a producer warp TMA-loading the next tiles into a shared-memory ring
  kPerQueryHead = 2,   // sm_80 gqa_accumulate: a CTA per (tensor, row tile, query head), added by the collective
};

// An entry of the tile table (compiled_tile_configs): the tile's head dim (its columns) and rows.
struct TileKey {
  int head_dim = 0;
  int block_n = 0;
  bool operator==(TileKey const& o) const { return head_dim == o.head_dim && block_n == o.block_n; }
};

struct LaunchPlan {
  int arch = 90;                           // the code path: 90 (sm_90 collectives, TMA) or 80 (the sm_80 ones)
  TileKey tile;                            // dK's tile, and dV's unless dv_tile differs
  TileKey dv_tile;                         // dV's tile: where it differs, dV runs in a launch of its own
  Driver driver = Driver::kOneCtaPerTile;
  int ctas_per_sm = 1;                     // what the driver's launch bounds promise
  bool predicated = true;                  // rows predicated per sequence (the collectives' Varlen instantiation)
  bool ordered = false;                    // sm_80 gqa_accumulate: a group's adds in head order, on semaphores
  int num_sms = 0;                         // the device's multiprocessors: persistent drivers' grids
  bool dv_own_launch() const { return !(dv_tile == tile); }
};

// CTAs per SM (registers per thread: 64K / (threads x CTAs)). Two let one CTA load while the other stores, where the
// registers allow it without spilling.
// `store`'s one-CTA-per-tile driver holds one tile's fragment and nothing else: two at every tile.
inline constexpr int kStoreTileCtasPerSm = 2;
// The GQA one-CTA-per-tile drivers: two up to 256 threads, and for the staged reduce (its fragment fills from shared
// memory); a 384-thread CTA (head dim 192 on sm_90) holding more spills at two.
constexpr int gqa_tile_ctas_per_sm(int num_threads, bool staged) { return num_threads <= 256 || staged ? 2 : 1; }
// store_zero holds no fragment and no shared memory: its launch bounds ask for no minimum.
inline constexpr int kStoreZeroCtasPerSm = 1;
// The streaming drivers take the SM's shared memory for their ring: one, or two on `store`'s 64-row tiles (half the
// stages each).
inline constexpr int kStreamCtasPerSm = 1;
inline constexpr int kStreamSmallTileCtasPerSm = 2;

}  // namespace flash_epilogue
