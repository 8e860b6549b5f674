// Configuration of the "split-D" backward kernel (bwd_split_d.cuh), which head dim 256 runs.
//
// Why a second kernel: the main kernel (bwd_traits.cuh) gives each consumer warpgroup 64 of the
// CTA's 128 keys and keeps dK and dV of those keys over ALL head-dim columns in registers. At
// d = 256 that is 256 fp32 registers per thread, so it would run two column passes over the
// query blocks and recompute S^T and dP^T in the second (7 GEMM units instead of 5, and spills).
// Here the CTA owns kBlockN = 80 keys and the two warpgroups split the HEAD DIM of dK/dV: each
// holds dK^T and dV^T for 128 of the 256 columns x 80 keys (2 x 80 registers). S and dP are
// computed once per step, split by keys (40 per warpgroup), and exchanged through shared memory
// as P and dS, so one pass over the query blocks suffices (5 GEMM units per step):
//   S    = Q K^T           (64 queries x 40 keys per WG, SS)       rows = queries
//   dP   = dO V^T          (same tiling)
//   P    = exp2(S * scale_log2 - lse_log2), dS = P o (dP - D)      (o tanh' with softcap)
//   P, dS -> shared memory (bf16/fp16, keys contiguous), both warpgroups sync
//   dV^T += dO^T P         (256 x 80 keys, K = queries; WG w owns 128 of the head-dim rows, SS)
//   dK^T += Q^T dS         (same)
//   dQ    = dS K           (64 x 256 in two column chunks, WGs split each chunk's columns, SS;
//                           added to the fp32 accumulator with float4 reductions: a 64 KB smem
//                           dQ tile does not fit next to the Q/dO stages)
// dK^T/dV^T are "swapAB" GEMMs: the head dim is the M side, the CTA's keys the N side.
#pragma once

#include "bwd/bwd_traits.cuh"

// Measured: 1.11-1.18x the column-pass main kernel at 2k-8k on the H200.
// 80 keys per CTA (FA3's hd256 tile: +8-16% over 64): they cut the Q/dO loads and the dQ adds per
// MAC by 20% and spread each step's fixed costs over 25% more tensor work; to fit 227 KB, dO gets
// its own one-stage ring (Q keeps two) and is released as soon as dV^T has read it.
// The CTAs run in bwd_order.cuh's longest-first section order, as the main kernel's (causal hd256
// CTAs run 1..128 steps at 8k; the 3D grid's tail model was 5.8-8.1% over the ideal at 512-8k,
// 1.0-1.9% in section order).

namespace fa3 {
namespace bwd {

template <typename Element_, int kHeadDim_, bool kSoftcap_>
struct SplitDTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr int kBlockM = 64;     // query rows per step
  static constexpr int kBlockN = 80;    // keys per CTA (registers: 2 x kBlockN for dK^T + dV^T)
  static constexpr int kNumMmaWG = 2;
  static constexpr int kNumMmaThreads = kNumMmaWG * 128;
  static constexpr int kNumThreads = kNumMmaThreads + 128;  // + producer warpgroup
  static constexpr int kStages = 2;    // Q/dO/LSE/D ring: the next step's 64 KB load overlaps
  // dO and D get a separate one-stage ring (two dO stages do not fit next to 80 keys of K and
  // V); dO is released after dV^T, half a step before the next dP needs it (FA3 does the same).
  static constexpr int kStagesdO = 1;
  static constexpr int kStagesPdS = 2; // P/dS buffers: the next step writes while the other
                                       // warpgroup may still read this step's (no extra barrier)
  static constexpr int kPasses = 1;    // one walk over the query blocks (no column passes)
  static constexpr int kHdWg = kHeadDim / kNumMmaWG;  // dK^T/dV^T rows per warpgroup
  // dQ in two column chunks of 128, each split 64/64 between the warpgroups, in the dQ WGMMA's
  // fragment order like the main kernel's, so the accumulator layout and bwd_postprocess are shared.
  static constexpr int kDQChunks = 2;
  static constexpr int kHdChunk = kHeadDim / kDQChunks;
  static constexpr int kDQFrag = kBlockM * kHdChunk / kNumMmaThreads;
  static constexpr int kDQWgFloats = kBlockM * kHdChunk / kNumMmaWG;
  using DQTileShape = Shape<Int<kBlockM>, Int<kHdChunk>>;  // one dQ chunk, (queries, columns)
  static constexpr bool kDQSmem = false;
  // Every problem, banded or not; the warpgroups in lockstep (see BwdTraitsT::kPingPong).
  static constexpr bool kNoBand = false, kPingPong = false;
  // The consumers take their warpgroup index warp-uniform (WGMMA descriptors in uniform
  // registers, not per thread + R2UR; see BwdTraitsT::kUniformWg).
  static constexpr bool kUniformWg = true;
  // See BwdTraits: 384 x 168 = 128 x 24 + 256 x 240.
  static constexpr int kProducerRegs = 24;
  static constexpr int kMmaRegs = 240;
  static_assert(register_split_fits(kProducerRegs, kNumMmaThreads, kMmaRegs), "register pool overcommitted");
  static_assert(kHeadDim == 256, "split-D is written for head dim 256 (192 would need 96-row WG halves)");
  static_assert(kDQFrag % 4 == 0);

