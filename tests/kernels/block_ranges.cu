// Unit test (host, no GPU): the band's block iteration (common/mask.cuh BandMask) agrees with
// brute force for random shapes and bands, with the backward's tiles (64-row query blocks,
// 128-key blocks):
//   * query_block_range (per key block: the query blocks a backward CTA visits);
//   * key_block_range (per query block: the key blocks that add into its dQ, the deterministic
//     turn order), and first_key, from which the dQ writer derives the first of them;
//   * block_is_interior (no element mask needed) only where every element is visible;
//   * interior_row_range (the backward's per-sub-step interior test) gives exactly
//     block_is_interior's answer, key bound included;
//   * zero_if_masked zeroes exactly the invisible elements, and its key-bound-only form
//     (problems without a band) exactly the keys past seqlen_k;
//   * the backward's masked steps (bwd_main.cuh, kSkipMaskedWg): query_block_range of a
//     warpgroup's 64 keys, row by row, skips a step exactly when no row of it sees those keys.
// Then interior_row_range against block_is_interior on long sequences (no brute force).
#include <cstdio>
#include <cstdlib>
#include "common/mask.cuh"
using namespace fa3;
int main() {
  srand(1);
  const int U = 1 << 30;
  int cases = 0, bad = 0;
  int wins[] = {U, 0, 1, 5, 63, 64, 65, 127, 128, 200, -1, -5, -64, -130, -300};
  for (int it = 0; it < 4000; ++it) {
    int sq = 1 + rand() % 400, sk = 1 + rand() % 400;
    int wl = wins[rand() % 15], wr = wins[rand() % 15];
    BandMask band{sq, sk, wl, wr};
    const int BM = 64, BN = 128;
    int mblocks = (sq + BM - 1) / BM, nblocks = (sk + BN - 1) / BN;
    for (int n = 0; n < nblocks; ++n) {
      int mb, me; band.query_block_range(n, BN, BM, mb, me);
      for (int m = 0; m < mblocks; ++m) {
        bool touch = false, all = true, zero_ok = true;
        bool wg_touch[2] = {false, false};  // a row of the step sees a key of consumer warpgroup 0 / 1
        for (int i = m * BM; i < std::min(m * BM + BM, sq); ++i)
          for (int j = n * BN; j < n * BN + BN; ++j) {
            long long rel = (long long)j - i - (sk - sq);
            bool vis = j < sk && rel >= -wl && rel <= wr;
            touch |= vis; all &= vis;
            wg_touch[(j - n * BN) / 64] |= vis;
            float v = 1.f;
            band.zero_if_masked(v, i, j);
            if ((v != 0.f) != vis) zero_ok = false;
            if (wl == U && wr == U) {  // no band: only the key bound
              float w = 1.f;
              band.zero_if_masked<true>(w, i, j);
              if ((w != 0.f) != (j < sk)) zero_ok = false;
            }
          }
        bool in = m >= mb && m < me;
        // The masked-step test of each consumer warpgroup (64 keys) on this step, as the kernel
        // forms it (rows past seqlen_q included in the step), against brute force.
        bool masked_ok = true;
        for (int wg = 0; wg < 2; ++wg) {
          int rb, re; band.query_block_range(n * 2 + wg, BN / 2, 1, rb, re);
          const bool skip = m * BM + BM <= rb || m * BM >= re;
          if (skip == wg_touch[wg]) masked_ok = false;
        }
        const int row_hi = std::min(m * BM + BM, sq) - 1;
        int nb, ne; band.key_block_range(m * BM, row_hi, BN, nb, ne);
        bool in2 = ((long long)wl + wr >= 0) && n >= nb && n < ne;
        // first_key of the block's first row: its key block is the first in key_block_range
        // (when the query block sees any key).
        bool first_ok = true;
        if (ne > nb) {
          long long fk = band.first_key((long long)m * BM);
          if ((fk > 0 ? int(fk / BN) : 0) != nb) first_ok = false;
        }
        bool interior = !(n * BN + BN > sk) && band.block_is_interior(m * BM, row_hi, n * BN, BN);
        int rmin, rmax; band.interior_row_range(n * BN, BN, rmin, rmax);
        bool interior_rows = m * BM >= rmin && row_hi <= rmax;
        if (in != touch || in2 != touch || (interior && !all) || interior_rows != interior || !zero_ok ||
            !first_ok || !masked_ok) {
          if (bad < 10)
            printf("sq %d sk %d wl %d wr %d m %d n %d: touch %d in %d in2 %d interior %d all %d rows %d "
                   "zero_ok %d first_ok %d masked_ok %d\n",
                   sq, sk, wl, wr, m, n, touch, in, in2, interior, all, interior_rows, zero_ok, first_ok, masked_ok);
          ++bad;
        }
        ++cases;
      }
    }
  }
  // Long sequences (no brute force): interior_row_range against block_is_interior only, windows
  // up to +-2^30, seqlens up to 2^28.
  for (int it = 0; it < 200000; ++it) {
    int sq = 1 + rand() % (1 << (1 + rand() % 28)), sk = 1 + rand() % (1 << (1 + rand() % 28));
    int wl = rand() % 3 ? wins[rand() % 15] : (rand() % 2 ? 1 : -1) * (rand() % (1 << 30)), wr = rand() % 3 ? wins[rand() % 15] : (rand() % 2 ? 1 : -1) * (rand() % (1 << 30));
    BandMask band{sq, sk, wl, wr};
    const int BM = 64, BN = 128;
    int n = rand() % ((sk + BN - 1) / BN), m = rand() % ((sq + BM - 1) / BM);
    bool interior = !(n * BN + BN > sk) && band.block_is_interior(m * BM, std::min(m * BM + BM, sq) - 1, n * BN, BN);
    int rmin, rmax; band.interior_row_range(n * BN, BN, rmin, rmax);
    bool interior_rows = m * BM >= rmin && std::min(m * BM + BM, sq) - 1 <= rmax;
    if (interior != interior_rows) {
      if (bad < 10) printf("long: sq %d sk %d wl %d wr %d m %d n %d: interior %d rows %d\n", sq, sk, wl, wr, m, n, interior, interior_rows);
      ++bad;
    }
    ++cases;
  }
  printf("block ranges: %d block pairs checked; %s (%d bad)\n", cases, bad ? "FAIL" : "ok", bad);
  return bad != 0;
}
