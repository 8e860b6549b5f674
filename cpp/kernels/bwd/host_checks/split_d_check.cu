// Host check (no GPU) of the split-D hd256 backward's index logic (bwd_split_d*.cuh), for the
// 64-key tile and the 80-key one (FA3_BWD_HD256_BLOCK_N=80), both checked in one run:
//  1. S/dP accumulators: the 256 consumer threads cover the (64 queries, kBlockN keys) tile
//     exactly once, warpgroup w holds keys [w, w + 1) * kBlockN / 2, and element i sits on row
//     row_lo (i/2 even) or row_hi = row_lo + 8 (the kernel loads LSE/D for these two rows only).
//  2. The stmatrix copy of P/dS moves every accumulator element to its own (query, key) position.
//  3. dK^T/dV^T accumulators cover (256 d, 64 keys) exactly once; each warpgroup owns 128 rows.
//  4. Transposed smem views (Q^T, dO^T, K^T, P^T, dS^T) are true transposes of the stored tiles.
//  5. The dQ chunk tiling (C partition) equals the default hd256 kernel's, so the fp32
//     accumulator layout and bwd_postprocess are the same for both variants.
//  6. (80 keys) the epilogue's (key, d) smem offsets cover the dK/dV tiles exactly once and fit
//     the Q (dK) and K (dV) regions they overwrite; the 16-byte store loop covers every valid row.
// Build: nvcc -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//   -I cpp/include -I cpp/kernels -I <cutlass include> split_d_check.cu -o /tmp/check && /tmp/check
#include <cstdio>
#include <cutlass/numeric_types.h>
#include "bwd/bwd_split_d.cuh"
using namespace cute;

template <class L1, class L2>
int same_transpose(L1 const& l, L2 const& lt, int rows, int cols, int stages, const char* name) {
  int bad = 0;
  for (int s = 0; s < stages; ++s)
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c)
        if (l(r, c, s) != lt(c, r, s)) ++bad;
  printf("transpose %s: %d bad\n", name, bad);
  return bad;
}

