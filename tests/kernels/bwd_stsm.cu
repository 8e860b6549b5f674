// Unit test (host only, no GPU) of the stmatrix tiled copy that writes dS^T in the backward main
// kernel (bwd_main.cuh, SM90_U32x4_STSM_N over MmaSdP): it covers the (keys, queries) tile exactly
// once in runs of 8 contiguous queries (what stmatrix rows need in the MN-major dS), each run 16
// contiguous bytes of SmemLayoutdSt; with sub-steps (hd64 at 128 rows) the sub-step destinations
// (flat_divide view, as in bwd_main.cuh) tile the step's whole (keys, kBlockM) tile exactly once.
// Run by tests/test_kernel_units.py; exits non-zero on any failure.
#include "bwd/bwd_traits.cuh"  // first: common/utils.cuh precedes every CuTe header

#include <cstdio>
#include <cutlass/numeric_types.h>
using namespace cute;
template <class Tr>
int check() {
  constexpr int HD = Tr::kHeadDim;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, SM = Tr::kBlockMSdP;
  typename Tr::MmaSdP mma_sdp;
  auto ds_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, cutlass::bfloat16_t>{}, mma_sdp);
  int bad = 0;
  static int seen[128 * 128];
  for (int x = 0; x < BN * BM; ++x) seen[x] = 0;
  for (int ct = 0; ct < 256; ++ct) {
    auto thr = ds_copy.get_thread_slice(ct);
    auto cS = mma_sdp.get_thread_slice(ct).partition_C(make_identity_tensor(Shape<Int<BN>, Int<SM>>{}));
    auto src = thr.retile_S(cS);  // the accumulator's elements in copy order
    auto dst_all = thr.partition_D(flat_divide(make_identity_tensor(Shape<Int<BN>, Int<BM>>{}),
                                               Shape<Int<BN>, Int<SM>>{}));  // (CPY, M, N, 1, sub)
    for (int sub = 0; sub < BM / SM; ++sub) {
      auto dst = dst_all(_, _, _, 0, sub);
      if (size(src) != size(dst)) { printf("size mismatch %d %d\n", int(size(src)), int(size(dst))); return 1; }
      // Each group of 8 destination values: one key row, 8 consecutive queries starting at 8k.
      // In the swizzled smem layout (SW32 for 80 rows) the run is 16 contiguous bytes.
      typename Tr::SmemLayoutdSt lay;
      for (int i = 0; i < size(dst); i += 8)
        for (int e = 1; e < 8; ++e) {
          if (get<0>(dst(i + e)) != get<0>(dst(i)) || get<1>(dst(i + e)) != get<1>(dst(i)) + e || get<1>(dst(i)) % 8) ++bad;
          if (lay(get<0>(dst(i)), get<1>(dst(i)) + e, 0) != lay(get<0>(dst(i)), get<1>(dst(i)), 0) + e) ++bad;
        }
      // Sub-step sub writes only its own SM columns (together: every element once, below).
      for (int i = 0; i < size(dst); ++i) {
        if (get<1>(dst(i)) / SM != sub) ++bad;
        seen[get<0>(dst(i)) * BM + get<1>(dst(i))]++;
      }
    }
  }
  for (int x = 0; x < BN * BM; ++x) if (seen[x] != 1) ++bad;
  printf("hd %d, %d rows stsm: %d bad\n", HD, BM, bad);
  return bad;
}
int main() {
  const int bad = check<fa3::bwd::BwdTraits<cutlass::bfloat16_t, 64, false>>() +
                  check<fa3::bwd::BwdTraits<cutlass::bfloat16_t, 96, false>>() +
                  check<fa3::bwd::BwdTraits<cutlass::bfloat16_t, 128, false>>() +
                  check<fa3::bwd::BwdTraits<cutlass::bfloat16_t, 192, false>>() +
                  check<fa3::bwd::BwdTraitsHd128Full<cutlass::bfloat16_t, false>>();
  printf("bwd_stsm: %s (%d bad)\n", bad ? "FAIL" : "all pass", bad);
  return bad != 0;
}
