// The backward's dK/dV epilogues: dK (scaled by softmax_scale) and dV of the CTA's keys, from the
// consumers' fp32 accumulators to the input dtype in global memory, once per CTA (per column pass).
//   store_dkv_tma        one-pass tiles (hd64/96/128): stmatrix into free shared memory, TMA stores
//   store_dkv_registers  column passes (hd192): 4-byte stores straight from the registers
//   store_dkv_part       a tail CTA's share (BwdTailSplit), fp32 to its workspace slot
//   store_dkv_split_d    the split-D kernel's (d, key) fragments, staged through shared memory
// store_dkv picks the main kernel's. The functions take the kernel's params (MainParams) as P.
#pragma once

#include "bwd/bwd_traits.cuh"  // first: common/utils.cuh before any CuTe header

#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_conversion.h>

#include "bwd/bwd_order.cuh"
#include "bwd/bwd_pipeline.cuh"

namespace fa3 {
namespace bwd {

// fp32 fragment -> 16-bit fragment of the same layout (packed-pair conversion).
template <class TIn, class TOut>
CUTE_DEVICE void convert_fragment(TIn const& in, TOut& out) {
  using To = typename TOut::value_type;
  constexpr int N = decltype(size(in))::value;
  cutlass::NumericArrayConverter<To, float, N> conv;
  *reinterpret_cast<cutlass::Array<To, N>*>(out.data()) =
      conv(*reinterpret_cast<cutlass::Array<float, N> const*>(in.data()));
}

// dK/dV through shared memory and TMA stores (store_dkv_tma below), for traits with kTmaDKV. Consumer warpgroup w stages its (64 keys, head dim) dK in the first 64 rows
// of the free Q/dO stage (Q for w = 0, dO for w = 1) in a compact K-major layout, and its dV in its
// own 64 rows of V, in V's layout. Both use V's swizzle atom (the widest that divides the head dim),
// rows first, so row r of either starts r * kAtomCols elements in (a multiple of the swizzle period
// for r % 8 == 0): warp k's 16 rows are a 16-row view at 16 k * kAtomCols, the TMA box is (atom
// columns, 16 rows), head dim / atom columns boxes per tensor. Without kTmaDKV: empty placeholders.
struct NoTmaStore {};
template <class Tr, class = void> struct TraitsTmaDKV : std::false_type {};
template <class Tr> struct TraitsTmaDKV<Tr, std::void_t<decltype(Tr::kTmaDKV)>> : std::bool_constant<Tr::kTmaDKV> {};
template <class Tr, bool = TraitsTmaDKV<Tr>::value>
struct DKVStore {
  static constexpr bool kEnabled = false;
  using TmaDK = NoTmaStore;
  using TmaDV = NoTmaStore;
};
template <class Tr>
struct DKVStore<Tr, true> {
  static constexpr bool kEnabled = true;
  using Element = typename Tr::Element;
  static constexpr int kHeadDim = Tr::kHeadDim, kBlockN = Tr::kBlockN;
  using Atom = typename Tr::AtomV;
  static constexpr int kAtomCols = decltype(size<1>(Atom{}))::value;
  static constexpr int kWarpRows = 16;  // key rows of one consumer warp (WGMMA C layout)
  // Warpgroup tiles: dK compact (64, hd); dV = rows [64 w, 64 w + 64) of SmemLayoutV (offset kVHalf).
  using SmemLayoutdK = decltype(tile_to_shape(Atom{}, Shape<_64, Int<kHeadDim>>{}));
  using SmemLayoutdV = decltype(composition(typename Tr::SmemLayoutV{},
                                            make_layout(Shape<_64, Int<kHeadDim>>{}, Stride<_1, Int<kBlockN>>{})));
  // One warp's 16 rows of each (offset kWarpOffset * warp).
  using SmemLayoutdK16 = decltype(composition(SmemLayoutdK{},
                                              make_layout(Shape<_16, Int<kHeadDim>>{}, Stride<_1, _64>{})));
  using SmemLayoutdV16 = decltype(composition(typename Tr::SmemLayoutV{},
                                              make_layout(Shape<_16, Int<kHeadDim>>{}, Stride<_1, Int<kBlockN>>{})));
  static constexpr int kVHalf = 64 * kAtomCols;                  // elements: V row 64
  static constexpr int kWarpOffset = kWarpRows * kAtomCols;      // elements: row 16 of either tile
  static constexpr int kStageElems = Tr::kBlockM * kHeadDim;     // one Q (or dO) stage
  // A swizzle period is one atom (8 rows): the warp and warpgroup offsets are whole atoms, so the
  // views and the TMA (which swizzles by address bits) see the pattern the layouts describe.
  static_assert(kHeadDim % kAtomCols == 0 && kWarpRows % 8 == 0 && kVHalf % (8 * kAtomCols) == 0);
  static_assert(cosize_v<SmemLayoutdK> <= kStageElems, "dK of a warpgroup must fit in one Q stage");
  static_assert((kStageElems * int(sizeof(Element))) % 1024 == 0, "stages 1024-byte aligned");
  // One warpgroup's slice of the dV/dK GEMM (its C layout is thread t_in_wg's part of MmadKV's
  // warpgroup w rows): the stmatrix tiling of the epilogue.
  using MmaWg = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<Tr::kHdPass>, Int<Tr::kBlockMSdP>>,
                           GMMA::Major::K, GMMA::Major::MN>()));
  using TmaDK = decltype(make_tma_copy(SM90_TMA_STORE{}, std::declval<BshdView<Element>>(), SmemLayoutdK16{}));
  using TmaDV = decltype(make_tma_copy(SM90_TMA_STORE{}, std::declval<BshdView<Element>>(), SmemLayoutdV16{}));
};

