// FlashAttention-3 style forward kernel for Hopper (sm_90a).
//
// One CTA = 1 producer warpgroup + kNumMmaWG consumer warpgroups, persistent over output tiles
// of kBlockM query rows of one (batch, head):
//   * producer (one thread of warpgroup 0, registers lowered with setmaxnreg): TMA loads of the
//     Q tile (once per tile, one 64-row slab per consumer) and of the K/V blocks into a
//     kStages-deep shared-memory ring (cutlass::PipelineTmaAsync, separate rings for K and V so
//     that S = Q K^T of a block can start before its V has landed);
//   * consumers (registers raised): each owns 64 query rows. S = Q K^T by SS-WGMMA, online
//     softmax in registers (exp2 domain, scale folded in), O += P V by RS-WGMMA with P converted
//     in registers. Intra-warpgroup overlap: the Q K^T of block n is issued together with the
//     P V of block n+1, and the softmax of block n runs while that P V is in flight.
//     Ping-pong (kPingPong): named barriers order the consumer warpgroups' GEMM issue (round
//     robin with three) so that one's softmax overlaps the others' GEMMs.
//   * epilogue: O normalised, converted, written with stmatrix into the consumer's own Q slab
//     (Q is dead by then), TMA-stored; LSE fp32 written directly. The slab is handed back to the
//     producer (q_empty barrier) once the store has read it.
// Key blocks are walked from the last to the first, so boundary blocks (causal diagonal,
// ragged seqlen_k end) come first; blocks outside the band are never loaded, and the
// per-element mask runs only on blocks that are not wholly inside the band.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/mask.cuh"
#include "common/softmax.cuh"
#include "common/tile_scheduler.cuh"
#include "common/utils.cuh"

