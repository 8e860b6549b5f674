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
#include "fa3/params.h"

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

  // block_is_interior(row_lo, row_hi, n0, block_n) for a fixed key block as
  // row_lo >= row_min && row_hi <= row_max (0 <= row_lo <= row_hi < seqlen_q), so that the backward
  // (keys fixed per CTA, query blocks stepped) computes the bounds once per CTA and tests each
  // sub-step with two compares (bwd_main.cuh, kMaskRows): n0 >= row_hi + off - left and
  // n0 + block_n - 1 <= row_lo + off + right solved for the rows; a key block that reaches past
  // seqlen_k is never interior (row_min = 2^30 > any row). 32-bit, as right_bound_only_from below:
  // 0 <= n0 < seqlen_k and |left|, |right| <= 2^30, so both bounds lie in (-seqlen_k - 2^30,
  // seqlen_q + block_n + 2^30): no overflow while seqlen_q + seqlen_k < 2^30 - 64.
  CUTE_HOST_DEVICE void interior_row_range(int n0, int block_n, int& row_min, int& row_max) const {
    row_min = n0 + block_n > seqlen_k ? (1 << 30) : n0 + block_n - 1 - offset() - right;
    row_max = n0 - offset() + left;
  }

  // The backward's side of the band (a CTA owns a key block and walks the query blocks).
  // Query blocks [m_begin, m_end) of height block_m holding a row that sees some key of key block
  // n_block (width block_n); empty (m_begin == m_end == 0) when none does. 64-bit as
  // key_block_range.
  CUTE_HOST_DEVICE void query_block_range(int n_block, int block_n, int block_m, int& m_begin,
                                          int& m_end) const {
    m_begin = m_end = 0;
    if ((long long)left + right < 0) return;  // empty band
    int n0 = n_block * block_n;
    int n_last = min(n0 + block_n, seqlen_k) - 1;
    if (n_last < n0) return;  // no key (a backward warpgroup's half block past seqlen_k)
    long long lo = (long long)n0 - offset() - right;
    long long hi = (long long)n_last - offset() + left;
    if (lo < 0) lo = 0;
    if (hi > seqlen_q - 1) hi = seqlen_q - 1;
    if (hi < lo) return;
    m_begin = int(lo / block_m);
    m_end = int(hi / block_m) + 1;
  }

  // The most query rows any one key sees (0: no key is seen): key j is seen by rows
  // [j - off - right, j - off + left] within [0, seqlen_q). The count is concave in j, so its
  // maximum is at j = 0, j = seqlen_k - 1 or where either end of the range meets the rows' bounds
  // (causal: min(seqlen_q, seqlen_k)). 64-bit as key_block_range. The backward's host picks a
  // tile by it (bwd_launch.cuh).
  CUTE_HOST_DEVICE long long max_rows_per_key() const {
    if (seqlen_k <= 0) return 0;
    auto rows = [&](long long j) {  // key j's rows: query_block_range of a 1-key block, 1-row blocks
      int m_begin, m_end;
      query_block_range(int(j < 0 ? 0 : (j > seqlen_k - 1 ? seqlen_k - 1 : j)), 1, 1, m_begin, m_end);
      return (long long)(m_end - m_begin);
    };
    long long best = rows(0);
    for (long long j : {(long long)seqlen_k - 1, (long long)right + offset(), (long long)seqlen_q - 1 + offset() - left}) {
      const long long r = rows(j);
      if (r > best) best = r;
    }
    return best;
  }

  // The lowest key that query row `row` sees, before clamping to 0 (key_block_range's lower bound):
  // its key block is the first to add into the row's dQ (the backward's deterministic turns).
  CUTE_HOST_DEVICE long long first_key(long long row) const { return row + offset() - left; }

  // The element mask of one (query i, key j) in the backward: v = 0 where j lies outside i's band
  // or past the keys; kKeyBoundOnly (problems without a band): past the keys only. 32-bit:
  // |i|, |j| < 2^30, and j - i - off is compared with the bounds rather than the bounds formed.
  // (A value to zero, not a bool: as a predicate the compiler materialised it per element.)
  template <bool kKeyBoundOnly = false>
  CUTE_HOST_DEVICE void zero_if_masked(float& v, int i, int j) const {
    if constexpr (kKeyBoundOnly) {
      if (j >= seqlen_k) v = 0.f;
    } else {
      const int rel = (j - seqlen_k) - (i - seqlen_q);  // j - i - off
      if (j >= seqlen_k || rel < -left || rel > right) v = 0.f;
    }
  }

  // block_is_interior(row_lo, row_hi, n0, block_n) as n0_lo <= n0 <= n0_hi for n0 >= 0, so that
  // a kernel computes the bounds once per tile and tests each block with two compares.
  // 32-bit as right_bound_only_from (row_hi < seqlen_q).
  CUTE_HOST_DEVICE void interior_key_range(int row_lo, int row_hi, int block_n, int& n0_lo,
                                           int& n0_hi) const {
    n0_lo = max(row_hi + offset() - left, 0);
    n0_hi = max(min(row_lo + offset() + right - block_n + 1, seqlen_k - block_n), -1);
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

  // One-compare form of apply(). True when, for every
  // query row up to row_hi (the last row the caller masks, padding rows included) and every key
  // from n0 on, neither the left bound nor the seqlen_k end can mask anything:
  //   i + off - left <= n0 <= j           (the left bound reaches past the block's first key)
  //   i + off + right <= seqlen_k - 1     (the right bound never passes the last key).
  // Both sides grow with i, so row_hi decides. apply() then reduces to "key j is masked iff
  // j > i + off + right", which apply_right() does with one compare per element. Holds on every
  // masked block of causal problems (left unbounded, right = 0) whose rows all lie below
  // seqlen_q (seqlen_q a multiple of 64, or not the last tile), whatever seqlen_k.
  CUTE_HOST_DEVICE bool right_bound_only(int row_hi, int n0) const {
    long long last = (long long)row_hi + offset();
    return last - left <= n0 && last + right <= seqlen_k - 1;
  }

  // right_bound_only(row_hi, n0) as n0 >= right_bound_only_from(row_hi) for n0 >= 0: the first
  // key from which it holds (0 when from the start, INT_MAX when never), computed once per tile.
  // 32-bit: |left|, |right| <= 2^30 and row_hi < seqlen_q + 64, so with seqlen_q + seqlen_k
  // below 2^30 - 64 (a GPU cannot hold the q, k, v, o of longer sequences) nothing overflows.
  CUTE_HOST_DEVICE int right_bound_only_from(int row_hi) const {
    int last = row_hi + offset();
    return last + right > seqlen_k - 1 ? 0x7fffffff : max(last - left, 0);
  }

  // The mask of apply() where right_bound_only(row0 + last row of coord, col0) holds, with one
  // integer compare per distinct (column - row) offset: element (r, c) is masked iff
  // dj - dr > hi, with dj, dr its compile-time column / row offsets from the thread's first
  // element and hi one register. The accumulator rows of a thread are 8 apart and its columns
  // come in pairs 8 apart, so row r + 1's compares are row r's shifted by one column group:
  // 34 compares for 64 elements (WGMMA 64 x 128), instead of two per element.
  template <class TS, class TC>
  CUTE_HOST_DEVICE void apply_right(TS& scores, TC const& coord, int row0, int col0) const {
    int const i0 = row0 + get<0>(coord(0, 0));
    // Last visible key of the thread's first row, relative to its first column. No int
    // overflow: i0 + off + right <= seqlen_k - 1 and right >= -2^30.
    int const hi = i0 + offset() + right - (col0 + get<1>(coord(0, 0)));
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(scores); ++r) {
      int const dr = get<0>(coord(r, 0)) - get<0>(coord(0, 0));
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        int const dj = get<1>(coord(r, c)) - get<1>(coord(0, 0));
        if (dj - dr > hi) scores(r, c) = -INFINITY;
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

// Packed documents (segment ids, varlen; fa3/params.h DocBands): each query row's keys as an
// interval [lo, hi) read from memory, applied on top of the band. Groups of kBandGroupRows rows
// carry (min lo, max lo, min hi, max hi), so that a tile's block range and its blocks without a
// mask come from a few loads; only boundary blocks read per-row intervals. The backward reads
// the key side (each key's interval of query rows), whose rows are fixed per CTA.
struct DocMask {
  int2 const* q_rows = nullptr;  // (batch, seqlen_q); nullptr: no documents
  int4 const* q_groups = nullptr;
  int2 const* k_rows = nullptr;  // (batch, seqlen_k)
  int4 const* k_groups = nullptr;
  int seqlen_q = 0, seqlen_k = 0;

  static DocMask of(DocBands const& d, int seqlen_q, int seqlen_k) {
    DocMask m;
    m.q_rows = reinterpret_cast<int2 const*>(d.q_rows);
    m.q_groups = reinterpret_cast<int4 const*>(d.q_groups);
    m.k_rows = reinterpret_cast<int2 const*>(d.k_rows);
    m.k_groups = reinterpret_cast<int4 const*>(d.k_groups);
    m.seqlen_q = seqlen_q;
    m.seqlen_k = seqlen_k;
    return m;
  }

  CUTE_HOST_DEVICE bool present() const { return q_rows != nullptr; }

  // (min lo, max lo, min hi, max hi) over rows [lo, hi] (inclusive; rows past seqlen count as the
  // last, as the groups have them) of one batch row.
  CUTE_DEVICE static int4 span(int4 const* groups, int seqlen, int b, int lo, int hi) {
    int const per_batch = (seqlen + kBandGroupRows - 1) / kBandGroupRows;
    lo = min(lo, seqlen - 1);
    hi = min(hi, seqlen - 1);
    int4 const* g = groups + int64_t(b) * per_batch;
    int const g_lo = lo / kBandGroupRows, g_hi = hi / kBandGroupRows;
    auto merge = [](int4 r, int4 x) { return make_int4(min(r.x, x.x), max(r.y, x.y), min(r.z, x.z), max(r.w, x.w)); };
    // The first two groups (a 128-row tile's) load at once: a tile start waits one load latency.
    int4 r = merge(__ldg(g + g_lo), __ldg(g + min(g_lo + 1, g_hi)));
    for (int i = g_lo + 2; i <= g_hi; ++i) r = merge(r, __ldg(g + i));
    return r;
  }

  // Narrows [begin, end), blocks of width `block` on the other side, to those holding a member
  // of some row's interval in `s` (a span()); empty as begin = end = 0.
  CUTE_DEVICE static void narrow(int4 s, int block, int& begin, int& end) {
    begin = max(begin, s.x / block);
    end = min(end, (max(s.w, 0) + block - 1) / block);
    if (end <= begin) begin = end = 0;
  }

  // Forward: key blocks of query rows [row_lo, row_hi] of batch row b.
  CUTE_DEVICE void narrow_key_blocks(int b, int row_lo, int row_hi, int block_n, int& n_begin, int& n_end) const {
    if (present()) narrow(span(q_groups, seqlen_q, b, row_lo, row_hi), block_n, n_begin, n_end);
  }

  // Backward: query blocks of keys [key_lo, key_hi] of batch row b.
  CUTE_DEVICE void narrow_query_blocks(int b, int key_lo, int key_hi, int block_m, int& m_begin, int& m_end) const {
    if (present()) narrow(span(k_groups, seqlen_k, b, key_lo, key_hi), block_m, m_begin, m_end);
  }

  // Forward: a key block starting at n0 needs no document mask for rows [row_lo, row_hi] iff
  // n0_lo <= n0 <= n0_hi; narrows the band's thresholds (FwdTileMask) to that.
  CUTE_DEVICE void narrow_interior_keys(int b, int row_lo, int row_hi, int block_n, int& n0_lo, int& n0_hi) const {
    if (!present()) return;
    int4 const s = span(q_groups, seqlen_q, b, row_lo, row_hi);
    n0_lo = max(n0_lo, s.y);
    n0_hi = min(n0_hi, s.z - block_n);
  }

  // Backward: query rows [iq_min, iq_max] see every key of keys [key_lo, key_hi]; narrows the
  // band's interior row range to that.
  CUTE_DEVICE void narrow_interior_rows(int b, int key_lo, int key_hi, int& iq_min, int& iq_max) const {
    if (!present()) return;
    int4 const s = span(k_groups, seqlen_k, b, key_lo, key_hi);
    iq_min = max(iq_min, s.y);
    iq_max = min(iq_max, s.z - 1);
  }

  // Forward: -inf at the scores of keys outside each row's interval (the rows and columns of
  // `scores` as in BandMask::apply). Rows past seqlen_q read the last row's interval.
  template <class TS, class TC>
  CUTE_DEVICE void apply(TS& scores, TC const& coord, int b, int row0, int col0) const {
    int const base = col0 + get<1>(coord(0, 0));
    int2 const* rows = q_rows + int64_t(b) * seqlen_q;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(scores); ++r) {
      int2 const band = __ldg(rows + min(row0 + get<0>(coord(r, 0)), seqlen_q - 1));
      int const lo = band.x - base, hi = band.y - base;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        int const j = get<1>(coord(r, c)) - get<1>(coord(0, 0));
        if (j < lo || j >= hi) scores(r, c) = -INFINITY;
      }
    }
  }

  // Whether query row i of batch row b is marked invalid (its segment ids broke the contract).
  CUTE_DEVICE bool row_invalid(int b, int i) const {
    return present() && __ldg(q_rows + int64_t(b) * seqlen_q + min(i, seqlen_q - 1)).y < 0;
  }

  // Backward with query rows fixed per thread (split-D): v = 0 unless query i sees key j.
  CUTE_DEVICE void zero_unless_sees(float& v, int b, int i, int j) const {
    int2 const band = __ldg(q_rows + int64_t(b) * seqlen_q + min(i, seqlen_q - 1));
    if (j < band.x || j >= band.y) v = 0.f;
  }

  // Backward with keys fixed per thread: v = 0 unless query i sees key j by its documents.
  CUTE_DEVICE void zero_if_hidden(float& v, int b, int i, int j) const {
    int2 const band = __ldg(k_rows + int64_t(b) * seqlen_k + min(j, seqlen_k - 1));
    if (i < band.x || i >= band.y) v = 0.f;
  }
};

}  // namespace fa3
