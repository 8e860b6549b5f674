// Forward tile scheduler: which output tile (m_block, head, batch) a CTA computes next.
//
// Tiles are numbered t = 0 .. num_tiles - 1 in one of two orders (decode):
//   * head-major (unmasked problems, every tile costs the same): the m_blocks of one head are
//     consecutive, so the CTAs running at the same time share that head's K/V in L2;
//   * longest-first (banded problems: causal, local; the work per tile varies with m_block):
//     (batch, head) pairs in sections of heads_per_section (their K/V stays in L2), and within a
//     section the last query blocks (longest key range for causal) first, the short ones filling
//     the tail. A greedy longest-first schedule is within 1% of ideal in simulation, where a
//     static round-robin of these tiles was 6-50% off.
// Query heads of one GQA group are adjacent either way (the head is the inner index).
// A CTA starts with tile blockIdx.x and then takes (next):
//   * with tile_counter (dynamic; banded problems on a persistent grid): gridDim.x + an atomic
//     increment of the counter, i.e. the tiles in order, each to whichever CTA is free first.
//     The counter is zeroed before the launch (the launcher's memset);
//   * without it (static): t + gridDim.x. On a persistent grid (min(tiles, SMs) CTAs) that is a
//     round-robin, on a grid of one CTA per tile (banded problems of kernels without the dynamic
//     code) the hardware's CTA dispatch makes it the greedy longest-first schedule.
// The backward keeps its own orders (bwd/bwd_order.cuh).
#pragma once

#include "common/utils.cuh"

namespace fa3 {

struct TileCoord {
  int m_block;
  int head;
  int batch;
};

struct TileScheduler {
  int num_m_blocks;
  int num_heads;
  int num_batch;
  int longest_first;  // 1: m_block-major descending (banded); 0: head-major (unmasked)
  // With longest_first, (batch, head) pairs are walked in sections of this many, so that the
  // K/V of the heads in flight stays in L2 while every section still goes longest-first.
  int heads_per_section;
  // Dynamic schedule when set (an int zeroed before the launch); nullptr: static.
  int* tile_counter;

  CUTE_HOST_DEVICE int num_tiles() const { return num_m_blocks * num_heads * num_batch; }

  CUTE_HOST_DEVICE TileCoord decode(int t) const {
    TileCoord c;
    int bh;
    if (longest_first) {
      // Section s holds heads [s*H, s*H + H) of the (batch*head) list; inside a section
      // m_blocks go from the last (longest) to the first, heads innermost.
      int total_bh = num_heads * num_batch;
      int per_section = heads_per_section * num_m_blocks;
      int s = t / per_section;
      int r = t - s * per_section;
      int h0 = s * heads_per_section;
      int nh = min(heads_per_section, total_bh - h0);
      int mi = r / nh;
      bh = h0 + (r - mi * nh);
      c.m_block = num_m_blocks - 1 - mi;
    } else {
      bh = t / num_m_blocks;
      c.m_block = t - bh * num_m_blocks;
    }
    c.batch = bh / num_heads;
    c.head = bh - c.batch * num_heads;
    return c;
  }

  // kDynamicCode: the kernel carries the dynamic-schedule code (it costs producer registers, so
  // only some kernels do); the counter then decides at run time.
  template <bool kDynamicCode>
  CUTE_DEVICE bool dynamic() const {
    return kDynamicCode && tile_counter != nullptr;
  }

  // The tile after t for this CTA. Called by the one thread that claims tiles (the producer),
  // once the current tile's loads are issued.
  template <bool kDynamicCode>
  CUTE_DEVICE int next(int t) const {
    if constexpr (kDynamicCode) {
      if (tile_counter != nullptr) return int(gridDim.x) + atomicAdd(tile_counter, 1);
    }
    return t + int(gridDim.x);
  }
};

}  // namespace fa3
