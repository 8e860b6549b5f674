// Host check (no GPU) of the direct O epilogue's index map (fwd_kernel.cuh, kDirectO): for the
// P V accumulator of every head dim, viewed as (rows, cols) per thread, columns j and j + 1
// (j even) are adjacent columns of the same row starting at an even column, the row of (r, j)
// does not depend on j, and the 128 threads cover the 64 x d tile exactly once.
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
  printf("d=%d: %s\n", D, bad ? "FAIL" : "ok");
  return bad != 0;
}

int main() {
  int f = check<64, 128>() + check<96, 128>() + check<128, 176>() + check<192, 96>() + check<256, 80>();
  return f;
}