namespace fa3 {

// kQPrefetch: what the producer publishes per tile (t >= num_tiles: end marker).
struct alignas(16) FwdTileInfo {
  int t, m_block, head, batch;
  int n_begin, n_end, pad0, pad1;
};
// Two Q buffers: q_full[b] completes when buffer b holds tile info[b] (Q landed, or a plain
// arrival for a keyless tile / the end marker); q_empty[b] when every consumer thread is done with it.
struct FwdQBuffers {
  alignas(16) uint64_t full[2];
  alignas(16) uint64_t empty[2];
  FwdTileInfo info[2];
};
struct FwdNoQBuffers {};

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_,
          bool kPingPong_ = false, bool kBanded_ = true>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kPingPong = kPingPong_;
  // false: the caller guarantees the band does not cut into the key range (both sides reach
  // past seqlen_q + seqlen_k), so boundary blocks need only the seqlen_k mask (fewer registers).
  static constexpr bool kBanded = kBanded_;
  static constexpr int kNumMmaWG = kBlockM / 64;
  static constexpr int kNumMmaThreads = kNumMmaWG * 128;
  static constexpr int kNumThreads = kNumMmaThreads + 128;
  // setmaxnreg budgets: 65536 registers / SM at one CTA per SM.
  //   2 consumers: 128 * 24 + 256 * 240 = 64512 (the pool of 384 threads x 168 registers);
  //   3 consumers: 128 * 32 + 384 * 160 = 65536.
  // Banded kernels carry the dynamic tile schedule (Params::tile_counter), whose producer code
  // spilled at 24 registers: 128 * 40 + 256 * 232 = 64512 as well (the consumers peak at R223).
  static constexpr bool kDynamicSchedule = kBanded && kNumMmaWG == 2;
  static constexpr int kProducerRegs = kNumMmaWG == 3 ? 32 : (kDynamicSchedule ? 40 : 24);
  static constexpr int kConsumerRegs = kNumMmaWG == 3 ? 160 : (kDynamicSchedule ? 232 : 240);
  static_assert(kBlockM % 64 == 0 && (kNumMmaWG == 2 || kNumMmaWG == 3));
  // kQPrefetch (only where a second Q tile fits in shared memory:
  // d = 64 and 96, not the 224 KB hd128 banded or 208 KB hd128 unbanded tiles; two consumer
  // warpgroups only: the 3-warpgroup tiles spilled 20-28 bytes at 160 registers): two Q buffers
  // used by alternate tiles, each with its q_full / q_empty barrier and a TileInfo slot. The
  // producer loads tile i + 1's Q as soon as tile i - 1 has released that buffer (after its last
  // Q K^T), i.e. about a tile ahead, instead of after tile i's last Q K^T; and it publishes the
  // decoded tile and key range, so the consumers' tile start is an LDS instead of three integer
  // divisions and the 64-bit key-range arithmetic (cpp/kernels/NOTES.md, "Session 7e").
  static constexpr int kQTileBytes = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kKVRingBytes = 2 * kStages * kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr bool kQPrefetch =
      kNumMmaWG == 2 && 2 * kQTileBytes + kKVRingBytes + 1024 <= 227 * 1024;
  static constexpr int kQBufs = kQPrefetch ? 2 : 1;
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256);

  using D = Int<kHeadDim>;
  using BN = Int<kBlockN>;

  // Per consumer warpgroup: S (64 x kBlockN) = Q (64 x d) K^T, both K-major in smem;
  // O (64 x d) += P (64 x kBlockN, registers) V, V read as an MN-major (d x kBlockN) view.
  using MmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, BN, D>>()));
  using MmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, D, BN>, GMMA::Major::K, GMMA::Major::MN>()));

  using SmemAtomQ = decltype(smem_atom_k_major<Element, kHeadDim>());
  using SmemLayoutQ1 = decltype(tile_to_shape(SmemAtomQ{}, Shape<_64, D>{}));  // one slab
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<_64, D, Int<kNumMmaWG * kQBufs>>{}));
  using SmemAtomK = decltype(smem_atom_k_major<Element, kHeadDim>());
  using SmemLayoutK1 = decltype(tile_to_shape(SmemAtomK{}, Shape<BN, D>{}));  // one stage
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<BN, D, Int<kStages>>{}));
  // V is stored like K ((n, d), d contiguous); the P V GEMM reads it as (d, n) with d contiguous.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<D, BN, Int<kStages>>{}, Step<_2, _1, _3>{})));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;

  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;  // Q; O staging in the epilogue
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> v;
    alignas(16) uint64_t q_full;   // TMA of the Q tile landed
    alignas(16) uint64_t q_empty;  // the consumers are done with the Q slabs (after their last Q K^T)
    int tile;                      // dynamic schedule: the tile of the q_full phase (>= num_tiles: end)
    alignas(16) typename Pipeline::SharedStorage pipe_k;
    alignas(16) typename Pipeline::SharedStorage pipe_v;
    // kQPrefetch: per Q buffer its barriers and the tile it holds (last, and empty otherwise, so
    // that the default kernels' layout is unchanged).
    std::conditional_t<kQPrefetch, FwdQBuffers, FwdNoQBuffers> qb;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");

  // Global tensors as (seqlen, d, heads, batch): the TMA box is (rows, d) of one (head, batch).
  using GShape = Shape<int, D, int, int>;
  using GStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GTensorIn = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GShape{}, GStride{}));
  using GTensorOut = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GShape{}, GStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorIn>(), SmemLayoutQ1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GTensorIn>(), SmemLayoutK1{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, std::declval<GTensorOut>(), SmemLayoutQ1{}));

  struct Params {
    TmaQ tma_q;
    TmaKV tma_k;
    TmaKV tma_v;
    TmaO tma_o;
    int seqlen_q, seqlen_k, heads_q, heads_kv, batch;
    int group;  // heads_q / heads_kv
    BandMask mask;
    SoftmaxScale scale;
    float* lse;
    Element* out;  // (batch, seqlen_q, heads_q, d), for the direct O epilogue
    StaticTileScheduler sched;
    // Dynamic schedule when set (zeroed before the launch): CTA b starts with tile b, and the
    // producer takes each next tile as gridDim.x + atomicAdd(tile_counter, 1), i.e. the tiles
    // in sched order, each to whichever CTA is free first (greedy longest-first for bands, on
    // a persistent grid). nullptr: the static order t = blockIdx.x + k * gridDim.x.
    int* tile_counter;
  };

  // Named barrier ids (CUTLASS reserves the ones below its FirstUserBarrier; NamedBarrier adds
  // that offset): one per consumer warpgroup for the epilogue, two for the ping-pong.
  static constexpr int kBarEpilogue = 0;               // + wg, wg < 3
  static constexpr int kBarPingPong = kBarEpilogue + 3;  // + wg, wg < 3
};

