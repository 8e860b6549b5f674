// Small device helpers shared by the forward and backward kernels: register-fragment views of
// WGMMA accumulators, type conversion of fragments, a WGMMA issue helper, quad reductions.
// CuTe only; no JAX, no params.
#pragma once

// Tile widths such as 80, 112, 144 or 176 need the "extended" WGMMA N shapes of CuTe's selectors.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace fa3 {

using namespace cute;

// ---------------------------------------------------------------------------------------------
// setmaxnreg budgets. A kernel launched with __launch_bounds__(threads, 1) gets 65536 / threads
// registers per thread, rounded down to 8 (384 threads: 168; 512: 128), and setmaxnreg only moves
// registers within that allocation: a producer / consumer split that asks for more (e.g. 32 / 240
// with two consumer warpgroups, 65536 > 384 x 168 = 64512) leaves the consumers'
// setmaxnreg.inc waiting forever (the FP8 hd256 128-key forward tile hung so).
constexpr bool register_split_fits(int producer_regs, int consumer_threads, int consumer_regs) {
  const int threads = 128 + consumer_threads;
  const int per_thread = 65536 / threads < 255 ? 65536 / threads : 255;
  return 128 * producer_regs + consumer_threads * consumer_regs <= threads * (per_thread / 8 * 8);
}

// ---------------------------------------------------------------------------------------------
// Accumulator views. A WGMMA fp32 accumulator fragment of one warpgroup has the layout
//   ((2, 2, N/8), MMA_M, MMA_N)
// whose value mode is (adjacent column pair, row +8, column group of 8). Each thread therefore
// owns 2*MMA_M rows, shared with the 3 other threads of its quad.

// ((2,2,N8), M, N) -> ((2, M), (2, N8, N)): rows first, columns second.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol(Layout const& l) {
  static_assert(decltype(rank(l))::value == 3);
  static_assert(decltype(rank<0>(l))::value == 3);
  auto v = get<0>(l);
  return make_layout(make_layout(get<1>(v), get<1>(l)),
                     make_layout(get<0>(v), get<2>(v), get<2>(l)));
}

template <class Tensor>
CUTE_HOST_DEVICE constexpr auto rowcol_view(Tensor&& t) {
  return make_tensor(t.data(), acc_rowcol(t.layout()));
}

// The same registers, seen as the A operand of a register-sourced (RS) WGMMA with K = 16 per
// instruction: ((2,2,N8), M, 1) -> ((2,2,2), M, N8/2). The A fragment's value mode is
// (adjacent column pair, row +8, column +8), so pairs of accumulator column groups form one
// K=16 slice: P = softmax(S) feeds O += P V without leaving registers.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_operand_a(Layout const& l) {
  static_assert(decltype(size<2>(l))::value == 1, "one MMA along N");
  auto v = get<0>(l);
  static_assert(decltype(size<2>(v))::value % 2 == 0, "N must be a multiple of 16");
  auto n8 = logical_divide(get<2>(v), _2{});  // (2, N8/2)
  return make_layout(make_layout(get<0>(v), get<1>(v), get<0>(n8)), get<1>(l), get<1>(n8));
}

// Element-wise conversion between two register fragments of the same size whose layouts map
// coordinates to the same register offsets (e.g. an accumulator and its operand-A view).
// Vectorised: the converter works on packed pairs.
template <class TIn, class TOut>
CUTE_DEVICE void convert_into(TIn const& in, TOut& out) {
  using From = typename std::remove_cv_t<std::remove_reference_t<TIn>>::value_type;
  using To = typename std::remove_cv_t<std::remove_reference_t<TOut>>::value_type;
  constexpr int N = decltype(cosize(in.layout()))::value;
  static_assert(N == decltype(cosize(out.layout()))::value, "fragment sizes differ");
  cutlass::NumericArrayConverter<To, From, N> conv;
  *reinterpret_cast<cutlass::Array<To, N>*>(out.data()) =
      conv(*reinterpret_cast<cutlass::Array<From, N> const*>(in.data()));
}

