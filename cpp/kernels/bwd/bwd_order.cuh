// Order of the backward main kernel's CTAs (on by default; FA3_BWD_LPT=0 gives back the 3D grid
// (key block, kv head, batch) with the key block fastest).
//
// With a causal or local band the work of a CTA depends on its key block: for causal, key block
// n visits the query blocks from about n * kBlockN / kBlockM to the end, so block 0 is the
// longest. In the default order the CTAs of one (kv head, batch) run consecutively, long and
// short mixed, and the longest CTA of the last head starts only in the last wave: the tail
// leaves most SMs idle for up to one longest CTA (estimated ~9-11% of the time at hd128
// causal 2k-8k). Here the CTAs are numbered in sections of `section` (kv head, batch) pairs;
// inside a section the key block is the slow index and the head the fast one, so every head's
// key block 0 starts first, then every head's block 1, ...: longest first within the section
// (a greedy longest-processing-time schedule once the hardware hands CTAs to free SMs in order).
// The section bounds how many heads' Q, dO and dQ accumulators are hot in L2 at once.
//
// `section` = 1 is exactly the 3D grid's order (linear = n + n_blocks * (hk + heads_kv * b)).
// Deterministic dQ needs, for each (kv head, batch), lower key blocks at lower linear indices
// (a CTA only waits for those): true in every section (n is the slow index inside it).
#pragma once

#include <cstdint>

#include "common/utils.cuh"
#include "fa3/params.h"

#ifndef FA3_BWD_LPT
#define FA3_BWD_LPT 1
#endif

namespace fa3 {
namespace bwd {

struct BwdTileOrder {
  int n_blocks;  // key blocks per (kv head, batch)
  int heads_kv;
  int batch;
  int section;   // (kv head, batch) pairs per section, >= 1

  CUTE_HOST_DEVICE int num_tiles() const { return n_blocks * heads_kv * batch; }

  // linear in [0, num_tiles()) -> (key block, kv head, batch).
  CUTE_HOST_DEVICE void decode(int linear, int& n_block, int& hk, int& b) const {
    const int per_section = section * n_blocks;
    const int s = linear / per_section;
    const int r = linear - s * per_section;
    const int hb0 = s * section;
    const int total = heads_kv * batch;
    const int width = total - hb0 < section ? total - hb0 : section;  // last section may be short
    n_block = r / width;
    const int hb = hb0 + (r - n_block * width);
    b = hb / heads_kv;
    hk = hb - b * heads_kv;
  }
};

// Host: the section width. Without a band (every CTA the same work) 1, the 3D grid's order.
// With one, as many (kv head, batch) pairs as keep their Q, dO (input dtype) and fp32 dQ
// accumulator within ~40 MB of the H200's L2 (FA3 budgets the same), rounded down to a power
// of two, at least 1.
inline int bwd_order_section(const AttentionShape& s, const AttentionOptions& opts, int elem_bytes) {
  if (!band_limits_work(s, opts)) return 1;
  const int heads_kv = s.heads_kv, batch = s.batch;
  const int64_t group = heads_kv > 0 ? s.heads_q / heads_kv : 1;
  const int64_t bytes = group * s.seqlen_q * int64_t(s.head_dim) * (2 * elem_bytes + 4);
  int64_t fit = (int64_t(40) << 20) / (bytes > 0 ? bytes : 1);
  int section = 1;
  while (int64_t(section) * 2 <= fit) section *= 2;
  const int64_t total = int64_t(heads_kv) * batch;
  return int(section < total ? section : (total > 0 ? total : 1));
}

}  // namespace bwd
}  // namespace fa3
