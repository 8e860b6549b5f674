// The forward consumer warpgroups. Each owns 64 query rows of the tile: S = Q K^T by SS-WGMMA,
// softcap and the mask as warp-uniform branches (the mask only on blocks that are not wholly
// inside the band), online softmax in registers (exp2 domain, scale folded in), O += P V by
// RS-WGMMA with P converted in registers, then fwd_epilogue.cuh. Intra-warpgroup overlap: the
// Q K^T of block n is issued together with the P V of block n + 1, and the softmax of block n
// runs while that P V is in flight. With kPingPong the warpgroups also take turns to issue their
// GEMMs, so that one's softmax overlaps the others' GEMMs.
// FP8 (T::kFp8): the descales join the softmax scale per tile, P becomes the e4m3 A operand in
// registers (common/utils.cuh, convert_into_fp8_operand_a), V comes transposed from its own ring
// (fwd_transpose.cuh; pipe_v is that ring), and v's descale joins O's final scale.
#pragma once

#include <cfloat>

#include "common/mask.cuh"
#include "common/pingpong.cuh"
#include "common/softmax.cuh"
#include "fwd/fwd_epilogue.cuh"
#include "fwd/fwd_pipeline.cuh"
#include "fwd/fwd_traits.cuh"

namespace fa3 {

// The mask of one warpgroup's rows in one tile: which key blocks need one, and which one.
// Banded: where neither the left bound nor the seqlen_k end can cut into the block for any of
// the 64 rows (padding rows included), the two-bound compare reduces to one (mask.cuh,
// right_bound_only / apply_right); the same elements are masked either way. Both tests compare
// the block's first key with per-tile thresholds (32-bit, once per block: a per-block
// right_bound_only() cost 11 uniform instructions on every block, interior ones included, in
// the hd128 SASS, and block_is_interior is 64-bit). Unbanded: only the seqlen_k end.
template <class T>
struct FwdTileMask {
  BandMask const& mask;
  DocMask const& docs;
  int row_lo;             // the warpgroup's first row
  int batch;
  int n0_1cmp;            // masked blocks from this key on take the one-compare mask
  int n0_int_lo, n0_int_hi;  // blocks whose first key lies in [lo, hi] need no mask

  // Documents narrow the blocks without a mask (the warpgroup's 64 rows: one group of intervals).
  CUTE_DEVICE FwdTileMask(BandMask const& m, DocMask const& d, int b, int wrow_lo, int wrow_hi)
      : mask(m), docs(d), row_lo(wrow_lo), batch(b) {
    n0_1cmp = mask.right_bound_only_from(wrow_lo + 63);
    mask.interior_key_range(wrow_lo, wrow_hi, T::kBlockN, n0_int_lo, n0_int_hi);
    if constexpr (T::kDocs) docs.narrow_interior_keys(b, wrow_lo, wrow_hi, T::kBlockN, n0_int_lo, n0_int_hi);
  }

  CUTE_DEVICE bool interior(int n) const { return n * T::kBlockN >= n0_int_lo && n * T::kBlockN <= n0_int_hi; }

  // S: the (rows, cols) view of block n's scores; cS: its identity tensor viewed the same way.
  template <class TS, class TC>
  CUTE_DEVICE void apply(int n, TS& S, TC const& cS) const {
    if constexpr (T::kBanded) {
      if (n * T::kBlockN >= n0_1cmp) mask.apply_right(S, cS, row_lo, n * T::kBlockN);
      else mask.apply(S, cS, row_lo, n * T::kBlockN);
      if constexpr (T::kDocs) docs.apply(S, cS, batch, row_lo, n * T::kBlockN);
    } else {
      mask.apply_seqlen_k(S, cS, n * T::kBlockN);
    }
  }
};

// The smem of V as the P V GEMM's B operand: V's own tiles, or FP8's transposed copy.
template <class T>
CUTE_DEVICE typename T::Element* fwd_vt_smem(typename T::SharedStorage& ss) {
  if constexpr (T::kFp8) return ss.vt.data();
  else return ss.v.data();
}

// Descales of one (batch, head) for FP8 (1 otherwise: nothing is read).
struct FwdTileDescale {
  float qk = 1.f;  // q_descale * k_descale: a factor of the scores
  float v = 1.f;   // v_descale: a factor of O

