// The backward main kernel (every head dim but 256): one CTA per (key block of 128, kv head,
// batch), warp specialised. This file holds the consumers' step (the GEMMs and the P/dS math) and
// the kernel's roles; the other parts live in their own files:
//   warpgroup 0, warp 0: producer (bwd_producer.cuh): K, V once, then per (pass, query head of
//     the group, query block) Q, dO, LSE and D into a ring of kStages shared-memory stages.
//   warpgroup 0, warp 1 (kDQSmem): the dQ writer (bwd_dq.cuh).
//   warpgroups 1, 2: consumers (registers raised with setmaxnreg), 64 keys each; the GEMMs of a
//     step in bwd_traits.cuh. dK/dV stay in registers over the whole loop (GQA: summed over the
//     query heads of the group inside the CTA, so no fp32 dK/dV workspace and no atomics for
//     them) and leave in the epilogue (bwd_epilogue.cuh); each step's dQ goes to the dQ writer or
//     is added by the consumers (bwd_dq.cuh).
// Synchronisation (rings, named barriers): bwd_pipeline.cuh. Masks (BandMask, common/mask.cuh):
// query blocks that see none of the CTA's keys are never visited; the element mask runs only on
// sub-steps that straddle the band or the end of the keys.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "bwd/bwd_dq.cuh"
#include "bwd/bwd_epilogue.cuh"
#include "bwd/bwd_params.cuh"
#include "bwd/bwd_pipeline.cuh"
#include "bwd/bwd_producer.cuh"
#include "bwd/bwd_traits.cuh"
#include "common/dependent_launch.cuh"
#include "common/mask.cuh"
#include "common/pingpong.cuh"
#include "common/softmax.cuh"
#include "common/utils.cuh"

