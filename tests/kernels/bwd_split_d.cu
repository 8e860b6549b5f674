// Unit test (host only, no GPU) of the split-D hd256 backward's index logic (bwd_split_d.cuh,
// bwd_split_d_traits.cuh: 80 keys per CTA), for bf16 and fp16:
//  1. S/dP accumulators: the 256 consumer threads cover the (64 queries, kBlockN keys) tile
//     exactly once, warpgroup w holds keys [w, w + 1) * kBlockN / 2, and element i sits on row
//     row_lo (i/2 even) or row_hi = row_lo + 8 (the kernel loads LSE/D for these two rows only).
//  2. (The stmatrix copy of P/dS, StsmAtom = two 8x8 matrices per instruction, is not checked
//     here: its TV value mode and destination rows do not follow the four-matrix form the main
//     kernel's check in bwd_stsm.cu uses.)
//  3. dK^T/dV^T accumulators cover (256 d, kBlockN keys) exactly once; each warpgroup owns 128 rows.
//  4. Transposed smem views (Q^T, dO^T, K^T, P^T, dS^T) are true transposes of the stored tiles.
//  5. The dQ chunk tiling (C partition) covers the (64, kHdChunk) chunk exactly once in pairs of
//     adjacent columns, and the accumulator order bwd_postprocess reads (float4 j of thread t of
//     warpgroup w at w * kDQWgFloats + 128 j + t) is a bijection onto the chunk.
//  6. The epilogue's (key, d) smem offsets cover the dK/dV tiles exactly once and fit the Q (dK)
//     and K (dV) regions they overwrite; the 16-byte store loop covers every valid row once.
// Run by tests/test_kernel_units.py; exits non-zero on any failure.
#include "bwd/bwd_split_d_traits.cuh"  // first: it includes common/utils.cuh before any CuTe header

#include <cstdio>
#include <type_traits>
#include <cutlass/numeric_types.h>
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

template <class E>
int check() {
  using Tr = fa3::bwd::SplitDTraits<E, 256, false>;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, D = Tr::kHeadDim;
  typename Tr::MmaSdP mma_sdp;
  typename Tr::MmadKV mma_dkv;
  typename Tr::MmadQ mma_dq;
  int part[7] = {0, 0, 0, 0, 0, 0, 0};  // failures per check number (1, 3, 5, 6)
  static int seen_s[BM * BN], seen_kv[D * BN], seen_epi[D * BN];
  static int seen_q[BM * Tr::kHdChunk], slot_q[BM * Tr::kHdChunk];
  for (auto& x : seen_q) x = 0;
  for (auto& x : slot_q) x = 0;
  static int wg_rows[2][D];
  for (auto& x : seen_s) x = 0;
  for (auto& x : seen_kv) x = 0;
  for (auto& x : seen_epi) x = 0;
  for (auto& r : wg_rows) for (auto& x : r) x = 0;
  for (int ct = 0; ct < 256; ++ct) {
    const int wg = ct / 128;
    Tensor cS = mma_sdp.get_thread_slice(ct).partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));
    const int row_lo = get<0>(cS(0)), row_hi = get<0>(cS(2));
    if (row_hi != row_lo + 8) ++part[1];
    for (int i = 0; i < size(cS); ++i) {
      const int q = get<0>(cS(i)), k = get<1>(cS(i));
      if (q != ((i / 2) % 2 ? row_hi : row_lo)) ++part[1];
      if (k / (BN / 2) != wg) ++part[1];
      seen_s[q * BN + k]++;
    }
    // 3. dK^T / dV^T.
    Tensor cKV = mma_dkv.get_thread_slice(ct).partition_C(make_identity_tensor(Shape<Int<D>, Int<BN>>{}));
    if (size(cKV) != D * BN / 256) ++part[3];
    for (int i = 0; i < size(cKV); ++i) {
      seen_kv[get<0>(cKV(i)) * BN + get<1>(cKV(i))]++;
      wg_rows[wg][get<0>(cKV(i))] = 1;
      // 6. the kernel's epilogue offset: key * D + d, inside the smem tile it overwrites.
      const int off = get<1>(cKV(i)) * D + get<0>(cKV(i));
      if (off < 0 || off >= BN * D || off >= int(cosize_v<typename Tr::SmemLayoutK>) ||
          off >= int(cosize_v<typename Tr::SmemLayoutQ>)) ++part[6];
      else seen_epi[off]++;
    }
    // 5. dQ fragments: pairs of adjacent columns, the chunk once, the postprocess order a bijection.
    Tensor cQ = mma_dq.get_thread_slice(ct).partition_C(make_identity_tensor(typename Tr::DQTileShape{}));
    if (size(cQ) != Tr::kDQFrag) ++part[5];
    for (int i = 0; i < size(cQ); ++i) {
      const int q = get<0>(cQ(i)), c = get<1>(cQ(i));
      if (q >= BM || c >= Tr::kHdChunk) { ++part[5]; continue; }
      if (i % 2 && (q != get<0>(cQ(i - 1)) || c != get<1>(cQ(i - 1)) + 1 || c % 2 != 1)) {
        if (part[5] < 3) printf("  dQ ct %d i %d: (%d,%d) after (%d,%d)\n", ct, i, q, c, int(get<0>(cQ(i - 1))), int(get<1>(cQ(i - 1))));
        ++part[5];
      }
      seen_q[q * Tr::kHdChunk + c]++;
      const int pos = wg * Tr::kDQWgFloats + (i / 4) * 512 + (ct % 128) * 4 + i % 4;
      if (pos < BM * Tr::kHdChunk) slot_q[pos]++; else ++part[5];
    }
  }
  for (int x : seen_s) if (x != 1) ++part[1];
  for (int x : seen_kv) if (x != 1) ++part[3];
  for (int x : seen_epi) if (x != 1) ++part[6];
  for (int x : seen_q) if (x != 1) ++part[5];
  for (int x : slot_q) if (x != 1) ++part[5];
  // 6. the 16-byte store loop (c = thread + 256 j, row c / (D / 8), column 8 (c % (D / 8))) writes
  //    each (row, column) of the rows below seqlen_k exactly once, for every number of valid rows.
  for (int rows = 1; rows <= BN; ++rows) {
    static int seen_vec[BN * D];
    for (auto& x : seen_vec) x = 0;
    for (int t = 0; t < 256; ++t)
      for (int c = t; c < rows * (D / 8); c += 256)
        for (int e = 0; e < 8; ++e) seen_vec[(c / (D / 8)) * D + (c % (D / 8)) * 8 + e]++;
    for (int i = 0; i < BN * D; ++i)
      if (seen_vec[i] != (i / D < rows ? 1 : 0)) ++part[6];
  }
  for (int w = 0; w < 2; ++w) {
    int n = 0;
    for (int d = 0; d < D; ++d) n += wg_rows[w][d];
    if (n != D / 2) ++part[3];
  }
  printf("split-D %d-bit, %d keys: accumulator %d, dK^T dV^T %d, dQ order %d, epilogue %d bad\n",
         int(sizeof(E) * 8), BN, part[1], part[3], part[5], part[6]);
  int bad = part[1] + part[3] + part[5] + part[6];
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
  const int bad = check<cutlass::bfloat16_t>() + check<cutlass::half_t>();
  printf("bwd_split_d: %s (%d bad)\n", bad ? "FAIL" : "all pass", bad);
  return bad != 0;
}
