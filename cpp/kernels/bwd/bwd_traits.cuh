// Backward configuration per (element, head dim): tile table, shared-memory layouts, WGMMA
// tilings and the TMA copy types. Kernels read everything from here.
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
// A step may cover its kBlockM rows in sub-steps of kBlockMSdP columns (hd64 at 128 rows): the
// five lines above S^T .. dK run per sub-step, dQ and its hand-off once per step.
// which is added in fp32 to a global accumulator with vector atomics. Computing S transposed
// makes both dK and dV register-sourced GEMMs (no P/dS round trip through shared memory for
// them) and keeps dK/dV accumulation for the CTA's keys in registers.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "common/utils.cuh"

namespace fa3 {
namespace bwd {

using namespace cute;

// Tile table. kPasses > 1 splits head_dim of the dK/dV accumulators into column passes over the
// query blocks (S and dP are recomputed per pass): register pressure, not smem, limits d >= 192
// (dK + dV for 64 keys x 256 columns would be 256 fp32 registers per thread). kDQChunks splits
// the dQ GEMM into sequential column chunks for the same reason.
//   kBlockM   query rows per step: one Q/dO stage, one dS barrier, one dQ GEMM and hand-off
//   kBlockMSdP query columns of one S^T/dP^T sub-step (the N side of S^T; 64 keeps S^T + dP^T at
//             64 registers); kBlockM / kBlockMSdP sub-steps per step
//   kStages   Q/dO/LSE/D shared-memory stages (TMA ring)
//   kStagesdS dS buffers (2 lets the next step write dS while the other warpgroup still reads)
template <int kHeadDim> struct BwdTile;
// Consumer-loop code quality (session 6, from the SASS against FA3's hd128 causal kernel; see
// NOTES.md "Session 6: ours vs FA3 at hd128 causal, SASS"). All on by default since session 7
// (H200 A/B with tma-dkv: hd128 +2..+15%, hd64 +2..+10%, hd256 level); 0 gives the earlier
// SASS. Each changes only how ptxas sees the same computation:
//   FA3_BWD_SMEM_SPACE=1: the SharedStorage reference keeps the provenance of the __shared__
//     array (1024 B rounding by an offset, not through an integer), so the statistics loads and
//     the dQ tile stores are LDS/STS instead of generic LD.E/ST.E (which go through the LSU's
//     global queue: long-scoreboard waits, lg_throttle, counted as L1 hits by ncu).
//   FA3_BWD_UNIFORM_WG=1: the consumer's warpgroup index comes from a warp shuffle
//     (cutlass::canonical_warp_group_idx), so ptxas knows it is warp-uniform and builds the K, V
//     and K^T WGMMA descriptors in uniform registers instead of per thread + R2UR.
//   FA3_BWD_SHFL_SEG_LANE=1: the statistics shuffles of the d <= 128 tiles take the immediate
//     source-lane form (shfl_idx_seg3, the 80-row tile's), which ptxas/LLVM deduplicate: one
//     shuffle per distinct column (16 per statistic at 64 columns) and no lane registers.
#ifndef FA3_BWD_SMEM_SPACE
#define FA3_BWD_SMEM_SPACE 1
#endif
#ifndef FA3_BWD_UNIFORM_WG
#define FA3_BWD_UNIFORM_WG 1
#endif
#ifndef FA3_BWD_SHFL_SEG_LANE
#define FA3_BWD_SHFL_SEG_LANE 1
#endif
// FA3_BWD_STATS_LDS=1 (session 7a, default 0; NOTES.md "Session 7a"): the hd128 64-row tile
//   (non-softcap) takes LSE and D as FA3 does: each thread loads its own 16 columns of a
//   statistic with 8 LDS.64 into registers, LSE between the S^T/dP^T issue and the S^T wait, D
//   after the exponentials and before the dP^T wait, so both land under a GEMM wait and the exp2
//   and dS math start on registers (the shuffles sit on that path: 16 SHFL after each wait).
//   28 more registers in the exp2 phase; with the cross-step dK overlap kept, ptxas fits them
//   (0 spills): it converts P to bf16 before the dP^T wait instead of after it.
#ifndef FA3_BWD_STATS_LDS
#define FA3_BWD_STATS_LDS 0
#endif
// FA3_BWD_STATS_LDS_SMALL=1 (session 7d; default 1 since session 10, with MASK_ROWS and
//   DS_BEFORE_DV: hd64 +1.1..+4.8%, hd128 causal +0..+5%; NOTES.md "Session 10", "Session 7d"):
//   the same per-thread LDS.64 statistics for the hd64 (128-row, two sub-steps; also the 64-row step) and hd96 tiles
//   (non-softcap), each sub-step loading its own 64 columns. hd64 spends 64 SHFL per consumer
//   warp-step there (of 725 instructions) and ~2x hd128's elementwise work per FLOP: the
//   shuffles take 64 of the MIO queue's issues in the MUFU-heavy phases, LDS.64 with a 4-address
//   broadcast takes 32.
#ifndef FA3_BWD_STATS_LDS_SMALL
#define FA3_BWD_STATS_LDS_SMALL 1
#endif
// FA3_BWD_MASK_ROWS=1 (session 7d; default 1 since session 10; NOTES.md "Session 7d"): the per-step "does the band
//   or the key bound cut this sub-step?" test as two 32-bit compares against a row range computed
//   once per CTA (BandMask::interior_row_range) instead of block_is_interior's 64-bit arithmetic
//   per sub-step: hd64's step loses the 54 uniform instructions at its top (between the dQ
//   hand-off and the next S^T issue; ptxas recomputes the two bounds inside the first exp2 phase,
//   ~10 instructions). Same booleans (host_checks/block_range_check.cu). The d <= 128 tiles.
#ifndef FA3_BWD_MASK_ROWS
#define FA3_BWD_MASK_ROWS 1
#endif
// FA3_BWD_DQ_TAIL_READ=1 (session 7a, default 0; every smem-dQ tile): the dQ writer leaves
//   without waiting for its last two bulk reduce-adds to be performed in L2 (they have been read
//   from shared memory, which is all the CTA's exit needs), as FA3's writer does: when the
//   writer is the CTA's last warp, the next CTA on the SM starts ~1 us earlier.
#ifndef FA3_BWD_DQ_TAIL_READ
#define FA3_BWD_DQ_TAIL_READ 0
#endif
// kDQSmem: dQ leaves the consumers through a shared-memory tile that a dedicated warp adds to the
// fp32 accumulator with one bulk reduce-add per warpgroup (cp.reduce.async.bulk); false: the
// consumers add it with float4 atomics (only where the smem tile does not fit: d >= 192).
// kOverlap: intra-warpgroup overlap. P = exp2(..) is computed while the dP^T GEMM runs, and the
// dK GEMM of one step stays in flight across the dQ hand-off and the next step's S^T/dP^T issue
// (its Q stage is released one step later). Costs 16-32 registers (dS^T of the step in flight).
// 128 query rows per step by default (FA3's step length; -DFA3_BWD_HD64_BLOCK_M=64 gives the
//     earlier 64-row step, spill-free with both overlaps, 6-9% slower at 2k-8k on the H200).
//     128 rows halve the per-step fixed costs (stage
//     wait/release, dS barrier, dQ GEMM wait and hand-off, the writer's bulk reduce). S^T + dP^T
//     over 128 columns would take 128 registers (spills 16/56 B without overlap, 200+ B with), so
//     the step runs S^T .. dK as two 64-column sub-steps (kBlockMSdP = 64): each has the 64-row
//     step's registers and both overlaps (P during dP^T; the dK of one sub-step stays in flight
//     over the next sub-step's S^T/dP^T). smem 16+16 (K,V) + 64 (Q,dO x2) + 64 (dS x2)
//     + 32 (dQ) = 192 KB: 2 stages (a third would need 224 KB + stats: over the limit).
// Overlap defaults for the d <= 128 tiles (-DFA3_BWD_OVERLAP_P=0 / -DFA3_BWD_OVERLAP_DK=0 turn
// one part off for A/B runs; ptxas: see NOTES.md).
#ifndef FA3_BWD_OVERLAP_P
#define FA3_BWD_OVERLAP_P 1
#endif
#ifndef FA3_BWD_OVERLAP_DK
#define FA3_BWD_OVERLAP_DK 1
#endif
// d >= 192 (atomic dQ, column passes): overlap on for 192 (0 / 8 B spills), off for 256 (see
// NOTES.md).
#ifndef FA3_BWD_HD192_OVERLAP
#define FA3_BWD_HD192_OVERLAP 1
#endif
#ifndef FA3_BWD_HD256_OVERLAP
#define FA3_BWD_HD256_OVERLAP 0
#endif
#ifndef FA3_BWD_HD64_BLOCK_M
#define FA3_BWD_HD64_BLOCK_M 128  // two 64-column sub-steps per step (see the comment above); 64: one
                                 // 64-row step (measured slower on the H200, bwd NOTES.md)
#endif
// Q/dO/LSE/D ring depth. With the dK overlap a stage is released one step late, so with 2
// stages the TMA for step i+2 starts only once step i+1 is under way; short steps (small head
// dims) get a third stage where smem allows (hd64: 144 KB, hd96: 200 KB; hd128 would need
// 224 KB + stats: see NOTES.md). hd64 at 128 rows: steps as long as hd128's, 2 stages.
#ifndef FA3_BWD_HD64_STAGES
#define FA3_BWD_HD64_STAGES (FA3_BWD_HD64_BLOCK_M == 128 ? 2 : 3)
#endif
#ifndef FA3_BWD_HD96_STAGES
#define FA3_BWD_HD96_STAGES 3
#endif
#ifndef FA3_BWD_HD128_STAGES
#define FA3_BWD_HD128_STAGES 2
#endif
// dQ GEMM split by query rows across the two warpgroups (FA3's hd64 AtomLayoutMdQ = 2): each
// warpgroup computes its 64 query rows x all 64 columns (m64n64k16 x 8, A = its half of dS, B = all
// of K^T) instead of all 128 rows x its 32 columns (m64n32k16 x 16). Same MAC, 2/3 of the shared-
// memory operand bytes (64 instead of 96 KB per step: m64n32 SS reads 192 B/clk, twice the tensor
// time's worth at 128 B/clk), half the HGMMAs. K takes the SW128 atom (each warpgroup reads all 64
// columns). The dQ accumulator stays in each tile's fragment order (bwd_postprocess inverts it with
// the same MmadQ). 128-row steps only. Default 1 (session 6, with FA3_BWD_SDP_AHEAD: +4..+11% at
// 4k-16k; bwd NOTES.md, "hd64: where the time goes"); 0 keeps the column split.
#ifndef FA3_BWD_HD64_DQ_SPLIT_M
#define FA3_BWD_HD64_DQ_SPLIT_M 1
#endif
// (A 64-row step keeps the column split.)
template <> struct BwdTile<64>  { static constexpr int kBlockM = FA3_BWD_HD64_BLOCK_M, kBlockMSdP = 64, kStages = FA3_BWD_HD64_STAGES, kStagesdS = 2, kPasses = 1, kDQChunks = 1; static constexpr bool kDQSmem = true, kOverlapP = FA3_BWD_OVERLAP_P, kOverlapDK = FA3_BWD_OVERLAP_DK; static constexpr bool kDQSplitM = FA3_BWD_HD64_DQ_SPLIT_M && FA3_BWD_HD64_BLOCK_M == 128; };
// 96: dK+dV 96 regs; smem 24+24 + 48 + 16 + 24 (dQ) KB.
template <> struct BwdTile<96>  { static constexpr int kBlockM = 64, kBlockMSdP = 64, kStages = FA3_BWD_HD96_STAGES, kStagesdS = 2, kPasses = 1, kDQChunks = 1; static constexpr bool kDQSmem = true, kOverlapP = FA3_BWD_OVERLAP_P, kOverlapDK = FA3_BWD_OVERLAP_DK; };
// 128: dK+dV 128 regs, S^T+dP^T 64, dQ 32, dS^T in flight 16: fits 240; smem 32+32 + 64 + 32
//      + 32 (dQ) = 192 KB.
template <> struct BwdTile<128> { static constexpr int kBlockM = 64, kBlockMSdP = 64, kStages = FA3_BWD_HD128_STAGES, kStagesdS = 2, kPasses = 1, kDQChunks = 1; static constexpr bool kDQSmem = true, kOverlapP = FA3_BWD_OVERLAP_P, kOverlapDK = FA3_BWD_OVERLAP_DK; };
// 192: two column passes of 96 (dK+dV 96 regs); smem 48+48 + 96 + 16 = 208 KB (one dS buffer).
template <> struct BwdTile<192> { static constexpr int kBlockM = 64, kBlockMSdP = 64, kStages = 2, kStagesdS = 1, kPasses = 2, kDQChunks = 1; static constexpr bool kDQSmem = false, kOverlapP = FA3_BWD_HD192_OVERLAP, kOverlapDK = FA3_BWD_HD192_OVERLAP; };
// 256: two passes of 128; dQ in two chunks; smem 64+64 + 64 (one stage) + 16 = 208 KB.
template <> struct BwdTile<256> { static constexpr int kBlockM = 64, kBlockMSdP = 64, kStages = 1, kStagesdS = 1, kPasses = 2, kDQChunks = 2; static constexpr bool kDQSmem = false, kOverlapP = FA3_BWD_HD256_OVERLAP, kOverlapDK = FA3_BWD_HD256_OVERLAP; };

// hd128 at 80 query rows per step for problems without a band (FA3's non-causal hd128 step;
// FA3_BWD_HD128_BLOCK_M_FULL, default 80 since session 5, +12-15% at non-causal 512-16k; 0 =
// off): run_bwd_impl (bwd_launch.cuh) picks it for non-causal, non-local, non-softcap
// problems; banded ones keep BwdTile<128>. 25% more work per step for the same per-step fixed
// costs (stage wait/release, dS barrier, dQ hand-off and bulk reduce). 80 rows cannot be the
// M side of a WGMMA, so the dQ GEMM is swapped (kDQSwapAB):
// dQ^T = K^T dS^T, M = head dim (the warpgroups split it), N = 80 queries, A = K^T and B = dS
// both MN-major from shared memory; the dQ accumulator holds each warpgroup's (64 d x 80 q)
// dQ^T fragment, which bwd_postprocess un-transposes through shared memory. S^T/dP^T are
// m64n80 per warpgroup (80 registers), dK + dV 128: the dK-across-steps overlap does not fit
// (FA3_BWD_HD128_FULL_OVERLAP_DK=1 to try), P during dP^T only with spills (below). dS (queries contiguous, 80 = 5
// x 16) takes the MN SW32 atom. smem 32+32 (K,V) + 2x20+2x20 (Q,dO) + 2x20 (dS) + 40 (dQ)
// = 224 KB + LSE/D: see NOTES.md, "hd128 at 80-row steps".
#ifndef FA3_BWD_HD128_BLOCK_M_FULL
#define FA3_BWD_HD128_BLOCK_M_FULL 80
#endif
#ifndef FA3_BWD_HD128_FULL_OVERLAP_DK
#define FA3_BWD_HD128_FULL_OVERLAP_DK 0
#endif
// P during dP^T at 80 rows: 24-40 B of spills (loop invariants reloaded, ~2 LDL per step), so off
// by default (0 spills); FA3_BWD_HD128_FULL_OVERLAP_P=1 for the A/B.
#ifndef FA3_BWD_HD128_FULL_OVERLAP_P
#define FA3_BWD_HD128_FULL_OVERLAP_P 0
#endif

// dK/dV epilogue through shared memory and TMA stores (FA3_BWD_TMA_DKV=1, the default since session 7's
// H200 A/B; 0: the 4-byte global stores from the accumulator registers). Each consumer warp writes its 16 key rows
// of dK (scaled) and dV with stmatrix into shared memory that is free by then (dK: a Q/dO stage no
// step reads any more; dV: the warpgroup's own rows of V) and one lane issues TMA stores of (16,
// head dim) boxes, which clip at seqlen_k. One-pass tiles only (kPasses == 1: hd64, 96, 128 and
// the 80-row hd128 tile); hd192 (column passes) keeps the register stores: DKVStore below and
// bwd_main.cuh (store_dkv_tma) say why each region is free.
#ifndef FA3_BWD_TMA_DKV
#define FA3_BWD_TMA_DKV 1
#endif

// dQ adds of the atomic paths (split-D hd256, hd192, FA3_BWD_DQ_ATOMIC) as reductions, not atomics
// (FA3_BWD_DQ_RED=1, the default since session 8: hd256 backward +12..+28% on the H200; NOTES.md "Session 7c"). atomicAdd(float4*) is PTX
// `atom.global.add.v4.f32`; ptxas turns an atom whose result is unused into REDG (no return) only
// when no fence follows it, and the deterministic path's __threadfence() after the adds makes it
// keep ATOMG.E.ADD.F32x4 (result to RZ) in every path: an atomic whose old value L2 sends back,
// 16 B per lane, as much traffic L2 -> SM as the adds themselves. With the switch the adds are
// `red.relaxed.gpu.global.add.v4.f32` (REDG.E.ADD.F32x4: the same relaxed gpu-scope add, FTZ.RN
// like atom.add.f32, no return); the fence still orders them before the turn release.
#ifndef FA3_BWD_DQ_RED
#define FA3_BWD_DQ_RED 1
#endif
// FA3_BWD_DS_BEFORE_DV (default 1 since session 10: alone +1.7..+3.1% at hd64; 0 = dS after
// dV, the session-9 order; the d <= 128 tiles, kDsBeforeDv): in each sub-step store the dS^T
// columns to shared memory before issuing dV += P^T dO instead of after, so the stores drain while
// dV is issued and the last sub-step's dS barrier / dQ GEMM start sooner (FA3 orders its hd64
// backward this way). The fence and the dS barrier stay after the dV issue.
#ifndef FA3_BWD_DS_BEFORE_DV
#define FA3_BWD_DS_BEFORE_DV 1
#endif
static_assert(FA3_BWD_HD128_BLOCK_M_FULL == 0 || FA3_BWD_HD128_BLOCK_M_FULL == 80,
              "FA3_BWD_HD128_BLOCK_M_FULL: 0 (off) or 80");
struct BwdTileHd128Full {
  static constexpr int kBlockM = 80, kBlockMSdP = 80, kStages = 2, kStagesdS = 2, kPasses = 1, kDQChunks = 1;
  static constexpr bool kDQSmem = true, kOverlapP = FA3_BWD_OVERLAP_P && FA3_BWD_HD128_FULL_OVERLAP_P,
                        kOverlapDK = FA3_BWD_OVERLAP_DK && FA3_BWD_HD128_FULL_OVERLAP_DK;
  static constexpr bool kDQSwapAB = true;
  static constexpr bool kNoBand = true;  // launched only for problems without a band
};
// kDQSwapAB, kNoBand of a tile (false where the tile does not say). kNoBand: the host launches the
// tile only for problems without a band (bwd_launch.cuh), so the element mask is the key bound.
template <class T, class = void> struct TileDQSwapAB : std::false_type {};
template <class T> struct TileDQSwapAB<T, std::void_t<decltype(T::kDQSwapAB)>> : std::bool_constant<T::kDQSwapAB> {};
template <class T, class = void> struct TileDQSplitM : std::false_type {};
template <class T> struct TileDQSplitM<T, std::void_t<decltype(T::kDQSplitM)>> : std::bool_constant<T::kDQSplitM> {};
template <class T, class = void> struct TileNoBand : std::false_type {};
template <class T> struct TileNoBand<T, std::void_t<decltype(T::kNoBand)>> : std::bool_constant<T::kNoBand> {};

// Traits of one (element, head dim, softcap, tile): BwdTraitsT below. BwdTraits is the tile
// table's instantiation (a derived type, so the kernels keep their names and SASS);
// BwdTraitsHd128Full the 80-row hd128 tile (FA3_BWD_HD128_BLOCK_M_FULL=80: unbanded, non-softcap
// problems only). The base is dependent, so it is complete where these are instantiated.
template <typename Element_, int kHeadDim_, bool kSoftcap_, class Tile_> struct BwdTraitsT;
template <typename Element, int kHeadDim, bool kSoftcap>
struct BwdTraits : BwdTraitsT<Element, kHeadDim, kSoftcap, BwdTile<kHeadDim>> {};
template <typename Element, bool kSoftcap>
struct BwdTraitsHd128Full : BwdTraitsT<Element, 128, kSoftcap, BwdTileHd128Full> {};

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
  static constexpr int kDQChunks = Tile::kDQChunks;
  static constexpr int kHdPass = kHeadDim / kPasses;     // dK/dV columns per pass
  static constexpr int kHdChunk = kHeadDim / kDQChunks;  // dQ columns per chunk (both WGs)
  // Compile-time switches (tile table defaults; -DFA3_BWD_DQ_ATOMIC / -DFA3_BWD_NO_OVERLAP force
  // the v1 behaviour for A/B measurements and as a fallback).
#ifdef FA3_BWD_DQ_ATOMIC
  static constexpr bool kDQSmem = false;
#else
  static constexpr bool kDQSmem = Tile::kDQSmem;
#endif
#ifdef FA3_BWD_NO_OVERLAP
  static constexpr bool kOverlapP = false, kOverlapDK = false;
#else
  static constexpr bool kOverlapP = Tile::kOverlapP, kOverlapDK = Tile::kOverlapDK;
#endif
  // LSE/D per accumulator column through lane shuffles (bwd_main.cuh): kBlockM/32 registers per
  // statistic instead of up to kBlockM/4 hoisted smem loads (hd128: 20 B of spills -> 0).
#ifdef FA3_BWD_SHUFFLE_STATS
  static constexpr bool kShuffleStats = FA3_BWD_SHUFFLE_STATS;
#else
  static constexpr bool kShuffleStats = true;
#endif
  // dQ = dS K as dQ^T = K^T dS^T (M = head dim): for a kBlockM that is no WGMMA M (80).
  static constexpr bool kDQSwapAB = TileDQSwapAB<Tile>::value;
  // dQ = dS K split by query rows across the warpgroups (FA3_BWD_HD64_DQ_SPLIT_M), not by columns.
  static constexpr bool kDQSplitM = TileDQSplitM<Tile>::value;
  static constexpr bool kNoBand = TileNoBand<Tile>::value;
  // Issue every sub-step's S^T/dP^T at the top of the step (FA3_BWD_SDP_AHEAD=1; kSubM > 1 only,
  // i.e. hd64 at 128 rows; not with softcap, which then spills 8 B): see bwd_main.cuh. Default 1
  // (session 6, with the dQ row split above); 0 issues each sub-step's pair in turn.
#ifndef FA3_BWD_SDP_AHEAD
#define FA3_BWD_SDP_AHEAD 1
#endif
  static constexpr bool kSdPAhead = FA3_BWD_SDP_AHEAD && kSubM > 1 && !kSoftcap;
  // Statistics shuffles with an immediate source-lane base (bwd_main.cuh, shfl_idx_seg3): frees
  // the 8 registers of source lanes. The 80-row tile only, so the GPU-tested kernels keep their
  // SASS; a candidate for every tile.
  static constexpr bool kShflSegLane = kNoBand || (FA3_BWD_SHFL_SEG_LANE && kDQSmem);
  // FA3_BWD_STATS_LDS (see the macro above): statistics as per-thread smem loads, no shuffles.
  static constexpr bool kStatsLds = !kSoftcap && ((FA3_BWD_STATS_LDS && kHeadDim == 128 && kBlockM == 64) ||
                                                  (FA3_BWD_STATS_LDS_SMALL && kHeadDim < 128 && kDQSmem));
  // FA3_BWD_MASK_ROWS (see the macro above): the banded tiles' interior test per sub-step.
  // The smem-dQ tiles only (d <= 128; hd192 / column-pass hd256 keep their SASS).
  static constexpr bool kMaskRows = FA3_BWD_MASK_ROWS && !kNoBand && kDQSmem;
  // FA3_BWD_DS_BEFORE_DV (see the macro above): the smem-dQ tiles (d <= 128), where it was measured
  // and tested on the H200; hd192 keeps the dS stores after the dV issue.
  static constexpr bool kDsBeforeDv = FA3_BWD_DS_BEFORE_DV && kDQSmem;
  // FA3_BWD_SMEM_SPACE / FA3_BWD_UNIFORM_WG (see BwdTile above): the smem-dQ tiles (d <= 128);
  // SMEM_SPACE also hd192 (atomic dQ; alone it adds no spill there: softcap keeps the default's
  // 8 B, NOTES.md "Split-D (hd256) and hd192"), not the column-pass hd256 (FA3_BWD_HD256_SPLIT_D=0:
  // its spills grow). With all three switches hd192 spilled 36/76 B, so UNIFORM_WG stays d <= 128.
  static constexpr bool kSmemSpace = FA3_BWD_SMEM_SPACE && (kDQSmem || kHeadDim <= 192);
  static constexpr bool kUniformWg = FA3_BWD_UNIFORM_WG && kDQSmem;
  static_assert(kBlockMSdP % 64 == 0 || kShflSegLane, "a partial 64-column group needs the kShflSegLane path");
  static_assert(kBlockM % kBlockMSdP == 0 && kBlockMSdP % 16 == 0 &&
                (kBlockMSdP % 64 == 0 || (kBlockMSdP == kBlockM && kDQSwapAB)));
  static_assert(!kDQSwapAB || (kDQSmem && kPasses == 1 && kDQChunks == 1), "swapped dQ: smem dQ path only");
  static_assert(!kDQSmem || (kPasses == 1 && kDQChunks == 1 && kNumMmaWG == 2), "smem dQ path: one pass, one chunk, 2 WGs");
  // Floats of one warpgroup's dQ tile (its half of the columns), in fragment order.
  static constexpr int kDQWgFloats = kBlockM * kHdChunk / kNumMmaWG;
  static constexpr uint32_t kDQWgBytes = kDQWgFloats * sizeof(float);
  static_assert(kDQWgBytes % 16 == 0);
  // setmaxnreg can only move registers within what the CTA got at launch: 384 threads x 168
  // (the __launch_bounds__(384, 1) cap) = 64512 = 128 x 24 + 256 x 240. Asking for more than
  // the pool (e.g. 32/240 = 65536) makes the consumers' setmaxnreg.inc wait forever.
  static constexpr int kProducerRegs = 24;
  static constexpr int kMmaRegs = 240;
  static_assert(128 * kProducerRegs + 256 * kMmaRegs <= 384 * 168, "register pool overcommitted");
  static_assert(kHdChunk % 16 == 0 && kHdPass % 8 == 0);
  // FA3_BWD_TMA_DKV: dK/dV leave through shared memory and TMA (DKVStore below). Needs one pass
  // (a pass > 0 has no dS barrier, so the warpgroups are not in step at its end) and a second Q/dO
  // stage (the one the last step does not read).
  static constexpr bool kTmaDKV = FA3_BWD_TMA_DKV != 0 && kPasses == 1 && kStages >= 2;

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
  };
  // +1024: the dynamic smem base is aligned up to 1024 B in the kernel (swizzle atoms).
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;
  static_assert(kSmemBytes <= 232448, "backward tile exceeds 227 KB of shared memory");
};

