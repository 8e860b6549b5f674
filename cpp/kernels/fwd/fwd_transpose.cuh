// The FP8 forward's V transpose (issue 28). FP8 WGMMA reads its B operand only K-major; for
// O += P V the K dimension is the keys, while TMA lands V as (n, d) with d contiguous. Warps 1-2
// of the producer warpgroup (warp 0's first thread issues the TMAs; the rest of the warpgroup
// idles) copy each V block of the TMA ring (pipe_v: they are its consumers) into the transposed
// ring SharedStorage::vt, (d, n) with n contiguous, and hand it to the consumer warpgroups
// through pipe_vt (a cutlass::PipelineAsync: full once all 64 transposer threads have written
// their part, empty once every consumer thread's P V has completed). Inside each 16-key chunk the
// keys go to the A-operand slots of P's registers (common/utils.cuh, fp8_key_slot), so that P
// needs no shuffle. The transposers take the V blocks in ring order up to the producer's end
// marker (fwd_pipeline.cuh, fwd_v_end_marker): they never look at the tiles, so the dynamic tile
// schedule of the banded kernels serves them as the static one does.
#pragma once

#include "fwd/fwd_pipeline.cuh"
#include "fwd/fwd_traits.cuh"

namespace fa3 {

static_assert(fp8_key_slot(0) == 0 && fp8_key_slot(1) == 1 && fp8_key_slot(8) == 2 && fp8_key_slot(9) == 3);

// __byte_perm, also on the host (tests/kernels/fwd_fp8_operand.cu): byte n of the result is byte
// (s >> 4n) & 7 of the 8 bytes y:x.
CUTE_HOST_DEVICE uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#ifdef __CUDA_ARCH__
  return __byte_perm(x, y, s);
#else
  uint64_t const xy = (uint64_t(y) << 32) | x;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) r |= uint32_t((xy >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
  return r;
#endif
}

// x, read anew at every block: otherwise the compiler hoists values derived from it out of the
// block loop, and on 32 registers spills them.
CUTE_DEVICE uint32_t per_block(uint32_t x) {
  asm volatile("mov.b32 %0, %0;\n" : "+r"(x));
  return x;
}

// The transpose by ldmatrix.trans / stmatrix. A tile is one 16-key chunk (keys 16 c ..) x 32 columns
// (d0 ..): ldmatrix.x4.trans reads four 8 x 8 matrices of 16-bit words of V, keys 0-7 | 8-15 of
// the chunk x columns d0 .. d0 + 15 | d0 + 16 .. d0 + 31 (matrix m = lane / 8 gets its row lane % 8
// from that lane's address), and gives lane t (q = t % 4, e = 2 (t / 4)) keys 2q, 2q + 1 (from the
// second and fourth matrices 8 + 2q, 9 + 2q) at columns d0 + e, d0 + e + 1. Two byte permutes per
// matrix pair turn those into, per column, the keys of slots 4q .. 4q + 3 (fp8_key_slot), and
// stmatrix.x4 writes them as matrix rows d0 + e (+ 1) (+ 16) of Vt, 16 bytes = the chunk's slots,
// lane t's word at byte 4q. 512 bytes in one LDSM, four PRMT and one STSM. Warp w takes the column
// groups of 32 whose index has its low bit = w, every chunk.
// The layouts are swizzled bit permutations of power-of-two tiles, linear over XOR in the
// coordinates' bits, so a lane's address for tile j is its tile-0 offset XOR tile j's lane-0
// offset: the bits its own offsets can have (mask()) by a XOR, the rest by an add that folds into
// the instruction's immediate. tests/kernels/fwd_fp8_operand.cu replays this against the layouts.
template <class T>
struct Fp8TransposeMap {
  using LayoutV = typename T::SmemLayoutK1;   // (n, d), one stage
  using LayoutVt = typename T::SmemLayoutVt;  // (d, n, stages)
  static constexpr int kWarps = 2;
  static constexpr int kStageBytes = T::kBlockN * T::kHeadDim;
  static constexpr int kGroupsPerWarp = T::kHeadDim / 32 / kWarps;  // column groups of 32 per warp
  static constexpr int kTilesPerWarp = T::kBlockN / 16 * kGroupsPerWarp;
  static_assert(T::kNumTransposeThreads == 32 * kWarps && T::kHeadDim % 64 == 0 && T::kBlockN % 16 == 0);

  // Tile j of warp w: chunk j / kGroupsPerWarp, first column col0(j, w).
  CUTE_HOST_DEVICE static constexpr int chunk(int j) { return j / kGroupsPerWarp; }
  CUTE_HOST_DEVICE static constexpr int col0(int j, int w) { return 32 * (kWarps * (j % kGroupsPerWarp) + w); }
  // Byte offsets in a stage of lane's ldmatrix row (V) and stmatrix row (Vt) in tile j of warp w.
  CUTE_HOST_DEVICE static constexpr uint32_t ld_offset(int lane, int w, int j) {
    int const m = lane / 8, r = lane % 8;
    return uint32_t(LayoutV{}(16 * chunk(j) + 8 * (m % 2) + r, col0(j, w) + 16 * (m / 2)));
  }
  CUTE_HOST_DEVICE static constexpr uint32_t st_offset(int lane, int w, int j) {
    int const m = lane / 8, r = lane % 8;
    return uint32_t(LayoutVt{}(col0(j, w) + 16 * (m / 2) + 2 * r + m % 2, 16 * chunk(j), 0));
  }
  // The bits a lane's tile-0 offsets can have.
  CUTE_HOST_DEVICE static constexpr uint32_t mask(bool store) {
    uint32_t bits = 0;
    for (int w = 0; w < kWarps; ++w)
      for (int lane = 0; lane < 32; ++lane) bits |= store ? st_offset(lane, w, 0) : ld_offset(lane, w, 0);
    return bits;
  }
  // Tile j's offset for a lane whose tile-0 offset is x (y: tile j's lane-0 offset, warp 0).
  template <bool kStore>
  CUTE_HOST_DEVICE static uint32_t at(uint32_t x, int j) {
    constexpr uint32_t kMask = mask(kStore);
    uint32_t const y = kStore ? st_offset(0, 0, j) : ld_offset(0, 0, j);
    return (y & ~kMask) + (x ^ (y & kMask));
  }
};

CUTE_DEVICE void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
CUTE_DEVICE void stsm_x4(uint32_t addr, uint32_t const (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// Lane t's words of an ldmatrix.x4.trans tile, (keys 2q, 2q + 1 | 8 + 2q, 9 + 2q) x (columns e,
// e + 1 | e + 16, e + 17), as the stmatrix.x4 words: columns e, e + 1, e + 16, e + 17, each the
// keys of slots 4q .. 4q + 3.
CUTE_HOST_DEVICE void ldsm_tile_to_vt_words(uint32_t const (&r)[4], uint32_t (&w)[4]) {
  w[0] = byte_perm(r[0], r[1], 0x6420);
  w[1] = byte_perm(r[0], r[1], 0x7531);
  w[2] = byte_perm(r[2], r[3], 0x6420);
  w[3] = byte_perm(r[2], r[3], 0x7531);
}

// One V block at shared addresses v (stage base) to vt, by a warp whose lane has tile-0 offsets
// x_ld, x_st. Two tiles' loads are issued together: one at a time, each load waited for the
// previous tile's permutes (a load's latency per tile). On 32 registers (hd64's three-warpgroup tile)
// one at a time, with the tiles' XORed offsets formed per block (per_block): hoisted out of the
// block loop they spilled 28 B.
template <class T>
CUTE_DEVICE void fwd_transpose_block(uint32_t v, uint32_t vt, uint32_t x_ld, uint32_t x_st) {
  using Map = Fp8TransposeMap<T>;
  constexpr bool kTight = T::kProducerRegs <= 32;
  constexpr int kBatch = kTight ? 1 : 2;
  static_assert(Map::kTilesPerWarp % kBatch == 0);
  if constexpr (kTight) {
    x_ld = per_block(x_ld);
    x_st = per_block(x_st);
  }
  CUTLASS_PRAGMA_UNROLL
  for (int j0 = 0; j0 < Map::kTilesPerWarp; j0 += kBatch) {
    uint32_t r[kBatch][4], w[4];
    CUTLASS_PRAGMA_UNROLL
    for (int b = 0; b < kBatch; ++b) ldsm_x4_trans(v + Map::template at<false>(x_ld, j0 + b), r[b]);
    CUTLASS_PRAGMA_UNROLL
    for (int b = 0; b < kBatch; ++b) {
      ldsm_tile_to_vt_words(r[b], w);
      stsm_x4(vt + Map::template at<true>(x_st, j0 + b), w);
    }
  }
}

// Run by the transposer threads: warps 1-2 of warpgroup 0.
template <class T>
CUTE_DEVICE void fwd_transpose_v(typename T::SharedStorage& ss,
                                 typename T::Pipeline& pipe_v, typename T::PipelineVt& pipe_vt) {
  using Map = Fp8TransposeMap<T>;
  int const tid = threadIdx.x - 32;
  // This lane's tile-0 offsets in its warp.
  uint32_t const x_ld = Map::ld_offset(tid % 32, tid / 32, 0), x_st = Map::st_offset(tid % 32, tid / 32, 0);
  uint32_t const v0 = cute::cast_smem_ptr_to_uint(ss.v.data());
  uint32_t const vt0 = cute::cast_smem_ptr_to_uint(ss.vt.data());
  typename T::PipelineState read;  // of pipe_v: starts at phase 0 like the consumers'
  for (;; ++read) {
    pipe_v.consumer_wait(read);
    if (*reinterpret_cast<uint32_t volatile*>(&ss.v_end[read.index()])) break;  // the end marker
    // The Vt ring has the V ring's stages and advances with it: its producer state is read's
    // with the phase flipped (a producer starts at phase 1): one state less to keep.
    typename T::PipelineState const write(read.index(), read.phase() ^ 1u, read.count());
    pipe_vt.producer_acquire(write);
    uint32_t const v = v0 + read.index() * Map::kStageBytes, vt = vt0 + write.index() * Map::kStageBytes;
    fwd_transpose_block<T>(v, vt, x_ld, x_st);
    cutlass::arch::fence_view_async_shared();  // the consumers' WGMMAs read these stores
    pipe_vt.producer_commit(write);
    pipe_v.consumer_release(read);
  }
}

}  // namespace fa3
