// The forward epilogue: the stores of one consumer warpgroup's 64 query rows. O (already
// divided by the row sums) is converted to the output element type (the input's; bf16 for FP8) and stored straight from the
// accumulator registers to global memory (no shared-memory staging, so the Q slabs are free from
// the tile's last Q K^T on); the LSE in fp32. Rows past seqlen_q and columns past out's head dim
// (head_dim_v, a multiple of 8 up to kHeadDim) are not stored.
#pragma once

#include "common/scheduler.cuh"
#include "common/utils.cuh"

namespace fa3 {

// lse: the LSE of this thread's rows; O: the (rows, cols) view of the warpgroup's fp32
// accumulator; cS: the identity tensor of the S accumulator viewed the same way (for the LSE
// rows); thr_pv: the P V MMA's thread slice; tid: the thread in the warpgroup; wrow_lo: the
// warpgroup's first query row.
template <class T, int kRows, class TO, class TC, class ThrMma>
CUTE_DEVICE void fwd_epilogue(typename T::Params const& p, TileCoord const& c, int wrow_lo, int tid,
                              float const (&lse)[kRows], TO& O, TC const& cS, ThrMma const& thr_pv) {
  using Element = typename T::OutElement;
  if (tid % 4 == 0) {  // the quad shares its rows' LSE
    float* lse_bh = p.lse + (int64_t(c.batch) * p.heads_q + c.head) * p.seqlen_q;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      int row = wrow_lo + get<0>(cS(r, 0));
      if (row < p.seqlen_q) lse_bh[row] = lse[r];
    }
  }

  // 8-byte stores. Thread q of a quad holds column pairs 8k + 2q (k = 0, 1, ...: the
  // accumulator's column groups of 8), so pair j / 2 sits 4 j columns after pair 0. Threads q and
  // q ^ 1 swap one pair per two k: the even one (b = 0) stores its pair of k and its partner's,
  // columns 8k + 2q .. + 3; the odd one those of k + 1 at 8 (k + 1) + 2q - 2. A quad then writes
  // 2 x 16 contiguous bytes per row and instruction (full 32-byte sectors; 4-byte stores of one
  // pair each wrote each sector in two halves), with half the stores. The shuffles run on every
  // lane (rows past seqlen_q only skip the stores). A store's 4 columns start at a multiple of 4,
  // so with head_dim_v a multiple of 8 each is wholly inside or wholly past it.
  static_assert(decltype(size<1>(O))::value % 4 == 0, "8-byte O stores: column pairs come in fours");
  Tensor cO = rowcol_view(thr_pv.partition_C(make_identity_tensor(Shape<_64, typename T::D>{})));
  Element* o_bh = p.out + (int64_t(c.batch) * p.seqlen_q * p.heads_q + c.head) * p.head_dim_v;
  int64_t const row_stride = int64_t(p.heads_q) * p.head_dim_v;
  int const b = tid & 1;
  int const col0 = get<1>(cO(0, 0)) + (b ? 6 : 0);  // the first store's column; then + 4 j
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < kRows; ++r) {
    int row = wrow_lo + get<0>(cO(r, 0));
    Element* o_row = o_bh + row * row_stride + col0;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < size<1>(O); j += 4) {
      cutlass::Array<Element, 2> w0, w1;
      w0[0] = Element(O(r, j));
      w0[1] = Element(O(r, j + 1));
      w1[0] = Element(O(r, j + 2));
      w1[1] = Element(O(r, j + 3));
      uint32_t u0 = reinterpret_cast<uint32_t&>(w0), u1 = reinterpret_cast<uint32_t&>(w1);
      uint32_t got = __shfl_xor_sync(0xffffffffu, b ? u0 : u1, 1);
      uint2 v = b ? make_uint2(got, u1) : make_uint2(u0, got);
      if (row < p.seqlen_q && col0 + 4 * j < p.head_dim_v) *reinterpret_cast<uint2*>(o_row + 4 * j) = v;
    }
  }
}

}  // namespace fa3
