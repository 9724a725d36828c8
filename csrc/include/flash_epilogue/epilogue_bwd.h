#pragma once

// CollectiveEpilogueBwd: the fp32 dK/dV C fragments of tile (n_block, head, batch) -> 16-bit dK/dV in
// global memory (`store`), or zeros to a tile no query block touched (`store_zero`). Two paths:
//   * TMA (sm_90): stmatrix to smem, one elected thread issues both TMA stores (TMA clips at the tensor's
//     bounds). Varlen tiles whose kBlockN rows all lie in their sequence take it too (a plain box of the
//     packed tensor): nearly every tile of a long sequence, and TMA beats predicated stores.
//   * predicated (sm_80; sm_90 varlen tiles that end a sequence): smem -> 16-byte global stores on rows <
//     the tile's valid rows (SeqlenInfo, clamped to the row extent) and columns < d: nothing out of bounds.
//
// Contract:
//   * NumEpilogueThreads threads call `store` / `store_zero` together with their `tiled_mma` slice's
//     fragments and one TensorStorage. `store` first syncs barrier BarrierId over them (the smem may alias
//     other buffers); the TMA path then hands the tile to its issuing warp through BarrierId + 1 over
//     NumEpilogueThreads + 32. Two ids, because a named barrier used at two thread counts at once faults
//     ("illegal instruction"): warps that only arrive at the hand-off can reach the next `store`'s first
//     barrier first (FA3 shares one id, safe only because a mainloop separates its calls). Repeated calls
//     (persistent kernels) are safe: the TMA issuer waits for the smem read.
//   * dK and dV have their own shape, stride and TMA descriptor (d, dv <= kHeadDim); ptr_dV == nullptr
//     writes dK only.
//   * Ranges: row extent in [0, 2^31); n_block any int (no valid rows: nothing written); cu_seqlens /
//     seqused any int32 (nothing outside the tensor is written). A TMA tile's start row must be < 2^31.

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

// The widest GMMA K-major shared-memory atom whose width divides kBlockK (SW128, SW64, SW32, interleaved).
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

// TileShape_MNK (BLK_M unused, BLK_D = max(d, dv)); Element bf16 or fp16; ArchTag Sm90 or Sm80 (predicated
// only); NumEpilogueThreads (whole warpgroups on sm_90); Varlen: cu_seqlens / seqused honoured at run time;
// dKV_swapAB: fragments cover (BLK_D, BLK_N); AtomLayoutKdKV: warpgroups along D; BarrierId: see above.
template <class TileShape_MNK_, class Element_, class ArchTag_, int NumEpilogueThreads_, bool Varlen_, bool dKV_swapAB_,
          int AtomLayoutKdKV_ = 1, int BarrierId_ = kDefaultEpilogueBarrierId>
struct CollectiveEpilogueBwd {
  using TileShape_MNK = TileShape_MNK_;
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

  // ---- shared memory: GMMA's K-major swizzled atoms on sm_90 (what TMA expects), a plain XOR
  // swizzle on 16-byte chunks on sm_80 (conflict-free 16-byte reads).
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

  // No empty aligned_struct base: inside a union in an aligned_struct-derived SharedStorage, two empty bases of one
  // type may not share an address, which would cost 1 KB of shared memory. The members carry the alignment.
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

