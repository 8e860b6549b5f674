// Unit test (host only, no GPU) of the backward main kernel's register and shared-memory index
// maps (bwd_traits.cuh, bwd_main.cuh), per tile of the table and the 80-row hd128 tile:
//  - the S^T accumulator re-viewed as the RS-WGMMA A operand of dV/dK (acc_as_operand_a) holds
//    the same (key, query) elements;
//  - the shuffled-statistics column map (and its segment-lane source) holds;
//  - dQ and dK/dV fragments pair adjacent columns (vector stores); dQ fragments tile the chunk
//    exactly once and the accumulator order is a bijection (the writer's bulk reduce and
//    bwd_postprocess read it so);
//  - transposed smem views are true transposes; the sub-step views (kBlockMSdP columns of a
//    kBlockM step: hd64 at 128 rows) address the step's tiles.
// Run by tests/test_kernel_units.py; exits non-zero on any failure.
#include "bwd/bwd_traits.cuh"  // first: common/utils.cuh precedes every CuTe header

#include <cstdio>
#include <cutlass/numeric_types.h>
using namespace cute;
template <class Tr>
int check() {
  constexpr int HD = Tr::kHeadDim;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN;
  constexpr int SM = Tr::kBlockMSdP;  // S^T/dP^T accumulator columns (one sub-step)
  typename Tr::MmaSdP mma_sdp;
  typename Tr::MmadKV mma_dkv;
  int bad = 0;
  for (int ct = 0; ct < 256; ++ct) {
    auto thr_sdp = mma_sdp.get_thread_slice(ct);
    auto thr_dkv = mma_dkv.get_thread_slice(ct);
    Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<BN>, Int<SM>>{}));  // (key, query)
    Tensor cA = thr_dkv.partition_A(make_identity_tensor(Shape<Int<BN>, Int<SM>>{}));  // (key, query as K)
    auto frag = make_tensor<float>(partition_fragment_C(mma_sdp, Shape<Int<BN>, Int<SM>>{}).layout());
    auto alay = fa3::acc_as_operand_a(frag.layout());
    if (size(cA) != size(cS)) { printf("size mismatch\n"); return 1; }
    // A-fragment logical index i lives in register alay(i) of the accumulator; its coordinate as
    // an accumulator element is cS at the register whose storage offset is alay(i).
    for (int i = 0; i < size(cA); ++i) {
      int off = alay(i);
      // find accumulator logical index with storage offset off
      int j = -1;
      for (int jj = 0; jj < size(cS); ++jj) if (frag.layout()(jj) == off) j = jj;
      auto a = cA(i); auto c = cS(j);
      if (get<0>(a) != get<0>(c) || get<1>(a) != get<1>(c)) {
        if (bad < 5) printf("hd %d ct %d i %d: A (%d,%d) vs C (%d,%d)\n", HD, ct, i, (int)get<0>(a), (int)get<1>(a), (int)get<0>(c), (int)get<1>(c));
        ++bad;
      }
    }
    // Shuffled statistics (bwd_main.cuh, the stat lambda): element i of the S^T accumulator is query column
    // 8 (i / 4) + 2 (lane % 4) + i % 2, which lane (column % 64) / 2 holds in float2 column / 64.
    // A partial last group of 64 columns (80 rows) is read from smem, not shuffled: the kernel's
    // test i / 32 < SM / 64 must select exactly the columns below 64 * (SM / 64).
    // kShflSegLane: shfl with segment mask 3 reads lane (lane & 3) | (base & ~3) (PTX ISA
    // pseudocode), base = 4 (j % 8): the same source lane.
    for (int i = 0; i < size(cS); ++i) {
      int col = get<1>(cS(i));
      int want = 8 * (i / 4) + 2 * (ct % 4) + i % 2;
      int src_lane = 4 * ((i / 4) % 8) + ct % 4, h = (i / 4) / 8;
      int seg_lane = ((ct % 32) & 3) | ((4 * ((i / 4) % 8)) & ~3);
      if (col != want || (i / 32 < SM / 64) != (col < 64 * (SM / 64))) ++bad;
      if (i / 32 < SM / 64 && (col != h * 64 + 2 * src_lane + i % 2 || seg_lane != src_lane)) ++bad;
    }
    // dQ fragment and dK/dV coordinates sanity: pairs (2k, 2k+1) adjacent columns (swapped dQ:
    // adjacent queries of one column; warpgroup w holds the columns [64w, 64w + 64)).
    typename Tr::MmadQ mma_dq;
    Tensor cQ = mma_dq.get_thread_slice(ct).partition_C(make_identity_tensor(typename Tr::DQTileShape{}));
    if (size(cQ) != Tr::kDQFrag) ++bad;
    for (int i = 0; i < size(cQ); i += 2)
      if (get<0>(cQ(i)) != get<0>(cQ(i + 1)) || get<1>(cQ(i)) + 1 != get<1>(cQ(i + 1)) || get<1>(cQ(i)) % 2) ++bad;
    if (Tr::kDQSwapAB)
      for (int i = 0; i < size(cQ); ++i)
        if (get<0>(cQ(i)) / (Tr::kHdChunk / 2) != ct / 128) ++bad;
    Tensor cKV = thr_dkv.partition_C(make_identity_tensor(Shape<Int<BN>, Int<Tr::kHdPass>>{}));
    for (int i = 0; i < size(cKV); i += 2)
      if (get<0>(cKV(i)) != get<0>(cKV(i + 1)) || get<1>(cKV(i)) + 1 != get<1>(cKV(i + 1))) ++bad;
  }
  // dQ fragments of all threads cover the (BM, kHdChunk) tile exactly once, and the accumulator
  // order (float4 j of thread t of warpgroup w at w * kDQWgFloats + 128 j + t; value e at + e)
  // is a bijection onto [0, BM * kHdChunk) (what the writer's bulk reduce and the postprocess use).
  {
    typename Tr::MmadQ mma_dq;
    static int seen[128 * 256], slot[128 * 256];
    for (int x = 0; x < BM * Tr::kHdChunk; ++x) seen[x] = slot[x] = 0;
    for (int ct = 0; ct < 256; ++ct) {
      Tensor cQ = mma_dq.get_thread_slice(ct).partition_C(make_identity_tensor(typename Tr::DQTileShape{}));
      for (int i = 0; i < size(cQ); ++i) {
        int q = Tr::kDQSwapAB ? get<1>(cQ(i)) : get<0>(cQ(i)), c = Tr::kDQSwapAB ? get<0>(cQ(i)) : get<1>(cQ(i));
        if (q >= BM || c >= Tr::kHdChunk) { ++bad; continue; }
        seen[q * Tr::kHdChunk + c]++;
        int pos = (ct / 128) * Tr::kDQWgFloats + (i / 4) * 512 + (ct % 128) * 4 + i % 4;
        if (pos < BM * Tr::kHdChunk) slot[pos]++; else ++bad;
      }
    }
    for (int x = 0; x < BM * Tr::kHdChunk; ++x) if (seen[x] != 1 || slot[x] != 1) ++bad;
  }
  // Transposed smem views: sdSt(n, m) == sdS(m, n); sQt(d, m) == sQ(m, d); sKt(d, n) == sK(n, d).
  {
    auto dS = typename Tr::SmemLayoutdS{}; auto dSt = typename Tr::SmemLayoutdSt{};
    for (int s = 0; s < Tr::kStagesdS; ++s) for (int m = 0; m < BM; ++m) for (int n = 0; n < BN; ++n)
      if (dS(m, n, s) != dSt(n, m, s)) ++bad;
    auto Q = typename Tr::SmemLayoutQ{}; auto Qt = typename Tr::SmemLayoutQt{};
    for (int s = 0; s < Tr::kStages; ++s) for (int m = 0; m < BM; ++m) for (int d = 0; d < HD; ++d)
      if (Q(m, d, s) != Qt(d, m, s)) ++bad;
    auto K = typename Tr::SmemLayoutK{}; auto Kt = typename Tr::SmemLayoutKt{};
    for (int n = 0; n < BN; ++n) for (int d = 0; d < HD; ++d) if (K(n, d) != Kt(d, n)) ++bad;
    // Sub-step views (bwd_main.cuh): Q/dO rows as the S^T/dP^T B operand (flat_divide: (SM, HD,
    // sub, 1, stage)); dS^T destination (flat_divide: (BN, SM, 1, sub, stage)).
    auto Qs = flat_divide(Q, Shape<Int<SM>, Int<HD>>{});
    auto dSts = flat_divide(dSt, Shape<Int<BN>, Int<SM>>{});
    for (int sub = 0; sub < BM / SM; ++sub) {
      for (int s = 0; s < Tr::kStages; ++s) for (int r = 0; r < SM; ++r) for (int d = 0; d < HD; ++d)
        if (Qs(r, d, sub, 0, s) != Q(sub * SM + r, d, s)) ++bad;
      for (int s = 0; s < Tr::kStagesdS; ++s) for (int n = 0; n < BN; ++n) for (int q = 0; q < SM; ++q)
        if (dSts(n, q, 0, sub, s) != dSt(n, sub * SM + q, s)) ++bad;
    }
  }
  printf("hd %d, %d rows%s: %d bad\n", HD, BM, Tr::kDQSwapAB ? " (swapped dQ)" : "", bad);
  return bad;
}
template <int HD> using T = fa3::bwd::BwdTraits<cutlass::bfloat16_t, HD, false>;
int main() {
  const int bad = check<T<64>>() + check<T<96>>() + check<T<128>>() + check<T<192>>() +
                  check<fa3::bwd::BwdTraitsHd128Full<cutlass::bfloat16_t, false>>() +
                  check<fa3::bwd::BwdTraitsHd128Full<cutlass::half_t, false>>();
  printf("bwd_layouts: %s (%d bad)\n", bad ? "FAIL" : "all pass", bad);
  return bad != 0;
}
