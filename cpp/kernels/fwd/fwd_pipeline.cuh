// The forward kernel's synchronisation, all of it: the K/V rings, the hand-off of each tile's
// Q (and of the tile itself, FwdTile) between the producer and the consumer warpgroups, and the
// named barriers of the ping-pong.
//   * K and V: two cutlass::PipelineTmaAsync rings of kStages blocks (full: the TMA landed;
//     empty: every consumer thread is done with the stage). K apart from V, so that a block's
//     Q K^T can start before its V has landed. Blocks are produced in lockstep (block j sits in
//     stage j % kStages of both), so a consumer's one read state serves both rings.
//   * Q: one buffer (FwdQBuffer: full / empty and the tile slot), or two used by alternate
//     tiles (kQPrefetch, FwdQBuffers: full[b] / empty[b] and the published tile info[b]), so
//     that the next tile's Q loads a tile ahead. full completes when the buffer holds the tile
//     (TMA landed, or a plain arrival for a tile without keys or the end marker); empty when
//     every consumer thread is past its tile's last Q K^T (one arrival per thread).
//   * FP8 only: the V ring feeds the V transposers (warps 1-2 of warpgroup 0), which fill a ring
//     of transposed V (PipelineVt) for the consumers. After the CTA's last V block the producer
//     adds an end marker to the V ring (fwd_v_end_marker), which stops the transposers.
//   * Named barriers: kFwdBarPingPong + w, one per consumer warpgroup w (WarpgroupPingPong).
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/scheduler.cuh"
#include "common/utils.cuh"

