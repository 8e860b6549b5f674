// What a backward main kernel (bwd_main.cuh, bwd_split_d.cuh) is given, MainParams, and which
// unit of work a CTA of the main kernel takes from its 1D grid (cta_work).
#pragma once

#include "bwd/bwd_epilogue.cuh"
#include "bwd/bwd_order.cuh"
#include "bwd/bwd_traits.cuh"
#include "common/mask.cuh"

namespace fa3 {
namespace bwd {

template <class Tr>
struct MainParams {
  typename BwdLoads<Tr>::TmaQ tma_q;
  typename BwdLoads<Tr>::TmaQ tma_do;
  typename BwdLoads<Tr>::TmaK tma_k;
  typename BwdLoads<Tr>::TmaV tma_v;
  const float* lse_log2;  // (b, hq, m_blocks * kBlockM), +inf where P must be 0
  const float* dpsum;     // (b, hq, m_blocks * kBlockM)
  float* dq_accum;        // (b, hq, m_blocks, chunk, warpgroup, fragment)
  int* dq_sem;            // (b, hq, m_blocks): deterministic turn counters
  typename Tr::Element* dk;
  typename Tr::Element* dv;
  int batch, seqlen_q, seqlen_k, heads_q, heads_kv, m_blocks;
  int head_dim, head_dim_v;  // of q/k/dk and v/dv (<= Tr::kHeadDim): the dK/dV stores' columns
  int window_left, window_right;
  float scale_log2;        // softmax_scale * log2 e, or softcap * log2 e with softcap
  float pre_tanh;          // softmax_scale / softcap
  float softmax_scale;
  int deterministic;
  // The dQ writer's tiles walk each head's query blocks from a block that depends on the key
  // block (first_query_block): set by the host for problems whose work does not vary over the
  // blocks (no band, no documents) outside deterministic mode.
  int rotate_walk;
  BwdTileOrder order;  // the 1D grid's CTA order (bwd_order.cuh)
  BwdTailSplit split;  // the tail units' CTAs (bwd_order.cuh)
  float* dkv_part;     // (split slots, 2, kBlockN * head_dim): the tail CTAs' fp32 dK, dV
  // dK/dV TMA stores over (seqlen_k, head_dim, heads_kv, batch) (store_dkv_tma; placeholders for
  // traits without kTmaDKV). launch_main's last two initializers (dkv_tma_store).
  typename DKVStore<Tr>::TmaDK tma_dk;
  typename DKVStore<Tr>::TmaDV tma_dv;
  DocMask docs;  // packed documents, or none

  // The problem's band (common/mask.cuh).
  CUTE_HOST_DEVICE BandMask band() const { return BandMask{seqlen_q, seqlen_k, window_left, window_right}; }
};

// The query blocks [m_begin, m_end) that see a key of key block n_block (batch row b): the
// band's, narrowed by the documents (kDocs: the kernel's copy for calls with documents).
template <class Tr, bool kDocs>
CUTE_DEVICE void query_blocks(MainParams<Tr> const& p, BandMask const& band, int n_block, int b, int& m_begin,
                              int& m_end) {
  band.query_block_range(n_block, Tr::kBlockN, Tr::kBlockM, m_begin, m_end);
  const int n0 = n_block * Tr::kBlockN;
  if constexpr (kDocs) p.docs.narrow_query_blocks(b, n0, min(n0 + Tr::kBlockN, p.seqlen_k) - 1, Tr::kBlockM, m_begin, m_end);
}

// The query block that the CTA's walk over [m_begin, m_end) (not empty) starts at; the walk goes up
// to m_end - 1, wraps to m_begin and ends before the start. Without a band every key block of a
// head sees the same query blocks, and walked in lockstep from m_begin they would all reach each
// query block at the same step: one key block's first store (bwd_dq.cuh) would hold up the others,
// and their reduce-adds would pile onto one tile. Key block n starts n blocks in instead, so that
// at each step the key blocks of a head are on different query blocks (while there are no more key
// blocks than query blocks) and each query block's first store lands a step before the next
// visitor. Banded problems are staggered by the band already; deterministic mode keeps the
// ascending walk, the order of its turns; so do documents (kDocs: the kernel's copy for them).
template <class Tr, bool kDocs>
CUTE_DEVICE int first_query_block(MainParams<Tr> const& p, int n_block, int m_begin, int m_end) {
  if constexpr (Tr::kDQSmem && !kDocs) {
    if (p.rotate_walk) return m_begin + n_block % (m_end - m_begin);
  }
  return m_begin;
}

// The walk's query block after m: the next one, wrapping at m_end to m_begin (first_query_block).
CUTE_DEVICE int next_query_block(int m, int m_begin, int m_end) { return m + 1 == m_end ? m_begin : m + 1; }

// This CTA's work in the main kernel: the unit (key block, kv head, batch), decoded from the 1D
// grid in the longest-first section order (bwd_order.cuh), and its query blocks [m_begin, m_end);
// slot >= 0 when it runs a share of a tail unit (BwdTailSplit), its dK/dV workspace slot.
// Each role calls it after its setmaxnreg.
template <class Tr, bool kDocs>
CUTE_DEVICE void cta_work(MainParams<Tr> const& p, int& n_block, int& hk, int& b, int& m_begin, int& m_end,
                          int& slot) {
  int unit = int(blockIdx.x);
  slot = -1;
  if constexpr (kTailSplitOk<Tr>) unit = p.split.unit_of(unit, slot);
  p.order.decode(unit, n_block, hk, b);
  query_blocks<Tr, kDocs>(p, p.band(), n_block, b, m_begin, m_end);
  if (slot >= 0) p.split.share(slot, m_begin, m_end);
}

}  // namespace bwd
}  // namespace fa3
