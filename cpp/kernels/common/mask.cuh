// The attention mask as a band around the bottom-right-aligned diagonal (see fa3/params.h):
//   query i sees key j  iff  i + off - left <= j <= i + off + right  and  0 <= j < seqlen_k,
// with off = seqlen_k - seqlen_q. Causal is right = 0, sliding windows are finite (left, right),
// ring attention shifts the band (negative bounds), kUnbounded (2^30) opens a side.
//
// The policy answers three questions for a tile of query rows:
//   * which key blocks intersect the band at all (the rest is never loaded nor computed);
//   * whether a key block lies wholly inside the band (no per-element mask needed);
//   * the per-element mask for the few boundary blocks.
// The forward and the backward kernels share it.
#pragma once

#include <cmath>

#include "common/utils.cuh"

namespace fa3 {

struct BandMask {
  int seqlen_q;
  int seqlen_k;
  int left;   // in [-2^30, 2^30]
  int right;  // in [-2^30, 2^30]

  CUTE_HOST_DEVICE int offset() const { return seqlen_k - seqlen_q; }

  // Key blocks [n_begin, n_end) of width block_n that hold at least one visible key for some
  // query row in [row_lo, row_hi] (inclusive, row_hi < seqlen_q). Empty (n_begin >= n_end)
  // when no row of the range sees any key. 64-bit arithmetic: the bounds may be near 2^30.
  CUTE_HOST_DEVICE void key_block_range(int row_lo, int row_hi, int block_n, int& n_begin,
                                        int& n_end) const {
    long long lo = (long long)row_lo + offset() - left;
    long long hi = (long long)row_hi + offset() + right;
    if (lo < 0) lo = 0;
    if (hi > seqlen_k - 1) hi = seqlen_k - 1;
    if (hi < lo) {
      n_begin = n_end = 0;
      return;
    }
    n_begin = int(lo / block_n);
    n_end = int(hi / block_n) + 1;
  }

  // True when every (row, key) of rows [row_lo, row_hi] x keys [n0, n0 + block_n) is visible.
  CUTE_HOST_DEVICE bool block_is_interior(int row_lo, int row_hi, int n0, int block_n) const {
    long long first_key_needed = (long long)row_hi + offset() - left;  // of the lowest-reaching row
    long long last_key_allowed = (long long)row_lo + offset() + right;
    return n0 >= first_key_needed && (long long)n0 + block_n - 1 <= last_key_allowed &&
           n0 + block_n <= seqlen_k;
  }

  // Sets to -inf the scores of a (rows, cols) register view whose element (r, c) is the score
  // of query row0 + row_of(r) and key col0 + col_of(c); `coord` is the identity tensor
  // partitioned and viewed like `scores`.
  template <class TS, class TC>
  CUTE_DEVICE void apply(TS& scores, TC const& coord, int row0, int col0) const {
    // Bounds relative to this thread's first column, so that each element compares a
    // compile-time column offset with two per-row registers (no per-column registers).
    int const base = col0 + get<1>(coord(0, 0));
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(scores); ++r) {
      int i = row0 + get<0>(coord(r, 0));
      // No int overflow: |bounds| <= 2^30 and 0 <= i + off < seqlen_k, far below 2^30.
      int lo = i + offset() - left - base;
      int hi = min(i + offset() + right, seqlen_k - 1) - base;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        int j = get<1>(coord(r, c)) - get<1>(coord(0, 0));
        if (j < lo || j > hi) scores(r, c) = -INFINITY;
      }
    }
  }

  // Only the end of the key range: for problems whose band reaches past both ends.
  template <class TS, class TC>
  CUTE_DEVICE void apply_seqlen_k(TS& scores, TC const& coord, int col0) const {
    int limit = seqlen_k - col0;  // keys at column >= limit do not exist
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < size<1>(scores); ++c) {
      if (get<1>(coord(0, c)) >= limit) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < size<0>(scores); ++r) scores(r, c) = -INFINITY;
      }
    }
  }
};

}  // namespace fa3