namespace fa3 {

// Named barrier ids (NamedBarrier adds CUTLASS's reserved ids below them).
constexpr int kFwdBarPingPong = 0;  // + consumer warpgroup, < 3 warpgroups (WarpgroupPingPong)

template <int kStages>
using FwdKVPipeline = cutlass::PipelineTmaAsync<kStages>;

// Parameters of the K and V rings: warpgroup 0 produces, the others consume; every thread
// constructs the rings, and thread 0 initialises their barriers. FP8's V ring (v_ring) is
// consumed by the V transposers (warps 1-2 of warpgroup 0, fwd_transpose.cuh) instead.
// FP8: whether this thread of warpgroup 0 is one of the V transposers (warp 0's first thread
// issues the TMAs).
template <class T>
CUTE_DEVICE bool fwd_is_v_transposer() {
  return threadIdx.x >= 32 && threadIdx.x < 32 + T::kNumTransposeThreads;
}

template <class T>
CUTE_DEVICE typename T::Pipeline::Params fwd_kv_pipeline_params(int warp_group, bool v_ring = false) {
  using Role = typename T::Pipeline::ThreadCategory;
  typename T::Pipeline::Params pp;
  pp.transaction_bytes = T::kBlockN * T::kHeadDim * int(sizeof(typename T::Element));
  pp.role = warp_group == 0 ? Role::Producer : Role::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = T::kNumMmaThreads;
  if (T::kFp8 && v_ring) {
    pp.role = warp_group != 0   ? Role::NonParticipant
              : threadIdx.x < 32  ? Role::Producer
              : fwd_is_v_transposer<T>() ? Role::Consumer
                                         : Role::NonParticipant;
    pp.num_consumers = T::kNumTransposeThreads;
  }
  return pp;
}

// FP8's transposed V ring (fwd_transpose.cuh): the transposers produce, the consumer warpgroups
// consume. Other kernels get an empty placeholder.
struct FwdNoPipeline {};

template <class T>
CUTE_DEVICE auto fwd_vt_pipeline(typename T::SharedStorage& ss, int warp_group) {
  if constexpr (T::kFp8) {
    typename T::PipelineVt::Params pp;
    pp.role = warp_group == 0 ? T::PipelineVt::ThreadCategory::Producer : T::PipelineVt::ThreadCategory::Consumer;
    pp.producer_arv_count = T::kNumTransposeThreads;
    pp.consumer_arv_count = T::kNumMmaThreads;
    return typename T::PipelineVt(ss.pipe_vt, pp);
  } else {
    return FwdNoPipeline{};
  }
}

// FP8: the producer's last entry in the V ring, after the CTA's last V block: a stage completed
// by a plain arrival (no TMA) whose flag v_end[stage] is 1. The V transposers stop there
// (fwd_transpose.cuh), so they need not know the tiles, whichever schedule hands them out. The
// flags start at 0 (before the CTA's first __syncthreads) and only the marker's is written, by
// the producer once it owns the stage: every transposer read the flag of the stage's earlier
// blocks before releasing them, and reads the marker's after the arrival that publishes it.
template <class T>
CUTE_DEVICE void fwd_v_end_marker(typename T::SharedStorage& ss, typename T::PipelineState s) {
  ss.pipe_v.empty_barrier_[s.index()].wait(s.phase());  // as producer_acquire, without the tx
  ss.v_end[s.index()] = 1;
  ss.pipe_v.full_barrier_[s.index()].arrive();
}

// ---------------------------------------------------------------------------------------------
// Q hand-off: its shared memory in the one- and the two-buffer form (FwdTraits::SharedStorage::qsync).
struct FwdQBuffer {
  alignas(16) uint64_t full;   // the Q tile landed (or a plain arrival)
  alignas(16) uint64_t empty;  // every consumer thread is past its last Q K^T
  int tile;                    // dynamic schedule: the tile of the full phase (>= num_tiles: end)
};
struct alignas(16) FwdTileInfo {  // what the producer publishes per tile (t >= num_tiles: end)
  int t, m_block, head, batch;
  int n_begin, n_end, pad0, pad1;
};
struct FwdQBuffers {
  alignas(16) uint64_t full[2];
  alignas(16) uint64_t empty[2];
  FwdTileInfo info[2];
};

// One tile of the schedule: its coordinates, query rows [row_lo, row_hi] (row_hi < seqlen_q),
// the key blocks [n_begin, n_end) that intersect the band, its Q buffer.
struct FwdTile {
  TileCoord c;
  int row_lo, row_hi;
  int n_end, n_begin;
  int buf;
};

// Tile t decoded: coordinates, rows, key blocks (buffer 0).
template <class T>
CUTE_DEVICE FwdTile fwd_tile(typename T::Params const& p, int t) {
  FwdTile tile;
  tile.c = p.sched.decode(t);
  tile.row_lo = tile.c.m_block * T::kBlockM;
  tile.row_hi = min(tile.row_lo + T::kBlockM, p.seqlen_q) - 1;
  p.mask.key_block_range(tile.row_lo, tile.row_hi, T::kBlockN, tile.n_begin, tile.n_end);
  if constexpr (T::kDocs) p.docs.narrow_key_blocks(tile.c.batch, tile.row_lo, tile.row_hi, T::kBlockN, tile.n_begin, tile.n_end);
  tile.buf = 0;
  return tile;
}

// Called by one thread before the CTA's first __syncthreads.
template <class T>
CUTE_DEVICE void fwd_q_barriers_init(typename T::SharedStorage& ss) {
  using ClusterBarrier = cutlass::arch::ClusterBarrier;
  if constexpr (T::kQPrefetch) {
    for (int b = 0; b < 2; ++b) {
      cutlass::arch::ClusterTransactionBarrier::init(&ss.qsync.full[b], 1);
      ClusterBarrier::init(&ss.qsync.empty[b], T::kNumMmaThreads);
    }
  } else {
    cutlass::arch::ClusterTransactionBarrier::init(&ss.qsync.full, 1);
    ClusterBarrier::init(&ss.qsync.empty, T::kNumMmaThreads);
  }
}

// Producer side: acquire() waits until the buffer of this tile is free and returns it;
// publish() writes the tile where the consumers read it; full(b) is the barrier whose phase the
// Q load (or a plain arrival) completes; advance() moves on to the next tile.
template <class T, bool kTwoBuffers = T::kQPrefetch>
struct FwdQProducer;

// One buffer: acquire waits for the previous tile's empty. The consumers decode the tile
// themselves; the slot carries it only under the dynamic schedule, where they cannot know it.
// The producer completes a full phase for every tile (a plain arrival when it has no keys), so
// the consumers never run more than one tile ahead of it (the empty parity waits rely on it).
template <class T>
struct FwdQProducer<T, false> {
  typename T::SharedStorage& ss;
  int empty_phase = 0;
  bool first = true;

  CUTE_DEVICE int acquire() {
    if (!first) {
      cutlass::arch::ClusterBarrier::wait(&ss.qsync.empty, empty_phase);
      empty_phase ^= 1;
    }
    first = false;
    return 0;
  }
  CUTE_DEVICE void advance() {}
  // Every consumer thread has read the previous slot (at its tile start, before empty).
  CUTE_DEVICE void publish(int, bool dynamic, int t, TileCoord, int, int) {
    if (dynamic) ss.qsync.tile = t;
  }
  CUTE_DEVICE uint64_t& full(int) { return ss.qsync.full; }
  // Static schedule: the consumers stop by themselves after their last tile. Dynamic: one more
  // full phase with an end marker, once the consumers are past their last tile's start.
  CUTE_DEVICE void finish(bool dynamic, int num_tiles) {
    if (dynamic && !first) {
      cutlass::arch::ClusterBarrier::wait(&ss.qsync.empty, empty_phase);
      ss.qsync.tile = num_tiles;
      cutlass::arch::ClusterBarrier::arrive(&ss.qsync.full);
    }
  }
};

// Two buffers: tile i of this CTA uses buffer b = i % 2; acquire waits until tile i - 2 has
// released it (completion (i - 2) / 2 of empty[b]; none for i < 2). That wait returns at once
// in the steady state (tile i - 2 released it after its last Q K^T, before tile i - 1
// started), so the next tile's Q is issued as soon as this tile's K / V loads are, about a
// tile before it is needed. Consumers arrive on empty[b] only after full[b] of that tile, so the
// barrier is never more than one completion ahead of the wait. The producer publishes the
// decoded tile and its key range, and every schedule ends with an end marker, so the consumers
// always read the tile from info[b].
template <class T>
struct FwdQProducer<T, true> {
  typename T::SharedStorage& ss;
  int i = 0;  // tiles of this CTA so far