  template <class P>
  CUTE_DEVICE static FwdTileDescale of(P const& p, TileCoord const& c) {
    FwdTileDescale d;
    int const hk = c.head / p.group;
    d.qk = p.q_descale[c.batch * p.heads_q + c.head] * p.k_descale[c.batch * p.heads_kv + hk];
    d.v = p.v_descale[c.batch * p.heads_kv + hk];
    return d;
  }
};

template <class T, class PipeV>
CUTE_DEVICE void fwd_consumer(typename T::Params const& p, typename T::SharedStorage& ss,
                              typename T::Pipeline& pipe_k, PipeV& pipe_v, int wg) {
  using Element = typename T::Element;
  using D = typename T::D;
  using BN = typename T::BN;

  int const tid = threadIdx.x % 128;  // thread in this warpgroup
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(fwd_vt_smem<T>(ss)), typename T::SmemLayoutVt{});

  typename T::MmaQK mma_qk;
  typename T::MmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);
  Tensor tSrQ0 = thr_qk.partition_fragment_A(sQ(_, _, wg));  // descriptors (MMA, 1, d/16)
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, 1, d/16, stages)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, 1, n/16, stages)
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<_64, BN>{});
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<_64, D>{});
  Tensor tOrP = [&]() {
    if constexpr (T::kFp8) return make_tensor<Element>(acc_as_fp8_operand_a(tSrS.layout()));
    else return make_tensor<Element>(acc_as_operand_a(tSrS.layout()));
  }();
  Tensor S = rowcol_view(tSrS);
  Tensor O = rowcol_view(tOrO);
  Tensor cS = rowcol_view(thr_qk.partition_C(make_identity_tensor(Shape<_64, BN>{})));
  constexpr int kRows = decltype(size<0>(S))::value;
  static_assert(kRows == 2);

  OnlineSoftmax<kRows, T::kFp8 ? 8 : 0> softmax(p.scale.scale_log2);
  FwdQConsumer<T> q{ss};
  typename T::PipelineState read;  // of both rings (fwd_pipeline.cuh); consumers start at phase 0
  bool const softcap = p.scale.softcap;
  float pre_tanh = p.scale.pre_tanh;
  WarpgroupPingPong<T::kNumMmaWG, T::kPingPong, kFwdBarPingPong> const pingpong{wg};
  pingpong.start();

  int const num_tiles = p.sched.num_tiles();
  bool const dynamic = p.sched.template dynamic<T::kDynamicSchedule>();
  for (int t = blockIdx.x;; t += int(gridDim.x)) {
    // One Q buffer and the static schedule: no end marker, the CTA's tiles end at num_tiles.
    if (!T::kQPrefetch && !dynamic && t >= num_tiles) break;
    clear(tOrO);
    softmax.reset();
    FwdTile tile;
    if (!q.next_tile(p, dynamic, num_tiles, t, tile)) break;
    if constexpr (!T::kQPrefetch) tile = fwd_tile<T>(p, t);  // the consumers decode it themselves
    FwdTileDescale descale;
    if constexpr (T::kFp8) {  // the scores' factor goes where the softmax scale is (softcap: inside tanh)
      descale = FwdTileDescale::of(p, tile.c);
      // A zero descale would make a masked score's exponent -inf * 0 = NaN; the smallest normal
      // scale gives what the portable path does, uniform weights.
      if (softcap) pre_tanh = p.scale.pre_tanh * descale.qk;
      else softmax.scale_log2 = fmaxf(p.scale.scale_log2 * descale.qk, FLT_MIN);
    }
    // This tile's Q slab descriptors.
    auto tSrQ = [&]() {
      if constexpr (T::kQPrefetch) return thr_qk.partition_fragment_A(sQ(_, _, tile.buf * T::kNumMmaWG + wg));
      else return tSrQ0;
    }();
    // This warpgroup's rows (rows past seqlen_q are never stored).
    int wrow_lo = tile.row_lo + wg * 64;
    int wrow_hi = max(wrow_lo, min(wrow_lo + 63, p.seqlen_q - 1));
    int const n_begin = tile.n_begin, n_end = tile.n_end;
    // The Q slabs go back as soon as this thread's last Q K^T has completed (every consumer
    // thread for itself: a lane-0 arrival left the other lanes' reads of the tile slot unordered).
    if (n_begin >= n_end) q.release(tile);  // no key: Q is never read
    if (n_begin < n_end) {
      FwdTileMask<T> const tile_mask(p.mask, p.docs, tile.c.batch, wrow_lo, wrow_hi);
      float alpha[kRows];

      // Last key block first (it may be a boundary block): S and its softmax.
      int n = n_end - 1;
      pipe_k.consumer_wait(read);
      pingpong.wait();
      wgmma_gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
      pingpong.signal();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      pipe_k.consumer_release(read);
      if (n == n_begin) q.release(tile);
      if (softcap) apply_softcap(tSrS, pre_tanh);
      if (!tile_mask.interior(n)) tile_mask.apply(n, S, cS);
      softmax.template update<true>(S, alpha);
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) alpha[r] = 1.f;
      bool pv_pending = false;  // a P V (and its V stage) is in flight
      typename T::PipelineState read_v;  // that V stage

      // Steady state: S_n = Q K_n^T and O += P_{n+1} V_{n+1} in flight together, and the
      // softmax of S_n runs while P V is still computing. Each block is split in two:
      //   head(n): issue Q K_n^T and P_{n+1} V_{n+1}, wait for S_n, mask, softmax;
      //   tail():  wait for P V, release V_{n+1}, rescale O, convert P_n into the A operand.
      // The loop body is tail() of the previous block, then head(n), so the wait for P V opens
      // the loop body's first basic block and the softmax closes the previous one. With both in
      // one block, ptxas (nvcc 13.0) hoisted the wait above the softmax (WARPGROUP.DEPBAR.LE
      // gsb0, 0x0 right before the row max): the softmax never overlapped P V. It does not move
      // the wait across the back-edge. One loop with one Q K^T and one P V issue site: with
      // three loops (masked / interior / masked) rotated this way, ptxas serialised every WGMMA
      // (C7512, insufficient registers: it gave each loop's P V its own P registers). The mask
      // is a uniform branch on the block instead; it is skipped on interior blocks, the bulk of
      // the work.
      auto tail = [&]() __attribute__((always_inline)) {
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        warpgroup_fence_operand(tOrP);
        if (pv_pending) pipe_v.consumer_release(read_v);
        if (warp_row_max_moved(alpha)) scale_rows(O, alpha);  // saves d/2 FMULs on most blocks
        if constexpr (T::kFp8) convert_into_fp8_operand_a(tSrS, tOrP);
        else convert_into(tSrS, tOrP);
      };
      CUTLASS_PRAGMA_NO_UNROLL
      for (--n; n >= n_begin; --n) {
        tail();
        read_v = read;  // block n + 1
        ++read;         // block n
        pipe_k.consumer_wait(read);
        pingpong.wait();
        wgmma_gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
        pipe_v.consumer_wait(read_v);
        wgmma_gemm<false, -1>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
        pingpong.signal();
        pv_pending = true;
        warpgroup_wait<1>();
        warpgroup_fence_operand(tSrS);
        pipe_k.consumer_release(read);
        if (n == n_begin) q.release(tile);
        if (softcap) apply_softcap(tSrS, pre_tanh);
        if (!tile_mask.interior(n)) tile_mask.apply(n, S, cS);
        softmax.template update<false>(S, alpha);
      }
      tail();

      // P V of the first key block.
      pipe_v.consumer_wait(read);
      pingpong.wait();
      wgmma_gemm<false, -1>(mma_pv, tOrP, tOrV(_, _, _, read.index()), tOrO);
      pingpong.signal();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(tOrP);
      pipe_v.consumer_release(read);
      ++read;
    }
    // O / l, LSE; then the stores.
    float inv_sum[kRows], lse[kRows];
    softmax.finalize(inv_sum, lse, sink_log2(p.sinks, tile.c.head));
    if constexpr (T::kDocs) {  // rows whose segment ids broke the contract: NaN, never wrong
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        if (p.docs.row_invalid(tile.c.batch, wrow_lo + get<0>(cS(r, 0)))) inv_sum[r] = lse[r] = NAN;
      }
    }
    if constexpr (T::kFp8) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) inv_sum[r] *= descale.v;
    }
    scale_rows(O, inv_sum);
    fwd_epilogue<T>(p, tile.c, wrow_lo, tid, lse, O, cS, thr_pv);
  }
}

}  // namespace fa3