// dK (scaled by softmax_scale) and dV of consumer warpgroup wg, through shared memory and TMA
// stores (one-pass tiles; DKVStore above). Called once per CTA after the main loop's final
// warpgroup_wait<0>, by all 128 threads of the warpgroup; `steps` is the number of steps the CTA
// ran (the step counter `it`).
// Why the staging memory is free without a barrier between the warpgroups:
//  - dV goes to this warpgroup's own 64 rows of V. Only this warpgroup reads them (dP^T = V dO^T
//    takes V rows of its own keys as the A operand), and its final wait<0> retired those reads.
//    The K/V TMA completed before the first step (kv_full), or was never issued (no steps).
//  - dK goes to stage fs = steps % kStages of the Q/dO ring (Q for wg 0, dO for wg 1), which the
//    last step (stage (steps - 1) % kStages) does not use. TMA: the producer issues exactly one
//    load per step and every step's load was waited for (full barrier), so no load is in flight
//    and none will come. Readers: the latest step that used stage fs is steps - kStages (or none).
//    This warpgroup retired all its reads. The other warpgroup's reads of that step (S^T, dP^T,
//    dV, and dK, which the dK overlap keeps in flight into the next step) are retired by its first
//    WGMMA wait of step steps - 1, before it arrives on that step's DsFull barrier. This warpgroup
//    has passed that barrier (a 256-thread sync) before leaving the loop, so the other warpgroup
//    reads only stage (steps - 1) % kStages, its dS buffer, K and its own V rows from now on.
//    kPasses == 1 makes the DsFull barrier part of every step; kStages >= 2 makes fs a second stage.
//    kDsFullMbar (no DsFull barrier): the dQ GEMM of step steps - 1 (kPingPong: after the loop)
//    waits on that step's ds_full, which the other warpgroup arrives on after its first WGMMA wait
//    of the step (a masked step issues none: it retires the previous step's dK first): the same
//    order.
// Each warp owns 16 key rows of the WGMMA C layout, so it writes its rows with stmatrix, fences
// (generic -> async proxy), and one lane stores its (16, head dim) boxes of dK and dV by TMA:
// no barrier beyond __syncwarp. Rows past seqlen_k are clipped by TMA (out-of-bounds box rows are
// not written); a box that starts past seqlen_k is not issued. The lane waits until the stores
// have read shared memory (tma_store_wait<0>) so the CTA outlives the reads; the global writes
// complete on their own before the grid does.
template <class Tr, class P, class FragK, class FragV>
CUTE_DEVICE void store_dkv_tma(P const& p, typename Tr::SharedStorage& ss, FragK& tdKrdK, FragV const& tdVrdV,
                               int steps, int n_block, int hk, int b, int wg, int t_in_wg) {
  using St = DKVStore<Tr>;
  using Element = typename Tr::Element;
  constexpr int kHeadDim = Tr::kHeadDim;
  const int fs = steps % Tr::kStages;
  Element* dk_buf = (wg == 0 ? ss.q.data() : ss.dout.data()) + fs * St::kStageElems;
  Element* dv_buf = ss.v.data() + wg * St::kVHalf;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= p.softmax_scale;
  Tensor rdK = make_tensor<Element>(tdKrdK.layout());
  convert_fragment(tdKrdK, rdK);
  Tensor rdV = make_tensor<Element>(tdVrdV.layout());
  convert_fragment(tdVrdV, rdV);
  auto stsm = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, typename St::MmaWg{});
  auto thr = stsm.get_thread_slice(t_in_wg);
  Tensor sdK = as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(dk_buf), typename St::SmemLayoutdK{}));
  Tensor sdV = as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(dv_buf), typename St::SmemLayoutdV{}));
  copy(stsm, thr.retile_S(rdK), thr.partition_D(sdK));
  copy(stsm, thr.retile_S(rdV), thr.partition_D(sdV));
  cutlass::arch::fence_view_async_shared();  // stmatrix writes -> visible to the TMA stores
  __syncwarp();
  const int warp = t_in_wg / 32;
  const int row_blk = n_block * (Tr::kBlockN / St::kWarpRows) + wg * (64 / St::kWarpRows) + warp;
  if (row_blk * St::kWarpRows < p.seqlen_k) {  // warp-uniform
    if (cute::elect_one_sync()) {
      auto shape = make_shape(p.seqlen_k, Int<kHeadDim>{}, p.heads_kv, p.batch);
      Tensor mdK = p.tma_dk.get_tma_tensor(shape);
      Tensor mdV = p.tma_dv.get_tma_tensor(shape);
      Tensor gdK = local_tile(mdK(_, _, hk, b), Shape<Int<St::kWarpRows>, Int<kHeadDim>>{}, make_coord(row_blk, _0{}));
      Tensor gdV = local_tile(mdV(_, _, hk, b), Shape<Int<St::kWarpRows>, Int<kHeadDim>>{}, make_coord(row_blk, _0{}));
      Tensor sdK_w = make_tensor(make_smem_ptr(dk_buf + warp * St::kWarpOffset), typename St::SmemLayoutdK16{});
      Tensor sdV_w = make_tensor(make_smem_ptr(dv_buf + warp * St::kWarpOffset), typename St::SmemLayoutdV16{});
      auto [tKg, tKs] = tma_partition(p.tma_dk, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdK_w), group_modes<0, 2>(gdK));
      auto [tVg, tVs] = tma_partition(p.tma_dv, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdV_w), group_modes<0, 2>(gdV));
      copy(p.tma_dk, tKs, tKg);
      copy(p.tma_dv, tVs, tVg);
      tma_store_arrive();
      tma_store_wait<0>();  // shared memory read: the CTA may exit
    }
  }
}