  CUTE_DEVICE int acquire() {
    if (i >= 2) cutlass::arch::ClusterBarrier::wait(&ss.qsync.empty[i & 1], ((i >> 1) + 1) & 1);
    return i & 1;
  }
  CUTE_DEVICE void advance() { ++i; }
  CUTE_DEVICE void publish(int b, bool, int t, TileCoord c, int n_begin, int n_end) {
    FwdTileInfo& info = ss.qsync.info[b];
    info.t = t;
    info.m_block = c.m_block;
    info.head = c.head;
    info.batch = c.batch;
    info.n_begin = n_begin;
    info.n_end = n_end;
  }
  CUTE_DEVICE uint64_t& full(int b) { return ss.qsync.full[b]; }
  // Every schedule ends with an end marker in the next buffer.
  CUTE_DEVICE void finish(bool, int num_tiles) {
    int const b = acquire();
    ss.qsync.info[b].t = num_tiles;
    cutlass::arch::ClusterBarrier::arrive(&ss.qsync.full[b]);
  }
};

// Consumer side: next_tile() waits for the next tile's Q (false: no tile left); release() hands
// the buffer back after this thread's last read of it and of the tile slot, so the producer's
// next write to either follows every read by a direct release/acquire pair.
template <class T, bool kTwoBuffers = T::kQPrefetch>
struct FwdQConsumer;

template <class T>
struct FwdQConsumer<T, false> {
  typename T::SharedStorage& ss;
  int full_phase = 0;

  // t: the static schedule's tile (advanced by the caller, which also stops at num_tiles),
  // replaced by the published one under the dynamic schedule (>= num_tiles: the end marker).
  // The caller decodes the tile (fwd_tile).
  CUTE_DEVICE bool next_tile(typename T::Params const&, bool dynamic, int num_tiles, int& t, FwdTile&) {
    cutlass::arch::ClusterBarrier::wait(&ss.qsync.full, full_phase);
    full_phase ^= 1;
    if (dynamic) {
      t = ss.qsync.tile;
      if (t >= num_tiles) return false;
    }
    return true;
  }
  CUTE_DEVICE void release(FwdTile const&) { cutlass::arch::ClusterBarrier::arrive(&ss.qsync.empty); }
};

template <class T>
struct FwdQConsumer<T, true> {
  typename T::SharedStorage& ss;
  int i = 0;  // tiles of this CTA so far (tile i uses buffer i % 2)

  CUTE_DEVICE bool next_tile(typename T::Params const& p, bool, int num_tiles, int& t, FwdTile& tile) {
    // Through a shuffle so that ptxas knows the buffer is warp-uniform (as
    // canonical_warp_group_idx does): without it the info / barrier addresses were vector
    // registers and ptxas moved the consumers' descriptor and barrier arithmetic off the uniform
    // datapath (+32 R2UR and 5 WARPSYNC per main-loop block).
    int const b = __shfl_sync(0xffffffffu, i & 1, 0);
    cutlass::arch::ClusterBarrier::wait(&ss.qsync.full[b], (i >> 1) & 1);
    ++i;
    // The producer rewrites info[b] only after every consumer thread's empty[b] arrival of this
    // tile, which comes after these reads.
    int4 const i0 = *reinterpret_cast<int4 const*>(&ss.qsync.info[b].t);
    int2 const i1 = *reinterpret_cast<int2 const*>(&ss.qsync.info[b].n_begin);
    t = i0.x;
    if (t >= num_tiles) return false;
    tile.c.m_block = i0.y;
    tile.c.head = i0.z;
    tile.c.batch = i0.w;
    tile.n_begin = i1.x;
    tile.n_end = i1.y;
    tile.row_lo = tile.c.m_block * T::kBlockM;
    tile.row_hi = min(tile.row_lo + T::kBlockM, p.seqlen_q) - 1;
    tile.buf = b;
    return true;
  }
  CUTE_DEVICE void release(FwdTile const& tile) { cutlass::arch::ClusterBarrier::arrive(&ss.qsync.empty[tile.buf]); }
};

}  // namespace fa3