template <class E, int kN>
int check() {
  using Tr = fa3::bwd::SplitDTraits<E, 256, false, kN>;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, D = Tr::kHeadDim;
  typename Tr::MmaSdP mma_sdp;
  typename Tr::MmadKV mma_dkv;
  typename Tr::MmadQ mma_dq;
  typename fa3::bwd::BwdTraits<E, 256, false>::MmadQ mma_dq_main;
  auto pds_copy = make_tiled_copy_C(Copy_Atom<typename Tr::StsmAtom, E>{}, mma_sdp);
  int bad = 0;
  static int seen_s[BM * BN], seen_d[BM * BN], seen_kv[D * BN], seen_epi[D * BN];
  static int wg_rows[2][D];
  for (auto& x : seen_s) x = 0;
  for (auto& x : seen_d) x = 0;
  for (auto& x : seen_kv) x = 0;
  for (auto& x : seen_epi) x = 0;
  for (auto& r : wg_rows) for (auto& x : r) x = 0;
  for (int ct = 0; ct < 256; ++ct) {
    const int wg = ct / 128;
    Tensor cS = mma_sdp.get_thread_slice(ct).partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));
    const int row_lo = get<0>(cS(0)), row_hi = get<0>(cS(2));
    if (row_hi != row_lo + 8) ++bad;
    for (int i = 0; i < size(cS); ++i) {
      const int q = get<0>(cS(i)), k = get<1>(cS(i));
      if (q != ((i / 2) % 2 ? row_hi : row_lo)) ++bad;
      if (k / (BN / 2) != wg) ++bad;
      seen_s[q * BN + k]++;
    }
    // 2. stmatrix is warp-collective: the value (thread t, j) of the copy's source TV layout is
    //    stored at tile coordinate layoutS_TV(t, j). Source element j of the retiled accumulator
    //    must hold exactly that coordinate; the destination rows (8 contiguous keys each) must
    //    cover the tile once (counted below).
    auto thr = pds_copy.get_thread_slice(ct);
    auto src = thr.retile_S(cS);
    auto dst = thr.partition_D(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));
    //    Only for the four-matrix atom (64 keys): for the two-matrix one (80 keys) the TV value
    //    mode and the destination rows are laid out differently, and this form of the check does
    //    not apply (not checked here; FA3 uses the same atom, tiling and unswizzled layout).
    if constexpr (std::is_same_v<typename Tr::StsmAtom, SM90_U32x4_STSM_N>) {
      auto tv = pds_copy.get_layoutS_TV();
      if (size(src) != size(dst) || size(src) != size<1>(tv)) ++bad;
      for (int j = 0; j < size(src); ++j) {
        const int idx = tv(ct, j);
        if (get<0>(src(j)) != idx % BM || get<1>(src(j)) != idx / BM) ++bad;
      }
      for (int j = 0; j < size(dst); j += 8)
        for (int e = 0; e < 8; ++e) {
          if (get<0>(dst(j + e)) != get<0>(dst(j)) || get<1>(dst(j + e)) != get<1>(dst(j)) + e) ++bad;
          seen_d[get<0>(dst(j + e)) * BN + get<1>(dst(j + e))]++;
        }
    } else {
      for (auto& x : seen_d) x = 1;  // not checked (see above)
    }
    // 3. dK^T / dV^T.
    Tensor cKV = mma_dkv.get_thread_slice(ct).partition_C(make_identity_tensor(Shape<Int<D>, Int<BN>>{}));
    if (size(cKV) != D * BN / 256) ++bad;
    for (int i = 0; i < size(cKV); ++i) {
      seen_kv[get<0>(cKV(i)) * BN + get<1>(cKV(i))]++;
      wg_rows[wg][get<0>(cKV(i))] = 1;
      // 6. the kernel's epilogue offset: key * D + d, inside the smem tile it overwrites.
      const int off = get<1>(cKV(i)) * D + get<0>(cKV(i));
      if (off < 0 || off >= BN * D || off >= int(cosize_v<typename Tr::SmemLayoutK>) ||
          off >= int(cosize_v<typename Tr::SmemLayoutQ>)) ++bad;
      else seen_epi[off]++;
    }
    // 5. dQ fragment order.
    Tensor cQ = mma_dq.get_thread_slice(ct).partition_C(make_identity_tensor(Shape<Int<BM>, Int<Tr::kHdChunk>>{}));
    Tensor cQm = mma_dq_main.get_thread_slice(ct).partition_C(make_identity_tensor(Shape<Int<BM>, Int<Tr::kHdChunk>>{}));
    if (size(cQ) != Tr::kDQFrag || size(cQ) != size(cQm)) ++bad;
    for (int i = 0; i < size(cQ); ++i)
      if (get<0>(cQ(i)) != get<0>(cQm(i)) || get<1>(cQ(i)) != get<1>(cQm(i))) ++bad;
  }
  for (int x : seen_s) if (x != 1) ++bad;
  for (int x : seen_d) if (x != 1) ++bad;
  for (int x : seen_kv) if (x != 1) ++bad;
  for (int x : seen_epi) if (x != 1) ++bad;
  // 6. the 16-byte store loop (c = thread + 256 j, row c / (D / 8), column 8 (c % (D / 8))) writes
  //    each (row, column) of the rows below seqlen_k exactly once, for every number of valid rows.
  for (int rows = 1; rows <= BN; ++rows) {
    static int seen_vec[BN * D];
    for (auto& x : seen_vec) x = 0;
    for (int t = 0; t < 256; ++t)
      for (int c = t; c < rows * (D / 8); c += 256)
        for (int e = 0; e < 8; ++e) seen_vec[(c / (D / 8)) * D + (c % (D / 8)) * 8 + e]++;
    for (int i = 0; i < BN * D; ++i)
      if (seen_vec[i] != (i / D < rows ? 1 : 0)) ++bad;
  }  for (int w = 0; w < 2; ++w) {
    int n = 0;
    for (int d = 0; d < D; ++d) n += wg_rows[w][d];
    if (n != D / 2) ++bad;
  }
  printf("split-D %d-bit, %d keys: accumulator / stmatrix / dK^T dV^T / dQ order / epilogue: %d bad\n",
         int(sizeof(E) * 8), BN, bad);
  bad += same_transpose(typename Tr::SmemLayoutQ{}, typename Tr::SmemLayoutQt{}, BM, D, Tr::kStages, "Q");
  bad += same_transpose(typename Tr::SmemLayoutdO{}, typename Tr::SmemLayoutdOt{}, BM, D, Tr::kStagesdO, "dO");
  bad += same_transpose(typename Tr::SmemLayoutPdS{}, typename Tr::SmemLayoutPdSt{}, BM, BN, Tr::kStagesPdS, "P/dS");
  {
    typename Tr::SmemLayoutK k;
    typename Tr::SmemLayoutKt kt;
    int bk = 0;
    for (int r = 0; r < BN; ++r)
      for (int c = 0; c < D; ++c)
        if (k(r, c) != kt(c, r)) ++bk;
    printf("transpose K: %d bad\n", bk);
    bad += bk;
  }
  printf("smem %d of 232448 B\n", Tr::kSmemBytes);
  return bad;
}
int main() {
  const int bad = check<cutlass::bfloat16_t, 64>() + check<cutlass::half_t, 64>() +
                  check<cutlass::bfloat16_t, 80>() + check<cutlass::half_t, 80>();
  printf("%s\n", bad ? "FAIL" : "all pass");
  return bad != 0;
}
