// Unit test (host only, no GPU) of the backward's dK/dV epilogue through shared memory and TMA
// (bwd_epilogue.cuh: DKVStore and store_dkv_tma), per one-pass tile:
//  - the one-warpgroup stmatrix tiling reads thread t's accumulator registers in an order that puts
//    every register at its own (key, column) of the two-warpgroup MmadKV C tile, minus 64 w rows;
//  - each warp writes only its 16 rows, each stmatrix row is 8 columns = 16 contiguous bytes in both
//    staging layouts, and a warpgroup's writes cover its (64, head dim) tile once;
//  - the staging layouts: dK inside one Q stage (a bijection onto [0, 64 hd)); dV = V's rows
//    [64 w, 64 w + 64) exactly (V(64 w + r, c) == w kVHalf + dV(r, c)), the two halves disjoint;
//    the 16-row views at k kWarpOffset are rows [16 k, 16 k + 16) of the warpgroup tiles;
//  - the TMA store atoms: a box of kAtomCols x 16 elements, head dim / kAtomCols boxes per tensor,
//    each box starting on a swizzle period (one 8-row atom) in shared memory;
//  - which tiles take it: every one-pass tile (kTmaDKV), not hd192 (column passes: register stores).
// Run by tests/test_kernel_units.py; exits non-zero on any failure.
#include "bwd/bwd_epilogue.cuh"  // first: it includes common/utils.cuh before any CuTe header

#include <cstdio>
#include <vector>
#include <cutlass/numeric_types.h>
using namespace cute;
using fa3::bwd::DKVStore;

