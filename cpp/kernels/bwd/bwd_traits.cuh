// Configuration of the backward main kernel (bwd_main.cuh) per (element, head dim, softcap): the
// tile table, shared-memory layouts, WGMMA tilings and the producer's TMA types (BwdLoads, also
// the split-D kernel's). Kernels read everything from here.
//
// The CTA owns kBlockN = 128 keys of one (batch, kv head); two consumer warpgroups own 64 keys
// each. Per query block (kBlockM rows) each consumer warpgroup computes, for its 64 keys:
//   S^T  = K Q^T            (64 x kBlockM, SS-WGMMA)   -- transposed: keys are the M side
//   dP^T = V dO^T           (64 x kBlockM, SS-WGMMA)
//   P^T  = exp2(S^T * scale_log2 - lse_log2),  dS^T = P^T o (dP^T - D)   (registers)
//   dV  += P^T dO           (RS-WGMMA: P^T straight from the accumulator registers)
//   dK  += dS^T Q           (RS-WGMMA)
// and dS^T goes to shared memory (queries contiguous) so both warpgroups can compute
//   dQ   = dS K             (kBlockM x head_dim, SS-WGMMA; the warpgroups split head_dim)
// which is added in fp32 to a global accumulator (bwd_dq.cuh). A step may cover its kBlockM rows
// in sub-steps of kBlockMSdP columns (hd64): the five lines above S^T .. dK run per sub-step, dQ
// and its hand-off once per step. Computing S transposed makes both dK and dV register-sourced
// GEMMs (no P/dS round trip through shared memory for them) and keeps dK/dV accumulation for the
// CTA's keys in registers.
#pragma once

// First: it enables CuTe's extended WGMMA N shapes (80) before any CuTe header is read.
#include "common/utils.cuh"

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

