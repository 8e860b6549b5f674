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