// What both producers load from and into: the Q / K / V tiles in shared memory and the global
// tensors as TMA sees them, (seqlen, head_dim, heads, batch).
template <class T>
CUTE_DEVICE auto producer_views(typename T::Params const& p, typename T::SharedStorage& ss) {
  using D = typename T::D;
  return cute::make_tuple(make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{}),
                          make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{}),
                          make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutK{}),
                          p.tma_q.get_tma_tensor(make_shape(p.seqlen_q, D{}, p.heads_q, p.batch)),
                          p.tma_k.get_tma_tensor(make_shape(p.seqlen_k, D{}, p.heads_kv, p.batch)),
                          p.tma_v.get_tma_tensor(make_shape(p.seqlen_k, D{}, p.heads_kv, p.batch)));
}

template <class T>
CUTE_DEVICE void fwd_producer(typename T::Params const& p, typename T::SharedStorage& ss,
                              typename T::Pipeline& pipe_k, typename T::Pipeline& pipe_v) {
  using Element = typename T::Element;
  using D = typename T::D;
  using BN = typename T::BN;
  using ClusterBarrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

  auto [sQ, sK, sV, mQ, mK, mV] = producer_views<T>(p, ss);

  auto k_state = cutlass::make_producer_start_state<typename T::Pipeline>();
  auto v_state = cutlass::make_producer_start_state<typename T::Pipeline>();
  int q_empty_phase = 0;
  bool first_tile = true;
  int const num_tiles = p.sched.num_tiles();
  // The next tile: claimed once this tile's loads are issued (the producer then waits for a
  // free stage anyway). Nothing extra stays live across the body: the producer has 24
  // registers, and a precomputed next tile and flag spilled.
  auto next_tile = [&](int t) {
    if constexpr (T::kDynamicSchedule) {
      if (p.tile_counter != nullptr) return int(gridDim.x) + atomicAdd(p.tile_counter, 1);
    }
    return t + int(gridDim.x);
  };
  for (int t = blockIdx.x; t < num_tiles; t = next_tile(t)) {
    TileCoord c = p.sched.decode(t);
    int row_lo = c.m_block * T::kBlockM;
    int row_hi = min(row_lo + T::kBlockM, p.seqlen_q) - 1;
    int n_begin, n_end;
    p.mask.key_block_range(row_lo, row_hi, T::kBlockN, n_begin, n_end);
    int hk = c.head / p.group;

    Tensor gK = local_tile(mK(_, _, hk, c.batch), Shape<BN, D>{}, make_coord(_, _0{}));  // (n, d, blocks)
    Tensor gV = local_tile(mV(_, _, hk, c.batch), Shape<BN, D>{}, make_coord(_, _0{}));
    auto [tKgK, tKsK] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

    // The first K block does not depend on the Q slabs: issue it before waiting for them.
    int n = n_end - 1;
    if (n_begin < n_end) {
      pipe_k.producer_acquire(k_state);
      copy(p.tma_k.with(*pipe_k.producer_get_barrier(k_state)), tKgK(_, n), tKsK(_, k_state.index()));
      ++k_state;
    }
    // The Q slabs double as O staging: wait until the previous tile's O stores have read them.
    if (!first_tile) {
      ClusterBarrier::wait(&ss.q_empty, q_empty_phase);
      q_empty_phase ^= 1;
    }
    first_tile = false;
    // Every consumer thread has read the previous slot (at its tile start, before q_empty).
    if (T::kDynamicSchedule && p.tile_counter != nullptr) ss.tile = t;
    if (n_begin >= n_end) {
      // No visible key: nothing to load; the consumers write O = 0, LSE = -inf. Still complete
      // a q_full phase, so that consumers never run more than one tile ahead of the producer
      // (the q_empty parity waits rely on it).
      ClusterBarrier::arrive(&ss.q_full);
      continue;
    }

    Tensor gQ = local_tile(mQ(_, _, c.head, c.batch), Shape<_64, D>{}, make_coord(_, _0{}));  // (64, d, slabs)
    auto [tQgQ, tQsQ] = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    TxBarrier::arrive_and_expect_tx(&ss.q_full, T::kBlockM * T::kHeadDim * int(sizeof(Element)));
    CUTLASS_PRAGMA_UNROLL
    for (int w = 0; w < T::kNumMmaWG; ++w)
      copy(p.tma_q.with(ss.q_full), tQgQ(_, c.m_block * T::kNumMmaWG + w), tQsQ(_, w));

    pipe_v.producer_acquire(v_state);
    copy(p.tma_v.with(*pipe_v.producer_get_barrier(v_state)), tVgV(_, n), tVsV(_, v_state.index()));
    ++v_state;
    for (--n; n >= n_begin; --n) {
      pipe_k.producer_acquire(k_state);
      copy(p.tma_k.with(*pipe_k.producer_get_barrier(k_state)), tKgK(_, n), tKsK(_, k_state.index()));
      ++k_state;
      pipe_v.producer_acquire(v_state);
      copy(p.tma_v.with(*pipe_v.producer_get_barrier(v_state)), tVgV(_, n), tVsV(_, v_state.index()));
      ++v_state;
    }
  }
  // Dynamic schedule: one more q_full phase with an end marker, once the consumers are past
  // their last tile's start (q_empty), so that they leave their loop.
  if (T::kDynamicSchedule && p.tile_counter != nullptr && !first_tile) {
    ClusterBarrier::wait(&ss.q_empty, q_empty_phase);
    ss.tile = num_tiles;
    ClusterBarrier::arrive(&ss.q_full);
  }
}