  // Why `args` cannot run, or nullptr. Call it first: make_tma_copy on failing arguments asserts, or
  // under NDEBUG encodes garbage.
  static char const* can_implement(Arguments const& args) {
    auto check_one = [](Element const* ptr, ShapedKV const& shape, StridedKV const& stride) -> char const* {
      int const d = cute::get<1>(shape);
      if (d <= 0 || d > kHeadDim) { return "head dim must be in [1, kHeadDim]"; }
      if (d % kGmemElemsPerStore != 0) { return "head dim must be a multiple of 8 (16-byte vectors)"; }
      if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) { return "tensor start must be 16-byte aligned"; }
      for (int64_t s : {cute::get<0>(stride), cute::get<2>(stride), cute::get<3>(stride)}) {
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
    if (!(cute::select<0, 2, 3>(args.shape_dK) == cute::select<0, 2, 3>(args.shape_dV))) {
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
    return {args.ptr_dK, args.shape_dK, args.stride_dK, args.ptr_dV, args.shape_dV, args.stride_dV,
            make_store(args.ptr_dK, args.shape_dK, args.stride_dK),  // without dV, dV's descriptor is dK's (unused)
            args.ptr_dV != nullptr ? make_store(args.ptr_dV, args.shape_dV, args.stride_dV)
                   : make_store(args.ptr_dK, args.shape_dK, args.stride_dK),
            args.cu_seqlens, args.seqused};
  }

  // Ideally from one thread, early in the kernel.
  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    if constexpr (Use_TMA) {
      cute::prefetch_tma_descriptor(params.tma_store_dK.get_tma_descriptor());
      if (params.ptr_dV) { cute::prefetch_tma_descriptor(params.tma_store_dV.get_tma_descriptor()); }
    }
  }

  // tdKrdK / tdVrdV: fp32 C fragments of tiled_mma's slice for thread_idx; block_coord = (n_block, head, batch).
  template <class FrgTensor, class TiledMma>
  CUTLASS_DEVICE void store(Params const& params, FrgTensor const& tdKrdK, FrgTensor const& tdVrdV,
                            TensorStorage& storage, TiledMma const& tiled_mma, int thread_idx,
                            cute::tuple<int32_t, int32_t, int32_t> const& block_coord) const {
    using namespace cute;
    auto [n_block, bidh, bidb] = block_coord;
    bool const has_dv = params.ptr_dV != nullptr;
    auto smem_tensor = [](Element* ptr, auto layout) {
      return as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(ptr), layout));
    };
    Tensor sdK = smem_tensor(storage.smem_dk.data(), SmemLayoutdKV{});
    Tensor sdV = smem_tensor(storage.smem_dv.data(), SmemLayoutdKV{});
    Tensor sdKt = smem_tensor(storage.smem_dk.data(), SmemLayoutdKVt{});
    Tensor sdVt = smem_tensor(storage.smem_dv.data(), SmemLayoutdKVt{});

    auto smem_tiled_copy_dKV = make_tiled_copy_C(SmemCopyAtomdKV{}, tiled_mma);
    auto smem_thr_copy_dKV = smem_tiled_copy_dKV.get_thread_slice(thread_idx);

    Tensor taccdKsdK = smem_thr_copy_dKV.partition_D(
        cute::conditional_return<!dKV_swapAB>(sdK, sdKt));  // ((Atom,AtomNum), PIPE_M, PIPE_N)
    Tensor taccdVsdV = smem_thr_copy_dKV.partition_D(
        cute::conditional_return<!dKV_swapAB>(sdV, sdVt));  // ((Atom,AtomNum), PIPE_M, PIPE_N)

    // One tensor at a time, so only one 16-bit copy is live (keeps two CTAs per SM for the drivers).
    auto to_smem = [&](FrgTensor const& frag, auto& smem_partition) {
      Tensor frag_out = make_tensor_like<Element>(frag);
      convert_fragment(frag, frag_out);
      Tensor tacc_frag = smem_thr_copy_dKV.retile_S(frag_out);  // ((Atom,AtomNum), MMA_M, MMA_N)
      if constexpr (decltype(size(tdKrdK))::value * NumEpilogueThreads <= kBlockN * kHeadDim) {
        cute::copy(smem_tiled_copy_dKV, tacc_frag, smem_partition);
      } else {
        // The TiledMma's tile does not divide the block (FA3's sm_80 hdim 192: N = 80 in steps of 32):
        // copy only the elements inside it, one by one.
        auto tile_shape =
            cute::conditional_return<!dKV_swapAB>(select<1, 2>(TileShape_MNK{}), select<2, 1>(TileShape_MNK{}));
        Tensor taccdKVcdKV = smem_thr_copy_dKV.partition_D(make_identity_tensor(tile_shape));
        Tensor tdKVpdKV = make_tensor<bool>(shape(taccdKVcdKV));
#pragma unroll
        for (int i = 0; i < size(tdKVpdKV); ++i) { tdKVpdKV(i) = elem_less(taccdKVcdKV(i), tile_shape); }
        cute::copy_if(tdKVpdKV, tacc_frag, smem_partition);
      }
    };

