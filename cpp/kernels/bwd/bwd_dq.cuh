// The backward's dQ path: each step's dQ = dS K (a key block's share of a query block's dQ) is
// added in fp32 into the accumulator (b, hq, m_blocks, chunk, warpgroup, fragment), in the
// fragment order of the dQ WGMMA (bwd_postprocess converts it), either
//   - by the dQ writer (kDQSmem: the main kernel at d <= 128): each consumer warpgroup hands its
//     fragment over through a shared-memory tile (dq_to_smem, dq_hand_to_writer), and one warp of the producer
//     warpgroup adds both tiles with bulk reduce-adds (dq_writer), or
//   - by the consumers themselves (hd192, split-D hd256): float4 reductions (dq_add_fragment).
// Deterministic mode: the key blocks of a query block add one after the other, in ascending
// order, on a turn counter per query block (dq_sem); the writer, or the consumers around their
// adds (wait_dq_turn, publish_dq_turn), take the turns.
#pragma once

#include <cutlass/arch/barrier.h>

#include "bwd/bwd_params.cuh"
#include "bwd/bwd_pipeline.cuh"
#include "common/mask.cuh"

namespace fa3 {
namespace bwd {

// One float4 of a dQ fragment added to the fp32 accumulator as a no-return reduction
// (REDG.E.ADD.F32x4). atomicAdd would stay a returning ATOMG next to the deterministic path's
// fence (as much L2 -> SM traffic as the adds themselves): the reduction made the hd256 backward
// 12-28% faster on the H200.
template <class F4>
CUTE_DEVICE void dq_add_f32x4(F4* p, F4 v) {
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w) : "memory");
}

// A warpgroup's dQ fragment added at acc: float4 j of thread t_in_wg at j * 128 + t_in_wg.
template <class Frag>
CUTE_DEVICE void dq_add_fragment(float4* acc, Frag const& tdQrdQ, int t_in_wg) {
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < decltype(size(tdQrdQ))::value / 4; ++j)
    dq_add_f32x4(acc + j * 128 + t_in_wg, make_float4(tdQrdQ(4 * j), tdQrdQ(4 * j + 1), tdQrdQ(4 * j + 2), tdQrdQ(4 * j + 3)));
}

// Deterministic mode, consumers: wait until the key blocks before n_block that the query block
// of rows [m0, m0 + kBlockM) sees have added their dQ (turn order from the band's first key
// block, key_block_range's n_begin), with all consumer threads.
template <class Tr>
CUTE_DEVICE void wait_dq_turn(BandMask const& band, int m0, int n_block, const int* sem, int ct) {
  int nb, ne;
  band.key_block_range(m0, min(m0 + Tr::kBlockM, band.seqlen_q) - 1, Tr::kBlockN, nb, ne);
  if (ct == 0) {
    while (ld_acquire(sem) != n_block - nb) __nanosleep(40);
  }
  cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDetIn);
}

// Deterministic mode, consumers: publish the next turn once every thread's adds are performed.
template <class Tr>
CUTE_DEVICE void publish_dq_turn(int* sem, int ct) {
  __threadfence();
  cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDetOut);
  if (ct == 0) red_release_add(sem, 1);
}

// Consumer warpgroup wg's side of the dQ writer: write the step's fragment into the warpgroup's
// shared-memory tile, once the writer has read the previous one ...
template <class Tr, class Frag>
CUTE_DEVICE void dq_to_smem(typename Tr::SharedStorage& ss, Frag const& tdQrdQ, int wg, int t_in_wg) {
  float4* dst = reinterpret_cast<float4*>(ss.dq.data() + wg * Tr::kDQWgFloats);
  // Barrier ids as immediates (a warp-uniform branch): no registers held for them.
  if (wg == 0) cutlass::arch::NamedBarrier::sync(kDQBarThreads, kBarDQEmpty0);
  else cutlass::arch::NamedBarrier::sync(kDQBarThreads, kBarDQEmpty0 + 1);
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < Tr::kDQFrag / 4; ++j) {
    dst[j * 128 + t_in_wg] = make_float4(tdQrdQ(4 * j), tdQrdQ(4 * j + 1), tdQrdQ(4 * j + 2), tdQrdQ(4 * j + 3));
  }
}

// ... and hand it over (the fence waits for this thread's stores to land).
CUTE_DEVICE void dq_hand_to_writer(int wg) {
  cutlass::arch::fence_view_async_shared();  // generic smem writes -> bulk copy
  if (wg == 0) cutlass::arch::NamedBarrier::arrive(kDQBarThreads, kBarDQFull0);
  else cutlass::arch::NamedBarrier::arrive(kDQBarThreads, kBarDQFull0 + 1);
}

// The main kernel's dQ of one step (query head h, query block m): to the dQ writer (kDQSmem), or
// added by the consumers (in deterministic mode on the query block's turn). kDQSmem: the tile is
// written but not yet handed over; dq_held says so, and the consumer hands it over after its
// next step's S^T / dP^T issue (the fence waits for the stores: handed over at once, that wait
// took 8.6% of the stall samples at hd128 causal 8k; late: +2..+7.5%, session 29).
template <class Tr, class Frag>
CUTE_DEVICE void dq_step_out(MainParams<Tr> const& p, typename Tr::SharedStorage& ss, Frag const& tdQrdQ, int b,
                             int h, int m, int n_block, int ct, int wg, int t_in_wg, bool& dq_held) {
  if constexpr (Tr::kDQSmem) {
    dq_to_smem<Tr>(ss, tdQrdQ, wg, t_in_wg);
    dq_held = true;
  } else {
    const int64_t acc_base = ((int64_t(b) * p.heads_q + h) * p.m_blocks + m) * int64_t(Tr::kBlockM * Tr::kHeadDim);
    int* sem = p.dq_sem + (int64_t(b) * p.heads_q + h) * p.m_blocks + m;
    if (p.deterministic) wait_dq_turn<Tr>(p.band(), m * Tr::kBlockM, n_block, sem, ct);
    float4* acc = reinterpret_cast<float4*>(p.dq_accum + acc_base + int64_t(wg) * Tr::kDQWgFloats);
    dq_add_fragment(acc, tdQrdQ, t_in_wg);
    if (p.deterministic) publish_dq_turn<Tr>(sem, ct);
  }
}

