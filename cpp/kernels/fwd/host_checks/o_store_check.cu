// Host check (no GPU) of the direct O epilogue's index map (fwd_kernel.cuh, kDirectO): for the
// P V accumulator of every head dim, viewed as (rows, cols) per thread, columns j and j + 1
// (j even) are adjacent columns of the same row starting at an even column, the row of (r, j)
// does not depend on j, and the 128 threads cover the 64 x d tile exactly once; the same for
// the 8-byte stores of FA3_FWD_O_STORE_8B.
// Build: nvcc -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//   -I cpp/include -I cpp/kernels -I <cutlass include> o_store_check.cu -o /tmp/o_check && /tmp/o_check
#include <cstdio>
#include <vector>
#include <cutlass/numeric_types.h>
#include "fwd/fwd_kernel.cuh"
using namespace cute;

template <int D, int BN>
int check() {
  using Tr = fa3::FwdTraits<cutlass::bfloat16_t, D, 128, BN, 2, true>;
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
  // FA3_FWD_O_STORE_8B: thread t (b = t & 1) stores, per row r and j = 0, 4, 8, ..., the 4
  // elements at column col(r, 0) + 4 j + 6 b: its own pairs j / 2 (b = 0) or j / 2 + 1 (b = 1)
  // and the partner's (t ^ 1) other one. Check those are the columns the two pairs hold, and
  // that the stores cover the tile once.
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
  printf("d=%d: %s\n", D, bad ? "FAIL" : "ok");
  return bad != 0;
}

int main() {
  int f = check<64, 128>() + check<96, 128>() + check<128, 176>() + check<192, 96>() + check<256, 80>();
  return f;
}
