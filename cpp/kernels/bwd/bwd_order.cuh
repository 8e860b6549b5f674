// Order of the backward main kernels' CTAs (a 1D grid decoded here), and the split of the last
// wave's units over several CTAs.
//
// With a causal or local band the work of a CTA depends on its key block: for causal, key block
// n visits the query blocks from about n * kBlockN / kBlockM to the end, so block 0 is the
// longest. In the 3D grid's order the CTAs of one (kv head, batch) run consecutively, long and
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
// of two, at least 1. Documents make the work vary as a band does (work_varies).
inline int bwd_order_section(const AttentionShape& s, const AttentionOptions& opts, int elem_bytes,
                             const DocBands& docs = DocBands{}) {
  if (!work_varies(s, opts, docs)) return 1;
  const int heads_kv = s.heads_kv, batch = s.batch;
  const int64_t group = heads_kv > 0 ? s.heads_q / heads_kv : 1;
  const int64_t bytes = group * s.seqlen_q * int64_t(s.head_dim) * (2 * elem_bytes + 4);
  int64_t fit = (int64_t(40) << 20) / (bytes > 0 ? bytes : 1);
  int section = 1;
  while (int64_t(section) * 2 <= fit) section *= 2;
  const int64_t total = int64_t(heads_kv) * batch;
  return int(section < total ? section : (total > 0 ? total : 1));
}

// The last wave's split (main kernel, one-pass tiles, no band). Without a
// band every unit (key block, kv head, batch) has the same work, so on num_sms SMs the
// num_tiles % num_sms units past the last full wave run alone while the other SMs idle: at 16k
// tokens every hd64 problem is 4096 units on 132 SMs, 31 waves and 4 units, ~3% of the time.
// Here those tail units run as `parts` CTAs each, CTA `part` taking the query blocks
// [m_begin + part * len / parts, m_begin + (part + 1) * len / parts) (none empty: parts <= len).
// Such a CTA stores its fp32 dK (scaled) and dV in its own workspace slot; bwd_dkv_tail_kernel
// sums a unit's slots in part order (deterministic) and writes dK/dV. dQ is untouched: every
// query block still gets each key block's add exactly once, and the parts of a unit come after
// every lower key block of their head in the linear order (deterministic turns stay safe).
// CTA linear index l: l < full is unit l (as without the split); else slot l - full, of unit
// full + (l - full) / parts.
struct BwdTailSplit {
  int full;   // units that run whole (the first `full` of the order)
  int tail;   // units after them that run split, 0 without a split
  int parts;  // CTAs per tail unit (1 without a split)

  CUTE_HOST_DEVICE int num_slots() const { return tail * parts; }
  CUTE_HOST_DEVICE int num_ctas() const { return full + num_slots(); }

  // CTA linear index -> its unit (linear in BwdTileOrder) and, for a tail CTA, its slot (else -1).
  CUTE_HOST_DEVICE int unit_of(int cta, int& slot) const {
    if (cta < full) {
      slot = -1;
      return cta;
    }
    slot = cta - full;
    return full + slot / parts;
  }
  // A tail CTA's share of its unit's query blocks [m_begin, m_end) (part slot % parts).
  CUTE_HOST_DEVICE void share(int slot, int& m_begin, int& m_end) const {
    const int part = slot % parts, m0 = m_begin, len = m_end - m_begin;
    m_begin = m0 + part * len / parts;
    m_end = m0 + (part + 1) * len / parts;
  }
};

// Whether the main kernel can run a tail unit split over several CTAs: one pass over the query
// blocks (dK/dV whole in registers at the end). Not the banded ping-pong tile: banded problems
// never split.
template <class Tr>
constexpr bool kTailSplitOk = Tr::kPasses == 1 && (!Tr::kPingPong || Tr::kNoBand);

// Host: the split of `num_tiles` equal units of `m_len` query blocks (times `group` query heads)
// on num_sms SMs, one CTA per SM: the `parts` that minimises the tail's modelled time,
// ceil(tail * parts / num_sms) rounds of (group * ceil(m_len / parts) + kCtaCost) steps, against
// group * m_len + kCtaCost unsplit. kCtaCost ~2 steps: K/V load, pipeline fill, the epilogue
// (the tail model). At most kMaxRounds rounds of tail CTAs:
// more gains little and costs workspace (2 x 128 keys x head_dim fp32 per slot) and the
// tail kernel's reads. No split with a band (unequal units: the longest-first order handles
// them) or when nothing is gained.
inline BwdTailSplit bwd_tail_split(int num_tiles, int m_len, int group, int num_sms, bool banded) {
  const BwdTailSplit none{num_tiles, 0, 1};
  if (banded || num_sms <= 0 || m_len < 2 || num_tiles <= 0) return none;
  const int tail = num_tiles % num_sms;
  if (tail == 0) return none;
  constexpr int64_t kCtaCost = 2, kMaxParts = 64, kMaxRounds = 2;
  int best = 1;
  int64_t best_cost = int64_t(group) * m_len + kCtaCost;
  for (int parts = 2; parts <= m_len && parts <= kMaxParts; ++parts) {
    const int64_t rounds = (int64_t(tail) * parts + num_sms - 1) / num_sms;
    if (rounds > kMaxRounds) break;
    const int64_t cost = rounds * (int64_t(group) * ((m_len + parts - 1) / parts) + kCtaCost);
    if (cost < best_cost) best = parts, best_cost = cost;
  }
  return best == 1 ? none : BwdTailSplit{num_tiles - tail, tail, best};
}

}  // namespace bwd
}  // namespace fa3