// One step of the dQ writer: in deterministic mode wait for the block's turn, add the consumers'
// two shared-memory tiles into the fp32 accumulator acc, free the tiles for the next step (more:
// there is one), and in deterministic mode publish the turn once the adds are performed. Turn
// order: the key blocks of a query block one after the other, from the first (the band's
// key_block_range's n_begin; the CTA's m range guarantees the band is not empty): its semaphore
// sem holds n_block - (first key block) when this key block's adds are next. The query block is
// m, the CTA's first m_begin; first_key0 the first key m_begin sees (BandMask::first_key).
template <class Tr>
CUTE_DEVICE void dq_writer_step(MainParams<Tr> const& p, typename Tr::SharedStorage& ss, float* acc, int* sem,
                                long long first_key0, int m, int m_begin, int n_block, bool lane0, bool more) {
  if (p.deterministic) {
    const long long first_key = first_key0 + (long long)(m - m_begin) * Tr::kBlockM;
    const int my_turn = n_block - (first_key > 0 ? int(first_key / Tr::kBlockN) : 0);
    if (lane0) {
      while (ld_acquire(sem) != my_turn) __nanosleep(32);
      fence_proxy_async_global();  // the acquired bulk writes before our bulk op
    }
    __syncwarp();
  }
  cutlass::arch::NamedBarrier::sync(kDQBarThreads, kBarDQFull0);
  if (lane0) {
    bulk_reduce_add_f32(acc, ss.dq.data(), Tr::kDQWgBytes);
    bulk_commit();
  }
  cutlass::arch::NamedBarrier::sync(kDQBarThreads, kBarDQFull0 + 1);
  if (lane0) {
    bulk_reduce_add_f32(acc + Tr::kDQWgFloats, ss.dq.data() + Tr::kDQWgFloats, Tr::kDQWgBytes);
    bulk_commit();
    bulk_wait_read_all();
  }
  __syncwarp();
  if (more) {
    cutlass::arch::NamedBarrier::arrive(kDQBarThreads, kBarDQEmpty0);
    cutlass::arch::NamedBarrier::arrive(kDQBarThreads, kBarDQEmpty0 + 1);
  }
  if (p.deterministic && lane0) {
    bulk_wait_all();             // our adds are performed ...
    fence_proxy_async_global();  // ... ordered before generic accesses ...
    red_release_add(sem, 1);     // ... and published with the turn
  }
}

// The dQ writer warp (warp 1 of the producer warpgroup, kDQSmem) over the CTA's steps, in the
// consumers' order (query heads of the group, query blocks innermost). Runs on the producer
// warpgroup's 24 registers: pointers advance incrementally and the turn (first key block of the
// query block) is computed inline.
template <class Tr>
CUTE_DEVICE void dq_writer(MainParams<Tr> const& p, typename Tr::SharedStorage& ss, int n_block, int hk, int b,
                           int group, int m_begin, int m_end) {
  constexpr int kBlockM = Tr::kBlockM, kHeadDim = Tr::kHeadDim;
  const bool lane0 = threadIdx.x == 32;
  const int steps = group * (m_end - m_begin);
  // Both smem tiles start empty. The writer arrives on DQEmpty exactly once per consumer
  // sync (here for the first step, then after each step but the last), so the barrier
  // phases alternate strictly: the writer's next arrive follows its DQFull sync, which
  // follows the consumers' DQEmpty sync of the step before.
  cutlass::arch::NamedBarrier::arrive(kDQBarThreads, kBarDQEmpty0);
  cutlass::arch::NamedBarrier::arrive(kDQBarThreads, kBarDQEmpty0 + 1);
  const int64_t head_rows = int64_t(hk * group + b * p.heads_q) * p.m_blocks + m_begin;
  float* acc = p.dq_accum + head_rows * int64_t(kBlockM * kHeadDim);
  int* sem = p.dq_sem + head_rows;
  const long long first_key0 = p.band().first_key((long long)m_begin * kBlockM);
  int m = m_begin;
  #pragma unroll 1
  for (int step = 0; step < steps; ++step) {
    dq_writer_step(p, ss, acc, sem, first_key0, m, m_begin, n_block, lane0, step + 1 < steps);
    // Next (head, query block): query blocks innermost, as the consumers walk them.
    acc += kBlockM * kHeadDim;
    ++sem;
    if (++m == m_end) {
      m = m_begin;
      const int skip = p.m_blocks - (m_end - m_begin);
      acc += int64_t(skip) * (kBlockM * kHeadDim);
      sem += skip;
    }
  }
  // The CTA may not exit while a bulk reduce still reads its shared memory; every step already
  // waited for that (wait_group.read 0 above). Deterministic mode also waited for each step's
  // adds to be performed (before publishing the turn). Wait here until the last adds are
  // performed too (leaving without it, as FA3's writer does, was level).
  if (lane0) bulk_wait_all();
}

}  // namespace bwd
}  // namespace fa3
