// Host check (no GPU) of the fused dQ conversion's counting and indexing (FA3_BWD_FUSED_DQ;
// bwd_main.cuh dq_writer_fused / dq_converter, bwd_prepost.cuh dq_contributors):
//  1. Arrival counts: for random shapes, bands (causal, windows, empty bands), GQA groups,
//     seqlen_q != seqlen_k, ragged last blocks and kBlockM 64 / 128, the number of (key block,
//     query head) steps that add into each (query head, query block), walking the CTAs as the
//     kernel does (query_block_range per key block, every head of the group), equals
//     dq_contributors; with the count-down in a random arrival order exactly one step takes the
//     counter from 1 to 0 (one conversion per block with a count), and every row < seqlen_q is
//     written exactly once: by that conversion, or by the preprocess when the count is 0.
//  2. Fragment map: for each fused tile (hd64 at 128 rows with the row-split dQ, hd96, hd128),
//     element i of MMA thread t sits at coord_t(0) + coord_0(i) (what the converter computes),
//     and (t, i) -> (row, column) covers the (kBlockM, head dim) block exactly once.
// Build: nvcc -std=c++17 --expt-relaxed-constexpr -DFA3_BWD_FUSED_DQ=1 \
//   -gencode=arch=compute_90a,code=sm_90a -I cpp/include -I cpp/kernels -I <cutlass include> \
//   fused_dq_check.cu -o /tmp/check && /tmp/check
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include <cutlass/numeric_types.h>
#include "bwd/bwd_launch.cuh"
using namespace cute;

int check_counts() {
  std::mt19937 rng(7);
  const int U = 1 << 30;
  const int wins[] = {U, 0, 1, 5, 63, 64, 65, 127, 128, 200, -1, -5, -64, -130, -300};
  long long blocks = 0, conversions = 0, zero_blocks = 0;
  int bad = 0;
  for (int it = 0; it < 3000; ++it) {
    const int BM = (it % 2) ? 128 : 64, BN = 128;
    const int sq = 1 + rng() % 700, sk = 1 + rng() % 700;
    const int wl = wins[rng() % 15], wr = wins[rng() % 15];
    const int group = 1 + rng() % 3, heads_kv = 1 + rng() % 2, hq = group * heads_kv;
    fa3::BandMask band{sq, sk, wl, wr};
    const int mblocks = (sq + BM - 1) / BM, nblocks = (sk + BN - 1) / BN;
    // Steps of the main kernel: CTA (n, hk) walks heads hk * group .. + group, blocks [mb, me).
    std::vector<int> adds(hq * mblocks, 0);
    std::vector<std::pair<int, int>> arrivals;  // (block index, CTA) per step
    for (int hk = 0; hk < heads_kv; ++hk)
      for (int n = 0; n < nblocks; ++n) {
        int mb, me;
        fa3::bwd::query_block_range(band, n, BN, BM, mb, me);
        for (int h = hk * group; h < hk * group + group; ++h)
          for (int m = mb; m < me; ++m) {
            ++adds[h * mblocks + m];
            arrivals.push_back({h * mblocks + m, n});
          }
      }
    std::vector<int> counter(hq * mblocks), converted(hq * mblocks, 0);
    for (int h = 0; h < hq; ++h)
      for (int m = 0; m < mblocks; ++m) {
        const int c = fa3::bwd::dq_contributors(sq, sk, wl, wr, m, BM, BN);
        counter[h * mblocks + m] = c;
        if (c != adds[h * mblocks + m]) {
          if (bad < 10) printf("count: sq %d sk %d wl %d wr %d BM %d m %d: contributors %d, steps %d\n", sq, sk, wl, wr, BM, m, c, adds[h * mblocks + m]);
          ++bad;
        }
      }
    std::shuffle(arrivals.begin(), arrivals.end(), rng);  // any completion order
    for (auto [blk, n] : arrivals) {
      const int old = counter[blk]--;
      if (old == 1) ++converted[blk];
      if (old <= 0) ++bad;  // a count-down past zero: an uncounted adder
    }
    std::vector<int> row_writes(hq * sq, 0);
    for (int h = 0; h < hq; ++h)
      for (int m = 0; m < mblocks; ++m) {
        const int blk = h * mblocks + m;
        const bool pre = adds[blk] == 0;  // the preprocess writes the block's rows
        if (counter[blk] != 0 || converted[blk] != (pre ? 0 : 1)) ++bad;
        const int rows = std::min(BM, sq - m * BM);  // converter and preprocess: rows < seqlen_q
        if (pre || converted[blk])
          for (int r = 0; r < rows; ++r) ++row_writes[h * sq + m * BM + r];
        ++blocks;
        conversions += converted[blk];
        zero_blocks += pre;
      }
    for (int x : row_writes)
      if (x != 1) ++bad;
  }
  printf("counts: %lld blocks (%lld converted in the main kernel, %lld zero-filled by the preprocess), %d bad\n",
         blocks, conversions, zero_blocks, bad);
  return bad;
}

template <class Tr>
int check_fragments(const char* name) {
  static_assert(Tr::kFusedDQ, "a fused tile");
  typename Tr::MmadQ mma_dq;
  constexpr int R = Tr::kBlockM, C = Tr::kHdChunk;
  std::vector<int> hits(R * C, 0);
  auto c0 = mma_dq.get_thread_slice(0).partition_C(make_identity_tensor(typename Tr::DQTileShape{}));
  int bad = 0;
  for (int t = 0; t < Tr::kNumMmaThreads; ++t) {
    auto ct = mma_dq.get_thread_slice(t).partition_C(make_identity_tensor(typename Tr::DQTileShape{}));
    for (int i = 0; i < Tr::kDQFrag; ++i) {
      const int row = get<0>(ct(i)), col = get<1>(ct(i));
      if (row != get<0>(ct(0)) + get<0>(c0(i)) || col != get<1>(ct(0)) + get<1>(c0(i))) ++bad;
      if (row < 0 || row >= R || col < 0 || col >= C) { ++bad; continue; }
      ++hits[row * C + col];
      // The converter's float4 j = i / 4 of thread t sits at (t / 128) * kDQWgFloats + j * 128 + t % 128
      // (the writer's layout): its pieces are the warpgroups' tiles.
    }
  }
  for (int x : hits)
    if (x != 1) ++bad;
  printf("fragments %s (%d x %d, %d per thread): %d bad\n", name, R, C, Tr::kDQFrag, bad);
  return bad;
}

int main() {
  int bad = check_counts();
  bad += check_fragments<fa3::bwd::BwdTraitsFused<cutlass::bfloat16_t, 64, false>>("hd64");
  bad += check_fragments<fa3::bwd::BwdTraitsFused<cutlass::bfloat16_t, 96, false>>("hd96");
  bad += check_fragments<fa3::bwd::BwdTraitsFused<cutlass::bfloat16_t, 128, false>>("hd128");
  bad += check_fragments<fa3::bwd::BwdTraitsFused<cutlass::half_t, 128, true>>("hd128 fp16 softcap");
  printf("%s\n", bad ? "FAILED" : "all pass");
  return bad != 0;
}
