// FwdTraits: everything the forward kernel derives at compile time from its tile (element, head
// dim, kBlockM x kBlockN, kStages, ping-pong, banded): warpgroups and register budgets, which
// optional machinery it carries (dynamic schedule, double-buffered Q, FP8's V transpose), the
// WGMMA types, the shared-memory layouts and SharedStorage, the TMA types and the kernel Params.
// The tile table that picks the tiles is in fwd_launch.cuh.
#pragma once

#include "common/mask.cuh"
#include "common/scheduler.cuh"
#include "common/softmax.cuh"
#include "common/utils.cuh"
#include "fwd/fwd_pipeline.cuh"

namespace fa3 {

// FP8 only: the transposed V ring (fwd_transpose.cuh), empty otherwise (a base class, so that it
// takes no space and moves nothing in the bf16 / fp16 kernels' SharedStorage).
template <bool kFp8, class Element, int kVtElems, int kStages>
struct FwdVtStorage {};
template <class Element, int kVtElems, int kStages>
struct FwdVtStorage<true, Element, kVtElems, kStages> {
  cute::array_aligned<Element, kVtElems, 1024> vt;
  alignas(16) typename cutlass::PipelineAsync<kStages>::SharedStorage pipe_vt;
  uint32_t v_end[kStages];  // per V stage: 1 once it holds the end marker (fwd_v_end_marker)
};

// V as the B operand of O += P V, (d, n, stages). bf16 / fp16: V's own (n, d) tiles viewed
// MN-major. FP8 WGMMA takes only K-major B, so FP8 kernels keep a transposed copy of V with the
// keys contiguous (fwd_transpose.cuh writes it).
template <bool kFp8, class Element, class SmemLayoutK, int kHeadDim, int kBlockN, int kStages>
CUTE_HOST_DEVICE constexpr auto fwd_smem_layout_vt() {
  using Shape3 = Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>;
  if constexpr (kFp8) return tile_to_shape(smem_atom_k_major<Element, kBlockN>(), Shape3{});
  else return composition(SmemLayoutK{}, make_ordered_layout(Shape3{}, Step<_2, _1, _3>{}));
}

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kPingPong_,
          bool kBanded_>
struct FwdTraits {
  using Element = Element_;
  // float8_e4m3fn inputs (issue 28): O is stored as bf16, q / k / v descales scale the scores
  // and O, P is rounded to e4m3 with FA3's max offset (common/softmax.cuh), V is transposed in
  // shared memory by the producer warpgroup's other warps (fwd_transpose.cuh).
  static constexpr bool kFp8 = sizeof(Element) == 1;
  using OutElement = std::conditional_t<kFp8, cutlass::bfloat16_t, Element>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  // The consumer warpgroups take turns to issue their GEMMs (common/pingpong.cuh).
  static constexpr bool kPingPong = kPingPong_;
  // false: the caller guarantees the band does not cut into the key range (both sides reach
  // past seqlen_q + seqlen_k), so boundary blocks need only the seqlen_k mask (fewer registers).
  static constexpr bool kBanded = kBanded_;
  // Packed documents (Params::docs): only FwdDocsTraits below compiles them in.
  static constexpr bool kDocs = false;
  static constexpr int kNumMmaWG = kBlockM / 64;
  static constexpr int kNumMmaThreads = kNumMmaWG * 128;
  static constexpr int kNumThreads = kNumMmaThreads + 128;
  // setmaxnreg budgets: 65536 registers / SM at one CTA per SM.
  //   2 consumers: 128 * 24 + 256 * 240 = 64512 (the pool of 384 threads x 168 registers);
  //   3 consumers: 128 * 32 + 384 * 160 = 65536.
  // Banded kernels with 2 consumers carry the dynamic tile schedule (common/scheduler.cuh),
  // whose producer code spilled at 24 registers: 128 * 40 + 256 * 232 = 64512 as well (the
  // consumers peak at R223). The 3-consumer banded tile runs one CTA per tile instead.
  // FP8: 56 producer registers (128 * 56 + 256 * 224 = 64512; the consumers hold O d/2 + S
  // kBlockN/2 + P kBlockN/8), banded or not. The V transposers follow the V ring up to its end
  // marker, not the tiles, so they run under either schedule. They also run on 32, one tile's
  // loads at a time, where the registers are needed elsewhere: the three-consumer tiles (hd64
  // and hd128 unbanded, hd64 long bands).
  static constexpr bool kDynamicSchedule = kBanded && kNumMmaWG == 2;
  // FP8 with three consumer warpgroups (hd64 and hd128 unbanded, hd64 long bands): 32 / 160, as
  // bf16. (hd128 on 56 / 152, its transposers spill-free and two tiles at a time, measured
  // -5..-7%.)
  static constexpr int kProducerRegs = kNumMmaWG == 3 ? 32 : kFp8 ? 56 : (kDynamicSchedule ? 40 : 24);
  static constexpr int kConsumerRegs = kNumMmaWG == 3 ? 160 : kFp8 ? 224 : (kDynamicSchedule ? 232 : 240);
  static_assert(register_split_fits(kProducerRegs, kNumMmaThreads, kConsumerRegs), "register pool overcommitted");
  // Warps 1-2 of the producer warpgroup transpose V (FP8); warp 0's first thread issues the TMAs.
  static constexpr int kNumTransposeThreads = kFp8 ? 64 : 0;
  static_assert(kBlockM % 64 == 0 && (kNumMmaWG == 2 || kNumMmaWG == 3));
  static_assert(!kFp8 || kBlockN % 32 == 0, "FP8: K = 32 per P V WGMMA");
  // Two Q buffers used by alternate tiles (fwd_pipeline.cuh, FwdQProducer), where a second Q
  // tile fits in shared memory (d = 64 banded and d = 96; not the 224 KB hd128 banded or 208 KB
  // hd128 unbanded tiles) and with two consumer warpgroups (the 3-warpgroup tiles spilled 20-28
  // bytes at 160 registers). The producer loads the next tile's Q about a tile ahead, and
  // publishes the decoded tile and key range, so the consumers' tile start is a shared-memory
  // load instead of three integer divisions and the 64-bit key-range arithmetic (H200: hd64
  // causal +12.8% at 512, +6.8% at 1k, +2.2% at 2k, level from 4k).
  static constexpr int kQTileBytes = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kKVRingBytes = (kFp8 ? 3 : 2) * kStages * kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr bool kQPrefetch = kNumMmaWG == 2 && 2 * kQTileBytes + kKVRingBytes + 1024 <= 227 * 1024;
  static constexpr int kQBufs = kQPrefetch ? 2 : 1;
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256);

