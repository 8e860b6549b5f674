// The split-D backward main kernel (head dim 256; traits and GEMM list in bwd_split_d_traits.cuh).
// One CTA per (80 keys, kv head, batch), warp specialised like bwd_main_kernel:
//   warpgroup 0, warp 0: producer (load_kv_and_steps_split_d, bwd_producer.cuh): K, V once; per
//     step Q + LSE into a 2-stage ring, dO + D into a one-stage ring.
//   warpgroups 1, 2: consumers. Per step (query block of 64 rows, one query head of the group):
//     S, dP for 40 keys each -> P, dS into shared memory -> sync -> each warpgroup accumulates
//     dV^T and dK^T for its 128 head-dim rows over all 80 keys, and adds its columns of
//     dQ = dS K to the fp32 accumulator with float4 reductions (bwd_dq.cuh).
// Shared with the main kernel: MainParams, the producer's helpers, the band (common/mask.cuh),
// the named-barrier ids (bwd_pipeline.cuh), the deterministic turn protocol (identical to its
// paths without the dQ writer) and the dQ accumulator layout (so preprocess/postprocess are the
// same kernels).
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "bwd/bwd_dq.cuh"
#include "bwd/bwd_epilogue.cuh"
#include "bwd/bwd_params.cuh"
#include "bwd/bwd_pipeline.cuh"
#include "bwd/bwd_producer.cuh"
#include "bwd/bwd_split_d_traits.cuh"
#include "common/dependent_launch.cuh"
#include "common/mask.cuh"
#include "common/softmax.cuh"
#include "common/utils.cuh"

namespace fa3 {
namespace bwd {

// P = exp2(S * scale_log2 - lse_log2) in place of S and dS = P o (dP - D) (o tanh' with softcap)
// in place of dP, for one step whose S and dP GEMMs are in flight (rows = queries from m0,
// columns = keys). lse_r/dpsum_r: the statistics of the thread's two accumulator rows.
template <class Tr, bool kDocs, class FragS, class CoordS>
CUTE_DEVICE void split_d_p_and_ds(MainParams<Tr> const& p, int n0, FragS& tSrS, FragS& tdPrdP,
                                  CoordS const& tScS, float const (&lse_r)[2], float const (&dpsum_r)[2],
                                  bool need_mask, int m0, int b) {
  // P of element i (query: its row, key: its column) = 0 where the band, the key bound or the
  // documents hide it.
  auto apply_mask = [&](float& pv, int i) {
    p.band().zero_if_masked(pv, m0 + get<0>(tScS(i)), n0 + get<1>(tScS(i)));
    if constexpr (kDocs) p.docs.zero_unless_sees(pv, b, m0 + get<0>(tScS(i)), n0 + get<1>(tScS(i)));
  };
  if constexpr (!Tr::kSoftcap) {
    // P while dP is still on the tensor cores; the mask is its own pass (boundary blocks).
    warpgroup_wait<1>();
    warpgroup_fence_operand(tSrS);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tSrS); ++i) tSrS(i) = prob_from_lse(tSrS(i), p.scale_log2, lse_r[(i / 2) % 2]);
    if (need_mask) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tSrS); ++i) apply_mask(tSrS(i), i);
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tdPrdP);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tSrS); ++i) tdPrdP(i) = softmax_grad(tSrS(i), tdPrdP(i), dpsum_r[(i / 2) % 2]);
  } else {
    // Softcap: tanh' must meet dP, so P and dS in one pass after both GEMMs.
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    warpgroup_fence_operand(tdPrdP);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tSrS); ++i) {
      const float s = softcap_score(tSrS(i), p.pre_tanh);
      float pv = prob_from_lse(s, p.scale_log2, lse_r[(i / 2) % 2]);
      if (need_mask) apply_mask(pv, i);
      tSrS(i) = pv;
      tdPrdP(i) = softmax_grad(pv * softcap_grad(s), tdPrdP(i), dpsum_r[(i / 2) % 2]);
    }
  }
}