namespace fa3 {
namespace bwd {

using namespace cute;

// Tile table, one row per head dim (hd256 runs the split-D kernel: bwd_split_d_traits.cuh).
//   kBlockM    query rows per step: one Q/dO stage, one dS barrier, one dQ GEMM and hand-off
//   kBlockMSdP query columns of one S^T/dP^T sub-step (the N side of S^T; 64 keeps S^T + dP^T at
//              64 registers); kBlockM / kBlockMSdP sub-steps per step
//   kStages    Q/dO/LSE/D shared-memory stages (TMA ring)
//   kStagesdS  dS buffers (2 lets the next step write dS while the other warpgroup still reads)
//   kPasses    > 1 splits head_dim of the dK/dV accumulators into column passes over the query
//              blocks (S and dP recomputed per pass): registers, not smem, limit d = 192 (dK + dV
//              for 64 keys x 192 columns would be 192 fp32 registers per thread)
//   kDQSmem    dQ leaves through a shared-memory tile that a dedicated warp adds to the fp32
//              accumulator with one bulk reduce-add per warpgroup; false: the consumers add it
//              with float4 reductions (where the smem tile does not fit: d = 192)
//   kOverlapP  P = exp2(..) is computed while the dP^T GEMM runs (off: 10-14% slower at hd128)
//   kOverlapDK the dK GEMM of one step stays in flight across the dQ hand-off and the next
//              step's S^T/dP^T issue (its Q stage is released one step later). Both overlaps cost
//              16-32 registers (dS^T of the step in flight).
// With the dK overlap a stage is released one step late, so with 2 stages the TMA for step i+2
// starts only once step i+1 is under way: short steps get a third stage where smem allows.
template <int kHeadDim> struct BwdTile;
// 64: 128 rows per step as two 64-column sub-steps (FA3's step length; 64-row steps were 6-9%
//     slower at 2k-8k): half the per-step fixed costs (stage wait/release, dS barrier, dQ GEMM
//     and hand-off, the writer's bulk reduce) with a 64-row step's registers per sub-step.
//     smem 16+16 (K,V) + 64 (Q,dO x2) + 64 (dS x2) + 32 (dQ) = 192 KB: 2 stages (a third would
//     need 224 KB + stats). dQ split by rows across the warpgroups (kDQSplitM, FA3's hd64
//     AtomLayoutMdQ = 2: 2/3 of the dQ GEMM's smem operand bytes, half the HGMMAs; +4..+11% at
//     4k-16k together with kSdPAhead).
template <> struct BwdTile<64>  { static constexpr int kBlockM = 128, kBlockMSdP = 64, kStages = 2, kStagesdS = 2, kPasses = 1; static constexpr bool kDQSmem = true, kOverlapP = true, kOverlapDK = true; static constexpr bool kDQSplitM = true; };
// 96: dK+dV 96 regs; smem 24+24 + 3 x 24 (Q,dO) + 16 + 24 (dQ) KB: 3 stages (short steps).
template <> struct BwdTile<96>  { static constexpr int kBlockM = 64, kBlockMSdP = 64, kStages = 3, kStagesdS = 2, kPasses = 1; static constexpr bool kDQSmem = true, kOverlapP = true, kOverlapDK = true; };
// 128: dK+dV 128 regs, S^T+dP^T 64, dQ 32; smem 32+32 + 64 + 32 + 32 (dQ) = 192 KB: 2 stages.
//      dK is waited for at the end of each step, as in FA3's causal step: the Q stage goes back
//      a step earlier, so the TMA for step i+2 overlaps step i+1 (causal 1k-16k +1..+5% against
//      the dK overlap, H100, session 32; a third stage, alone or with this, was no better).
template <> struct BwdTile<128> { static constexpr int kBlockM = 64, kBlockMSdP = 64, kStages = 2, kStagesdS = 2, kPasses = 1; static constexpr bool kDQSmem = true, kOverlapP = true, kOverlapDK = false; };
// 192: two column passes of 96 (dK+dV 96 regs); smem 48+48 + 96 + 16 = 208 KB (one dS buffer);
//      both overlaps (0 B spills, 8 B with softcap, where P is not overlapped).
template <> struct BwdTile<192> { static constexpr int kBlockM = 64, kBlockMSdP = 64, kStages = 2, kStagesdS = 1, kPasses = 2; static constexpr bool kDQSmem = false, kOverlapP = true, kOverlapDK = true; };

// hd128 at 80 query rows per step for problems without a band (FA3's non-causal hd128 step,
// +12-15% at non-causal 512-16k): run_bwd_impl (bwd_launch.cuh) picks it for non-causal,
// non-local, non-softcap problems; banded ones keep BwdTile<128> (on this tile with the band
// mask, causal 512-16k measured -6..-12%: it lacks the two overlaps). 25% more work per step for
// the same per-step fixed costs (stage wait/release, dS barrier, dQ hand-off and bulk reduce). 80 rows
// cannot be the M side of a WGMMA, so the dQ GEMM is swapped (kDQSwapAB):
// dQ^T = K^T dS^T, M = head dim (the warpgroups split it), N = 80 queries, A = K^T and B = dS
// both MN-major from shared memory; the dQ accumulator holds each warpgroup's (64 d x 80 q)
// dQ^T fragment, which bwd_postprocess un-transposes through shared memory. S^T/dP^T are
// m64n80 per warpgroup (80 registers), dK + dV 128: the dK-across-steps overlap does not fit,
// and P during dP^T spills 24-40 B (loop invariants reloaded, ~2 LDL per step): both off. dS
// (queries contiguous, 80 = 5 x 16) takes the MN SW32 atom. smem 32+32 (K,V) + 2x20+2x20 (Q,dO)
// + 2x20 (dS) + 40 (dQ) = 224 KB + LSE/D.
struct BwdTileHd128Full {
  static constexpr int kBlockM = 80, kBlockMSdP = 80, kStages = 2, kStagesdS = 2, kPasses = 1;
  static constexpr bool kDQSmem = true, kOverlapP = false, kOverlapDK = false;
  static constexpr bool kDQSwapAB = true;
  static constexpr bool kNoBand = true;  // launched only for problems without a band
};
// hd128 problems in which some key is seen by kBwdPingPongMinRows or more query rows
// (BandMask::max_rows_per_key: seqlen_q without a band, min(seqlen_q, seqlen_k) causal) run their
// tile out of lockstep (kPingPong, BwdTraitsT): step i's dQ GEMM runs in step i + 1, so no
// 256-thread dS barrier holds the warpgroups together every step, and they issue their GEMM
// batches round robin, so one's exp2 / dS math runs under the other's GEMMs. H100: causal +1..+6%
// from 2k rows, non-causal +1..+2% (within the card's noise at some points); both lost 2-3% at
// 512 / 1k (too few steps per CTA to stagger), hence 2048.
constexpr int64_t kBwdPingPongMinRows = 2048;
// Without a band and without softcap (the 80-row tile's problems): its two dS buffers hold the lag.
struct BwdTileHd128FullPingPong : BwdTileHd128Full {
  static constexpr bool kPingPong = true;
};
// Banded, without documents: a ring of three dS buffers (+16 KB over the 64-row tile's two).
struct BwdTileHd128PingPong : BwdTile<128> {
  static constexpr int kStagesdS = 3;
  static constexpr bool kPingPong = true;
};

// kDQSwapAB, kDQSplitM, kNoBand, kPingPong of a tile (false where the tile does not say).
// kNoBand: the host launches the tile only for problems without a band (bwd_launch.cuh), so the
// element mask is the key bound.
template <class T, class = void> struct TileDQSwapAB : std::false_type {};
template <class T> struct TileDQSwapAB<T, std::void_t<decltype(T::kDQSwapAB)>> : std::bool_constant<T::kDQSwapAB> {};
template <class T, class = void> struct TileDQSplitM : std::false_type {};
template <class T> struct TileDQSplitM<T, std::void_t<decltype(T::kDQSplitM)>> : std::bool_constant<T::kDQSplitM> {};
template <class T, class = void> struct TileNoBand : std::false_type {};
template <class T> struct TileNoBand<T, std::void_t<decltype(T::kNoBand)>> : std::bool_constant<T::kNoBand> {};
template <class T, class = void> struct TilePingPong : std::false_type {};
template <class T> struct TilePingPong<T, std::void_t<decltype(T::kPingPong)>> : std::bool_constant<T::kPingPong> {};

// Traits of one (element, head dim, softcap, tile): BwdTraitsT below. BwdTraits is the tile
// table's instantiation (a derived type, so the kernels keep their names); BwdTraitsHd128Full the
// 80-row hd128 tile (unbanded, non-softcap problems only). The base is dependent, so it is
// complete where these are instantiated.
template <typename Element_, int kHeadDim_, bool kSoftcap_, class Tile_> struct BwdTraitsT;
template <typename Element, int kHeadDim, bool kSoftcap>
struct BwdTraits : BwdTraitsT<Element, kHeadDim, kSoftcap, BwdTile<kHeadDim>> {};
template <typename Element, bool kSoftcap>
struct BwdTraitsHd128Full : BwdTraitsT<Element, 128, kSoftcap, BwdTileHd128Full> {};
template <typename Element, bool kSoftcap>
struct BwdTraitsHd128PingPong : BwdTraitsT<Element, 128, kSoftcap, BwdTileHd128PingPong> {};
template <typename Element, bool kSoftcap>
struct BwdTraitsHd128FullPingPong : BwdTraitsT<Element, 128, kSoftcap, BwdTileHd128FullPingPong> {};

// K-major GMMA shared-memory atom whose width divides kK elements (the widest swizzle that fits).
template <typename T, int kK>
CUTE_HOST_DEVICE constexpr auto kmajor_atom() {
  if constexpr (kK % 64 == 0) return GMMA::Layout_K_SW128_Atom<T>{};
  else if constexpr (kK % 32 == 0) return GMMA::Layout_K_SW64_Atom<T>{};
  else if constexpr (kK % 16 == 0) return GMMA::Layout_K_SW32_Atom<T>{};
  else return GMMA::Layout_K_INTER_Atom<T>{};
}
template <typename T, int kMN>
CUTE_HOST_DEVICE constexpr auto mnmajor_atom() {
  if constexpr (kMN % 64 == 0) return GMMA::Layout_MN_SW128_Atom<T>{};
  else if constexpr (kMN % 32 == 0) return GMMA::Layout_MN_SW64_Atom<T>{};
  else if constexpr (kMN % 16 == 0) return GMMA::Layout_MN_SW32_Atom<T>{};
  else return GMMA::Layout_MN_INTER_Atom<T>{};
}

// dQ tiling (bwd_traits below): (queries kBlockM, kHdWg per warpgroup, keys 128), warpgroups
// side by side along N; swapped: (kHdWg per warpgroup, queries kBlockM, keys 128), warpgroups
// along M; split by rows (kSplitM): (kBlockM / 2 queries per warpgroup, kHdWg * 2 = all columns,
// keys 128), warpgroups along M. A function, so that only the chosen form is instantiated (80 rows
// are no WGMMA M).
template <class Element, int kBlockM, int kHdWg, bool kSwap, bool kSplitM = false>
CUTE_HOST_DEVICE constexpr auto make_mma_dq() {
  if constexpr (kSplitM) {
    static_assert(!kSwap && kBlockM % 128 == 0, "dQ split by rows: 64-row multiples per warpgroup");
    return make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM / 2>, Int<2 * kHdWg>, _128>,
                                               GMMA::Major::MN, GMMA::Major::MN>(),
                          Layout<Shape<_2, _1, _1>>{});
  } else if constexpr (kSwap) {
    return make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<Int<kHdWg>, Int<kBlockM>, _128>,
                                               GMMA::Major::MN, GMMA::Major::MN>(),
                          Layout<Shape<_2, _1, _1>>{});
  } else {
    return make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kHdWg>, _128>,
                                               GMMA::Major::MN, GMMA::Major::MN>(),
                          Layout<Shape<_1, _2, _1>>{});
  }
}

