// The backward's dQ path: each step's dQ = dS K (a key block's share of a query block's dQ) is
// added in fp32 into the accumulator (b, hq, m_blocks, chunk, warpgroup, fragment), in the
// fragment order of the dQ WGMMA (bwd_postprocess converts it), either
//   - by the dQ writer (kDQSmem: the main kernel at d <= 128): each consumer warpgroup hands its
//     fragment over through a shared-memory tile (dq_to_smem, dq_hand_to_writer), and one warp of
//     the producer warpgroup puts both tiles into the accumulator with bulk copies (dq_writer): the
//     first key block to reach a query block stores, the others reduce-add, so this accumulator is
//     never cleared; or
//   - by the consumers themselves (hd192, split-D hd256): float4 reductions (dq_add_fragment) into
//     the accumulator that the preprocess cleared.
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

// A query block's counter (dq_sem) outside deterministic mode, in the dQ writer's tiles: each key
// block that reaches the block takes a ticket (adds 1); ticket 0 bulk-stores its tile, so the
// accumulator needs no clear, and adds kDQStored once the store has landed; the others wait for
// that flag before their reduce-adds. 0 at the end: no key block reached the block (its dQ is 0,
// written by the postprocess).
constexpr int kDQStored = 1 << 30;

// One step of the dQ writer: put the consumers' two shared-memory tiles into the fp32 accumulator
// acc (the block's first key block stores them, the others add them), free the tiles for the next
// step (more: there is one), and publish what the counter sem says to the later key blocks.
// Deterministic mode: the key blocks of a query block go one after the other, in ascending order,
// from the first (the band's key_block_range's n_begin; the CTA's m range guarantees the band is
// not empty): sem holds n_block - (first key block) when this key block is next, and the first
// stores. The query block is m, the CTA's first m_begin; first_key0 the first key m_begin sees
// (BandMask::first_key).
template <class Tr>
CUTE_DEVICE void dq_writer_step(MainParams<Tr> const& p, typename Tr::SharedStorage& ss, float* acc, int* sem,
                                long long first_key0, int m, int m_begin, int n_block, bool lane0, bool more) {
  bool first = false;  // lane 0's: this key block stores
  if (p.deterministic) {
    const long long first_key = first_key0 + (long long)(m - m_begin) * Tr::kBlockM;
    const int my_turn = n_block - (first_key > 0 ? int(first_key / Tr::kBlockN) : 0);
    if (lane0) {
      while (ld_acquire(sem) != my_turn) __nanosleep(32);
      first = my_turn == 0;
      fence_proxy_async_global();  // the acquired bulk writes before our bulk op
    }
    __syncwarp();
  }
  // The ticket is taken before the wait for the first tile, so that its round trip overlaps the wait.
  int ticket = 0;
  if (!p.deterministic && lane0) ticket = atom_relaxed_add(sem, 1);
  cutlass::arch::NamedBarrier::sync(kDQBarThreads, kBarDQFull0);
  if (!p.deterministic && lane0) {
    first = ticket == 0;
    if (!first) {
      while (!(ld_acquire(sem) & kDQStored)) __nanosleep(32);
      fence_proxy_async_global();  // the acquired bulk store before our bulk adds
    }
  }
  auto put = [&](float* dst, const float* tile) {
    if (first) bulk_store_f32(dst, tile, Tr::kDQWgBytes);
    else bulk_reduce_add_f32(dst, tile, Tr::kDQWgBytes);
    bulk_commit();
  };
  if (lane0) put(acc, ss.dq.data());
  cutlass::arch::NamedBarrier::sync(kDQBarThreads, kBarDQFull0 + 1);
  if (lane0) {
    put(acc + Tr::kDQWgFloats, ss.dq.data() + Tr::kDQWgFloats);
    bulk_wait_read_all();
  }
  __syncwarp();
  if (more) {
    cutlass::arch::NamedBarrier::arrive(kDQBarThreads, kBarDQEmpty0);
    cutlass::arch::NamedBarrier::arrive(kDQBarThreads, kBarDQEmpty0 + 1);
  }
  // The tiles are free; the consumers go on while this waits.
  if (lane0 && (p.deterministic || first)) {
    bulk_wait_all();             // our writes are performed ...
    fence_proxy_async_global();  // ... ordered before generic accesses ...
    red_release_add(sem, p.deterministic ? 1 : kDQStored);  // ... and published
  }
}

// The dQ writer warp (warp 1 of the producer warpgroup, kDQSmem) over the CTA's steps, in the
// consumers' order (query heads of the group, query blocks innermost from m_first,
// first_query_block). Runs on the producer warpgroup's 24 registers: few loop values, and the
// turn (first key block of the query block) computed inline.
template <class Tr>
CUTE_DEVICE void dq_writer(MainParams<Tr> const& p, typename Tr::SharedStorage& ss, int n_block, int hk, int b,
                           int group, int m_begin, int m_end, int m_first) {
  constexpr int kBlockM = Tr::kBlockM, kHeadDim = Tr::kHeadDim;
  const bool lane0 = threadIdx.x == 32;
  // Both smem tiles start empty. The writer arrives on DQEmpty exactly once per consumer
  // sync (here for the first step, then after each step but the last), so the barrier
  // phases alternate strictly: the writer's next arrive follows its DQFull sync, which
  // follows the consumers' DQEmpty sync of the step before.
  cutlass::arch::NamedBarrier::arrive(kDQBarThreads, kBarDQEmpty0);
  cutlass::arch::NamedBarrier::arrive(kDQBarThreads, kBarDQEmpty0 + 1);
  const long long first_key0 = p.band().first_key((long long)m_begin * kBlockM);
  #pragma unroll 1
  for (int hi = 0; hi < group; ++hi) {
    const int64_t head_rows = int64_t(hk * group + hi + b * p.heads_q) * p.m_blocks;
    int m = m_first;
    #pragma unroll 1
    do {
      const int next = next_query_block(m, m_begin, m_end);
      dq_writer_step(p, ss, p.dq_accum + (head_rows + m) * (kBlockM * kHeadDim), p.dq_sem + head_rows + m,
                     first_key0, m, m_begin, n_block, lane0, hi + 1 < group || next != m_first);
      m = next;
    } while (m != m_first);
  }
  // The CTA may not exit while a bulk operation still reads its shared memory; every step already
  // waited for that (wait_group.read 0 above), and for the writes it published. Wait here until
  // the last adds are performed too (leaving without it, as FA3's writer does, was level).
  if (lane0) bulk_wait_all();
}

}  // namespace bwd
}  // namespace fa3
