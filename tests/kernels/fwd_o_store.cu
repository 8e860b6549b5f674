// Unit test (host, no GPU) of the forward epilogue's O store map (fwd_epilogue.cuh): for the P V
// accumulator of every forward tile, viewed as (rows, cols) per thread,
//   * columns j and j + 1 (j even) are adjacent columns of the same row starting at an even
//     column, the row of (r, j) does not depend on j, and the 128 threads of a warpgroup cover
//     the 64 x d tile exactly once (what the epilogue's addressing from cO(r, 0) relies on);
//   * the 8-byte stores: thread t (b = t & 1) stores, per row r and j = 0, 4, 8, ..., the 4
//     elements at column col(r, 0) + 4 j + 6 b, namely its own pair j / 2 and its partner's
//     (t ^ 1) pair j / 2 (b = 0), or the partner's pair j / 2 + 1 and its own (b = 1): those are
//     the columns the two pairs hold, the partner has the same row, and the stores cover the
//     tile exactly once;
//   * the clipped stores (out's head dim dv < d, a multiple of 8): the stores whose first column is
//     below dv write exactly the columns below dv, once each.
#include <cstdio>
#include <vector>
#include <cutlass/numeric_types.h>
#include "fwd/fwd_traits.cuh"
using namespace cute;

template <class Tr>
int check() {
  constexpr int D = Tr::kHeadDim;
  typename Tr::MmaPV mma;
  std::vector<int> seen(64 * D, 0);
  int bad = 0;
  for (int t = 0; t < 128; ++t) {
    auto thr = mma.get_thread_slice(t);
    Tensor cO = fa3::rowcol_view(thr.partition_C(make_identity_tensor(Shape<_64, Int<D>>{})));
    for (int r = 0; r < size<0>(cO); ++r) {
      int row = get<0>(cO(r, 0));
      for (int j = 0; j < size<1>(cO); ++j) {
        auto x = cO(r, j);
        if (get<0>(x) != row) ++bad;
        if (j % 2 == 0) {
          auto y = cO(r, j + 1);
          if (get<1>(x) % 2 != 0 || get<0>(y) != row || get<1>(y) != get<1>(x) + 1) ++bad;
        }
        seen[get<0>(x) * D + get<1>(x)]++;
      }
    }
  }
  for (int v : seen) bad += v != 1;
  std::vector<int> seen8(64 * D, 0);
  for (int t = 0; t < 128; ++t) {
    int b = t & 1;
    auto cO = fa3::rowcol_view(mma.get_thread_slice(t).partition_C(make_identity_tensor(Shape<_64, Int<D>>{})));
    auto cP = fa3::rowcol_view(mma.get_thread_slice(t ^ 1).partition_C(make_identity_tensor(Shape<_64, Int<D>>{})));
    if (size<1>(cO) % 4 != 0) { ++bad; continue; }
    for (int r = 0; r < size<0>(cO); ++r) {
      int row = get<0>(cO(r, 0));
      if (get<0>(cP(r, 0)) != row) ++bad;
      for (int j = 0; j < size<1>(cO); j += 4) {
        int col = get<1>(cO(r, 0)) + 4 * j + 6 * b;
        // lo: own pair j (b = 0) or partner's pair j + 2 (b = 1); hi: partner's pair j or own j + 2.
        int lo = b ? get<1>(cP(r, j + 2)) : get<1>(cO(r, j));
        int hi = b ? get<1>(cO(r, j + 2)) : get<1>(cP(r, j));
        if (lo != col || hi != col + 2 || col % 4 != 0) ++bad;
        for (int e = 0; e < 4; ++e) seen8[row * D + col + e]++;
      }
    }
  }
  for (int v : seen8) bad += v != 1;
  for (int dv = 8; dv <= D; dv += 8) {
    std::vector<int> seen_dv(64 * D, 0);
    for (int t = 0; t < 128; ++t) {
      auto cO = fa3::rowcol_view(mma.get_thread_slice(t).partition_C(make_identity_tensor(Shape<_64, Int<D>>{})));
      for (int r = 0; r < size<0>(cO); ++r)
        for (int j = 0; j < size<1>(cO); j += 4) {
          int col = get<1>(cO(r, 0)) + 4 * j + 6 * (t & 1);
          if (col < dv)
            for (int e = 0; e < 4; ++e) seen_dv[get<0>(cO(r, 0)) * D + col + e]++;
        }
    }
    for (int i = 0; i < 64 * D; ++i) bad += seen_dv[i] != (i % D < dv ? 1 : 0);
  }
  if (bad) printf("  d=%d BN=%d: FAIL (%d bad)\n", D, Tr::kBlockN, bad);
  return bad;
}

int main() {
  using E = cutlass::bfloat16_t;
  // The forward's tiles (fwd_launch.cuh FwdTileTable): every head dim, each key width it uses.
  int bad = check<fa3::FwdTraits<E, 64, 128, 128, 4, true, true>>() +
            check<fa3::FwdTraits<E, 96, 128, 128, 3, true, true>>() +
            check<fa3::FwdTraits<E, 128, 128, 176, 2, true, false>>() +
            check<fa3::FwdTraits<E, 128, 128, 128, 3, true, true>>() +
            check<fa3::FwdTraits<E, 192, 128, 96, 2, false, true>>() +
            check<fa3::FwdTraits<E, 256, 128, 80, 2, false, true>>() +
            check<fa3::FwdTraits<E, 256, 128, 64, 2, false, true>>();
  printf("fwd O store map: 7 tiles checked; %s (%d bad)\n", bad ? "FAIL" : "ok", bad);
  return bad != 0;
}
