// The backward's producers: one elected thread of the producer warp loads, by TMA, K and V of the
// CTA's key block once, then per step (pass, query head of the group, query block) Q and dO and,
// by 1D bulk copies, the block's LSE and D into the shared-memory ring(s) that the consumers walk
// (bwd_pipeline.cuh). load_kv_and_steps: the main kernel's; load_kv_and_steps_split_d: the
// split-D kernel's, with dO and D in a ring of their own.
#pragma once

#include <cutlass/arch/barrier.h>

#include "bwd/bwd_params.cuh"
#include "bwd/bwd_traits.cuh"

namespace fa3 {
namespace bwd {

// L2 policy of the Q/dO tile loads. Every key block of the head reads them again (the CTAs of a
// section of heads run at about the same time), while K/V are read once per CTA: so L2 is asked
// to keep Q/dO (as FA3 does).
CUTE_HOST_DEVICE constexpr TMA::CacheHintSm90 qdo_hint() { return TMA::CacheHintSm90::EVICT_LAST; }

// K and V of key block n_block (kv head hk, batch b), once per CTA, completing on kv_full; the
// first thing each producer issues.
template <class Tr>
CUTE_DEVICE void load_kv(MainParams<Tr> const& p, typename Tr::SharedStorage& ss, int n_block, int hk, int b) {
  using TxBar = cutlass::arch::ClusterTransactionBarrier;
  using Loads = BwdLoads<Tr>;
  constexpr int kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutV{});
  Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seqlen_k, kHeadDim, p.heads_kv, p.batch));
  Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.seqlen_k, kHeadDim, p.heads_kv, p.batch));
  Tensor gK = local_tile(mK(_, _, hk, b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
  Tensor gV = local_tile(mV(_, _, hk, b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
  auto tma_k = p.tma_k.get_slice(_0{});
  auto tma_v = p.tma_v.get_slice(_0{});
  TxBar::arrive_and_expect_tx(&ss.kv_full, 2 * Loads::kBytesK);
  copy(p.tma_k.with(ss.kv_full), tma_k.partition_S(gK), tma_k.partition_D(sK));
  copy(p.tma_v.with(ss.kv_full), tma_v.partition_S(gV), tma_v.partition_D(sV));
}

// TMA destination partitions (TMA, TMA_M, TMA_K, stage) of the Q and dO rings, dO in the
// kernel's layout (SmemLayoutQ when it shares Q's ring, SmemLayoutdO in its own).
template <class Tr, class SmemLayoutdO>
CUTE_DEVICE auto qdo_ring_tiles(MainParams<Tr> const& p, typename Tr::SharedStorage& ss) {
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), SmemLayoutdO{});
  return cute::make_tuple(p.tma_q.get_slice(_0{}).partition_D(sQ), p.tma_do.get_slice(_0{}).partition_D(sdO));
}

// TMA source partitions (TMA, TMA_M, TMA_K, m_blocks) of Q and dO of query head h, batch b: what
// both producers walk per head.
template <class Tr>
CUTE_DEVICE auto qdo_head_tiles(MainParams<Tr> const& p, int h, int b) {
  constexpr int kBlockM = Tr::kBlockM, kHeadDim = Tr::kHeadDim;
  const auto shape = make_shape(p.seqlen_q, kHeadDim, p.heads_q, p.batch);
  Tensor gQ = local_tile(p.tma_q.get_tma_tensor(shape)(_, _, h, b), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                         make_coord(_, _0{}));
  Tensor gdO = local_tile(p.tma_do.get_tma_tensor(shape)(_, _, h, b), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                          make_coord(_, _0{}));
  return cute::make_tuple(p.tma_q.get_slice(_0{}).partition_S(gQ), p.tma_do.get_slice(_0{}).partition_S(gdO));
}

// Producer, one elected thread: K and V of key block n_block once, then for every (pass, query
// head of kv head hk's group, query block in [m_begin, m_end) from m_first, first_query_block)
// Q and dO (TMA) and the block's LSE and D (1D bulk copies) into the kStages ring, in the order
// the consumers walk the steps.
template <class Tr>
CUTE_DEVICE void load_kv_and_steps(MainParams<Tr> const& p, typename Tr::SharedStorage& ss, int n_block, int hk,
                                   int b, int group, int m_begin, int m_end, int m_first) {
  using TxBar = cutlass::arch::ClusterTransactionBarrier;
  using ClusterBar = cutlass::arch::ClusterBarrier;
  using Loads = BwdLoads<Tr>;
  constexpr int kBlockM = Tr::kBlockM;
  load_kv(p, ss, n_block, hk, b);
  auto [tQsQ, tdOsdO] = qdo_ring_tiles<Tr, typename Tr::SmemLayoutQ>(p, ss);
  int stage = 0;
  uint32_t phase = 0;
  #pragma unroll 1
  for (int pass = 0; pass < Tr::kPasses; ++pass) {
    // Walk the group's query heads by head index, and LSE/D rows by a running offset: with hk
    // and b decoded from the 1D grid rather than read from blockIdx, fewer loop values keep the
    // 24-register producer free of spills.
    const int h_first = hk * group, h_end = h_first + group;
    int64_t row0 = (int64_t(b) * p.heads_q + h_first) * p.m_blocks * kBlockM;
    #pragma unroll 1
    for (int h = h_first; h < h_end; ++h, row0 += int64_t(p.m_blocks) * kBlockM) {
      auto [tQgQ, tdOgdO] = qdo_head_tiles(p, h, b);
      int m = m_first;
      #pragma unroll 1
      do {
        const float* lse = p.lse_log2 + row0 + m * kBlockM;
        const float* dpsum = p.dpsum + row0 + m * kBlockM;
        ClusterBar::wait(&ss.empty[stage], phase ^ 1);
        uint64_t* const do_full = &ss.full_do[stage];  // dO + D; Q + LSE on full[stage]
        TxBar::arrive_and_expect_tx(&ss.full[stage], Loads::kBytesHalfStage);
        TxBar::arrive_and_expect_tx(do_full, Loads::kBytesHalfStage);
        copy(p.tma_q.with(ss.full[stage], 0, qdo_hint()), tQgQ(_, _, _, m), tQsQ(_, _, _, stage));
        copy(p.tma_do.with(*do_full, 0, qdo_hint()), tdOgdO(_, _, _, m), tdOsdO(_, _, _, stage));
        SM90_BULK_COPY_G2S::copy(lse, &ss.full[stage], ss.lse.data() + stage * kBlockM, Loads::kBytesRow);
        SM90_BULK_COPY_G2S::copy(dpsum, do_full, ss.dpsum.data() + stage * kBlockM, Loads::kBytesRow);
        if (++stage == Tr::kStages) { stage = 0; phase ^= 1; }
        m = next_query_block(m, m_begin, m_end);
      } while (m != m_first);
    }
  }
}

// The split-D kernel's producer (SplitDTraits: dO has its own one-stage ring, kStagesdO). The
// same arguments, TMA types and byte counts (BwdLoads<Tr>) as load_kv_and_steps. One elected
// thread issues everything:
//   K, V once (kv_full);
//   per step: Q + LSE into the kStages ring (full/empty, released at the end of the step), then
//   dO + D into the one-stage ring (do_full/do_empty, released once dV^T has read dO).
// Issuing Q(i+1) before waiting for the dO slot keeps Q one step ahead; the dO wait then blocks
// until step i's dV^T retires, which is all step i+1 needs.
template <class Tr>
CUTE_DEVICE void load_kv_and_steps_split_d(MainParams<Tr> const& p, typename Tr::SharedStorage& ss, int n_block,
                                           int hk, int b, int group, int m_begin, int m_end) {
  static_assert(Tr::kStagesdO == 1);
  using TxBar = cutlass::arch::ClusterTransactionBarrier;
  using ClusterBar = cutlass::arch::ClusterBarrier;
  using Loads = BwdLoads<Tr>;
  constexpr int kBlockM = Tr::kBlockM;
  load_kv(p, ss, n_block, hk, b);
  auto [tQsQ, tdOsdO] = qdo_ring_tiles<Tr, typename Tr::SmemLayoutdO>(p, ss);
  int stage = 0;
  uint32_t phase = 0, do_phase = 0;
  #pragma unroll 1
  for (int hi = 0; hi < group; ++hi) {
    const int h = hk * group + hi;
    auto [tQgQ, tdOgdO] = qdo_head_tiles(p, h, b);
    const int64_t row0 = ((int64_t(b) * p.heads_q + h) * p.m_blocks + m_begin) * kBlockM;
    const float* lse = p.lse_log2 + row0;
    const float* dpsum = p.dpsum + row0;
    #pragma unroll 1
    for (int m = m_begin; m < m_end; ++m, lse += kBlockM, dpsum += kBlockM) {
      ClusterBar::wait(&ss.empty[stage], phase ^ 1);
      TxBar::arrive_and_expect_tx(&ss.full[stage], Loads::kBytesHalfStage);
      copy(p.tma_q.with(ss.full[stage], 0, qdo_hint()), tQgQ(_, _, _, m), tQsQ(_, _, _, stage));
      SM90_BULK_COPY_G2S::copy(lse, &ss.full[stage], ss.lse.data() + stage * kBlockM, Loads::kBytesRow);
      if (++stage == Tr::kStages) { stage = 0; phase ^= 1; }
      ClusterBar::wait(&ss.do_empty, do_phase ^ 1);
      TxBar::arrive_and_expect_tx(&ss.do_full, Loads::kBytesHalfStage);
      copy(p.tma_do.with(ss.do_full, 0, qdo_hint()), tdOgdO(_, _, _, m), tdOsdO(_, _, _, 0));
      SM90_BULK_COPY_G2S::copy(dpsum, &ss.do_full, ss.dpsum.data(), Loads::kBytesRow);
      do_phase ^= 1;
    }
  }
}

}  // namespace bwd
}  // namespace fa3