// The consumer warpgroups: the CTA's steps, then the dK/dV epilogue.
template <class Tr, bool kDocs>
CUTE_DEVICE void split_d_consumer(MainParams<Tr> const& p, char* smem_raw) {
  using Element = typename Tr::Element;
  using TxBar = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  constexpr int kStages = Tr::kStages, kStagesPdS = Tr::kStagesPdS;
  cutlass::arch::warpgroup_reg_alloc<Tr::kMmaRegs>();
  auto& ss = aligned_storage<typename Tr::SharedStorage, true>(smem_raw);
  int n_block, hk, b;
  p.order.decode(int(blockIdx.x), n_block, hk, b);
  const int group = p.heads_q / p.heads_kv;
  const BandMask band = p.band();
  int m_begin, m_end;
  query_blocks<Tr, kDocs>(p, band, n_block, b, m_begin, m_end);
  int ct, wg, t_in_wg;  // wg unused here: the thread slices take it from ct
  consumer_thread<Tr::kUniformWg>(ct, wg, t_in_wg);

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQt{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Tr::SmemLayoutdO{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename Tr::SmemLayoutdOt{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutV{});
  Tensor sP = make_tensor(make_smem_ptr(ss.p.data()), typename Tr::SmemLayoutPdS{});
  Tensor sPt = make_tensor(make_smem_ptr(ss.p.data()), typename Tr::SmemLayoutPdSt{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.ds.data()), typename Tr::SmemLayoutPdS{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.ds.data()), typename Tr::SmemLayoutPdSt{});

  typename Tr::MmaSdP mma_sdp;
  typename Tr::MmadKV mma_dkv;
  typename Tr::MmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(ct);
  auto thr_dkv = mma_dkv.get_thread_slice(ct);
  auto thr_dq = mma_dq.get_thread_slice(ct);

  // Operand descriptors. (MMA, M|N, K, stage|buffer)
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  Tensor tdVrdO = thr_dkv.partition_fragment_A(sdOt);
  Tensor tdVrP = thr_dkv.partition_fragment_B(sPt);
  Tensor tdKrQ = thr_dkv.partition_fragment_A(sQt);
  Tensor tdKrdS = thr_dkv.partition_fragment_B(sdSt);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  // K^T of dQ chunk c (its head-dim columns).
  auto tdQrK = [&](int c) {
    return thr_dq.partition_fragment_B(local_tile(sKt, Shape<Int<Tr::kHdChunk>, Int<kBlockN>>{}, make_coord(c, _0{})));
  };

  // (query, key) of this thread's S/dP accumulator elements; (d, key) of its dK^T/dV^T ones.
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tdKVc = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kHeadDim>, Int<kBlockN>>{}));

  // P and dS: accumulator fragments -> (queries, keys) tiles with stmatrix.
  auto pds_copy = make_tiled_copy_C(Copy_Atom<typename Tr::StsmAtom, Element>{}, mma_sdp);
  auto thr_pds_copy = pds_copy.get_thread_slice(ct);
  Tensor tPsP = thr_pds_copy.partition_D(as_position_independent_swizzle_tensor(sP));     // (CPY, M, N, buf)
  Tensor tdSsdS = thr_pds_copy.partition_D(as_position_independent_swizzle_tensor(sdS));

  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kHeadDim>, Int<kBlockN>>{});
  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kHeadDim>, Int<kBlockN>>{});
  clear(tdKrdK);
  clear(tdVrdV);

  const int n0 = n_block * kBlockN;
  const bool n_partial = n0 + kBlockN > p.seqlen_k;
  int iq_min = 0, iq_max = 0x7fffffff;  // documents: only rows in [iq_min, iq_max] see every key
  if constexpr (kDocs) p.docs.narrow_interior_rows(b, n0, min(n0 + kBlockN, p.seqlen_k) - 1, iq_min, iq_max);
  // The accumulator rows of a thread: element i sits on row get<0>(tScS(2 * ((i / 2) % 2)))
  // (value mode (column pair, row +8, column group)).
  const int row_lo = get<0>(tScS(0)), row_hi = get<0>(tScS(2));

  if (m_end > m_begin) TxBar::wait(&ss.kv_full, 0);

  int it = 0;  // step counter: Q stage and phase, dO phase, P/dS buffer
  for (int hi = 0; hi < group; ++hi) {
    const int h = hk * group + hi;
    // Recomputed per query head (a few integer ops): kept live across the step loop, the range
    // spilled.
    query_blocks<Tr, kDocs>(p, band, n_block, b, m_begin, m_end);
    for (int m = m_begin; m < m_end; ++m, ++it) {
      const int m0 = m * kBlockM;
      const bool need_mask = n_partial ||
                             !band.block_is_interior(m0, min(m0 + kBlockM, p.seqlen_q) - 1, n0, kBlockN) ||
                             (kDocs && (m0 < iq_min || min(m0 + kBlockM, p.seqlen_q) - 1 > iq_max));
      const int stage = it % kStages;
      const int buf = it % kStagesPdS;
      TxBar::wait(&ss.full[stage], (it / kStages) & 1);

      Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      wgmma_gemm<true, -1>(mma_sdp, tSrQ(_, _, _, stage), tSrK, tSrS);
      // The dO load started when the last step's dV^T retired; S runs meanwhile.
      TxBar::wait(&ss.do_full, it & 1);
      wgmma_gemm<true, -1>(mma_sdp, tdPrdO(_, _, _, 0), tdPrV, tdPrdP);
      const float* lse = ss.lse.data() + stage * kBlockM;
      const float* dpsum = ss.dpsum.data();
      const float lse_r[2] = {lse[row_lo], lse[row_hi]};
      const float dpsum_r[2] = {dpsum[row_lo], dpsum[row_hi]};
      split_d_p_and_ds<Tr, kDocs>(p, n0, tSrS, tdPrdP, tScS, lse_r, dpsum_r, need_mask, m0, b);
      {
        Tensor rP = make_tensor<Element>(tSrS.layout());
        convert_fragment(tSrS, rP);
        Tensor rdS = make_tensor<Element>(tdPrdP.layout());
        convert_fragment(tdPrdP, rdS);
        copy(pds_copy, thr_pds_copy.retile_S(rP), tPsP(_, _, _, buf));
        copy(pds_copy, thr_pds_copy.retile_S(rdS), tdSsdS(_, _, _, buf));
      }
      cutlass::arch::fence_view_async_shared();  // generic smem writes -> WGMMA operand reads
      // Both warpgroups' keys are in P/dS. The buffer written next step is the other one; the one
      // after that is this one again, which both warpgroups have finished reading (wait<0> at
      // the end of this step) before either passes the next step's sync.
      cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDsFull);

      // dQ chunk 0 first, so its adds run while dV^T and dK^T are on the tensor cores.
      Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<Tr::kHdChunk>>{});
      wgmma_gemm<true, -1>(mma_dq, tdQrdS(_, _, _, buf), tdQrK(0), tdQrdQ);
      wgmma_gemm<false, -1>(mma_dkv, tdVrdO(_, _, _, 0), tdVrP(_, _, _, buf), tdVrdV);
      wgmma_gemm<false, -1>(mma_dkv, tdKrQ(_, _, _, stage), tdKrdS(_, _, _, buf), tdKrdK);

      const int64_t acc_base = ((int64_t(b) * p.heads_q + h) * p.m_blocks + m) * int64_t(kBlockM * kHeadDim);
      int* sem = p.dq_sem + (int64_t(b) * p.heads_q + h) * p.m_blocks + m;
      float4* acc = reinterpret_cast<float4*>(p.dq_accum + acc_base + int64_t(ct / 128) * Tr::kDQWgFloats);
      warpgroup_wait<2>();  // dQ chunk 0 done; dV^T, dK^T may still run
      warpgroup_fence_operand(tdQrdQ);
      if (p.deterministic) wait_dq_turn<Tr>(band, m0, n_block, sem, ct);
      dq_add_fragment(acc, tdQrdQ, t_in_wg);
      // dV^T (issued before dK^T) is the last reader of dO: free the slot now, so the next
      // step's dO load runs under dK^T, dQ chunk 1 and the next S. dK^T stays in flight.
      warpgroup_wait<1>();
      warpgroup_fence_operand(tdVrdV);
      release_stage(&ss.do_empty);
      wgmma_gemm<true, -1>(mma_dq, tdQrdS(_, _, _, buf), tdQrK(1), tdQrdQ);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tdQrdQ);
      warpgroup_fence_operand(tdVrdV);
      warpgroup_fence_operand(tdKrdK);
      // Q, dO, LSE, D of this stage are no longer read by this thread.
      release_stage(&ss.empty[stage]);
      acc += (kBlockM * Tr::kHdChunk) / 4;  // chunk 1
      dq_add_fragment(acc, tdQrdQ, t_in_wg);
      if (p.deterministic) publish_dq_turn<Tr>(sem, ct);
    }
  }
  // dK (scaled) and dV, transposed back from (d, key) fragments, in the input dtype.
  store_dkv_split_d<Tr>(p, ss, tdKrdK, tdVrdV, tdKVc, n0, hk, b, ct);
}

