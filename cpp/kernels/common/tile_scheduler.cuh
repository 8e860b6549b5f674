// Tile scheduler: maps a linear tile index to (m_block, head, batch). A CTA walks
// t = blockIdx.x, blockIdx.x + gridDim.x, ... so the same code runs a persistent grid (at most
// num_sms CTAs, fixed stride) or one CTA per tile. Static: no global counter, so no workspace,
// nothing to reset between launches, safe under CUDA graphs.
//
// Order: with a band mask (causal/local) the work per tile varies with m_block, so tiles go
// longest-first: the last query blocks (longest key range for causal) of every head in a
// section come first and the short ones fill the tail. The launcher then starts one CTA per
// tile, and the hardware hands each next tile to the first SM that frees up: a greedy
// longest-first schedule (a static round-robin of these tiles was 6-50% off; NOTES.md).
// Without a mask all tiles cost the same, the grid is persistent, and the m_blocks of one head
// are consecutive, so the CTAs running at the same time share that head's K/V in L2. Query
// heads of one GQA group are adjacent either way (the head is the inner index).
#pragma once

#include "common/utils.cuh"

namespace fa3 {

struct TileCoord {
  int m_block;
  int head;
  int batch;
};

struct StaticTileScheduler {
  int num_m_blocks;
  int num_heads;
  int num_batch;
  int longest_first;  // 1: m_block-major descending (masked); 0: head-major (unmasked)
  // With longest_first, (batch, head) pairs are walked in sections of this many, so that the
  // K/V of the heads in flight stays in L2 while every section still goes longest-first.
  int heads_per_section;

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
};

}  // namespace fa3
