// Producer of the split-D kernel, whose dO has its own one-stage ring (SplitDTraits::kStagesdO). The same
// arguments, TMA types and byte counts (BwdLoads<Tr>, bwd_traits.cuh). One elected thread issues
// everything:
//   K, V once (kv_full);
//   per step: Q + LSE into the kStages ring (full/empty, released at the end of the step), then
//   dO + D into the one-stage ring (do_full/do_empty, released once dV^T has read dO).
// Issuing Q(i+1) before waiting for the dO slot keeps Q one step ahead; the dO wait then blocks
// until step i's dV^T retires, which is all step i+1 needs.
#pragma once

#include <cutlass/arch/barrier.h>

#include "bwd/bwd_main.cuh"
#include "bwd/bwd_split_d_traits.cuh"

namespace fa3 {
namespace bwd {

template <class Tr>
CUTE_DEVICE void split_d_producer_sep_do(MainParams<Tr> const& p, typename Tr::SharedStorage& ss, int n_block,
                                         int hk, int b, int group, int m_begin, int m_end) {
  static_assert(Tr::kStagesdO == 1);
  using TxBar = cutlass::arch::ClusterTransactionBarrier;
  using ClusterBar = cutlass::arch::ClusterBarrier;
  using Loads = BwdLoads<Tr>;
  constexpr uint32_t kBytesHalfStage = Loads::kBytesQ + Loads::kBytesRow;  // Q + LSE, or dO + D
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
      TxBar::arrive_and_expect_tx(&ss.full[stage], kBytesHalfStage);
      copy(p.tma_q.with(ss.full[stage], 0, qdo_hint()), tQgQ(_, _, _, m), tQsQ(_, _, _, stage));
      SM90_BULK_COPY_G2S::copy(lse, &ss.full[stage], ss.lse.data() + stage * kBlockM, Loads::kBytesRow);
      if (++stage == Tr::kStages) { stage = 0; phase ^= 1; }
      ClusterBar::wait(&ss.do_empty, do_phase ^ 1);
      TxBar::arrive_and_expect_tx(&ss.do_full, kBytesHalfStage);
      copy(p.tma_do.with(ss.do_full, 0, qdo_hint()), tdOgdO(_, _, _, m), tdOsdO(_, _, _, 0));
      SM90_BULK_COPY_G2S::copy(dpsum, &ss.do_full, ss.dpsum.data(), Loads::kBytesRow);
      do_phase ^= 1;
    }
  }
}

}  // namespace bwd
}  // namespace fa3