  using D = Int<kHeadDim>;
  using BN = Int<kBlockN>;

  // Per consumer warpgroup: S (64 x kBlockN) = Q (64 x d) K^T, both K-major in smem;
  // O (64 x d) += P (64 x kBlockN, registers) V, V read as an MN-major (d x kBlockN) view
  // (FP8: the K-major transposed copy).
  using MmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, BN, D>>()));
  static constexpr GMMA::Major kMajorV = kFp8 ? GMMA::Major::K : GMMA::Major::MN;
  using MmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, D, BN>, GMMA::Major::K, kMajorV>()));

  // Q: one 64-row slab per consumer warpgroup and Q buffer (slab b * kNumMmaWG + wg).
  using SmemAtomQ = decltype(smem_atom_k_major<Element, kHeadDim>());
  using SmemLayoutQ1 = decltype(tile_to_shape(SmemAtomQ{}, Shape<_64, D>{}));  // one slab
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<_64, D, Int<kNumMmaWG * kQBufs>>{}));
  using SmemAtomK = decltype(smem_atom_k_major<Element, kHeadDim>());
  using SmemLayoutK1 = decltype(tile_to_shape(SmemAtomK{}, Shape<BN, D>{}));  // one stage
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<BN, D, Int<kStages>>{}));
  // V is stored like K ((n, d), d contiguous); the P V GEMM reads it as (d, n) (fwd_smem_layout_vt).
  using SmemLayoutVt = decltype(fwd_smem_layout_vt<kFp8, Element, SmemLayoutK, kHeadDim, kBlockN, kStages>());

  using Pipeline = FwdKVPipeline<kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  using PipelineVt = cutlass::PipelineAsync<kStages>;  // FP8: transposers -> consumers

  struct SharedStorage : FwdVtStorage<kFp8, Element, int(cosize_v<SmemLayoutVt>), kStages> {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> v;
    // The Q hand-off's barriers and tile slots (fwd_pipeline.cuh), in its one- or two-buffer form.
    std::conditional_t<kQPrefetch, FwdQBuffers, FwdQBuffer> qsync;
    alignas(16) typename Pipeline::SharedStorage pipe_k;
    alignas(16) typename Pipeline::SharedStorage pipe_v;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");

  // Global tensors as (seqlen, d, heads, batch): the TMA box is (rows, kHeadDim) of one (head,
  // batch). d is the tensor's own head dim (at most kHeadDim): TMA fills the box's columns past
  // it with zeros, which add nothing to Q K^T and give O columns that are not stored.
  using GShape = Shape<int, int, int, int>;
  using GStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GTensorIn = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GShape{}, GStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorIn>(), SmemLayoutQ1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorIn>(), SmemLayoutK1{}));

  struct Params {
    TmaQ tma_q;
    TmaKV tma_k;
    TmaKV tma_v;
    int seqlen_q, seqlen_k, heads_q, heads_kv, batch;
    int group;  // heads_q / heads_kv
    BandMask mask;
    SoftmaxScale scale;
    float* lse;       // (batch, heads_q, seqlen_q)
    OutElement* out;  // (batch, seqlen_q, heads_q, head_dim_v)
    int head_dim_v;       // v's and out's head dim (<= kHeadDim): the O store's columns
    const float* sinks;   // (heads_q) sink logits, or nullptr (FwdParams::sinks)
    TileScheduler sched;
    DocMask docs;         // packed documents (kDocs kernels only)
    // FP8 only (fa3/params.h FwdParams): q (batch, heads_q), k and v (batch, heads_kv) float32.
    const float* q_descale;
    const float* k_descale;
    const float* v_descale;
  };
};

// A banded tile's traits for calls with packed documents (fwd_launch.cuh): a kernel of its own,
// so that the document loads and masks cost the calls without documents nothing.
template <class T>
struct FwdDocsTraits : T {
  static_assert(T::kBanded, "documents need the band mask code");
  static constexpr bool kDocs = true;
};

}  // namespace fa3
