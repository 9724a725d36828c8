// Compile-time tests of the header library as a kernel embeds it (tests/test_header_library.py compiles this
// file; nothing runs). 1. Each collective's TensorStorage, put in a union inside an aligned_struct-derived
// SharedStorage as CUTLASS's and FlashAttention-3's kernels do, adds nothing to the SharedStorage's size.
// 2. The MHA and GQA collectives expose the same members, so one kernel can switch between them.

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "flash_epilogue/bwd_config.h"
#include "flash_epilogue/epilogue_bwd.h"
#include "flash_epilogue/epilogue_bwd_gqa.h"

namespace fe = flash_epilogue;
using namespace cute;

template <class Config, class ArchTag>
using MmaOf = std::conditional_t<ArchTag::kMinComputeCapability >= 90, fe::BwdTiledMmaSm90<Config, cutlass::bfloat16_t>,
                                 fe::BwdTiledMmaSm80<Config, cutlass::bfloat16_t>>;

template <int kHeadDim, class ArchTag, bool kVarlen>
struct Collectives {
  using Config = fe::BwdTileConfig<kHeadDim, ArchTag>;
  using TiledMma = typename MmaOf<Config, ArchTag>::TiledMma;
  using FragmentTileShape = typename MmaOf<Config, ArchTag>::FragmentTileShape;
  using TileShape = Shape<_64, Int<Config::kBlockN>, Int<kHeadDim>>;
  using Mha = fe::CollectiveEpilogueBwd<TileShape, cutlass::bfloat16_t, ArchTag, Config::kNumThreads, kVarlen,
                                        Config::kSwapAB, Config::kAtomLayoutKdKV>;
  static constexpr int kAccumTileElems =
      decltype(size(partition_fragment_C(TiledMma{}, FragmentTileShape{})))::value * Config::kNumThreads;
  using Gqa = fe::CollectiveEpilogueBwdGQA<TileShape, ArchTag, Config::kNumThreads, kAccumTileElems>;
};

// 1. A mainloop's storage of `kBytes` in a union with the epilogue's, the layouts of CUTLASS's kernels
// (SharedStorage : aligned_struct { union ... }) and of FA3's backward (SharedStorage { TensorStorage :
// aligned_struct<128> { union ... } tensors; ... }), against the same union without the empty bases.
template <int kBytes>
struct MainloopStorage {
  cute::array_aligned<cutlass::bfloat16_t, kBytes / 2, 1024> smem;
};
template <class Epilogue, int kBytes>
struct BareUnion {
  union {
    MainloopStorage<kBytes> mainloop;
    Epilogue epilogue;
  };
};
template <class Epilogue, int kBytes, size_t kAlign>
struct CutlassShared : cute::aligned_struct<kAlign> {
  union {
    MainloopStorage<kBytes> mainloop;
    Epilogue epilogue;
  };
};
template <class Epilogue, int kBytes>
struct Fa3Shared {
  struct TensorStorage : cute::aligned_struct<128> {
    union {
      MainloopStorage<kBytes> mainloop;
      Epilogue epilogue;
    };
  } tensors;
};
template <class Storage>
constexpr bool adds_nothing() {
  // mainloops smaller and larger than the epilogue's storage
  for (bool ok : {sizeof(CutlassShared<Storage, 1024, 128>) == sizeof(BareUnion<Storage, 1024>),
                  sizeof(CutlassShared<Storage, 1024, 1024>) == sizeof(BareUnion<Storage, 1024>),
                  sizeof(Fa3Shared<Storage, 1024>) == sizeof(BareUnion<Storage, 1024>),
                  sizeof(CutlassShared<Storage, 196608, 128>) == sizeof(BareUnion<Storage, 196608>),
                  sizeof(Fa3Shared<Storage, 196608>) == sizeof(BareUnion<Storage, 196608>)}) {
    if (!ok) { return false; }
  }
  return true;
}

// 2. What a kernel calls, on either collective: the same names and signatures.
template <class Epilogue, class TiledMma, class FragmentTileShape>
__device__ void embed(typename Epilogue::Params const& params, typename Epilogue::TensorStorage& storage) {
  static_assert(sizeof(typename Epilogue::Element) >= 2 && (Epilogue::Varlen || !Epilogue::Varlen));
  static_assert(std::is_same_v<decltype(&Epilogue::can_implement),
                               char const* (*)(typename Epilogue::Arguments const&)>);
  static_assert(std::is_same_v<decltype(&Epilogue::to_underlying_arguments),
                               typename Epilogue::Params (*)(typename Epilogue::Arguments const&)>);
  TiledMma tiled_mma;
  auto frag = partition_fragment_C(tiled_mma, FragmentTileShape{});
  Epilogue::prefetch_tma_descriptors(params);
  Epilogue epilogue;
  epilogue.store(params, frag, frag, storage, tiled_mma, int(threadIdx.x), make_tuple(0, 0, 0));
  epilogue.store_tail();
  epilogue.store_zero(params, int(threadIdx.x), make_tuple(0, 0, 0));
}

template <int kHeadDim, class ArchTag, bool kVarlen>
__global__ void switch_between(typename Collectives<kHeadDim, ArchTag, kVarlen>::Mha::Params const mha,
                               typename Collectives<kHeadDim, ArchTag, kVarlen>::Gqa::Params const gqa, bool use_gqa) {
  using C = Collectives<kHeadDim, ArchTag, kVarlen>;
  static_assert(adds_nothing<typename C::Mha::TensorStorage>(), "the MHA TensorStorage grows an enclosing struct");
  static_assert(adds_nothing<typename C::Gqa::TensorStorage>(), "the GQA TensorStorage grows an enclosing struct");
  extern __shared__ char smem[];
  if (use_gqa) {
    embed<typename C::Gqa, typename C::TiledMma, typename C::FragmentTileShape>(gqa, *reinterpret_cast<typename C::Gqa::TensorStorage*>(smem));
  } else {
    embed<typename C::Mha, typename C::TiledMma, typename C::FragmentTileShape>(mha, *reinterpret_cast<typename C::Mha::TensorStorage*>(smem));
  }
}

#define FE_INSTANTIATE(D, ARCH, VARLEN)                                                                        \
  template __global__ void switch_between<D, cutlass::arch::ARCH, VARLEN>(                                      \
      Collectives<D, cutlass::arch::ARCH, VARLEN>::Mha::Params const,                                          \
      Collectives<D, cutlass::arch::ARCH, VARLEN>::Gqa::Params const, bool);
FE_INSTANTIATE(128, Sm90, true)   // FA3's most common GQA config
FE_INSTANTIATE(192, Sm90, false)  // swapAB, three warpgroups
FE_INSTANTIATE(128, Sm80, true)   // the predicated path, atomics