template <class Tr>
int check(const char* name) {
  using St = DKVStore<Tr>;
  static_assert(St::kEnabled, "the tile stores dK/dV through shared memory and TMA");
  using Element = typename Tr::Element;
  constexpr int HD = Tr::kHeadDim, BN = Tr::kBlockN;
  typename Tr::MmadKV mma2;
  typename St::MmaWg mma1;
  auto stsm = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma1);
  typename St::SmemLayoutdK lk;
  typename St::SmemLayoutdV lv;
  typename St::SmemLayoutdK16 lk16;
  typename St::SmemLayoutdV16 lv16;
  typename Tr::SmemLayoutV lV;
  int bad = 0;
  auto fail = [&](const char* what, int a, int b2, int c) {
    if (bad < 8) printf("  %s: %s (%d, %d, %d)\n", name, what, a, b2, c);
    ++bad;
  };
  // 1. stmatrix tiling vs the accumulator. stmatrix.x4 (PTX ISA): register j of lane l holds row
  // l / 4, columns 2 (l % 4) + {0, 1} of matrix j, whose row r is stored at the address lane 8 j + r
  // supplies. So element 2 j + e of lane l's source lands at element 2 (l % 4) + e of the
  // destination row of lane 8 j + l / 4 (same atom invocation). Emulated per warp here.
  for (int w = 0; w < 2; ++w) {
    std::vector<int> seen(64 * HD, 0);
    for (int warp = 0; warp < 4; ++warp) {
      using SrcT = decltype(stsm.get_thread_slice(0).retile_S(
          mma2.get_thread_slice(0).partition_C(make_identity_tensor(Shape<Int<BN>, Int<HD>>{}))));
      using DstT = decltype(stsm.get_thread_slice(0).partition_D(make_identity_tensor(Shape<_64, Int<HD>>{})));
      std::vector<SrcT> src;
      std::vector<DstT> dst;
      for (int l = 0; l < 32; ++l) {
        const int t = 32 * warp + l;
        auto thr = stsm.get_thread_slice(t);
        src.push_back(thr.retile_S(mma2.get_thread_slice(128 * w + t).partition_C(make_identity_tensor(Shape<Int<BN>, Int<HD>>{}))));
        dst.push_back(thr.partition_D(make_identity_tensor(Shape<_64, Int<HD>>{})));
      }
      // Flat value 8 k + v of a thread is value v of its k-th stmatrix.x4 call (the CPY mode is
      // (8, calls) for these tilings; the 8-consecutive-columns test below would catch another order).
      if (size(src[0]) != size(dst[0])) { fail("size", int(size(src[0])), int(size(dst[0])), warp); continue; }
      const int calls = int(size(dst[0])) / 8;
      for (int l = 0; l < 32; ++l) {
        for (int k = 0; k < calls; ++k) {
          // destination row of lane l in call k: 8 consecutive columns, 16 contiguous bytes, in the warp's rows
          int r = get<0>(dst[l](8 * k)), c = get<1>(dst[l](8 * k));
          if (r / 16 != warp) fail("row outside the warp's 16", warp, l, r);
          if (c % 8) fail("row not 16-byte aligned", warp, l, c);
          for (int e = 1; e < 8; ++e) {
            if (get<0>(dst[l](8 * k + e)) != r || get<1>(dst[l](8 * k + e)) != c + e) fail("row not 8 columns", warp, l, e);
            if (lk(r, c + e) != lk(r, c) + e || lv(r, c + e) != lv(r, c) + e) fail("row not contiguous", warp, l, e);
          }
          for (int v = 0; v < 8; ++v) {
            const int j = v / 2, e = v % 2;
            auto to = dst[8 * j + l / 4](8 * k + 2 * (l % 4) + e);
            auto from = src[l](8 * k + v);
            if (get<0>(from) != get<0>(to) + 64 * w || get<1>(from) != get<1>(to)) fail("register lands elsewhere", warp, l, v);
            seen[get<0>(to) * HD + get<1>(to)]++;
          }
        }
      }
    }
    for (int x = 0; x < 64 * HD; ++x) if (seen[x] != 1) fail("coverage", w, x, seen[x]);
  }
  // 2. staging layouts.
  {
    std::vector<int> hitk(St::kStageElems, 0), hitv(BN * HD, 0);
    for (int r = 0; r < 64; ++r)
      for (int c = 0; c < HD; ++c) {
        int ok = lk(r, c);
        if (ok < 0 || ok >= 64 * HD) { fail("dK outside 64 hd", r, c, ok); continue; }
        hitk[ok]++;
        if (lk(r, c) != (r / 16) * St::kWarpOffset + lk16(r % 16, c)) fail("dK 16-row view", r, c, ok);
        for (int w = 0; w < 2; ++w) {
          int ov = w * St::kVHalf + lv(r, c);
          if (ov != lV(64 * w + r, c)) fail("dV != V rows", w, r, c);
          if (lv(r, c) != (r / 16) * St::kWarpOffset + lv16(r % 16, c)) fail("dV 16-row view", r, c, w);
          if (ov >= 0 && ov < BN * HD) hitv[ov]++;
        }
      }
    for (int x = 0; x < 64 * HD; ++x) if (hitk[x] != 1) fail("dK not a bijection", x, hitk[x], 0);
    for (int x = 0; x < BN * HD; ++x) if (hitv[x] != 1) fail("dV halves overlap or miss", x, hitv[x], 0);
    if (int(cosize(lk)) > St::kStageElems) fail("dK larger than a stage", int(cosize(lk)), St::kStageElems, 0);
  }
  // 3. TMA boxes: elements per instruction and box starts (coordinate (0, j kAtomCols) of the 16-row views).
  // (a TiledCopy is its Copy_Atom: NumValSrc = elements per TMA instruction)
  constexpr int box_k = St::TmaDK::NumValSrc, box_v = St::TmaDV::NumValSrc;
  constexpr int n_k = decltype(size(typename St::TmaDK::TiledLayout_TV{}))::value / box_k;
  constexpr int n_v = decltype(size(typename St::TmaDV::TiledLayout_TV{}))::value / box_v;
  if (n_k != HD / St::kAtomCols || n_v != HD / St::kAtomCols) fail("TMA instructions per tensor", n_k, n_v, HD / St::kAtomCols);
  if (box_k != 16 * St::kAtomCols || box_v != 16 * St::kAtomCols) fail("TMA box elements", box_k, box_v, St::kAtomCols);
  auto inv_k = right_inverse(get_nonswizzle_portion(lk16));
  auto inv_v = right_inverse(get_nonswizzle_portion(lv16));
  if (int(size(inv_k)) != box_k || int(size(inv_v)) != box_v) fail("contiguous smem run != box", int(size(inv_k)), int(size(inv_v)), box_k);
  const int period = 8 * St::kAtomCols;
  for (int j = 0; j < HD / St::kAtomCols; ++j) {
    if (lk16(0, j * St::kAtomCols) % period || lv16(0, j * St::kAtomCols) % period) fail("box start off period", j, 0, 0);
  }
  printf("%s: atom %d cols, %d boxes of %d x 16 per tensor, dV half %d el, warp %d el: %d bad\n", name,
         St::kAtomCols, HD / St::kAtomCols, St::kAtomCols, St::kVHalf, St::kWarpOffset, bad);
  return bad;
}

int main() {
  using namespace fa3::bwd;
  using bf16 = cutlass::bfloat16_t;
  using fp16 = cutlass::half_t;
  int bad = check<BwdTraits<bf16, 64, false>>("hd64 bf16") + check<BwdTraits<bf16, 96, false>>("hd96 bf16") +
            check<BwdTraits<bf16, 128, false>>("hd128 bf16") + check<BwdTraits<fp16, 128, true>>("hd128 fp16 softcap") +
            check<BwdTraitsHd128Full<bf16, false>>("hd128 80-row bf16");
  static_assert(!DKVStore<BwdTraits<bf16, 192, false>>::kEnabled, "hd192 (column passes) keeps the register stores");
  printf("bwd_dkv_store: %s (%d bad)\n", bad ? "FAIL" : "all pass", bad);
  return bad != 0;
}