// dK (scaled) and dV of one column pass (columns [pass * kHdPass, (pass + 1) * kHdPass)) straight
// from the accumulators: registers i, i + 1 hold adjacent columns of one key, so each thread
// writes 4-byte pairs; keys past seqlen_k and columns past dK's or dV's head dim are skipped. tdKVc: the (key, column) coordinates of
// the accumulator elements; n0 the CTA's first key.
template <class Tr, class P, class FragK, class FragV, class Coord>
CUTE_DEVICE void store_dkv_registers(P const& p, FragK const& tdKrdK, FragV const& tdVrdV, Coord const& tdKVc,
                                     int n0, int pass, int hk, int b) {
  using Element = typename Tr::Element;
  const int64_t kv_row = int64_t(b) * p.seqlen_k * p.heads_kv + hk;  // (b, key 0, hk)
  Element* dk = p.dk + kv_row * p.head_dim;
  Element* dv = p.dv + kv_row * p.head_dim_v;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(tdKrdK); i += 2) {
    const int key = n0 + get<0>(tdKVc(i));
    const int col = pass * Tr::kHdPass + get<1>(tdKVc(i));  // col, col + 1 in registers i, i+1
    if (key < p.seqlen_k) {
      const int64_t rows = int64_t(key) * p.heads_kv;
      if (col < p.head_dim) {
        cutlass::Array<Element, 2> k2;
        k2[0] = Element(tdKrdK(i) * p.softmax_scale);
        k2[1] = Element(tdKrdK(i + 1) * p.softmax_scale);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(dk + rows * p.head_dim + col) = k2;
      }
      if (col < p.head_dim_v) {
        cutlass::Array<Element, 2> v2;
        v2[0] = Element(tdVrdV(i));
        v2[1] = Element(tdVrdV(i + 1));
        *reinterpret_cast<cutlass::Array<Element, 2>*>(dv + rows * p.head_dim_v + col) = v2;
      }
    }
  }
}