// Traits of one (element, head dim, softcap, tile); BwdTraits / BwdTraitsHd128Full above.
template <typename Element_, int kHeadDim_, bool kSoftcap_, class Tile_>
struct BwdTraitsT {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kSoftcap = kSoftcap_;
  using Tile = Tile_;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockMSdP = Tile::kBlockMSdP;    // query columns per S^T/dP^T sub-step
  static constexpr int kSubM = kBlockM / kBlockMSdP;     // sub-steps per step
  static constexpr int kBlockN = 128;
  static constexpr int kNumMmaWG = 2;
  static constexpr int kNumMmaThreads = kNumMmaWG * 128;
  static constexpr int kNumThreads = kNumMmaThreads + 128;  // + producer warpgroup
  static constexpr int kStages = Tile::kStages;
  static constexpr int kStagesdS = Tile::kStagesdS;
  static constexpr int kPasses = Tile::kPasses;
  static constexpr int kDQChunks = 1;                    // the dQ GEMM in one piece (split-D: 2)
  static constexpr int kHdPass = kHeadDim / kPasses;     // dK/dV columns per pass
  static constexpr int kHdChunk = kHeadDim / kDQChunks;  // dQ columns per chunk (both WGs)
  static constexpr bool kDQSmem = Tile::kDQSmem;
  static constexpr bool kOverlapP = Tile::kOverlapP, kOverlapDK = Tile::kOverlapDK;
  // dQ = dS K as dQ^T = K^T dS^T (M = head dim): for a kBlockM that is no WGMMA M (80).
  static constexpr bool kDQSwapAB = TileDQSwapAB<Tile>::value;
  // dQ = dS K split by query rows across the warpgroups, not by columns (hd64).
  static constexpr bool kDQSplitM = TileDQSplitM<Tile>::value;
  static constexpr bool kNoBand = TileNoBand<Tile>::value;
  // Issue every sub-step's S^T/dP^T at the top of the step (kSubM > 1, i.e. hd64; not with
  // softcap, which then spills 8 B): see bwd_main.cuh. +4..+11% at 4k-16k with kDQSplitM.
  static constexpr bool kSdPAhead = kSubM > 1 && !kSoftcap;
  // The per-column statistics (LSE, D) come through lane shuffles: kBlockMSdP/32 registers per
  // statistic instead of up to kBlockMSdP/4 hoisted smem loads (hd128: 20 B of spills -> 0).
  // kShflSegLane: with an immediate source-lane base (shfl_idx_seg3), which ptxas deduplicates
  // (one shuffle per distinct column, no lane registers); the smem-dQ tiles, as measured.
  static constexpr bool kShflSegLane = kNoBand || kDQSmem;
  // kStatsLds: hd64/96 (non-softcap) load each thread's own statistic columns with LDS.64
  // instead (the shuffles took 64 of the MIO queue's issues per warp-step in the MUFU-heavy
  // phases; with kMaskRows and kDsBeforeDv: hd64 +1.1..+4.8%).
  // The banded hd128 tile keeps the shuffles: LDS there (FA3's form, 16 per step for our 32 SHFL)
  // measured level to -3.6% (H100, ABBA, causal 8k the most), and level again once the step
  // waited for dK at its end (session 32). D is loaded for this form on
  // p_and_ds's overlap path only, hence kOverlapP.
  static constexpr bool kStatsLds = kOverlapP && !kSoftcap && kHeadDim < 128 && kDQSmem;
  // kMaskRows: the banded smem-dQ tiles test "does the band cut this sub-step?" as two 32-bit
  // compares against a row range computed once per CTA (BandMask::interior_row_range) instead
  // of block_is_interior's 64-bit arithmetic per sub-step (hd64: 54 uniform instructions less
  // per step). hd192 keeps the measured block_is_interior form.
  static constexpr bool kMaskRows = !kNoBand && kDQSmem;
  // kDsBeforeDv: store dS^T before issuing dV += P^T dO, so the stores drain under the dV issue
  // and the dS barrier / dQ GEMM start sooner (hd64 +1.7..+3.1%; the smem-dQ tiles, as measured).
  static constexpr bool kDsBeforeDv = kDQSmem;
  // kUniformWg: the warpgroup index from a warp shuffle, which ptxas knows is warp-uniform (WGMMA
  // descriptors in uniform registers, no R2UR per step). Not hd192: it spilled 36/76 B there.
  static constexpr bool kUniformWg = kDQSmem;
  // kSkipMaskedWg: a warpgroup whose 64 keys no row of the step sees (warpgroup 1 on the causal
  // diagonal's first step; keys past seqlen_k) skips its S^T, dP^T, dV and dK GEMMs and the P / dS
  // math there (bwd_main.cuh, the masked step). One sub-step per step only: hd64's 128-row steps
  // reach both warpgroups' keys on the causal diagonal. Not hd192 (it spilled 24-68 B there).
  static constexpr bool kSkipMaskedWg = kSubM == 1 && !kNoBand && kDQSmem;
  // kPingPong (BwdTileHd128PingPong, BwdTileHd128FullPingPong):
  //  - step i's dQ GEMM runs in step i + 1 (the last one after the loop) on dS buffer
  //    i % kStagesdS, handed over on ds_full[s] (kDsFullMbar, below); each thread arrives on
  //    ds_empty[s] once its dQ GEMM has read buffer s;
  //  - the warpgroups issue their batches (dV, the lagged dQ, dK, then the next step's S^T / dP^T)
  //    round robin (WarpgroupPingPong) on barrier ids 0 and 1: the DsFull / DsFree ids, which
  //    these tiles do not use.
  static constexpr bool kPingPong = TilePingPong<Tile>::value;
  // kDsFullMbar: each thread arrives on the mbarrier ds_full[s] after its dS^T stores and the dQ
  // GEMM of buffer s waits on it, instead of both warpgroups syncing on the DsFull named barrier.
  // kPingPong's lag needs it; with kSkipMaskedWg a warpgroup reaches the hand-off from either step
  // form (two instruction sites), which bar.sync does not allow (PTX .aligned: one site for all
  // its threads; compute-sanitizer synccheck reports it).
  static constexpr bool kDsFullMbar = kPingPong || kSkipMaskedWg;
  static_assert(!kPingPong || (kStagesdS >= 2 && kPasses == 1 && kBlockM == kBlockMSdP && kDQSmem),
                "dQ lag: a dS buffer is written again two or more steps on; one pass, one sub-step, the "
                "dQ writer");
  static_assert(kBlockMSdP % 64 == 0 || kShflSegLane, "a partial 64-column group needs the kShflSegLane path");
  static_assert(kBlockM % kBlockMSdP == 0 && kBlockMSdP % 16 == 0 &&
                (kBlockMSdP % 64 == 0 || (kBlockMSdP == kBlockM && kDQSwapAB)));
  static_assert(!kDQSwapAB || (kDQSmem && kPasses == 1 && kDQChunks == 1), "swapped dQ: smem dQ path only");
  static_assert(!kDQSmem || (kPasses == 1 && kDQChunks == 1 && kNumMmaWG == 2), "smem dQ path: one pass, one chunk, 2 WGs");
  // Floats of one warpgroup's dQ tile (its half of the columns), in fragment order.
  static constexpr int kDQWgFloats = kBlockM * kHdChunk / kNumMmaWG;
  static constexpr uint32_t kDQWgBytes = kDQWgFloats * sizeof(float);
  static_assert(kDQWgBytes % 16 == 0);
  // The whole pool of 384 threads x 168 registers: 128 x 24 + 256 x 240 = 64512
  // (register_split_fits, common/utils.cuh).
  static constexpr int kProducerRegs = 24;
  static constexpr int kMmaRegs = 240;
  static_assert(register_split_fits(kProducerRegs, kNumMmaThreads, kMmaRegs), "register pool overcommitted");
  static_assert(kHdChunk % 16 == 0 && kHdPass % 8 == 0);
  // dK/dV leave through shared memory and TMA stores (DKVStore, bwd_epilogue.cuh; faster than the
  // 4-byte register stores on the H200). Needs one pass (a pass > 0 has no dS barrier, so the
  // warpgroups are not in step at its end) and a second Q/dO stage (the one the last step does
  // not read).
  static constexpr bool kTmaDKV = kPasses == 1 && kStages >= 2;