namespace fa3 {
namespace bwd {

// shfl.sync.idx with segment mask 3 (c = 0x31f): reads lane (lane & 3) | (base & ~3), i.e. lane
// base + lane % 4 for base a multiple of 4 (PTX ISA, shfl.sync: j = minLane | (b & ~segmask)).
CUTE_DEVICE float shfl_idx_seg3(uint32_t mask, float v, int base) {
  float r;
  asm("shfl.sync.idx.b32 %0, %1, %2, 0x31f, %3;" : "=f"(r) : "f"(v), "r"(base), "r"(mask));
  return r;
}

// The consumers' per-sub-step math, once its S^T and dP^T are issued: P^T = exp2(S^T * scale_log2
// - lse_log2) in place of S^T, dS^T = P^T o (dP^T - D) (o tanh' with softcap) in place of dP^T;
// rows = keys, columns = queries (the sub-step's first query q0). lse and dpsum point at the
// sub-step's statistics in the stage; need_mask says whether the band or the key bound cuts the
// sub-step. The first WGMMA wait also retires the previous step's dK (kOverlapDK), whose Q stage
// prev_stage is released there when release_prev. kAhead: the younger S^T/dP^T groups that stay
// in flight (kSdPAhead).
template <class Tr, int kAhead, bool kDocs, class FragS, class CoordS, class FragK, class Release>
CUTE_DEVICE void p_and_ds(MainParams<Tr> const& p, int n0, FragS& tSrS, FragS& tdPrdP,
                          CoordS const& tScS, const float* lse, const float* dpsum, int ct, bool need_mask,
                          int q0, int b, bool release_prev, FragK& tdKrdK, Release const& release, int prev_stage) {
  constexpr int kBlockMSdP = Tr::kBlockMSdP;
  // Per-query statistics of accumulator element i (column get<1>(tScS(i))). Lane L keeps columns
  // 64h + 2L, 64h + 2L + 1 (one float2 per 64 columns) and the thread that needs column
  // c = 8j + 2(lane % 4) + e (element i = e + 2 r + 4 j of the ((2,2,kBlockMSdP/8),1,1)
  // accumulator) takes it from lane (c % 64) / 2 by a shuffle: kBlockMSdP/32 registers per
  // statistic instead of up to kBlockMSdP/4 loaded values. A partial last group of 64 columns
  // (80 rows: columns 64..79) is not shuffled: each thread reads its own 4 columns there from
  // shared memory (fewer live registers).
  float2 lse_r[kBlockMSdP / 64], dpsum_r[kBlockMSdP / 64];
  CUTLASS_PRAGMA_UNROLL
  for (int c64 = 0; c64 < kBlockMSdP / 64; ++c64) {
    lse_r[c64] = *reinterpret_cast<const float2*>(lse + c64 * 64 + 2 * (ct % 32));
    dpsum_r[c64] = *reinterpret_cast<const float2*>(dpsum + c64 * 64 + 2 * (ct % 32));
  }
  // kStatsLds: the thread's own columns 8 j + 2 (lane % 4) + {0, 1} (element i = e + 2 r + 4 j,
  // as above) as kBlockMSdP / 8 float2 loads: LSE here, under the S^T wait, D after the
  // exponentials, under the dP^T wait.
  constexpr int kStatsV = Tr::kStatsLds ? kBlockMSdP / 8 : 1;
  float2 lse_v[kStatsV], dpsum_v[kStatsV];
  auto load_stat = [&](const float* sm, float2 (&v)[kStatsV]) {
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kStatsV; ++j) v[j] = *reinterpret_cast<const float2*>(sm + 8 * j + 2 * (ct % 4));
  };
  if constexpr (Tr::kStatsLds) load_stat(lse, lse_v);
  auto stat = [&](const float* sm, float2 const (&r)[kBlockMSdP / 64], float2 const (&v)[kStatsV], int i) {
    if constexpr (Tr::kStatsLds) {
      return (i % 2) ? v[i / 4].y : v[i / 4].x;
    } else if constexpr (Tr::kShflSegLane) {
      // Source lane 4 (j % 8) + lane % 4 with the lane bits 0-1 taken from the reader (segment
      // mask 3 in shfl's c operand): 4 (j % 8) is an immediate, so no register holds the 8
      // source lanes. Columns past the last full 64 (80 rows: 64..79) are read from shared memory.
      if (i / 32 < kBlockMSdP / 64) {
        const int j = i / 4;
        const float2 v = r[j / 8];
        return shfl_idx_seg3(0xffffffffu, (i % 2) ? v.y : v.x, 4 * (j % 8));
      }
      return sm[get<1>(tScS(i))];
    } else {
      const int j = i / 4;
      const float2 v = r[j / 8];
      return __shfl_sync(0xffffffffu, (i % 2) ? v.y : v.x, 4 * (j % 8) + ct % 4);
    }
  };
  // P of element i (key: its S^T row, query: its column) = 0 where the band or the key bound
  // hides it (kNoBand: the tile runs only without a band).
  auto apply_mask = [&](float& pv, int i) {
    p.band().template zero_if_masked<Tr::kNoBand>(pv, q0 + get<1>(tScS(i)), n0 + get<0>(tScS(i)));
    if constexpr (kDocs) p.docs.zero_if_hidden(pv, b, q0 + get<1>(tScS(i)), n0 + get<0>(tScS(i)));
  };
  if constexpr (Tr::kOverlapP && !Tr::kSoftcap) {
    // Groups in flight: [dK of the previous step | dV, dK of the previous sub-step,] S^T, dP^T.
    // Waiting down to one completes all but dP^T; P is computed while dP^T runs (kAhead: the
    // later sub-steps' S^T/dP^T, or this step's dV/dK of the previous sub-step, stay in flight too).
    warpgroup_wait<1 + kAhead>();
    warpgroup_fence_operand(tSrS);
    if (release_prev) {
      warpgroup_fence_operand(tdKrdK);
      release(prev_stage);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tSrS); ++i) tSrS(i) = prob_from_lse(tSrS(i), p.scale_log2, stat(lse, lse_r, lse_v, i));
    // The mask as its own pass, only on boundary sub-steps, so the exponentials of interior ones
    // carry no per-element coordinates or branches.
    if (need_mask) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tSrS); ++i) apply_mask(tSrS(i), i);
    }
    if constexpr (Tr::kStatsLds) load_stat(dpsum, dpsum_v);
    warpgroup_wait<0 + kAhead>();
    warpgroup_fence_operand(tdPrdP);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tSrS); ++i) tdPrdP(i) = softmax_grad(tSrS(i), tdPrdP(i), stat(dpsum, dpsum_r, dpsum_v, i));
  } else {
    // Softcap needs tanh' next to dP^T: P and dS^T in one pass after both GEMMs, which keeps only
    // S^T and dP^T live next to dK/dV.
    warpgroup_wait<0 + kAhead>();
    warpgroup_fence_operand(tSrS);
    warpgroup_fence_operand(tdPrdP);
    if (release_prev) {
      warpgroup_fence_operand(tdKrdK);
      release(prev_stage);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tSrS); ++i) {
      float s = tSrS(i), dtanh = 1.f;
      if constexpr (Tr::kSoftcap) {
        s = softcap_score(s, p.pre_tanh);
        dtanh = softcap_grad(s);
      }
      float pv = prob_from_lse(s, p.scale_log2, stat(lse, lse_r, lse_v, i));
      if (need_mask) apply_mask(pv, i);
      tSrS(i) = pv;
      tdPrdP(i) = softmax_grad(pv * dtanh, tdPrdP(i), stat(dpsum, dpsum_r, dpsum_v, i));
    }
  }
}