// FP8: P as the A operand of an e4m3 RS WGMMA (K = 32 per instruction) without leaving
// registers. A thread (quad lane q, rows r and r + 8) holds, per 16 accumulator columns,
// c0..c7 = (r, 2q..2q+1), (r+8, 2q..2q+1), (r, 8+2q..), (r+8, 8+2q..) (the layout above). An 8-bit
// A register holds 4 consecutive k of one row: k = 4q..4q+3 of row r, of row r + 8, then the
// same 16 k further (CuTe's ALayout_64x32 for 8-bit types). So the keys of each 16-key chunk are
// permuted: A slot 4q + e holds key 2q + e and slot 4q + 2 + e key 8 + 2q + e (e = 0, 1). Then
// the 4 values of an A register are already in the thread: (c0, c1, c4, c5) for row r and
// (c2, c3, c6, c7) for row r + 8. The V transpose (fwd_transpose.cuh) stores V's keys with the
// same permutation, so P V, a sum over keys, is unchanged.
CUTE_HOST_DEVICE constexpr int fp8_key_slot(int key) {  // key of a 16-key chunk -> its A slot
  return (key % 8) / 2 * 4 + (key / 8) * 2 + key % 2;
}

// The register layout of P as that A operand, (MMA = (4 k, 2 rows, 2 k16), MMA_M = 1, kBlockN / 32)
// compact, for an fp32 accumulator layout `l` of kBlockN columns.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_fp8_operand_a(Layout const& l) {
  constexpr int kRegs = decltype(size(l))::value;  // kBlockN / 2 per thread
  static_assert(kRegs % 16 == 0, "kBlockN must be a multiple of 32");
  return make_layout(Shape<Shape<_4, _2, _2>, _1, Int<kRegs / 16>>{});
}

// acc (fp32, kBlockN columns) -> a (e4m3, acc_as_fp8_operand_a), rounded to nearest, saturating.
template <class TIn, class TOut>
CUTE_DEVICE void convert_into_fp8_operand_a(TIn const& acc, TOut& a) {
  constexpr int kRegs = decltype(cosize(acc.layout()))::value;
  static_assert(decltype(cosize(a.layout()))::value == kRegs, "fragment sizes differ");
  float const* c = acc.data();
  uint32_t* out = reinterpret_cast<uint32_t*>(a.data());
  cutlass::NumericArrayConverter<cutlass::float_e4m3_t, float, 4> conv;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kRegs / 8; ++j) {  // 16-column chunks
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {  // rows r, r + 8
      cutlass::Array<float, 4> x;
      x[0] = c[8 * j + 2 * h];
      x[1] = c[8 * j + 2 * h + 1];
      x[2] = c[8 * j + 2 * h + 4];
      x[3] = c[8 * j + 2 * h + 5];
      cutlass::Array<cutlass::float_e4m3_t, 4> y = conv(x);
      out[2 * j + h] = reinterpret_cast<uint32_t const&>(y);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The widest swizzle atom for a K-major shared-memory tile whose contiguous (K) extent is
// kK elements: 128-byte rows when possible (fewest bank conflicts for TMA and WGMMA).
template <typename T, int kK>
CUTE_HOST_DEVICE constexpr auto smem_atom_k_major() {
  constexpr int kBytes = kK * int(sizeof(T));
  if constexpr (kBytes % 128 == 0) return GMMA::Layout_K_SW128_Atom<T>{};
  else if constexpr (kBytes % 64 == 0) return GMMA::Layout_K_SW64_Atom<T>{};
  else if constexpr (kBytes % 32 == 0) return GMMA::Layout_K_SW32_Atom<T>{};
  else return GMMA::Layout_K_INTER_Atom<T>{};
}

// ---------------------------------------------------------------------------------------------
// Issue one warpgroup GEMM C (+)= A B over all K slices as one WGMMA batch.
// kZeroInit: C = A B (the accumulator's old values are ignored).
// kWait >= 0: wait until at most kWait batches are in flight; -1: return at once (the caller
// waits later with warpgroup_wait<N>() and then fences C).
template <bool kZeroInit, int kWait, class TiledMma, class TA, class TB, class TC>
CUTE_DEVICE void wgmma_gemm(TiledMma& mma, TA const& a, TB const& b, TC& c) {
  constexpr bool kRS = !cute::is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kRS) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) {
    warpgroup_wait<kWait>();
    warpgroup_fence_operand(c);
    if constexpr (kRS) warpgroup_fence_operand(const_cast<TA&>(a));
  }
}

// ---------------------------------------------------------------------------------------------
// Reductions over the 4 threads of a quad (the threads that share an accumulator row).
CUTE_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}
CUTE_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

}  // namespace fa3