// Double-buffered Q producer (T::kQPrefetch): tile i of this CTA uses Q buffer b = i % 2. Per
// tile: wait until tile i - 2 has released buffer b (q_empty[b], completion (i - 2) / 2; none
// for i < 2), publish the tile (info[b]), load its Q into buffer b (q_full[b]), then its K / V
// blocks into the rings as fwd_producer does. The wait for buffer b returns at once in the
// steady state (tile i - 2 released it after its last Q K^T, before tile i - 1 started), so
// the next tile's Q is issued as soon as this tile's K / V loads are, about a tile before it is
// needed; and the next tile's K / V no longer wait for this tile's last Q K^T either.
// Every schedule (static or dynamic) ends with an end marker in the next buffer, so the
// consumers read the tile from info[b] always and never decode it.
template <class T>
CUTE_DEVICE void fwd_producer_qpf(typename T::Params const& p, typename T::SharedStorage& ss,
                                  typename T::Pipeline& pipe_k, typename T::Pipeline& pipe_v) {
  using D = typename T::D;
  using BN = typename T::BN;
  using ClusterBarrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

  auto [sQ, sK, sV, mQ, mK, mV] = producer_views<T>(p, ss);

  auto k_state = cutlass::make_producer_start_state<typename T::Pipeline>();
  auto v_state = cutlass::make_producer_start_state<typename T::Pipeline>();
  int i = 0;  // tiles of this CTA so far
  int const num_tiles = p.sched.num_tiles();
  // Wait until buffer i % 2 is free: tile i - 2 (completion (i - 2) / 2 of its q_empty) is done
  // with it. Consumers arrive on q_empty[b] only after q_full[b] of that tile, so the barrier is
  // never more than one completion ahead of this wait.
  auto acquire_q = [&](int i) {
    if (i >= 2) ClusterBarrier::wait(&ss.qb.empty[i & 1], ((i >> 1) + 1) & 1);
  };
  auto next_tile = [&](int t) {
    if constexpr (T::kDynamicSchedule) {
      if (p.tile_counter != nullptr) return int(gridDim.x) + atomicAdd(p.tile_counter, 1);
    }
    return t + int(gridDim.x);
  };
  for (int t = blockIdx.x; t < num_tiles; t = next_tile(t), ++i) {
    TileCoord c = p.sched.decode(t);
    int row_lo = c.m_block * T::kBlockM;
    int row_hi = min(row_lo + T::kBlockM, p.seqlen_q) - 1;
    int n_begin, n_end;
    p.mask.key_block_range(row_lo, row_hi, T::kBlockN, n_begin, n_end);
    int const b = i & 1;
    acquire_q(i);
    FwdTileInfo& info = ss.qb.info[b];
    info.t = t;
    info.m_block = c.m_block;
    info.head = c.head;
    info.batch = c.batch;
    info.n_begin = n_begin;
    info.n_end = n_end;
    if (n_begin >= n_end) {
      // No visible key: nothing to load; the consumers write O = 0, LSE = -inf.
      ClusterBarrier::arrive(&ss.qb.full[b]);
      continue;
    }
    Tensor gQ = local_tile(mQ(_, _, c.head, c.batch), Shape<_64, D>{}, make_coord(_, _0{}));  // (64, d, slabs)
    auto [tQgQ, tQsQ] = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    TxBarrier::arrive_and_expect_tx(&ss.qb.full[b], T::kBlockM * T::kHeadDim * int(sizeof(typename T::Element)));
    CUTLASS_PRAGMA_UNROLL
    for (int w = 0; w < T::kNumMmaWG; ++w)
      copy(p.tma_q.with(ss.qb.full[b]), tQgQ(_, c.m_block * T::kNumMmaWG + w), tQsQ(_, b * T::kNumMmaWG + w));

    int hk = c.head / p.group;
    Tensor gK = local_tile(mK(_, _, hk, c.batch), Shape<BN, D>{}, make_coord(_, _0{}));  // (n, d, blocks)
    Tensor gV = local_tile(mV(_, _, hk, c.batch), Shape<BN, D>{}, make_coord(_, _0{}));
    auto [tKgK, tKsK] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    for (int n = n_end - 1; n >= n_begin; --n) {
      pipe_k.producer_acquire(k_state);
      copy(p.tma_k.with(*pipe_k.producer_get_barrier(k_state)), tKgK(_, n), tKsK(_, k_state.index()));
      ++k_state;
      pipe_v.producer_acquire(v_state);
      copy(p.tma_v.with(*pipe_v.producer_get_barrier(v_state)), tVgV(_, n), tVsV(_, v_state.index()));
      ++v_state;
    }
  }
  // End marker in the next buffer, for the static schedule too.
  acquire_q(i);
  ss.qb.info[i & 1].t = num_tiles;
  ClusterBarrier::arrive(&ss.qb.full[i & 1]);
}