// What the producer warp loads (bwd_main.cuh, load_kv_and_steps) for a traits class Tr, either
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
  static constexpr uint32_t kBytesStage = 2 * kBytesQ + 2 * kBytesRow;
};

// dK/dV through shared memory and TMA stores (FA3_BWD_TMA_DKV; bwd_main.cuh, store_dkv_tma), for
// traits with kTmaDKV. Consumer warpgroup w stages its (64 keys, head dim) dK in the first 64 rows
// of the free Q/dO stage (Q for w = 0, dO for w = 1) in a compact K-major layout, and its dV in its
// own 64 rows of V, in V's layout. Both use V's swizzle atom (the widest that divides the head dim),
// rows first, so row r of either starts r * kAtomCols elements in (a multiple of the swizzle period
// for r % 8 == 0): warp k's 16 rows are a 16-row view at 16 k * kAtomCols, the TMA box is (atom
// columns, 16 rows), head dim / atom columns boxes per tensor. Without kTmaDKV: empty placeholders.
struct NoTmaStore {};
template <class Tr, class = void> struct TraitsTmaDKV : std::false_type {};
template <class Tr> struct TraitsTmaDKV<Tr, std::void_t<decltype(Tr::kTmaDKV)>> : std::bool_constant<Tr::kTmaDKV> {};
template <class Tr, bool = TraitsTmaDKV<Tr>::value>
struct DKVStore {
  static constexpr bool kEnabled = false;
  using TmaDK = NoTmaStore;
  using TmaDV = NoTmaStore;
};
template <class Tr>
struct DKVStore<Tr, true> {
  static constexpr bool kEnabled = true;
  using Element = typename Tr::Element;
  static constexpr int kHeadDim = Tr::kHeadDim, kBlockN = Tr::kBlockN;
  using Atom = typename Tr::AtomV;
  static constexpr int kAtomCols = decltype(size<1>(Atom{}))::value;
  static constexpr int kWarpRows = 16;  // key rows of one consumer warp (WGMMA C layout)
  // Warpgroup tiles: dK compact (64, hd); dV = rows [64 w, 64 w + 64) of SmemLayoutV (offset kVHalf).
  using SmemLayoutdK = decltype(tile_to_shape(Atom{}, Shape<_64, Int<kHeadDim>>{}));
  using SmemLayoutdV = decltype(composition(typename Tr::SmemLayoutV{},
                                            make_layout(Shape<_64, Int<kHeadDim>>{}, Stride<_1, Int<kBlockN>>{})));
  // One warp's 16 rows of each (offset kWarpOffset * warp).
  using SmemLayoutdK16 = decltype(composition(SmemLayoutdK{},
                                              make_layout(Shape<_16, Int<kHeadDim>>{}, Stride<_1, _64>{})));
  using SmemLayoutdV16 = decltype(composition(typename Tr::SmemLayoutV{},
                                              make_layout(Shape<_16, Int<kHeadDim>>{}, Stride<_1, Int<kBlockN>>{})));
  static constexpr int kVHalf = 64 * kAtomCols;                  // elements: V row 64
  static constexpr int kWarpOffset = kWarpRows * kAtomCols;      // elements: row 16 of either tile
  static constexpr int kStageElems = Tr::kBlockM * kHeadDim;     // one Q (or dO) stage
  // A swizzle period is one atom (8 rows): the warp and warpgroup offsets are whole atoms, so the
  // views and the TMA (which swizzles by address bits) see the pattern the layouts describe.
  static_assert(kHeadDim % kAtomCols == 0 && kWarpRows % 8 == 0 && kVHalf % (8 * kAtomCols) == 0);
  static_assert(cosize_v<SmemLayoutdK> <= kStageElems, "dK of a warpgroup must fit in one Q stage");
  static_assert((kStageElems * int(sizeof(Element))) % 1024 == 0, "stages 1024-byte aligned");
  // One warpgroup's slice of the dV/dK GEMM (its C layout is thread t_in_wg's part of MmadKV's
  // warpgroup w rows): the stmatrix tiling of the epilogue.
  using MmaWg = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<Tr::kHdPass>, Int<Tr::kBlockMSdP>>,
                           GMMA::Major::K, GMMA::Major::MN>()));
  using TmaDK = decltype(make_tma_copy(SM90_TMA_STORE{}, std::declval<BshdView<Element>>(), SmemLayoutdK16{}));
  using TmaDV = decltype(make_tma_copy(SM90_TMA_STORE{}, std::declval<BshdView<Element>>(), SmemLayoutdV16{}));
};

}  // namespace bwd
}  // namespace fa3
