// The forward producer: one thread of warpgroup 0 walks this CTA's tiles (common/scheduler.cuh)
// and issues the TMA loads of each tile's Q (one 64-row slab per consumer warpgroup, into the Q
// buffer of fwd_pipeline.cuh's hand-off) and of its K / V blocks into the two rings. Key blocks
// go from the last to the first, so boundary blocks (causal diagonal, ragged seqlen_k end) come
// first; blocks outside the band are never loaded.
#pragma once

#include "fwd/fwd_pipeline.cuh"
#include "fwd/fwd_traits.cuh"

namespace fa3 {

template <class T>
CUTE_DEVICE void fwd_producer(typename T::Params const& p, typename T::SharedStorage& ss,
                              typename T::Pipeline& pipe_k, typename T::Pipeline& pipe_v) {
  using D = typename T::D;
  using BN = typename T::BN;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

  // Shared-memory tiles, and the global tensors as TMA sees them: (seqlen, d, heads, batch).
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutK{});
  Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.seqlen_q, D{}, p.heads_q, p.batch));
  Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seqlen_k, D{}, p.heads_kv, p.batch));
  Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.seqlen_k, D{}, p.heads_kv, p.batch));

  FwdQProducer<T> q{ss};
  auto k_state = cutlass::make_producer_start_state<typename T::Pipeline>();
  auto v_state = cutlass::make_producer_start_state<typename T::Pipeline>();
  int const num_tiles = p.sched.num_tiles();
  // The next tile is claimed once this tile's loads are issued (the producer then waits for a
  // free stage anyway). Nothing extra stays live across the body: the producer has 24-40
  // registers, and a precomputed next tile and flag spilled.
  for (int t = blockIdx.x; t < num_tiles; t = p.sched.template next<T::kDynamicSchedule>(t), q.advance()) {
    FwdTile const tile = fwd_tile<T>(p, t);
    TileCoord const c = tile.c;
    int const n_begin = tile.n_begin, n_end = tile.n_end;
    int hk = c.head / p.group;
    Tensor gK = local_tile(mK(_, _, hk, c.batch), Shape<BN, D>{}, make_coord(_, _0{}));  // (n, d, blocks)
    Tensor gV = local_tile(mV(_, _, hk, c.batch), Shape<BN, D>{}, make_coord(_, _0{}));
    auto [tKg, tKs] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVg, tVs] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    // Each K / V block below: wait for a free stage of its ring, issue the TMA, advance.

    int n = n_end - 1;
    if constexpr (!T::kQPrefetch) {
      // One Q buffer: it frees up only when the previous tile's consumers are past their last
      // Q K^T. The first K block does not need it: issue that first.
      if (n_begin < n_end) {
        pipe_k.producer_acquire(k_state);
        copy(p.tma_k.with(*pipe_k.producer_get_barrier(k_state)), tKg(_, n), tKs(_, k_state.index()));
        ++k_state;
      }
    }
    int const b = q.acquire();
    q.publish(b, p.sched.template dynamic<T::kDynamicSchedule>(), t, c, n_begin, n_end);
    if (n_begin >= n_end) {
      // No visible key: nothing to load; the consumers write O = 0, LSE = -inf.
      cutlass::arch::ClusterBarrier::arrive(&q.full(b));
      continue;
    }
    Tensor gQ = local_tile(mQ(_, _, c.head, c.batch), Shape<_64, D>{}, make_coord(_, _0{}));  // (64, d, slabs)
    auto [tQg, tQs] = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    TxBarrier::arrive_and_expect_tx(&q.full(b), T::kQTileBytes);
    CUTLASS_PRAGMA_UNROLL
    for (int w = 0; w < T::kNumMmaWG; ++w)
      copy(p.tma_q.with(q.full(b)), tQg(_, c.m_block * T::kNumMmaWG + w), tQs(_, b * T::kNumMmaWG + w));

    if constexpr (!T::kQPrefetch) {  // the first block's V (its K went first)
      pipe_v.producer_acquire(v_state);
      copy(p.tma_v.with(*pipe_v.producer_get_barrier(v_state)), tVg(_, n), tVs(_, v_state.index()));
      ++v_state;
      --n;
    }
    for (; n >= n_begin; --n) {
      pipe_k.producer_acquire(k_state);
      copy(p.tma_k.with(*pipe_k.producer_get_barrier(k_state)), tKg(_, n), tKs(_, k_state.index()));
      ++k_state;
      pipe_v.producer_acquire(v_state);
      copy(p.tma_v.with(*pipe_v.producer_get_barrier(v_state)), tVg(_, n), tVs(_, v_state.index()));
      ++v_state;
    }
  }
  q.finish(p.sched.template dynamic<T::kDynamicSchedule>(), num_tiles);
  if constexpr (T::kFp8) fwd_v_end_marker<T>(ss, v_state);
}

}  // namespace fa3
