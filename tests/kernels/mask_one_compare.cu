// Unit test (host, no GPU) of the forward's one-compare mask (common/mask.cuh right_bound_only /
// apply_right, as fwd_consumer.cuh FwdTileMask uses them): on the S accumulator of every banded
// tile width, for all 128 threads of a consumer warpgroup and random shapes and bands, whenever
// right_bound_only(wrow_lo + 63, n0) holds, apply_right masks exactly the elements that the band
// definition masks (query i sees key j iff i + off - left <= j <= i + off + right, 0 <= j <
// seqlen_k), padding rows past seqlen_q included; rows that see no key come out all -inf.
// It also counts how often the one-compare path is taken for causal problems (it must be every
// masked block when all of the warpgroup's rows lie below seqlen_q), checks that it is never
// claimed for a block where the left bound or the seqlen_k end does cut, and that the per-tile
// thresholds (right_bound_only_from, interior_key_range) agree with the per-block tests
// (right_bound_only, block_is_interior).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cutlass/numeric_types.h>
#include "fwd/fwd_traits.cuh"
using namespace cute;

static bool visible(long long i, long long j, fa3::BandMask const& b) {
  long long rel = j - i - b.offset();
  return j >= 0 && j < b.seqlen_k && rel >= -(long long)b.left && rel <= b.right;
}

template <int BN>
int check(long long& taken, long long& causal_blocks, long long& causal_taken) {
  // The banded tiles' key widths: 128 (d = 64, 96, 128), 96 (d = 192), 80 (d = 256); the S
  // accumulator's layout depends only on the width.
  using Tr = fa3::FwdTraits<cutlass::bfloat16_t, 128, 128, BN, 2, true, true>;
  typename Tr::MmaQK mma;
  const int U = 1 << 30;
  int wins[] = {U, U, 0, 1, 5, 63, 64, 65, 127, 128, 200, 1000, -1, -5, -64, -130};
  int const nw = sizeof(wins) / sizeof(wins[0]);
  int bad = 0;
  for (int it = 0; it < 3000; ++it) {
    bool causal = it % 3 == 0;
    int sq = 1 + rand() % 700, sk = 1 + rand() % 700;
    if (it % 5 == 0) sq = 64 * (1 + rand() % 10);  // no padding rows
    if (it % 7 == 0) sk = sq;
    int left = causal ? U : wins[rand() % nw];
    int right = causal ? 0 : wins[rand() % nw];
    fa3::BandMask band{sq, sk, left, right};
    int nblocks = (sk + BN - 1) / BN;
    for (int wrow_lo = 0; wrow_lo < sq; wrow_lo += 64) {
      int wrow_hi = std::min(wrow_lo + 63, sq - 1);
      int nb, ne;
      band.key_block_range(wrow_lo, wrow_hi, BN, nb, ne);
      for (int n = 0; n < nblocks; ++n) {
        int n0 = n * BN;
        bool interior = band.block_is_interior(wrow_lo, wrow_hi, n0, BN);
        bool masked = n >= nb && n < ne && !interior;  // the kernel masks these blocks
        bool one = band.right_bound_only(wrow_lo + 63, n0);
        // The per-tile thresholds agree with the per-block tests.
        if (one != (n0 >= band.right_bound_only_from(wrow_lo + 63))) ++bad;
        int ilo, ihi;
        band.interior_key_range(wrow_lo, wrow_hi, BN, ilo, ihi);
        if (interior != (n0 >= ilo && n0 <= ihi)) ++bad;
        // Does the claim hold? Neither the left bound nor seqlen_k masks a key that the right
        // bound lets through, for any of the 64 rows.
        bool claim_ok = true;
        for (int i = wrow_lo; i < wrow_lo + 64; ++i)
          for (int j = n0; j < n0 + BN; ++j)
            if ((long long)j <= (long long)i + band.offset() + right && !visible(i, j, band))
              claim_ok = false;
        if (one && !claim_ok) ++bad;
        if (causal && masked && wrow_lo + 63 < sq) {
          ++causal_blocks;
          causal_taken += one;
          if (!one) ++bad;  // causal blocks with only real rows must take the one-compare path
        }
        if (!one) continue;
        ++taken;
        for (int t = 0; t < 128; ++t) {
          auto thr = mma.get_thread_slice(t);
          Tensor cS = fa3::rowcol_view(thr.partition_C(make_identity_tensor(Shape<_64, Int<BN>>{})));
          Tensor S = make_tensor<float>(shape(cS));
          fill(S, 1.f);
          band.apply_right(S, cS, wrow_lo, n0);
          for (int r = 0; r < size<0>(S); ++r)
            for (int c = 0; c < size<1>(S); ++c) {
              int i = wrow_lo + get<0>(cS(r, c)), j = n0 + get<1>(cS(r, c));
              bool m = S(r, c) == -INFINITY;
              if (m == visible(i, j, band)) {
                if (bad < 10)
                  printf("BN=%d sq=%d sk=%d band=(%d,%d) row %d key %d: masked=%d\n", BN, sq, sk,
                         left, right, i, j, int(m));
                ++bad;
              }
            }
        }
      }
    }
  }
  return bad;
}

int main() {
  srand(1);
  long long taken = 0, cb = 0, ct = 0;
  int bad = check<128>(taken, cb, ct) + check<96>(taken, cb, ct) + check<80>(taken, cb, ct);
  printf("one-compare blocks checked: %lld; causal masked blocks with real rows only: %lld, "
         "one-compare: %lld; %s (%d bad)\n", taken, cb, ct, bad ? "FAIL" : "ok", bad);
  return bad != 0;
}