  // ---- shared-memory layouts (physical: row-major tiles, head_dim contiguous)
  // Q, dO: B operand of S^T/dP^T (K-major), and B of dK/dV through the transposed view
  // (MN-major, sliced per pass): the atom must divide kHdPass.
  using AtomQ = decltype(kmajor_atom<Element, kHdPass>());
  using SmemLayoutQ1 = decltype(tile_to_shape(AtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(AtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                 Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  // K: A operand of S^T (K-major) and B of dQ through the transposed view, sliced per warpgroup
  // and chunk: the atom must divide kHdChunk / 2.
  // (kDQSplitM: every warpgroup reads all kHdChunk columns.)
  using AtomK = decltype(kmajor_atom<Element, kDQSplitM ? kHdChunk : kHdChunk / kNumMmaWG>());
  using SmemLayoutK = decltype(tile_to_shape(AtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
  // V: A operand of dP^T only.
  using AtomV = decltype(kmajor_atom<Element, kHeadDim>());
  using SmemLayoutV = decltype(tile_to_shape(AtomV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // dS: (queries, keys) with queries contiguous (MN-major A operand of dQ), written from the S^T
  // accumulators through the transposed view with stmatrix.
  using AtomdS = decltype(mnmajor_atom<Element, kBlockM>());
  using SmemLayoutdS = decltype(tile_to_shape(AtomdS{}, Shape<Int<kBlockM>, Int<kBlockN>, Int<kStagesdS>>{}));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>, Int<kStagesdS>>{},
                                  Stride<Int<kBlockM>, _1, Int<kBlockM * kBlockN>>{})));

  // ---- WGMMA tilings (2 consumer warpgroups)
  // S^T, dP^T: (keys 128, queries kBlockMSdP, head_dim); warpgroups split the keys.
  using MmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockMSdP>, Int<kHeadDim>>>(),
      Layout<Shape<_2, _1, _1>>{}));
  // dV, dK: (keys 128, kHdPass, queries kBlockMSdP), A = P^T / dS^T of one sub-step from registers.
  using MmadKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHdPass>, Int<kBlockMSdP>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));
  // dQ chunk: (queries kBlockM, kHdChunk, keys 128); warpgroups split the columns.
  // kDQSwapAB: (kHdChunk, queries kBlockM, keys 128), A = K^T, B = dS; warpgroups split the rows
  // (the head dim) of dQ^T.
  using MmadQ = decltype(make_mma_dq<Element, kBlockM, kHdChunk / kNumMmaWG, kDQSwapAB, kDQSplitM>());
  // Shape of the dQ GEMM's C tile: (queries, columns), or (columns, queries) when swapped.
  using DQTileShape = std::conditional_t<kDQSwapAB, Shape<Int<kHdChunk>, Int<kBlockM>>,
                                         Shape<Int<kBlockM>, Int<kHdChunk>>>;
  // fp32 values per thread of one dQ chunk; the accumulator is stored in this fragment order.
  static constexpr int kDQFrag = kBlockM * kHdChunk / kNumMmaThreads;
  static_assert(kDQFrag % 4 == 0);