// A tail CTA's share of its unit's dK (scaled by softmax_scale) and dV, in fp32 to workspace slot
// `slot` (BwdTailSplit): float4 j of consumer thread ct at j * 256 + ct (coalesced), dK's
// fragment then dV's, as bwd_dkv_tail_kernel reads them back. ct is the dK/dV MMA's thread index.
template <class Tr, class P, class FragK, class FragV>
CUTE_DEVICE void store_dkv_part(P const& p, FragK const& tdKrdK, FragV const& tdVrdV, int slot, int ct) {
  constexpr int kVec = decltype(size(tdKrdK))::value / 4;
  static_assert(Tr::kNumMmaThreads == 256 && kVec * 4 * 256 == Tr::kBlockN * Tr::kHeadDim);
  float4* dst = reinterpret_cast<float4*>(p.dkv_part + int64_t(slot) * (2 * Tr::kBlockN * Tr::kHeadDim));
  const float sc = p.softmax_scale;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kVec; ++j) {
    dst[j * 256 + ct] = make_float4(tdKrdK(4 * j) * sc, tdKrdK(4 * j + 1) * sc, tdKrdK(4 * j + 2) * sc,
                                    tdKrdK(4 * j + 3) * sc);
    dst[(kVec + j) * 256 + ct] = make_float4(tdVrdV(4 * j), tdVrdV(4 * j + 1), tdVrdV(4 * j + 2), tdVrdV(4 * j + 3));
  }
}

// The main kernel's epilogue of a pass, after its final warpgroup_wait<0>: a tail CTA's share to
// its workspace slot (slot >= 0), else through TMA (one-pass tiles) or from the registers.
template <class Tr, class P, class FragK, class FragV, class Coord>
CUTE_DEVICE void store_dkv(P const& p, typename Tr::SharedStorage& ss, FragK& tdKrdK, FragV& tdVrdV,
                           Coord const& tdKVc, int steps, int slot, int n_block, int pass, int hk, int b, int ct,
                           int wg, int t_in_wg) {
  if constexpr (kTailSplitOk<Tr>) {
    if (slot >= 0) {
      store_dkv_part<Tr>(p, tdKrdK, tdVrdV, slot, ct);
      return;
    }
  }
  if constexpr (DKVStore<Tr>::kEnabled) {
    store_dkv_tma<Tr>(p, ss, tdKrdK, tdVrdV, steps, n_block, hk, b, wg, t_in_wg);
  } else {
    store_dkv_registers<Tr>(p, tdKrdK, tdVrdV, tdKVc, n_block * Tr::kBlockN, pass, hk, b);
  }
}

// The split-D kernel's epilogue (bwd_split_d.cuh): its accumulators are (d, key) fragments, so
// adjacent registers are adjacent keys, and with 160 of them live per-element global stores
// spilled (their addresses and key predicates are hoisted). Instead: dK (scaled) and dV to shared
// memory as (key, d) rows over the dead K and Q tiles (each address = a per-thread base + a
// constant), then 16-byte coalesced global stores of the valid key rows and columns. All 256
// consumer threads.
template <class Tr, class P, class FragK, class FragV, class Coord>
CUTE_DEVICE void store_dkv_split_d(P const& p, typename Tr::SharedStorage& ss, FragK const& tdKrdK,
                                   FragV const& tdVrdV, Coord const& tdKVc, int n0, int hk, int b, int ct) {
  using Element = typename Tr::Element;
  constexpr int kHeadDim = Tr::kHeadDim;
  const int64_t kv_row = int64_t(b) * p.seqlen_k * p.heads_kv + hk;  // (b, key 0, hk)
  Element* dk = p.dk + kv_row * p.head_dim;
  Element* dv = p.dv + kv_row * p.head_dim_v;
  cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDsFull);  // both WGs done with K, Q
  Element* sdk = ss.q.data();  // 64 KB >= 40 KB
  Element* sdv = ss.k.data();  // exactly 80 x 256
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(tdKrdK); ++i) {
    const int off = get<1>(tdKVc(i)) * kHeadDim + get<0>(tdKVc(i));
    sdk[off] = Element(tdKrdK(i) * p.softmax_scale);
    sdv[off] = Element(tdVrdV(i));
  }
  cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDsFull);
  constexpr int kVecRow = kHeadDim / 8;  // 16-byte vectors per key row
  const int n_vec = min(Tr::kBlockN, p.seqlen_k - n0) * kVecRow;
  #pragma unroll 1
  for (int c = ct; c < n_vec; c += Tr::kNumMmaThreads) {
    const int r = c / kVecRow, col = (c % kVecRow) * 8;  // head dims are multiples of 8
    const int64_t rows = int64_t(n0 + r) * p.heads_kv;
    if (col < p.head_dim)
      *reinterpret_cast<uint4*>(dk + rows * p.head_dim + col) = *reinterpret_cast<const uint4*>(sdk + r * kHeadDim + col);
    if (col < p.head_dim_v)
      *reinterpret_cast<uint4*>(dv + rows * p.head_dim_v + col) = *reinterpret_cast<const uint4*>(sdv + r * kHeadDim + col);
  }
}

}  // namespace bwd
}  // namespace fa3
