#pragma once

// CollectiveEpilogueBwd: the last step of an attention backward for one KV tile. The dK and dV
// accumulators of tile (n_block, head, batch) sit in registers as the C fragment of the dK/dV
// TiledMma (fp32); `store` converts them to the 16-bit output type and writes them to global
// memory, `store_zero` writes zeros to a tile that no query block touched.
//
// Two paths:
//   * TMA (sm_90): registers -> shared memory (stmatrix) -> one elected thread issues two TMA
//     stores. TMA clips rows >= seqlen and columns >= d (dV: >= dv) by itself. Varlen tiles take
//     it too when all kBlockN rows lie inside their sequence (and seqused): such a tile is a plain
//     box at row offset + n_block * kBlockN of the packed tensor.
//   * predicated (every sm_80 tile; on sm_90 the Varlen tiles that end a sequence): registers ->
//     shared memory -> 16-byte vectors -> global stores predicated on rows < the tile's valid rows
//     and columns < d (dv). Rows are located through SeqlenInfo (cu_seqlens / seqused, both
//     optional at run time) and clamped to the tensor's row extent, so nothing past a row or
//     column bound is ever written.
//   Why TMA for varlen's full tiles: the predicated path streamed slower than TMA stores
//   (measured: see docs/design.md), and in a long sequence nearly every tile is full.
//
// Contract for a kernel that embeds the collective:
//   * NumEpilogueThreads threads (whole warps, thread_idx in [0, NumEpilogueThreads)) call
//     `store` / `store_zero` together, with the fragments of `tiled_mma`'s thread slice.
//   * Shared memory: one TensorStorage, passed in. `store` first syncs named barrier BarrierId
//     over NumEpilogueThreads threads (so all warps are done with whatever aliased that memory);
//     the TMA path then hands the tile to its issuing warp through barrier BarrierId + 1 over
//     NumEpilogueThreads + 32 threads. Two ids, because a named barrier must never be used with
//     two thread counts at once: the warps that only arrive at the hand-off can reach the next
//     `store`'s first barrier while the issuing warp has not yet synced the hand-off, and one id
//     for both then faults ("an illegal instruction was encountered"; FA3's epilogue shares one
//     id and is safe only because a mainloop separates its calls). Calling `store` again
//     (persistent kernels) is safe: the thread that issued the TMA store waits for its read of
//     shared memory before it reaches the next call's first barrier.
//   * dK and dV may have different head dims (d, dv <= kHeadDim): each has its own shape,
//     stride and TMA descriptor; the tile is sized for kHeadDim = max(d, dv).
//   * dV is optional: with ptr_dV == nullptr only dK is written (tdVrdV is ignored), e.g. for a
//     single-tensor group reduce.
//   * Ranges: the row extent (seqlen, or total tokens in varlen) in [0, 2^31), heads and the batch
//     extent ints >= 0; block_coord's batch in [0, batch) and n_block any int (a tile with no valid
//     rows writes nothing); cu_seqlens / seqused entries any int32, consistent or not (SeqlenInfo
//     forms its sums in 64-bit and clamps them: nothing outside the tensor is written). A stored
//     tile starts at a row offset + n_block * kBlockN in [0, 2^31) (the TMA path's int32
//     coordinate); global addresses are 64-bit (64-bit strides). store_zero's row window is any
//     [row_begin, row_end) of ints.

#include <climits>

#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/arch.h>
#include <cutlass/detail/layout.hpp>

#include "flash_epilogue/fragment_utils.h"
#include "flash_epilogue/named_barrier.h"
#include "flash_epilogue/seqlen_info.h"