  // The producer's TMA types and transaction bytes: BwdLoads below (shared with split-D).

  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> dout;
    cute::array_aligned<Element, cosize_v<SmemLayoutdS>, 1024> ds;
    cute::array_aligned<float, kStages * kBlockM, 16> lse;    // log2-domain LSE per stage
    cute::array_aligned<float, kStages * kBlockM, 16> dpsum;  // D = rowsum(dO o O) per stage
    // dQ tile of each consumer warpgroup (fragment order), read by the dQ writer's bulk reduce.
    cute::array_aligned<float, kDQSmem ? kNumMmaWG * kDQWgFloats : 4, 128> dq;
    uint64_t kv_full;
    uint64_t full[kStages];
    uint64_t empty[kStages];
    uint64_t full_do[kStages];  // dO + D of stage s (full[s]: Q + LSE)
    uint64_t ds_full[kDsFullMbar ? kStagesdS : 1], ds_empty[kPingPong ? kStagesdS : 1];  // the dS ring's
  };
  // +1024: the dynamic smem base is aligned up to 1024 B in the kernel (swizzle atoms).
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;
  static_assert(kSmemBytes <= 232448, "backward tile exceeds 227 KB of shared memory");
};

// What the producer warp loads (bwd_producer.cuh) for a traits class Tr, either
// BwdTraits or SplitDTraits: the TMA copy types over the global tensors as TMA sees them,
// (seqlen, head_dim, heads, batch), and the transaction bytes of K + V and of one Q/dO/LSE/D stage.
// The type of a (batch, seqlen, heads, head_dim) tensor of T as TMA sees it, (seqlen, head_dim,
// heads, batch): what bshd_view (bwd_launch.cuh) builds.
template <class T>
using BshdView = decltype(make_tensor(make_gmem_ptr(static_cast<T*>(nullptr)), Shape<int32_t, int32_t, int32_t, int32_t>{},
                                      Stride<int64_t, _1, int64_t, int64_t>{}));

template <class Tr>
struct BwdLoads {
  using Element = typename Tr::Element;
  template <class SmemLayout>
  using Tma = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<BshdView<Element const>>(), SmemLayout{}));
  using TmaQ = Tma<typename Tr::SmemLayoutQ1>;  // Q and dO: one stage
  using TmaK = Tma<typename Tr::SmemLayoutK>;
  using TmaV = Tma<typename Tr::SmemLayoutV>;

  static constexpr uint32_t kBytesQ = Tr::kBlockM * Tr::kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesK = Tr::kBlockN * Tr::kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesRow = Tr::kBlockM * sizeof(float);  // LSE or D of one query block
  static constexpr uint32_t kBytesHalfStage = kBytesQ + kBytesRow;  // Q + LSE, or dO + D
};

}  // namespace bwd
}  // namespace fa3