// The consumer warpgroups: the CTA's steps, then the dK/dV epilogue of each pass. A step covers
// its query rows in kSubM sub-steps of kBlockMSdP columns (one for every tile but hd64, which has
// two): each computes S^T, dP^T, P^T, dS^T and dV and stores its dS^T columns with the registers
// of a 64-row step. A sub-step's dK is issued at once and retired by the next sub-step's first
// wait; the last one's follows the dQ GEMM (and with kOverlapDK stays in flight into the next
// step). The dS barrier, the dQ GEMM and its hand-off come once per step.
// kSdPAhead (kSubM > 1): every sub-step's S^T and dP^T are issued at the top of the step, before
// the first exponential, so that the tensor cores run dP^T(0), S^T(1), dP^T(1) under sub-step 0's
// exp2/dS math and dV(0), dK(0) under sub-step 1's (instead of dP^T alone). Costs 64 accumulator
// registers per extra sub-step; the waits then leave the 2 (kSubM - 1) younger groups in flight
// (kAhead).
template <class Tr, bool kDocs>
CUTE_DEVICE void consumer(MainParams<Tr> const& p, char* smem_raw) {
  using Element = typename Tr::Element;
  using TxBar = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  constexpr int kStages = Tr::kStages, kStagesdS = Tr::kStagesdS, kBlockMSdP = Tr::kBlockMSdP;
  cutlass::arch::warpgroup_reg_alloc<Tr::kMmaRegs>();
  auto& ss = aligned_storage<typename Tr::SharedStorage, true>(smem_raw);
  int n_block, hk, b, m_begin, m_end, slot;
  cta_work<Tr, kDocs>(p, n_block, hk, b, m_begin, m_end, slot);
  const int group = p.heads_q / p.heads_kv;
  const bool has_work = m_end > m_begin;
  // The walk's start, as the offset of the first query block from m_begin (first_query_block).
  // Each step's block is computed from i rather than carried by next_query_block as the producer
  // and the dQ writer do: a carried block cost the document kernels 8-20 B more spills.
  const int rot = has_work ? first_query_block<Tr, kDocs>(p, n_block, m_begin, m_end) - m_begin : 0;
  int ct, wg, t_in_wg;
  consumer_thread<Tr::kUniformWg>(ct, wg, t_in_wg);

  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutV{});
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQt{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Tr::SmemLayoutQ{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename Tr::SmemLayoutQt{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.ds.data()), typename Tr::SmemLayoutdS{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.ds.data()), typename Tr::SmemLayoutdSt{});

  typename Tr::MmaSdP mma_sdp;
  typename Tr::MmadKV mma_dkv;
  typename Tr::MmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(ct);
  auto thr_dkv = mma_dkv.get_thread_slice(ct);
  auto thr_dq = mma_dq.get_thread_slice(ct);

  // Q/dO rows as (kBlockMSdP, head_dim, sub-step, 1, stage): the B operands of S^T/dP^T per
  // sub-step (kSubM = 1: the whole step).
  auto sub_rows = [](auto const& t) { return flat_divide(t, Shape<Int<kBlockMSdP>, Int<kHeadDim>>{}); };
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);              // descriptors
  Tensor tSrQ = thr_sdp.partition_fragment_B(sub_rows(sQ));    // (MMA, N, K, sub, 1, stage)
  Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = thr_sdp.partition_fragment_B(sub_rows(sdO));
  // dS as the dQ GEMM's A operand (MMA, M, K, dS stage), or B when swapped (MMA, N, K, dS stage).
  Tensor tdQrdS = [&] {
    if constexpr (Tr::kDQSwapAB) return thr_dq.partition_fragment_B(sdS);
    else return thr_dq.partition_fragment_A(sdS);
  }();

  // A sub-step's S^T / dP^T accumulator (keys x kBlockMSdP queries).
  using FragSdP = decltype(partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockMSdP>>{}));
  // Coordinates (key row, query column of the sub-step) of this thread's S^T accumulator elements.
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockMSdP>>{}));
  // Coordinates (key row, column) of this thread's dK/dV accumulator elements.
  Tensor tdKVc = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<Tr::kHdPass>>{}));

  auto ds_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
  auto thr_ds_copy = ds_copy.get_thread_slice(ct);
  // dS^T destination per sub-step: (CPY, M, N, 1, sub, stage). The view is taken over the whole
  // (1024 B aligned) tile, so the swizzle still sees offsets from the tile base.
  Tensor tdSsdS = thr_ds_copy.partition_D(as_position_independent_swizzle_tensor(
      flat_divide(sdSt, Shape<Int<kBlockN>, Int<kBlockMSdP>>{})));

  const BandMask band = p.band();
  const int n0 = n_block * kBlockN;
  const bool n_partial = n0 + kBlockN > p.seqlen_k;
  // kMaskRows: a sub-step of rows [q0, q_hi] of this key block needs no element mask iff
  // q0 >= iq_min && q_hi <= iq_max (n_partial included: then iq_min = 2^30).
  // Documents narrow it (kDocs: rows outside [iq_min, iq_max] are masked).
  int iq_min = 0, iq_max = 0x7fffffff;
  if constexpr (Tr::kMaskRows) band.interior_row_range(n0, kBlockN, iq_min, iq_max);
  if constexpr (kDocs) p.docs.narrow_interior_rows(b, n0, min(n0 + kBlockN, p.seqlen_k) - 1, iq_min, iq_max);

  // kSkipMaskedWg: the query rows [wg_rows_begin, wg_rows_end) that see some of this warpgroup's
  // 64 keys (empty: none, e.g. keys past seqlen_k); the steps outside them are masked steps (below).
  int wg_rows_begin = 0, wg_rows_end = 0;
  if constexpr (Tr::kSkipMaskedWg)
    band.query_block_range(n_block * Tr::kNumMmaWG + wg, kBlockN / Tr::kNumMmaWG, 1, wg_rows_begin, wg_rows_end);

  if (has_work) TxBar::wait(&ss.kv_full, 0);

  // Q, dO, LSE, D of a stage are no longer read by this thread.
  auto release = [&](int s) { release_stage(&ss.empty[s]); };

  // One step counter carries the whole pipeline state (registers are the limit here): stage
  // and phase of the Q/dO ring, the dS buffer (dS is written only in pass 0, whose steps come
  // first), and the stage an in-flight dK still reads (the previous step's).
  int it = 0;
  // kDQSmem: this warpgroup's dQ tile of the previous step is written but not yet handed to the
  // writer; handed over once this step's S^T / dP^T are issued (or after the last step).
  bool dq_held = false;
  auto hand_held_dq = [&] {
    if constexpr (Tr::kDQSmem) {
      if (dq_held) dq_hand_to_writer(wg);
      dq_held = false;
    }
  };
  // kPingPong: warpgroup 0 issues first; each hands the turn on after its batch (dV, dQ, dK and
  // the next step's S^T / dP^T).
  const WarpgroupPingPong<2, Tr::kPingPong, kBarDsFull> turn{wg};
  static_assert(kBarDsFree == kBarDsFull + 1);
  turn.start();
  using ClusterBar = cutlass::arch::ClusterBarrier;
  // Issue the dQ GEMM of step it_ds on its dS buffer (kDsFullMbar: once both warpgroups stored it).
  auto issue_dq = [&](auto& tdQrdQ, int it_ds) {
    const int s = it_ds % kStagesdS;
    if constexpr (Tr::kDsFullMbar) ClusterBar::wait(&ss.ds_full[s], (it_ds / kStagesdS) & 1);
    if constexpr (Tr::kDQSwapAB) {
      Tensor tdQrK = thr_dq.partition_fragment_A(sKt);
      wgmma_gemm<true, -1>(mma_dq, tdQrK, tdQrdS(_, _, _, s), tdQrdQ);
    } else {
      Tensor tdQrK = thr_dq.partition_fragment_B(sKt);
      wgmma_gemm<true, -1>(mma_dq, tdQrdS(_, _, _, s), tdQrK, tdQrdQ);
    }
  };
  // dS^T of sub-step sub (rdS) into dS buffer ds_stage of step it, once that buffer is free;
  // fence and barrier in ds_stored.
  auto store_ds = [&](auto const& rdS, int sub, int ds_stage) {
    // With one dS buffer the other warpgroup may still read it (previous dQ GEMM).
    if (kStagesdS == 1 && sub == 0) cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDsFree);
    // kPingPong: both warpgroups' dQ GEMMs of this buffer's last use (step it - kStagesdS) done.
    if constexpr (Tr::kPingPong) ClusterBar::wait(&ss.ds_empty[ds_stage], ((it / kStagesdS) & 1) ^ 1);
    copy(ds_copy, thr_ds_copy.retile_S(rdS), tdSsdS(_, _, _, 0, sub, ds_stage));
  };
  // This warpgroup's part of the dS tile in buffer ds_stage is complete: to the dQ GEMM.
  auto ds_stored = [&](int ds_stage) {
    cutlass::arch::fence_view_async_shared();
    if constexpr (Tr::kDsFullMbar) ClusterBar::arrive(&ss.ds_full[ds_stage]);
    else cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDsFull);
  };
  // The dQ GEMM of step it_dq has been waited for: its dS buffer is free (kPingPong), its tile
  // goes out (h, m: the step's; read only by the consumers' own adds, not by the smem path that
  // kPingPong takes, whose writer walks the steps in order).
  auto dq_done = [&](auto& tdQrdQ, int it_dq, int h, int m) {
    warpgroup_fence_operand(tdQrdQ);
    if constexpr (Tr::kPingPong) ClusterBar::arrive(&ss.ds_empty[it_dq % kStagesdS]);
    dq_step_out(p, ss, tdQrdQ, b, h, m, n_block, ct, wg, t_in_wg, dq_held);
  };
  for (int pass = 0; pass < Tr::kPasses; ++pass) {
    Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<Tr::kHdPass>>{});
    Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<Tr::kHdPass>>{});
    clear(tdKrdK);
    clear(tdVrdV);
    const bool dq_pass = pass == 0;
    const int it_pass = it;  // kOverlapDK: steps after the pass's first have a dK in flight
    for (int hi = 0; hi < group; ++hi) {
      const int h = hk * group + hi;
      for (int i = m_begin; i < m_end; ++i) {
        const int m = i + rot < m_end ? i + rot : i + rot - (m_end - m_begin);  // wrapping at m_end
        const int m0 = m * kBlockM;
        // Per sub-step: does the band or the key bound cut through its (query, key) tile?
        bool need_mask[Tr::kSubM];
        CUTLASS_PRAGMA_UNROLL
        for (int sub = 0; sub < Tr::kSubM; ++sub) {
          const int q0 = m0 + sub * kBlockMSdP;
          // kNoBand (the 80-row hd128 tile, launched only without a band): the key bound alone.
          if constexpr (Tr::kNoBand) need_mask[sub] = n_partial;
          else if constexpr (Tr::kMaskRows)  // rows [iq_min, iq_max] are interior
            need_mask[sub] = q0 < iq_min || min(q0 + kBlockMSdP, p.seqlen_q) - 1 > iq_max;
          else need_mask[sub] = n_partial ||
                                !band.block_is_interior(q0, min(q0 + kBlockMSdP, p.seqlen_q) - 1, n0, kBlockN) ||
                                (kDocs && (q0 < iq_min || min(q0 + kBlockMSdP, p.seqlen_q) - 1 > iq_max));
        }
        const int stage = it % kStages;
        const uint32_t phase = (it / kStages) & 1;
        const int ds_stage = it % kStagesdS;
        const int prev_stage = (it + kStages - 1) % kStages;
        const bool pending = Tr::kOverlapDK && it != it_pass;
        // The dQ GEMM of this step, or with kPingPong of the previous one (none before the first).
        const bool dq_now = dq_pass && (!Tr::kPingPong || it > it_pass);
        const int it_dq = Tr::kPingPong ? it - 1 : it;
        TxBar::wait(&ss.full[stage], phase);
        // kSkipMaskedWg, the masked step: this warpgroup's keys see none of the step's rows (causal:
        // warpgroup 1 on each key block's diagonal step), so P = dS = 0 there: no S^T / dP^T / dV
        // / dK GEMM and no exponentials; only its zero half of dS for the dQ GEMM, the dQ GEMM
        // and the step's barriers and hand-offs, in the order of a full step.
        if (Tr::kSkipMaskedWg && (m0 + kBlockM <= wg_rows_begin || m0 >= wg_rows_end)) {
          hand_held_dq();
          if (it > it_pass) turn.signal();
          if (pending) {  // the previous step's dK retires here
            warpgroup_wait<0>();
            warpgroup_fence_operand(tdKrdK);
            release(prev_stage);
          }
          if (dq_pass) {
            Tensor rdS = make_tensor<Element>(FragSdP{}.layout());
            fill(rdS, Element(0));
            store_ds(rdS, 0, ds_stage);
            ds_stored(ds_stage);
          }
          turn.wait();
          if (dq_now) {
            Tensor tdQrdQ = partition_fragment_C(mma_dq, typename Tr::DQTileShape{});
            issue_dq(tdQrdQ, it_dq);
            warpgroup_wait<0>();
            dq_done(tdQrdQ, it_dq, h, m);
          }
          if constexpr (!Tr::kOverlapDK) release(stage);  // else in the next step, as after a full step
          ++it;
          continue;
        }
        // dO and D are waited for right before the first dP^T: S^T is issued first (ABBA:
        // +1.2% geomean, up to +3.3% at hd64 causal 8k).
        auto wait_do = [&](int sub) {
          if (sub == 0) TxBar::wait(&ss.full_do[stage], phase);
        };

        // kSdPAhead: every sub-step's S^T and dP^T issued here (see above).
        constexpr int kAhead = Tr::kSdPAhead ? 2 * (Tr::kSubM - 1) : 0;
        FragSdP tSrS_sub[Tr::kSdPAhead ? Tr::kSubM : 1], tdPrdP_sub[Tr::kSdPAhead ? Tr::kSubM : 1];
        if constexpr (Tr::kSdPAhead) {
          CUTLASS_PRAGMA_UNROLL
          for (int sub = 0; sub < Tr::kSubM; ++sub) {
            wgmma_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, sub, 0, stage), tSrS_sub[sub]);
            wait_do(sub);
            wgmma_gemm<true, -1>(mma_sdp, tdPrV, tdPrdO(_, _, _, sub, 0, stage), tdPrdP_sub[sub]);
          }
          hand_held_dq();
        }
        CUTLASS_PRAGMA_UNROLL
        for (int sub = 0; sub < Tr::kSubM; ++sub) {
          const bool last = sub == Tr::kSubM - 1;
          const int q0 = m0 + sub * kBlockMSdP;  // first query row of the sub-step
          FragSdP tSrS_own, tdPrdP_own;  // without kSdPAhead: this sub-step's own accumulators
          FragSdP& tSrS = Tr::kSdPAhead ? tSrS_sub[Tr::kSdPAhead ? sub : 0] : tSrS_own;
          FragSdP& tdPrdP = Tr::kSdPAhead ? tdPrdP_sub[Tr::kSdPAhead ? sub : 0] : tdPrdP_own;
          if constexpr (!Tr::kSdPAhead) {
            wgmma_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, sub, 0, stage), tSrS);
            wait_do(sub);
            wgmma_gemm<true, -1>(mma_sdp, tdPrV, tdPrdO(_, _, _, sub, 0, stage), tdPrdP);
            if (sub == 0) hand_held_dq();
            if (it > it_pass) turn.signal();  // the previous step's batch ends here
          }
          const float* lse = ss.lse.data() + stage * kBlockM + sub * kBlockMSdP;
          const float* dpsum = ss.dpsum.data() + stage * kBlockM + sub * kBlockMSdP;
          p_and_ds<Tr, kAhead, kDocs>(p, n0, tSrS, tdPrdP, tScS, lse, dpsum, ct, need_mask[sub], q0, b,
                               sub == 0 && pending, tdKrdK, release, prev_stage);
          Tensor rP = make_tensor<Element>(tSrS.layout());
          convert_fragment(tSrS, rP);
          Tensor rdS = make_tensor<Element>(tdPrdP.layout());
          convert_fragment(tdPrdP, rdS);
          // dS^T of this sub-step to shared memory for the dQ GEMM.
          if constexpr (Tr::kDsBeforeDv) {
            if (dq_pass) store_ds(rdS, sub, ds_stage);
          }
          turn.wait();
          // dV += P^T dO (this pass's columns).
          {
            Tensor sdOt_p = local_tile(sdOt(_, _, stage), Shape<Int<Tr::kHdPass>, Int<kBlockMSdP>>{},
                                       make_coord(pass, sub));
            Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOt_p);
            Tensor tdVrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
            wgmma_gemm<false, -1>(mma_dkv, tdVrP, tdVrdO, tdVrdV);
          }

          if (dq_pass) {
            if constexpr (!Tr::kDsBeforeDv) store_ds(rdS, sub, ds_stage);
            if (last) ds_stored(ds_stage);
          }
          // dK += dS^T Q (this pass's columns); in the last sub-step of a dq_pass issued after
          // the dQ GEMM below.
          Tensor sQt_p = local_tile(sQt(_, _, stage), Shape<Int<Tr::kHdPass>, Int<kBlockMSdP>>{},
                                    make_coord(pass, sub));
          Tensor tdKrQ = thr_dkv.partition_fragment_B(sQt_p);
          Tensor tdKrdS = make_tensor(rdS.data(), acc_as_operand_a(rdS.layout()));

          // dQ = dS K over both warpgroups' dS (kDQSwapAB: dQ^T = K^T dS^T, this warpgroup's 64
          // columns x kBlockM), after the last sub-step; the dK issued behind it retires under the
          // dQ hand-off.
          if (dq_now && last) {
            Tensor tdQrdQ = partition_fragment_C(mma_dq, typename Tr::DQTileShape{});
            issue_dq(tdQrdQ, it_dq);
            wgmma_gemm<false, -1>(mma_dkv, tdKrdS, tdKrQ, tdKrdK);
            warpgroup_wait<1>();  // dV and dQ done; dK may still run
            dq_done(tdQrdQ, it_dq, h, m);
          } else {
            wgmma_gemm<false, -1>(mma_dkv, tdKrdS, tdKrQ, tdKrdK);
          }
        }  // sub-steps
        if constexpr (!Tr::kOverlapDK) {
          warpgroup_wait<0>();
          warpgroup_fence_operand(tdKrdK);
          warpgroup_fence_operand(tdVrdV);
          release(stage);
        }  // else dK stays in flight into the next step; its Q stage is released there.
        ++it;
      }
    }
    // kPingPong: warpgroup 1's last batch may go (its own last signal has no taker). Before the
    // lag's last dQ below: that waits (dq_to_smem) for the writer, which waits for warpgroup 1.
    if (wg == 0 && it > it_pass) turn.signal();
    if constexpr (Tr::kPingPong) {
      if (it > it_pass) {  // the last step's dQ; the tile before it goes to the writer meanwhile
        Tensor tdQrdQ = partition_fragment_C(mma_dq, typename Tr::DQTileShape{});
        issue_dq(tdQrdQ, it - 1);
        hand_held_dq();
        warpgroup_wait<0>();
        warpgroup_fence_operand(tdQrdQ);
        dq_step_out(p, ss, tdQrdQ, b, 0, 0, n_block, ct, wg, t_in_wg, dq_held);  // h, m: unread (smem path)
      }
    }
    hand_held_dq();
    warpgroup_wait<0>();  // unconditional: ptxas must see every GMMA retired before the epilogue
    if (Tr::kOverlapDK && it != it_pass) release((it + kStages - 1) % kStages);
    warpgroup_fence_operand(tdKrdK);
    warpgroup_fence_operand(tdVrdV);
    // This pass's columns of dK (scaled) and dV, in the input dtype; a tail unit's share in fp32.
    store_dkv<Tr>(p, ss, tdKrdK, tdVrdV, tdKVc, it, slot, n_block, pass, hk, b, ct, wg, t_in_wg);
  }
}