namespace flash_epilogue {

namespace detail {

// The widest GMMA K-major shared-memory atom whose width divides kBlockK (SW128 for 64 columns
// of 16-bit elements, then SW64, SW32, interleaved).
template <class Element, int kBlockK>
constexpr auto smem_layout_atom_k_major() {
  using namespace cute;
  if constexpr (kBlockK % decltype(size<1>(GMMA::Layout_K_SW128_Atom<Element>{}))::value == 0) {
    return GMMA::Layout_K_SW128_Atom<Element>{};
  } else if constexpr (kBlockK % decltype(size<1>(GMMA::Layout_K_SW64_Atom<Element>{}))::value == 0) {
    return GMMA::Layout_K_SW64_Atom<Element>{};
  } else if constexpr (kBlockK % decltype(size<1>(GMMA::Layout_K_SW32_Atom<Element>{}))::value == 0) {
    return GMMA::Layout_K_SW32_Atom<Element>{};
  } else {
    static_assert(kBlockK % decltype(size<1>(GMMA::Layout_K_INTER_Atom<Element>{}))::value == 0,
                  "the tile's head dim per warpgroup must be a multiple of 8");
    return GMMA::Layout_K_INTER_Atom<Element>{};
  }
}

}  // namespace detail

// Template parameters:
//   TileShape_MNK       (BLK_M, BLK_N, BLK_D) of the mainloop; BLK_N rows of K/V per tile, BLK_D =
//                       kHeadDim = max(d, dv), a multiple of 8. BLK_M is not used here.
//   Element             the 16-bit output type (cutlass::bfloat16_t or cutlass::half_t).
//   ArchTag             cutlass::arch::Sm90 (TMA path possible) or Sm80 (predicated path only).
//   NumEpilogueThreads  threads that hold the dK/dV fragments and call store (whole warps; on sm_90
//                       whole warpgroups, the MMA warpgroups of the mainloop).
//   Varlen              true: cu_seqlens and/or seqused honoured (sm_90: TMA stores for the tiles
//                       inside their sequence, predicated stores for the rest); false: no
//                       sequence metadata (sm_90: TMA stores only).
//   dKV_swapAB          the MMA computed dK^T/dV^T: fragments cover (BLK_D, BLK_N).
//   AtomLayoutKdKV      warpgroups along the head dim (shapes the TMA path's smem atom).
//   BarrierId           the first of the two named barriers the collective uses, BarrierId and
//                       BarrierId + 1, in 1..15 (default 8, 9: above the ids CUTLASS reserves,
//                       1..7; a kernel already using them passes another).
template <class TileShape_MNK_, class Element_, class ArchTag_, int NumEpilogueThreads_, bool Varlen_, bool dKV_swapAB_,
          int AtomLayoutKdKV_ = 1, int BarrierId_ = kDefaultEpilogueBarrierId>
struct CollectiveEpilogueBwd {
  using TileShape_MNK = TileShape_MNK_;  // (BLK_M, BLK_N, BLK_D); BLK_M is the mainloop's, unused here
  using Element = Element_;
  using ArchTag = ArchTag_;
  static constexpr int NumEpilogueThreads = NumEpilogueThreads_;
  static constexpr bool Varlen = Varlen_;
  static constexpr bool dKV_swapAB = dKV_swapAB_;
  static constexpr int AtomLayoutKdKV = AtomLayoutKdKV_;
  static constexpr int BarrierId = BarrierId_;           // NumEpilogueThreads threads
  static constexpr int StoreBarrierId = BarrierId_ + 1;  // the TMA store's hand-off, NumEpilogueThreads + 32
  static constexpr bool Use_TMA = ArchTag::kMinComputeCapability >= 90;  // for every tile unless Varlen
  static constexpr bool Use_Predicated = Varlen || !Use_TMA;             // compiled in; per tile when Varlen
  static constexpr int kBlockN = cute::get<1>(TileShape_MNK{});
  static constexpr int kHeadDim = cute::get<2>(TileShape_MNK{});

  static_assert(ArchTag::kMinComputeCapability >= 80, "CollectiveEpilogueBwd needs sm_80 or newer");
  static_assert(sizeof(Element) == 2, "dK/dV outputs are 16-bit (bf16 or fp16)");
  static_assert(NumEpilogueThreads % cutlass::NumThreadsPerWarp == 0, "NumEpilogueThreads must be whole warps");
  static_assert(BarrierId > 0 && StoreBarrierId <= kMaxNamedBarrierId,
                "BarrierId and BarrierId + 1 must be in [1, 15] (0 is __syncthreads)");