template <class T>
CUTE_DEVICE void fwd_consumer(typename T::Params const& p, typename T::SharedStorage& ss,
                              typename T::Pipeline& pipe_k, typename T::Pipeline& pipe_v, int wg) {
  using Element = typename T::Element;
  using D = typename T::D;
  using BN = typename T::BN;
  using ClusterBarrier = cutlass::arch::ClusterBarrier;
  using cutlass::arch::NamedBarrier;

  int const tid = threadIdx.x % 128;  // thread in this warpgroup
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutVt{});
  Tensor sQw = sQ(_, _, wg);  // this warpgroup's 64 query rows; its O staging at the end

  typename T::MmaQK mma_qk;
  typename T::MmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);
  Tensor tSrQ0 = thr_qk.partition_fragment_A(sQw);  // descriptors (MMA, 1, d/16)
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, 1, d/16, stages)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, 1, n/16, stages)
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<_64, BN>{});
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<_64, D>{});
  Tensor tOrP = make_tensor<Element>(acc_as_operand_a(tSrS.layout()));
  Tensor S = rowcol_view(tSrS);
  Tensor O = rowcol_view(tOrO);
  Tensor cS = rowcol_view(thr_qk.partition_C(make_identity_tensor(Shape<_64, BN>{})));
  constexpr int kRows = decltype(size<0>(S))::value;
  static_assert(kRows == 2);

  OnlineSoftmax<kRows> softmax(p.scale.scale_log2);
  // K and V blocks are produced in lockstep (block j sits in stage j % kStages of both rings),
  // so one read state serves both pipelines.
  typename T::PipelineState read;  // consumers start at phase 0
  int q_phase = 0;
  bool const softcap = p.scale.softcap;
  float const pre_tanh = p.scale.pre_tanh;

  // Ping-pong (round robin with three consumer warpgroups): warpgroup wg may issue its GEMMs
  // once the previous one, (wg - 1) mod kNumMmaWG, has issued its own; it then hands the turn to
  // (wg + 1) mod kNumMmaWG. Barrier kBarPingPong + w is synced by warpgroup w and arrived at by
  // its predecessor (2 x 128 threads). The branches on wg keep the barrier ids immediates (a
  // register id stayed live across the main loop and was spilled).
  constexpr int kWG = T::kNumMmaWG;
  auto pingpong_wait = [&]() {
    if constexpr (T::kPingPong) {
      if (wg == 0) NamedBarrier::sync(2 * 128, T::kBarPingPong + 0);
      else if (kWG == 2 || wg == 1) NamedBarrier::sync(2 * 128, T::kBarPingPong + 1);
      else NamedBarrier::sync(2 * 128, T::kBarPingPong + 2);
    }
  };
  auto pingpong_signal = [&]() {
    if constexpr (T::kPingPong) {
      if (wg == 0) NamedBarrier::arrive(2 * 128, T::kBarPingPong + 1);
      else if (kWG == 3 && wg == 1) NamedBarrier::arrive(2 * 128, T::kBarPingPong + 2);
      else NamedBarrier::arrive(2 * 128, T::kBarPingPong + 0);
    }
  };

  // Warpgroup 0 issues first: give it the turn that the last warpgroup would otherwise hand over.
  if constexpr (T::kPingPong) {
    if (wg == kWG - 1) NamedBarrier::arrive(2 * 128, T::kBarPingPong + 0);
  }

  int const num_tiles = p.sched.num_tiles();
  bool const dynamic = T::kDynamicSchedule && p.tile_counter != nullptr;
  int qi = 0;  // kQPrefetch: tiles of this CTA so far (tile qi uses Q buffer qi % 2)
  for (int t = blockIdx.x;; t += int(gridDim.x)) {
    if (!T::kQPrefetch && !dynamic && t >= num_tiles) break;
    clear(tOrO);
    softmax.reset();
    TileCoord c;
    int row_lo, row_hi, n_begin, n_end;
    int qb = 0;  // this tile's Q buffer
    if constexpr (T::kQPrefetch) {
      // The producer published the tile (decoded, with its key range) before q_full[qb]'s
      // arrival; it rewrites info[qb] only after every consumer thread's q_empty[qb] arrival of
      // this tile, which comes after these reads.
      // Through a shuffle so that ptxas knows qb is warp-uniform (as canonical_warp_group_idx
      // does): without it the info / barrier addresses were vector registers and ptxas moved
      // the consumers' descriptor and barrier arithmetic off the uniform datapath (+32 R2UR
      // and 5 WARPSYNC per main-loop block).
      qb = __shfl_sync(0xffffffffu, qi & 1, 0);
      ClusterBarrier::wait(&ss.qb.full[qb], (qi >> 1) & 1);
      ++qi;
      int4 const i0 = *reinterpret_cast<int4 const*>(&ss.qb.info[qb].t);
      int2 const i1 = *reinterpret_cast<int2 const*>(&ss.qb.info[qb].n_begin);
      t = i0.x;
      if (t >= num_tiles) break;
      c.m_block = i0.y;
      c.head = i0.z;
      c.batch = i0.w;
      n_begin = i1.x;
      n_end = i1.y;
      row_lo = c.m_block * T::kBlockM;
      row_hi = min(row_lo + T::kBlockM, p.seqlen_q) - 1;
    } else {
      // Completed by the TMA of Q, or by a plain arrive for a tile without keys (or, dynamic
      // schedule, for the end marker).
      ClusterBarrier::wait(&ss.q_full, q_phase);
      q_phase ^= 1;
      if (dynamic) {
        t = ss.tile;
        if (t >= num_tiles) break;
      }
      c = p.sched.decode(t);
      row_lo = c.m_block * T::kBlockM;
      row_hi = min(row_lo + T::kBlockM, p.seqlen_q) - 1;
      p.mask.key_block_range(row_lo, row_hi, T::kBlockN, n_begin, n_end);
    }
    // This tile's Q slab descriptors (kQPrefetch: buffer qb).
    auto tSrQ = [&]() {
      if constexpr (T::kQPrefetch) return thr_qk.partition_fragment_A(sQ(_, _, qb * kWG + wg));
      else return tSrQ0;
    }();
    // This warpgroup's rows, for the interior test (rows past seqlen_q are never stored).
    int wrow_lo = row_lo + wg * 64;
    int wrow_hi = max(wrow_lo, min(wrow_lo + 63, p.seqlen_q - 1));
    // Hand the Q slabs back as soon as this thread's last Q K^T has completed. Every
    // consumer thread arrives for itself, after its last read of the slabs and of the tile slot
    // (ss.tile / qb.info), so the producer's next write to either follows every read by a direct
    // release/acquire pair. (A lane-0 arrival left the other lanes' reads of the tile slot
    // unordered: issue 24's racecheck report.)
    auto release_q = [&]() {
      if constexpr (T::kQPrefetch) ClusterBarrier::arrive(&ss.qb.empty[qb]);
      else ClusterBarrier::arrive(&ss.q_empty);
    };
    if (n_begin >= n_end) release_q();  // no key: Q is never read
    if (n_begin < n_end) {
      float alpha[kRows];
      // Masked blocks from key n0_1cmp on take the one-compare mask, and the interior test
      // compares with per-tile bounds (32-bit, once per block) instead of block_is_interior's
      // 64-bit arithmetic per block.
      int n0_1cmp = 0, n0_int_lo = 0, n0_int_hi = 0;
      n0_1cmp = p.mask.right_bound_only_from(wrow_lo + 63);
      p.mask.interior_key_range(wrow_lo, wrow_hi, T::kBlockN, n0_int_lo, n0_int_hi);

      auto apply_mask = [&](int n) __attribute__((always_inline)) {
        if constexpr (T::kBanded) {
          // Where neither the left bound nor the seqlen_k end can cut
          // into the block for any of the warpgroup's 64 rows (padding rows included), the
          // two-bound compare reduces to one (mask.cuh, right_bound_only / apply_right); the
          // same elements are masked either way. The test is one compare per block against a
          // per-tile threshold (a per-block right_bound_only() cost 11 uniform instructions on
          // every block, interior ones included, in the hd128 SASS).
          if (n * T::kBlockN >= n0_1cmp) {
            p.mask.apply_right(S, cS, wrow_lo, n * T::kBlockN);
            return;
          }
          p.mask.apply(S, cS, wrow_lo, n * T::kBlockN);
        } else {
          p.mask.apply_seqlen_k(S, cS, n * T::kBlockN);
        }
      };

      auto interior = [&](int n) {
        return n * T::kBlockN >= n0_int_lo && n * T::kBlockN <= n0_int_hi;
      };

      // Last key block first (it may be a boundary block): S and its softmax.
      int n = n_end - 1;
      pipe_k.consumer_wait(read);
      pingpong_wait();
      wgmma_gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
      pingpong_signal();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      pipe_k.consumer_release(read);
      if (n == n_begin) release_q();
      if (softcap) apply_softcap(tSrS, pre_tanh);
      if (!interior(n)) apply_mask(n);
      softmax.template update<true>(S, alpha);
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) alpha[r] = 1.f;
      bool pv_pending = false;  // a P V (and its V stage) is in flight
      typename T::PipelineState read_v;  // that V stage

      // Steady state: S_n = Q K_n^T and O += P_{n+1} V_{n+1} in flight together, and the
      // softmax of S_n runs while P V is still computing. Each block is split in two:
      //   head(n): issue Q K_n^T and P_{n+1} V_{n+1}, wait for S_n, mask, softmax;
      //   tail():  wait for P V, release V_{n+1}, rescale O, convert P_n into the A operand.
      // The loop body is tail() of the previous block, then head(n), so the wait for P V opens
      // the loop body's first basic block and the softmax closes the previous one. With both in
      // one block, ptxas (nvcc 13.0) hoisted the wait above the softmax (WARPGROUP.DEPBAR.LE
      // gsb0, 0x0 right before the row max, in every loop of v1-v3): the softmax never
      // overlapped P V. It does not move the wait across the back-edge. One loop with one Q K^T
      // and one P V issue site: with v2's three loops (masked / interior / masked) rotated this
      // way, ptxas serialised every WGMMA (C7512, insufficient registers: it gave each loop's
      // P V its own P registers). The mask is a uniform branch on the block instead; it is
      // skipped on interior blocks, the bulk of the work.
      auto tail = [&]() __attribute__((always_inline)) {
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        warpgroup_fence_operand(tOrP);
        if (pv_pending) pipe_v.consumer_release(read_v);
        // Rescale O only when some row max of this warp moved (alpha == 1 exactly otherwise:
        // exp2 of an exact 0), which after the first blocks is rare: saves d/2 FMULs per block.
        bool same_max = true;
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) same_max = same_max && alpha[r] == 1.f;
        if (!__all_sync(0xffffffffu, same_max)) scale_rows(O, alpha);
        convert_into(tSrS, tOrP);
      };
      CUTLASS_PRAGMA_NO_UNROLL
      for (--n; n >= n_begin; --n) {
        tail();
        read_v = read;  // block n + 1
        ++read;         // block n
        pipe_k.consumer_wait(read);
        pingpong_wait();
        wgmma_gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
        pipe_v.consumer_wait(read_v);
        wgmma_gemm<false, -1>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
        pingpong_signal();
        pv_pending = true;
        warpgroup_wait<1>();
        warpgroup_fence_operand(tSrS);
        pipe_k.consumer_release(read);
        if (n == n_begin) release_q();
        if (softcap) apply_softcap(tSrS, pre_tanh);
        if (!interior(n)) apply_mask(n);
        softmax.template update<false>(S, alpha);
      }
      tail();

      // P V of the first key block.
      pipe_v.consumer_wait(read);
      pingpong_wait();
      wgmma_gemm<false, -1>(mma_pv, tOrP, tOrV(_, _, _, read.index()), tOrO);
      pingpong_signal();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(tOrP);
      pipe_v.consumer_release(read);
      ++read;
    }

    // Epilogue: O / l and LSE.
    float inv_sum[kRows], lse[kRows];
    softmax.finalize(inv_sum, lse);
    scale_rows(O, inv_sum);
    if (tid % 4 == 0) {
      float* lse_bh = p.lse + (int64_t(c.batch) * p.heads_q + c.head) * p.seqlen_q;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        int row = wrow_lo + get<0>(cS(r, 0));
        if (row < p.seqlen_q) lse_bh[row] = lse[r];
      }
    }
    // Each thread holds column pairs (c, c + 1) of 2 rows: one 4-byte store per pair; the 4
    // threads of a quad cover 16 contiguous bytes of a row, and L2 merges the sectors.
    Tensor cO = rowcol_view(thr_pv.partition_C(make_identity_tensor(Shape<_64, D>{})));
    Element* o_bh = p.out + (int64_t(c.batch) * p.seqlen_q * p.heads_q + c.head) * T::kHeadDim;
    int64_t const row_stride = int64_t(p.heads_q) * T::kHeadDim;
    static_assert(size<1>(decltype(O){}) % 4 == 0, "8-byte O stores: column pairs come in fours");
    // 8-byte stores: thread q of a quad holds column pairs 8k + 2q (k = 0, 1, ...). Threads
    // q and q ^ 1 swap one pair per two k: the even one (b = 0) stores its pair of k and its
    // partner's, columns 8k + 2q .. + 3; the odd one those of k + 1 at 8 (k + 1) + 2q - 2.
    // A quad then writes 2 x 16 contiguous bytes per row and instruction (full 32-byte
    // sectors; the 4-byte stores wrote each sector in two halves), with half the stores.
    // The shuffles run on every lane (rows past seqlen_q only skip the stores).
    int const b = tid & 1;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      int row = wrow_lo + get<0>(cO(r, 0));
      Element* o_row = o_bh + row * row_stride + get<1>(cO(r, 0)) + (b ? 6 : 0);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(O); j += 4) {
        cutlass::Array<Element, 2> w0, w1;
        w0[0] = Element(O(r, j));
        w0[1] = Element(O(r, j + 1));
        w1[0] = Element(O(r, j + 2));
        w1[1] = Element(O(r, j + 3));
        uint32_t u0 = reinterpret_cast<uint32_t&>(w0), u1 = reinterpret_cast<uint32_t&>(w1);
        uint32_t got = __shfl_xor_sync(0xffffffffu, b ? u0 : u1, 1);
        uint2 v = b ? make_uint2(got, u1) : make_uint2(u0, got);
        // Column of pair j / 2 is get<1>(cO(r, j)) = that of pair 0 + 4 j (checked in
        // host_checks/o_store_check.cu).
        if (row < p.seqlen_q) *reinterpret_cast<uint2*>(o_row + 4 * j) = v;
      }
    }
  }
}