// The producer warpgroup on 24 registers: warp 0 the producer, warp 1 the dQ writer (kDQSmem).
// Each role derives its block range itself, inside its branch: values shared by the two branches
// would stay live through both on 24 registers (ptxas spilled the TMA loop).
template <class Tr, bool kDocs>
CUTE_DEVICE void producer_warpgroup(MainParams<Tr> const& p, char* smem_raw) {
  using Storage = typename Tr::SharedStorage;
  cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
  const int warp = threadIdx.x / 32;
  int m_begin, m_end;
  if (warp == 0) {
    Storage& ss = aligned_storage<Storage, false>(smem_raw);
    int n_block, hk, b, slot;
    cta_work<Tr, kDocs>(p, n_block, hk, b, m_begin, m_end, slot);
    const int group = p.heads_q / p.heads_kv;
    if (threadIdx.x == 0 && m_end > m_begin)
      load_kv_and_steps(p, ss, n_block, hk, b, group, m_begin, m_end, first_query_block<Tr, kDocs>(p, n_block, m_begin, m_end));
  } else if (Tr::kDQSmem && warp == 1) {
    Storage& ss = aligned_storage<Storage, false>(smem_raw);
    int n_block, hk, b, slot;
    cta_work<Tr, kDocs>(p, n_block, hk, b, m_begin, m_end, slot);
    const int group = p.heads_q / p.heads_kv;
    if (m_end > m_begin) dq_writer(p, ss, n_block, hk, b, group, m_begin, m_end, first_query_block<Tr, kDocs>(p, n_block, m_begin, m_end));
  }
}