  // ---- predicated global stores: 16-byte vectors, consecutive threads along a row
  static constexpr int kGmemElemsPerStore = sizeof(cute::uint128_t) / sizeof(Element);
  static_assert(kHeadDim % kGmemElemsPerStore == 0, "kHeadDim must be a multiple of 8 (one 16-byte vector)");
  static constexpr int kGmemThreadsPerRow = cutlass::gcd(kHeadDim / kGmemElemsPerStore, NumEpilogueThreads);
  static constexpr int kGmemRowsPerPass = NumEpilogueThreads / kGmemThreadsPerRow;
  using GmemLayoutAtom = cute::Layout<cute::Shape<cute::Int<kGmemRowsPerPass>, cute::Int<kGmemThreadsPerRow>>,
                                      cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>;
  using GmemTiledCopydKV = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<128>, Element>{}, GmemLayoutAtom{},
      cute::Layout<cute::Shape<cute::_1, cute::Int<kGmemElemsPerStore>>>{}));  // one vector per thread and step
  static constexpr bool kEvenN = kBlockN % kGmemRowsPerPass == 0;

  // ---- shared memory. sm_90 uses GMMA's K-major swizzled atoms (what TMA expects; the predicated
  // path reads them too, in 16-byte chunks); sm_80 a plain XOR swizzle on 16-byte chunks
  // (conflict-free 16-byte reads).
  using SmemLayoutAtomdKVTMA = decltype(detail::smem_layout_atom_k_major<Element, kHeadDim / AtomLayoutKdKV>());
  using SmemLayoutdKVTMA = decltype(cute::tile_to_shape(SmemLayoutAtomdKVTMA{}, cute::select<1, 2>(TileShape_MNK{})));
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : (kHeadDim % 32 == 0 ? 32 : 16);
  static constexpr int kSwizzleBits = kBlockKSmem == 64 ? 3 : (kBlockKSmem == 32 ? 2 : 1);
  using SmemLayoutAtomdKVSTG = decltype(cute::composition(
      cute::Swizzle<kSwizzleBits, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kBlockKSmem>>, cute::Stride<cute::Int<kBlockKSmem>, cute::_1>>{}));
  using SmemLayoutAtomdKV = std::conditional_t<Use_TMA, SmemLayoutAtomdKVTMA, SmemLayoutAtomdKVSTG>;
  using SmemLayoutdKV =
      decltype(cute::tile_to_shape(SmemLayoutAtomdKV{}, cute::select<1, 2>(TileShape_MNK{})));  // (BLK_N, BLK_D)
  // The same memory seen as (BLK_D, BLK_N), for the transposed fragment of a swapAB MMA.
  using SmemLayoutdKVt = decltype(cute::composition(
      SmemLayoutdKV{}, cute::make_layout(cute::make_shape(cute::Int<kHeadDim>{}, cute::Int<kBlockN>{}),
                                         cute::make_stride(cute::Int<kBlockN>{}, cute::_1{}))));

  // Registers -> shared: stmatrix on sm_90 (transposing for swapAB), 16-byte vectors on sm_80.
  using SmemCopyAtomdKV = cute::Copy_Atom<
      std::conditional_t<ArchTag::kMinComputeCapability >= 90,
                         std::conditional_t<!dKV_swapAB, cute::SM90_U32x4_STSM_N, cute::SM90_U16x8_STSM_T>,
                         cute::AutoVectorizingCopyWithAssumedAlignment<128>>,
      Element>;

  static constexpr size_t SmemAlignmentdKV =
      ArchTag::kMinComputeCapability >= 90 ? cutlass::detail::alignment_for_swizzle(SmemLayoutdKV{}) : 128;
  static_assert(SmemAlignmentdKV >= 128, "shared-memory tiles need at least 128-byte alignment");

  // No empty base (cute::aligned_struct): kernels put this in a union inside a SharedStorage that itself derives
  // from an aligned_struct, and two empty bases of one type may not share an address, so the compiler would move
  // the union by its alignment (1 KB more shared memory). The members carry the alignment.
  struct TensorStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutdKV>, SmemAlignmentdKV> smem_dk;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutdKV>, SmemAlignmentdKV> smem_dv;
  };

  using ShapedKV = cute::Shape<int32_t, int32_t, int32_t, int32_t>;  // (seqlen or total_tokens, d, head, batch)
  using StridedKV = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;

  using TMA_dKV = std::conditional_t<Use_TMA,
                                     decltype(cute::make_tma_copy(
                                         cute::SM90_TMA_STORE{},
                                         cute::make_tensor(cute::make_gmem_ptr(static_cast<Element*>(nullptr)),
                                                           ShapedKV{}, StridedKV{}),
                                         SmemLayoutdKVTMA{}, cute::select<1, 2>(TileShape_MNK{}), cute::_1{})),
                                     std::nullptr_t>;

  // Host side. In varlen (cu_seqlens set) the layout is (total_tokens, d, head, 1).
  struct Arguments {
    Element* ptr_dK;
    ShapedKV shape_dK;
    StridedKV stride_dK;
    Element* ptr_dV;    // may be null: dK only
    ShapedKV shape_dV;  // same as shape_dK but for the head dim, which may differ (dv != d)
    StridedKV stride_dV;
    int const* cu_seqlens = nullptr;  // (batch + 1,), Varlen only
    int const* seqused = nullptr;     // (batch,), Varlen only
  };

  // Device side.
  struct Params {
    Element* ptr_dK;
    ShapedKV shape_dK;
    StridedKV stride_dK;
    Element* ptr_dV;
    ShapedKV shape_dV;
    StridedKV stride_dV;
    TMA_dKV tma_store_dK;
    TMA_dKV tma_store_dV;
    int const* cu_seqlens;
    int const* seqused;
  };

  // Why `args` cannot run on this collective, or nullptr if it can. Building a TMA descriptor from
  // arguments that fail here is undefined (make_tma_copy asserts, or under NDEBUG silently encodes
  // garbage), so call this first.
  static char const* can_implement(Arguments const& args) {
    auto check_one = [](Element const* ptr, ShapedKV const& shape, StridedKV const& stride) -> char const* {
      int const d = cute::get<1>(shape);
      if (d <= 0 || d > kHeadDim) { return "head dim must be in [1, kHeadDim]"; }
      if (d % kGmemElemsPerStore != 0) { return "head dim must be a multiple of 8 (16-byte vectors)"; }
      if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) { return "tensor start must be 16-byte aligned"; }
      int64_t const strides[3] = {cute::get<0>(stride), cute::get<2>(stride), cute::get<3>(stride)};
      for (int64_t s : strides) {
        if (s < 0 || (s * int64_t(sizeof(Element))) % 16 != 0) {
          return "row, head and batch strides must be non-negative multiples of 16 bytes";
        }
        if (Use_TMA && s * int64_t(sizeof(Element)) >= (int64_t(1) << 40)) {
          return "TMA strides must be < 2^40 bytes";
        }
      }
      if (cute::get<0>(shape) < 0 || cute::get<2>(shape) < 0 || cute::get<3>(shape) < 0) { return "negative extent"; }
      if (Use_TMA && (cute::get<0>(shape) == 0 || cute::get<2>(shape) == 0 || cute::get<3>(shape) == 0)) {
        return "TMA cannot encode an empty tensor: return before launching";
      }
      return nullptr;
    };
    if (char const* why = check_one(args.ptr_dK, args.shape_dK, args.stride_dK)) { return why; }
    if (args.ptr_dV == nullptr) { return nullptr; }
    if (char const* why = check_one(args.ptr_dV, args.shape_dV, args.stride_dV)) { return why; }
    if (cute::get<0>(args.shape_dK) != cute::get<0>(args.shape_dV) ||
        cute::get<2>(args.shape_dK) != cute::get<2>(args.shape_dV) ||
        cute::get<3>(args.shape_dK) != cute::get<3>(args.shape_dV)) {
      return "dK and dV must agree on rows, heads and batch";
    }
    if (!Varlen && (args.cu_seqlens || args.seqused)) { return "cu_seqlens/seqused need Varlen = true"; }
    return nullptr;
  }

  static Params to_underlying_arguments(Arguments const& args) {
    auto make_store = [](Element* ptr, ShapedKV const& shape, StridedKV const& stride) {
      if constexpr (Use_TMA) {
        auto mdKV = cute::make_tensor(cute::make_gmem_ptr(ptr), shape, stride);
        return cute::make_tma_copy(cute::SM90_TMA_STORE{}, mdKV, SmemLayoutdKVTMA{},
                                   cute::select<1, 2>(TileShape_MNK{}), cute::_1{});  // no multicast for dK/dV
      } else {
        return nullptr;
      }
    };
    bool const has_dv = args.ptr_dV != nullptr;  // without dV, its descriptor is dK's (never used)
    return {args.ptr_dK,
            args.shape_dK,
            args.stride_dK,
            args.ptr_dV,
            args.shape_dV,
            args.stride_dV,
            make_store(args.ptr_dK, args.shape_dK, args.stride_dK),
            has_dv ? make_store(args.ptr_dV, args.shape_dV, args.stride_dV)
                   : make_store(args.ptr_dK, args.shape_dK, args.stride_dK),
            args.cu_seqlens,
            args.seqused};
  }

  // Ideally from one thread, early in the kernel.
  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    if constexpr (Use_TMA) {
      cute::prefetch_tma_descriptor(params.tma_store_dK.get_tma_descriptor());
      if (params.ptr_dV) { cute::prefetch_tma_descriptor(params.tma_store_dV.get_tma_descriptor()); }
    }
  }

  // tdKrdK / tdVrdV: fp32 C fragments of `tiled_mma`'s slice for thread_idx, covering
  // (BLK_N, BLK_D) (or (BLK_D, BLK_N) with dKV_swapAB). block_coord = (n_block, head, batch).
  template <class FrgTensor, class TiledMma>
  CUTLASS_DEVICE void store(Params const& params, FrgTensor const& tdKrdK, FrgTensor const& tdVrdV,
                            TensorStorage& storage, TiledMma const& tiled_mma, int thread_idx,
                            cute::tuple<int32_t, int32_t, int32_t> const& block_coord) const {
    using namespace cute;
    auto [n_block, bidh, bidb] = block_coord;
    bool const has_dv = params.ptr_dV != nullptr;
    Tensor sdK =
        as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(storage.smem_dk.data()), SmemLayoutdKV{}));
    Tensor sdV =
        as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(storage.smem_dv.data()), SmemLayoutdKV{}));
    Tensor sdKt =
        as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(storage.smem_dk.data()), SmemLayoutdKVt{}));
    Tensor sdVt =
        as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(storage.smem_dv.data()), SmemLayoutdKVt{}));

    auto smem_tiled_copy_dKV = make_tiled_copy_C(SmemCopyAtomdKV{}, tiled_mma);
    auto smem_thr_copy_dKV = smem_tiled_copy_dKV.get_thread_slice(thread_idx);

    Tensor taccdKsdK = smem_thr_copy_dKV.partition_D(
        cute::conditional_return<!dKV_swapAB>(sdK, sdKt));  // ((Atom,AtomNum), PIPE_M, PIPE_N)
    Tensor taccdVsdV = smem_thr_copy_dKV.partition_D(
        cute::conditional_return<!dKV_swapAB>(sdV, sdVt));  // ((Atom,AtomNum), PIPE_M, PIPE_N)

    // Convert one fragment and copy it to its shared-memory tile. One tensor at a time, so only one
    // 16-bit copy is live (a driver holding a single fp32 fragment stays small enough for two CTAs
    // per SM).
    auto to_smem = [&](FrgTensor const& frag, auto& smem_partition) {
      Tensor frag_out = make_tensor_like<Element>(frag);
      convert_fragment(frag, frag_out);
      Tensor tacc_frag = smem_thr_copy_dKV.retile_S(frag_out);  // ((Atom,AtomNum), MMA_M, MMA_N)
      if constexpr (decltype(size(tdKrdK))::value * NumEpilogueThreads <= kBlockN * kHeadDim) {
        cute::copy(smem_tiled_copy_dKV, tacc_frag, smem_partition);
      } else {
        // The TiledMma's tile does not divide (kBlockN, kHeadDim) (FA3's sm_80 hdim-192 config: N = 80
        // in steps of 32), so the fragment has padding elements whose smem address lies outside the
        // tile. Copy element by element, only those inside.
        auto tile_shape =
            cute::conditional_return<!dKV_swapAB>(select<1, 2>(TileShape_MNK{}), select<2, 1>(TileShape_MNK{}));
        Tensor taccdKVcdKV = smem_thr_copy_dKV.partition_D(make_identity_tensor(tile_shape));
        Tensor tdKVpdKV = make_tensor<bool>(shape(taccdKVcdKV));
#pragma unroll
        for (int i = 0; i < size(tdKVpdKV); ++i) { tdKVpdKV(i) = elem_less(taccdKVcdKV(i), tile_shape); }
        cute::copy_if(tdKVpdKV, tacc_frag, smem_partition);
      }
    };

    // Every epilogue warp is done with whatever last lived in this shared memory.
    named_barrier_sync(NumEpilogueThreads, BarrierId);
    if (has_dv) { to_smem(tdVrdV, taccdVsdV); }
    to_smem(tdKrdK, taccdKsdK);

    // Varlen: a tile whose rows all lie inside its sequence is stored by TMA like a batched one.
    // The same answer in every thread (one tile), so the paths' barriers match.
    int const rows = get<0>(params.shape_dK);
    SeqlenInfo<kBlockN> const seqlen_info = Varlen ? SeqlenInfo<kBlockN>{bidb, rows, params.cu_seqlens, params.seqused}
                                                   : SeqlenInfo<kBlockN>{bidb, rows, nullptr, nullptr};
    [[maybe_unused]] bool const full_tile = !Varlen || seqlen_info.valid_rows(n_block, rows) >= kBlockN;
    if constexpr (Use_TMA) {
      if (full_tile) {
        tma_store_tile(params, sdK, sdV, thread_idx, n_block, bidh, Varlen && params.cu_seqlens ? 0 : bidb,
                       seqlen_info.offset);
        return;
      }
    }
    if constexpr (Use_Predicated) {
      named_barrier_sync(NumEpilogueThreads, BarrierId);
      store_from_smem(params, sdK, sdV, thread_idx, seqlen_info, block_coord);
    }
  }

  // Nothing is left in flight after `store` returns; kept for the mainloop/epilogue interface.
  CUTLASS_DEVICE void store_tail() const {}

  // Zeros to the valid rows and columns of tile (n_block, head, batch), through the predicated
  // path whatever Varlen is (no shared memory, no barrier). Optionally only the rows of the tile
  // inside [row_begin, row_end), counted from the sequence's start (so callers can zero a row
  // range that does not align to kBlockN).
  CUTLASS_DEVICE void store_zero(Params const& params, int thread_idx,
                                 cute::tuple<int32_t, int32_t, int32_t> const& block_coord, int row_begin = 0,
                                 int row_end = INT_MAX) const {
    using namespace cute;
    auto [n_block, bidh, bidb] = block_coord;
    SeqlenInfo<kBlockN> const seqlen_info{bidb, get<0>(params.shape_dK), params.cu_seqlens, params.seqused};
    // The tile-relative window in 64-bit (n_block * kBlockN may pass 2^31), clamped to [0, kBlockN]
    // before it goes back to int: rows outside it are never written anyway.
    auto clamp_rows = [](int64_t r) { return static_cast<int>(r < 0 ? 0 : (r > kBlockN ? kBlockN : r)); };
    int64_t const tile_start = int64_t(n_block) * kBlockN;
    int const first_row = clamp_rows(row_begin - tile_start);
    int const end_row = clamp_rows(row_end - tile_start);
    int const valid_rows = cute::min(seqlen_info.valid_rows(n_block, get<0>(params.shape_dK)), end_row);
    if (valid_rows <= 0 || first_row >= valid_rows) { return; }
    Tensor gdK =
        tile_of(params.ptr_dK, params.shape_dK, params.stride_dK, params, seqlen_info, block_coord);  // (BLK_N, BLK_D)
    Tensor gdV =
        tile_of(params.ptr_dV, params.shape_dV, params.stride_dV, params, seqlen_info, block_coord);  // (BLK_N, BLK_D)
    bool const has_dv = params.ptr_dV != nullptr;

    GmemTiledCopydKV gmem_tiled_copy_dKV;
    auto gmem_thr_copy_dKV = gmem_tiled_copy_dKV.get_thread_slice(thread_idx);
    Tensor tdKVgdK = gmem_thr_copy_dKV.partition_D(gdK);
    Tensor tdKVgdV = gmem_thr_copy_dKV.partition_D(gdV);
    Tensor tdKVrZero = make_fragment_like(tdKVgdK);
    clear(tdKVrZero);
    Tensor tdKVcdKV = gmem_thr_copy_dKV.partition_D(make_identity_tensor(select<1, 2>(TileShape_MNK{})));
    copy_predicated(gmem_tiled_copy_dKV, tdKVrZero, tdKVgdK, tdKVcdKV,
                    column_predicate(tdKVcdKV, get<1>(params.shape_dK)), valid_rows, first_row);
    if (has_dv) {
      copy_predicated(gmem_tiled_copy_dKV, tdKVrZero, tdKVgdV, tdKVcdKV,
                      column_predicate(tdKVcdKV, get<1>(params.shape_dV)), valid_rows, first_row);
    }
  }

 private:
  // Both shared-memory tiles -> global through TMA: tile n_block of rows [row_offset, ...) of
  // (head, batch). Every epilogue thread calls it after writing shared memory.
  template <class SmemTensor>
  CUTLASS_DEVICE static void tma_store_tile(Params const& params, SmemTensor const& sdK, SmemTensor const& sdV,
                                            int thread_idx, int n_block, int head, int batch, int row_offset) {
    using namespace cute;
    cutlass::arch::fence_view_async_shared();  // generic-proxy smem writes -> visible to TMA
    // Everyone arrives; only the last warp waits, so the others move on at once.
    named_barrier_arrive(NumEpilogueThreads + cutlass::NumThreadsPerWarp, StoreBarrierId);
    auto tile = [&](auto const& tma, auto const& shape) {
      Tensor m =
          domain_offset(make_coord(row_offset, _0{}), tma.get_tma_tensor(shape)(_, _, head, batch));  // (rows, d)
      return local_tile(m, select<1, 2>(TileShape_MNK{}), make_coord(n_block, _0{}));                 // (BLK_N, BLK_D)
    };
    Tensor gdK = tile(params.tma_store_dK, params.shape_dK);
    Tensor gdV = tile(params.tma_store_dV, params.shape_dV);
    auto block_tma_dK = params.tma_store_dK.get_slice(_0{});
    auto block_tma_dV = params.tma_store_dV.get_slice(_0{});
    Tensor tdKgdK = block_tma_dK.partition_D(gdK);  // (TMA, TMA_N, TMA_D)
    Tensor tdKsdK = block_tma_dK.partition_S(sdK);  // (TMA, TMA_N, TMA_D)
    Tensor tdVgdV = block_tma_dV.partition_D(gdV);  // (TMA, TMA_N, TMA_D)
    Tensor tdVsdV = block_tma_dV.partition_S(sdV);  // (TMA, TMA_N, TMA_D)
    int const warp_idx = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarp, 0);
    if (warp_idx == NumEpilogueThreads / cutlass::NumThreadsPerWarp - 1) {
      named_barrier_sync(NumEpilogueThreads + cutlass::NumThreadsPerWarp, StoreBarrierId);
      if (cute::elect_one_sync()) {
        if (params.ptr_dV != nullptr) { cute::copy(params.tma_store_dV, tdVsdV, tdVgdV); }
        cute::copy(params.tma_store_dK, tdKsdK, tdKgdK);
        tma_store_arrive();
      }
    }
    // Only the issuing thread has a bulk group: it waits until TMA has read shared memory.
    tma_store_wait<0>();
  }

  // The (BLK_N, BLK_D) global tile of one output, offset to its sequence's start in varlen.
  template <class ShapeT, class StrideT>
  CUTLASS_DEVICE static auto tile_of(Element* ptr, ShapeT const& shape, StrideT const& stride, Params const& params,
                                     SeqlenInfo<kBlockN> const& seqlen_info,
                                     cute::tuple<int32_t, int32_t, int32_t> const& block_coord) {
    using namespace cute;
    auto [n_block, bidh, bidb] = block_coord;
    bool const is_varlen = params.cu_seqlens != nullptr;
    Tensor m = make_tensor(make_gmem_ptr(ptr), shape, stride)(_, _, bidh, is_varlen ? 0 : bidb);  // (rows, d)
    return local_tile(domain_offset(make_coord(seqlen_info.offset, _0{}), m), select<1, 2>(TileShape_MNK{}),
                      make_coord(n_block, _0{}));
  }

  // One flag per 16-byte column block of this thread's partition: inside [0, num_cols).
  template <class IdentityTensor>
  CUTLASS_DEVICE static auto column_predicate(IdentityTensor const& identity, int num_cols) {
    using namespace cute;
    Tensor pred = make_tensor<bool>(make_shape(size<2>(identity)));
#pragma unroll
    for (int k = 0; k < size(pred); ++k) { pred(k) = get<1>(identity(_0{}, _0{}, k)) < num_cols; }
    return pred;
  }

  template <class SmemTensor>
  CUTLASS_DEVICE void store_from_smem(Params const& params, SmemTensor const& sdK, SmemTensor const& sdV,
                                      int thread_idx, SeqlenInfo<kBlockN> const& seqlen_info,
                                      cute::tuple<int32_t, int32_t, int32_t> const& block_coord) const {
    using namespace cute;
    int const n_block = get<0>(block_coord);
    int const valid_rows = seqlen_info.valid_rows(n_block, get<0>(params.shape_dK));
    Tensor gdK =
        tile_of(params.ptr_dK, params.shape_dK, params.stride_dK, params, seqlen_info, block_coord);  // (BLK_N, BLK_D)
    Tensor gdV =
        tile_of(params.ptr_dV, params.shape_dV, params.stride_dV, params, seqlen_info, block_coord);  // (BLK_N, BLK_D)

    GmemTiledCopydKV gmem_tiled_copy_dKV;
    auto gmem_thr_copy_dKV = gmem_tiled_copy_dKV.get_thread_slice(thread_idx);
    Tensor tdKVsdK = gmem_thr_copy_dKV.partition_S(sdK);  // (CPY, CPY_N, CPY_D)
    Tensor tdKVsdV = gmem_thr_copy_dKV.partition_S(sdV);
    Tensor tdKVgdK = gmem_thr_copy_dKV.partition_D(gdK);
    Tensor tdKVgdV = gmem_thr_copy_dKV.partition_D(gdV);
    Tensor tdKVrdK = make_fragment_like(tdKVgdK);
    Tensor tdKVrdV = make_fragment_like(tdKVgdV);
    Tensor tdKVcdKV = gmem_thr_copy_dKV.partition_D(make_identity_tensor(select<1, 2>(TileShape_MNK{})));
    Tensor all_columns = make_tensor<bool>(make_shape(size<2>(tdKVcdKV)));
    fill(all_columns, true);
    // Shared memory holds the whole tile: read it all (only rows past kBlockN when the thread
    // layout does not divide kBlockN are skipped).
    bool const has_dv = params.ptr_dV != nullptr;
    if (has_dv) { copy_predicated<!kEvenN>(gmem_tiled_copy_dKV, tdKVsdV, tdKVrdV, tdKVcdKV, all_columns, kBlockN); }
    copy_predicated<!kEvenN>(gmem_tiled_copy_dKV, tdKVsdK, tdKVrdK, tdKVcdKV, all_columns, kBlockN);
    if (has_dv) {
      copy_predicated(gmem_tiled_copy_dKV, tdKVrdV, tdKVgdV, tdKVcdKV,
                      column_predicate(tdKVcdKV, get<1>(params.shape_dV)), valid_rows);
    }
    copy_predicated(gmem_tiled_copy_dKV, tdKVrdK, tdKVgdK, tdKVcdKV,
                    column_predicate(tdKVcdKV, get<1>(params.shape_dK)), valid_rows);
  }
};

}  // namespace flash_epilogue