// kDocs: the copy for calls with documents (as bwd_main_kernel).
template <class Tr, bool kDocs>
__global__ void __launch_bounds__(Tr::kNumThreads, 1)
    bwd_split_d_kernel(const __grid_constant__ MainParams<Tr> p) {
  using TxBar = cutlass::arch::ClusterTransactionBarrier;
  using ClusterBar = cutlass::arch::ClusterBarrier;
  using Storage = typename Tr::SharedStorage;
  extern __shared__ char smem_raw[];
  if (threadIdx.x == 0) {
    Storage& ss = aligned_storage<Storage, false>(smem_raw);
    init_ring_barriers<Tr>(ss);
    TxBar::init(&ss.do_full, 1);
    ClusterBar::init(&ss.do_empty, Tr::kNumMmaThreads);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  wait_for_previous_grid();
  allow_next_grid();

  if (threadIdx.x / 128 == 0) {
    // Producer warpgroup: one thread issues every load (the 1D grid in bwd_order.cuh's
    // longest-first section order).
    cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
    if (threadIdx.x == 0) {
      int n_block, hk, b;
      p.order.decode(int(blockIdx.x), n_block, hk, b);
      const int group = p.heads_q / p.heads_kv;
      int m_begin, m_end;
      query_blocks<Tr, kDocs>(p, p.band(), n_block, b, m_begin, m_end);
      if (m_end > m_begin)
        load_kv_and_steps_split_d(p, aligned_storage<Storage, false>(smem_raw), n_block, hk, b, group, m_begin, m_end);
    }
    return;
  }
  split_d_consumer<Tr, kDocs>(p, smem_raw);
}

}  // namespace bwd
}  // namespace fa3