template <class T>
__global__ void __launch_bounds__(T::kNumThreads, 1) fwd_kernel(__grid_constant__ typename T::Params const p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ss = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  int const warp_group = cutlass::canonical_warp_group_idx();

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_o.get_tma_descriptor());
    cutlass::arch::ClusterTransactionBarrier::init(&ss.q_full, 1);
    // One arrival per consumer thread after its last Q K^T.
    cutlass::arch::ClusterBarrier::init(&ss.q_empty, T::kNumMmaThreads);
    if constexpr (T::kQPrefetch) {
      for (int b = 0; b < 2; ++b) {
        cutlass::arch::ClusterTransactionBarrier::init(&ss.qb.full[b], 1);
        cutlass::arch::ClusterBarrier::init(&ss.qb.empty[b], T::kNumMmaThreads);  // every consumer thread
      }
    }
  }
  typename T::Pipeline::Params pp;
  pp.transaction_bytes = T::kBlockN * T::kHeadDim * int(sizeof(typename T::Element));
  pp.role = warp_group == 0 ? T::Pipeline::ThreadCategory::Producer : T::Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = T::kNumMmaThreads;
  typename T::Pipeline pipe_k(ss.pipe_k, pp, Shape<_1, _1, _1>{});
  typename T::Pipeline pipe_v(ss.pipe_v, pp, Shape<_1, _1, _1>{});
  __syncthreads();

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if constexpr (T::kQPrefetch) {
      if (threadIdx.x == 0) fwd_producer_qpf<T>(p, ss, pipe_k, pipe_v);
    } else {
      if (threadIdx.x == 0) fwd_producer<T>(p, ss, pipe_k, pipe_v);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    fwd_consumer<T>(p, ss, pipe_k, pipe_v, warp_group - 1);
  }
}

}  // namespace fa3