// kDocs: the copy launched for calls with documents (bwd_launch.cuh). Its own kernel, because
// the document loads and masks in the same kernel cost the other calls registers (the hd64
// consumer spilled 160 bytes).
template <class Tr, bool kDocs>
__global__ void __launch_bounds__(Tr::kNumThreads, 1)
    bwd_main_kernel(const __grid_constant__ MainParams<Tr> p) {
  extern __shared__ char smem_raw[];
  // Everything a role needs is (re)computed after its setmaxnreg, so that no value lives across
  // the register reallocation (ptxas would spill it).
  if (threadIdx.x == 0) {
    init_main_ring_barriers<Tr>(aligned_storage<typename Tr::SharedStorage, false>(smem_raw));
    cutlass::arch::fence_barrier_init();
    if constexpr (DKVStore<Tr>::kEnabled) {
      cute::prefetch_tma_descriptor(p.tma_dk.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_dv.get_tma_descriptor());
    }
  }
  __syncthreads();
  wait_for_previous_grid();
  allow_next_grid();  // the postprocess's launch under this grid's last CTAs
  if (threadIdx.x / 128 == 0) producer_warpgroup<Tr, kDocs>(p, smem_raw);
  else consumer<Tr, kDocs>(p, smem_raw);
}

}  // namespace bwd
}  // namespace fa3