  // ---- shared-memory layouts (physical: row-major tiles, last mode contiguous)
  // Q, dO (queries, d): A operand of S / dP (K-major), and through the transposed view (d,
  // queries) the MN-major A operand of dK^T / dV^T. 128-byte swizzle: 64-column atoms, so each
  // warpgroup's 128 head-dim rows and each dQ column slice start on an atom boundary.
  using AtomQ = decltype(kmajor_atom<Element, kHeadDim>());
  using SmemLayoutQ1 = decltype(tile_to_shape(AtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(AtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                 Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutdO = decltype(tile_to_shape(AtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStagesdO>>{}));
  using SmemLayoutdOt = decltype(composition(
      SmemLayoutdO{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStagesdO>>{},
                                  Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  // K (keys, d): B operand of S (K-major); through the transposed view (d, keys) the MN-major
  // B operand of dQ, sliced per chunk and warpgroup (64 columns = one swizzle atom).
  using SmemLayoutK = decltype(tile_to_shape(AtomQ{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
  // V (keys, d): B operand of dP only.
  using SmemLayoutV = SmemLayoutK;
  // P, dS (queries, keys), keys contiguous: written from the S/dP accumulators with stmatrix;
  // dS is the K-major A operand of dQ, and the transposed views (keys, queries) are the
  // MN-major B operands of dV^T / dK^T. The stmatrix copy splits the columns by warpgroup, so an
  // atom must not straddle the 40-key halves of the tile: 8-column atoms (no swizzle: each 8 x 8
  // core matrix is 128 contiguous bytes, one stmatrix matrix, no bank conflicts).
  using AtomPdS = decltype(kmajor_atom<Element, kBlockN / kNumMmaWG>());
  using SmemLayoutPdS = decltype(tile_to_shape(AtomPdS{}, Shape<Int<kBlockM>, Int<kBlockN>, Int<kStagesPdS>>{}));
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>, Int<kStagesPdS>>{},
                                   Stride<Int<kBlockM>, _1, Int<kBlockM * kBlockN>>{})));

  // stmatrix of a warpgroup's S/dP accumulator (64 x 40 keys): four 8x8 matrices per
  // instruction would need 16-key column groups, so two at a time.
  using StsmAtom = SM90_U32x2_STSM_N;
  static_assert((kBlockN / kNumMmaWG) % 16 == 8);

  // ---- WGMMA tilings (2 consumer warpgroups)
  // S, dP: (queries 64, keys kBlockN, d 256); warpgroup w takes keys [w, w + 1) * kBlockN / 2.
  using MmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN / kNumMmaWG>, Int<kHeadDim>>>(),
      Layout<Shape<_1, Int<kNumMmaWG>, _1>>{}));
  // dV^T, dK^T: (d 256, keys 64, queries 64); warpgroup w takes the 64-row M tiles w, w + 2
  // (head-dim rows [64w, 64w + 64) and [128 + 64w, 192 + 64w)): 2 x 32 accumulators each.
  using MmadKV = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kBlockM>>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      Layout<Shape<Int<kNumMmaWG>, _1, _1>>{}));
  // dQ chunk: (queries 64, 128 columns, keys 64); warpgroups split the columns.
  using MmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHdChunk / kNumMmaWG>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_1, Int<kNumMmaWG>, _1>>{}));

  // The producer's TMA types and transaction bytes: BwdLoads (bwd_traits.cuh), as for BwdTraits.

  // 40 (K) + 40 (V) + 2 x 32 (Q) + 32 (dO) + 20 (P x2) + 20 (dS x2) = 216 KB + statistics.
  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutdO>, 1024> dout;
    cute::array_aligned<Element, cosize_v<SmemLayoutPdS>, 1024> p;
    cute::array_aligned<Element, cosize_v<SmemLayoutPdS>, 1024> ds;
    cute::array_aligned<float, kStages * kBlockM, 16> lse;    // log2-domain LSE per stage
    cute::array_aligned<float, kStages * kBlockM, 16> dpsum;  // D of the dO stage (first kBlockM)
    uint64_t kv_full;
    uint64_t full[kStages];   // Q ring
    uint64_t empty[kStages];
    uint64_t do_full;         // the one-stage dO + D ring
    uint64_t do_empty;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + base alignment
  static_assert(kSmemBytes <= 232448, "split-D backward tile exceeds 227 KB of shared memory");
};

template <class Tr> struct IsSplitD : std::false_type {};
template <typename E, int D, bool S> struct IsSplitD<SplitDTraits<E, D, S>> : std::true_type {};

// The traits a (element, head dim, softcap) backward is built with: split-D for hd256, the
// tile table otherwise.
template <typename Element, int kHeadDim, bool kSoftcap>
using BwdTraitsFor = std::conditional_t<kHeadDim == 256,
                                        SplitDTraits<Element, kHeadDim, kSoftcap>,
                                        BwdTraits<Element, kHeadDim, kSoftcap>>;

}  // namespace bwd
}  // namespace fa3