    named_barrier_sync(NumEpilogueThreads, BarrierId);
    if (has_dv) { to_smem(tdVrdV, taccdVsdV); }
    to_smem(tdKrdK, taccdKsdK);

    // Varlen: a full tile is stored by TMA; the answer is the same in every thread, so barriers match.
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

  // Nothing is left in flight after `store`; kept for the mainloop/epilogue interface.
  CUTLASS_DEVICE void store_tail() const {}

  // Zeros to the valid rows and columns of the tile, predicated whatever Varlen is (no shared memory,
  // no barrier); only rows in [row_start, row_end), counted from the sequence's start.
  CUTLASS_DEVICE void store_zero(Params const& params, int thread_idx,
                                 cute::tuple<int32_t, int32_t, int32_t> const& block_coord, int row_start = 0,
                                 int row_end = INT_MAX) const {
    using namespace cute;
    auto [n_block, bidh, bidb] = block_coord;
    SeqlenInfo<kBlockN> const seqlen_info{bidb, get<0>(params.shape_dK), params.cu_seqlens, params.seqused};
    // Tile-relative window in 64-bit (n_block * kBlockN may pass 2^31), clamped to [0, kBlockN].
    auto clamp_rows = [](int64_t r) { return static_cast<int>(r < 0 ? 0 : (r > kBlockN ? kBlockN : r)); };
    int64_t const tile_start = int64_t(n_block) * kBlockN;
    int const first_row = clamp_rows(row_start - tile_start);
    int const end_row = clamp_rows(row_end - tile_start);
    int const valid_rows = cute::min(seqlen_info.valid_rows(n_block, get<0>(params.shape_dK)), end_row);
    if (valid_rows <= 0 || first_row >= valid_rows) { return; }
    Tensor gdK = tile_of(params.ptr_dK, params.shape_dK, params.stride_dK, params, seqlen_info, block_coord);
    Tensor gdV = tile_of(params.ptr_dV, params.shape_dV, params.stride_dV, params, seqlen_info, block_coord);

    GmemTiledCopydKV gmem_tiled_copy_dKV;
    auto gmem_thr_copy_dKV = gmem_tiled_copy_dKV.get_thread_slice(thread_idx);
    Tensor tdKVgdK = gmem_thr_copy_dKV.partition_D(gdK);
    Tensor tdKVgdV = gmem_thr_copy_dKV.partition_D(gdV);
    Tensor tdKVrZero = make_fragment_like(tdKVgdK);
    clear(tdKVrZero);
    Tensor tdKVcdKV = gmem_thr_copy_dKV.partition_D(make_identity_tensor(select<1, 2>(TileShape_MNK{})));
    copy_predicated(gmem_tiled_copy_dKV, tdKVrZero, tdKVgdK, tdKVcdKV,
                    column_predicate(tdKVcdKV, get<1>(params.shape_dK)), valid_rows, first_row);
    if (params.ptr_dV != nullptr) {
      copy_predicated(gmem_tiled_copy_dKV, tdKVrZero, tdKVgdV, tdKVcdKV,
                      column_predicate(tdKVcdKV, get<1>(params.shape_dV)), valid_rows, first_row);
    }
  }

 private:
  // Both smem tiles -> tile n_block of rows [row_offset, ...) of (head, batch) by TMA; every thread calls it.
  template <class SmemTensor>
  CUTLASS_DEVICE static void tma_store_tile(Params const& params, SmemTensor const& sdK, SmemTensor const& sdV,
                                            int thread_idx, int n_block, int head, int batch, int row_offset) {
    using namespace cute;
    cutlass::arch::fence_view_async_shared();  // generic-proxy smem writes -> visible to TMA
    // Everyone arrives; only the issuing (last) warp waits.
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
    tma_store_wait<0>();  // only the issuing thread has a bulk group: until TMA has read smem
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
    Tensor gdK = tile_of(params.ptr_dK, params.shape_dK, params.stride_dK, params, seqlen_info, block_coord);
    Tensor gdV = tile_of(params.ptr_dV, params.shape_dV, params.stride_dV, params, seqlen_info, block_coord);

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
    // Read the whole smem tile (rows past kBlockN skipped when the thread layout does not divide it).
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
