// Host check (no GPU): the backward's block iteration agrees with brute force for random
// shapes and bands: query_block_range (per key block), BandMask::key_block_range (per query block,
// used for the deterministic turn order) and block_is_interior (no element mask needed); and
// interior_row_range (FA3_BWD_MASK_ROWS) gives exactly block_is_interior's answer, key bound included.
// Build: nvcc -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//   -I cpp/include -I cpp/kernels -I <cutlass include> block_range_check.cu -o /tmp/check && /tmp/check
#include <cstdio>
#include <cstdlib>
#include <cutlass/numeric_types.h>
#include "bwd/bwd_main.cuh"
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
      int mb, me; bwd::query_block_range(band, n, BN, BM, mb, me);
      for (int m = 0; m < mblocks; ++m) {
        bool touch = false, all = true;
        for (int i = m * BM; i < std::min(m * BM + BM, sq); ++i)
          for (int j = n * BN; j < n * BN + BN; ++j) {
            long long rel = (long long)j - i - (sk - sq);
            bool vis = j < sk && rel >= -wl && rel <= wr;
            touch |= vis; all &= vis;
          }
        bool in = m >= mb && m < me;
        int nb, ne; band.key_block_range(m * BM, std::min(m * BM + BM, sq) - 1, BN, nb, ne);
        bool in2 = ((long long)wl + wr >= 0) && n >= nb && n < ne;
        bool interior = !(n * BN + BN > sk) && band.block_is_interior(m * BM, std::min(m * BM + BM, sq) - 1, n * BN, BN);
        int rmin, rmax; band.interior_row_range(n * BN, BN, rmin, rmax);
        const int row_hi = std::min(m * BM + BM, sq) - 1;
        bool interior_rows = m * BM >= rmin && row_hi <= rmax;
        if (in != touch || in2 != touch || (interior && !all) || interior_rows != interior) {
          if (bad < 10) printf("sq %d sk %d wl %d wr %d m %d n %d: touch %d in %d in2 %d interior %d all %d rows %d\n", sq, sk, wl, wr, m, n, touch, in, in2, interior, all, interior_rows);
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
  printf("%d block pairs checked, %d bad\n", cases, bad);
  return bad != 0;
}
