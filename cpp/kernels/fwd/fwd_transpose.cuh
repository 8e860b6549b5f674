// The FP8 forward's V transpose (issue 28). FP8 WGMMA reads its B operand only K-major; for
// O += P V the K dimension is the keys, while TMA lands V as (n, d) with d contiguous. Warps 1-3
// of the producer warpgroup (warp 0's first thread issues the TMAs; the rest of the warpgroup
// idled) copy each V block of the TMA ring (pipe_v: they are its consumers) into the transposed
// ring SharedStorage::vt, (d, n) with n contiguous, and hand it to the consumer warpgroups
// through pipe_vt (a cutlass::PipelineAsync: full once all 96 transposer threads have written
// their part, empty once every consumer thread's P V has completed). Inside each 16-key chunk the
// keys go to the A-operand slots of P's registers (common/utils.cuh, fp8_key_slot), so that P
// needs no shuffle. The transposers walk the tiles as the producer does (FP8 kernels keep the
// static schedule, FwdTraits::kDynamicSchedule), so they know how many blocks each tile has.
#pragma once

#include "fwd/fwd_pipeline.cuh"
#include "fwd/fwd_traits.cuh"

namespace fa3 {

// One V block: units of 4 keys x 4 columns. Keys 2q, 2q + 1, 8 + 2q, 9 + 2q of a 16-key chunk
// fill A slots 4q .. 4q + 3, so a unit reads four 4-byte words (one per key, columns d0 .. d0 + 3)
// and writes four (one per column, slots 4q .. 4q + 3), the 4 x 4 bytes transposed by byte
// permutes. A swizzled row keeps each 4-byte group contiguous (the swizzles move 16-byte pieces).
// The 32 units of a warp take the 4 quads q, 4 neighbouring column groups and 2 neighbouring
// chunks: of the bit choices for the lanes, the one whose loads and stores both have at most
// 2-way bank conflicts in every FP8 tile (tests/kernels/fwd_fp8_operand.cu counts them; one warp
// per chunk, column groups across the lanes, loaded conflict-free but stored 8- to 16-way).
struct Fp8TransposeUnit {
  int key0;  // the unit's keys: key0, key0 + 1, key0 + 8, key0 + 9 (key0 = 16 chunk + 2q)
  int d0;    // its columns d0 .. d0 + 3
  int slot;  // its first A slot, 16 chunk + 4q (= 16 chunk + fp8_key_slot(2q))
};

template <int kHeadDim, int kBlockN>
CUTE_HOST_DEVICE constexpr Fp8TransposeUnit fp8_transpose_unit(int u) {
  static_assert(kHeadDim % 16 == 0 && kBlockN % 32 == 0);
  constexpr int kChunkPairs = kBlockN / 32;
  int const q = u & 3, rest = u >> 5;
  int const chunk = 2 * (rest % kChunkPairs) + ((u >> 4) & 1);
  int const group = 4 * (rest / kChunkPairs) + ((u >> 2) & 3);
  return {16 * chunk + 2 * q, 4 * group, 16 * chunk + 4 * q};
}
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

// w[i] holds (key i, columns d0 .. d0 + 3) in bytes 0..3; out[j] gets (column d0 + j, keys 0..3).
CUTE_HOST_DEVICE void transpose_4x4_bytes(uint32_t const (&w)[4], uint32_t (&out)[4]) {
  uint32_t const lo01 = byte_perm(w[0], w[1], 0x5140), hi01 = byte_perm(w[0], w[1], 0x7362);
  uint32_t const lo23 = byte_perm(w[2], w[3], 0x5140), hi23 = byte_perm(w[2], w[3], 0x7362);
  out[0] = byte_perm(lo01, lo23, 0x5410);
  out[1] = byte_perm(lo01, lo23, 0x7632);
  out[2] = byte_perm(hi01, hi23, 0x5410);
  out[3] = byte_perm(hi01, hi23, 0x7632);
}

// Where a thread's units sit: byte offsets inside one stage, the load's (V, (n, d)) in the low
// half and the store's (Vt, (d, n)) in the high half, computed once per kernel. The layouts are
// swizzled bit permutations of power-of-two tiles, so they are linear over XOR: the unit's other
// keys (key0 + 1, + 8, + 9 set bits that key0 leaves clear) and columns (d0 + j) lie at fixed XORs
// of its first offsets (Fp8TransposeMap::load_xor, store_xor), and a stage moves every offset by
// its size. tests/kernels/fwd_fp8_operand.cu replays these offsets against the layouts.
template <class T>
struct Fp8TransposeMap {
  using LayoutV = typename T::SmemLayoutK1;  // (n, d), one stage
  using LayoutVt = typename T::SmemLayoutVt;  // (d, n, stages)
  static constexpr int kUnits = T::kBlockN / 16 * 4 * (T::kHeadDim / 4);  // chunks x quads x column groups
  static constexpr int kUnitsPerThread = (kUnits + T::kNumTransposeThreads - 1) / T::kNumTransposeThreads;
  static constexpr int kStageBytes = T::kBlockN * T::kHeadDim;
  static_assert(sizeof(typename T::Element) == 1 && kStageBytes <= 65536, "offsets in 16 bits");

  CUTE_HOST_DEVICE static uint32_t offsets(int u) {
    Fp8TransposeUnit const x = fp8_transpose_unit<T::kHeadDim, T::kBlockN>(u);
    return uint32_t(LayoutV{}(x.key0, x.d0)) | uint32_t(LayoutVt{}(x.d0, x.slot, 0)) << 16;
  }
  // Unit i of transposer thread tid: units tid, tid + kThreads, ...; where the threads do not
  // divide the units, the last one stands in (fwd_transpose_block skips it).
  CUTE_HOST_DEVICE static uint32_t thread_unit_offsets(int tid, int i) {
    return offsets(min(tid + i * T::kNumTransposeThreads, kUnits - 1));
  }
  // Load i reads key key0 + (i & 1) + 8 (i >> 1); store j writes column d0 + j.
  CUTE_HOST_DEVICE static uint32_t load_xor(int i) { return uint32_t(LayoutV{}((i & 1) + 8 * (i >> 1), 0)); }
  CUTE_HOST_DEVICE static uint32_t store_xor(int j) { return uint32_t(LayoutVt{}(j, 0, 0)); }
};

CUTE_DEVICE uint32_t lds_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
CUTE_DEVICE void sts_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
// x, read anew at every block: otherwise the compiler hoists the 8 addresses of each unit out of
// the block loop and spills them (the producer warpgroup has 56 registers).
CUTE_DEVICE uint32_t per_block(uint32_t x) {
  asm volatile("mov.b32 %0, %0;\n" : "+r"(x));
  return x;
}

// The offsets a thread's transposer holds across blocks: every unit's (Fp8TransposeMap::offsets),
// or none (the FA3_FP8_LEAN_TRANSPOSER and FA3_FP8_LDSM_TRANSPOSER experiments: fwd_traits.cuh).
template <class T>
using Fp8TransposeOffsets =
    uint32_t[T::kLeanTranspose || T::kLdsmTranspose ? 1 : Fp8TransposeMap<T>::kUnitsPerThread];

// One V block at shared addresses v (stage base) to vt. Two units at a time: their 8 loads are in
// flight together before the permutes.
template <class T>
CUTE_DEVICE void fwd_transpose_block(uint32_t v, uint32_t vt, Fp8TransposeOffsets<T> const& offs, int tid) {
  using Map = Fp8TransposeMap<T>;
  constexpr int kThreads = T::kNumTransposeThreads;
  // Every thread has unit i but, where the threads do not divide the units, the last one.
  auto has_unit = [&](int i) { return (i + 1) * kThreads <= Map::kUnits || tid + i * kThreads < Map::kUnits; };
  // Unit i's offsets: from the table, or computed here from the thread index (read anew at every
  // block, so that they are not hoisted out of the block loop either).
  auto unit_offsets = [&](int i) -> uint32_t {
    if constexpr (T::kLeanTranspose) return Map::thread_unit_offsets(int(per_block(uint32_t(tid))), i);
    else return per_block(offs[i]);
  };
  CUTLASS_PRAGMA_UNROLL
  for (int i0 = 0; i0 < Map::kUnitsPerThread; i0 += 2) {
    uint32_t w[2][4], st[2];
    CUTLASS_PRAGMA_UNROLL
    for (int i = i0; i < i0 + 2 && i < Map::kUnitsPerThread; ++i) {
      if (!has_unit(i)) continue;
      uint32_t const both = unit_offsets(i);
      uint32_t const ld = both & 0xffffu;
      if constexpr (T::kLeanTranspose) st[i - i0] = both >> 16;
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < 4; ++k) w[i - i0][k] = lds_u32(v + (ld ^ Map::load_xor(k)));
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = i0; i < i0 + 2 && i < Map::kUnitsPerThread; ++i) {
      if (!has_unit(i)) continue;
      uint32_t const st_i = T::kLeanTranspose ? st[i - i0] : per_block(offs[i]) >> 16;
      uint32_t out[4];
      transpose_4x4_bytes(w[i - i0], out);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < 4; ++j) sts_u32(vt + (st_i ^ Map::store_xor(j)), out[j]);
    }
  }
}

// ---- FA3_FP8_LDSM_TRANSPOSER (the experiment in fwd_traits.cuh): the same transpose by
// ldmatrix.trans / stmatrix, on warps 1-2. A tile is one 16-key chunk (keys 16 c ..) x 32 columns
// (d0 ..): ldmatrix.x4.trans reads four 8 x 8 matrices of 16-bit words of V, keys 0-7 | 8-15 of
// the chunk x columns d0 .. d0 + 15 | d0 + 16 .. d0 + 31 (matrix m = lane / 8 gets its row lane % 8
// from that lane's address), and gives lane t (q = t % 4, e = 2 (t / 4)) keys 2q, 2q + 1 (from the
// second and fourth matrices 8 + 2q, 9 + 2q) at columns d0 + e, d0 + e + 1. Two byte permutes per
// matrix pair turn those into, per column, the keys of slots 4q .. 4q + 3 (fp8_key_slot), and
// stmatrix.x4 writes them as matrix rows d0 + e (+ 1) (+ 16) of Vt, 16 bytes = the chunk's slots,
// lane t's word at byte 4q. 512 bytes in one LDSM, four PRMT and one STSM. Warp w takes the column
// groups of 32 whose index has its low bit = w, every chunk.
// The layouts are linear over XOR in the coordinates' bits (as for Fp8TransposeMap), so a lane's
// address for tile j is its tile-0 offset XOR tile j's lane-0 offset: the bits its own offsets
// can have (mask()) by a XOR, the rest by an add that folds into the instruction's immediate.
template <class T>
struct Fp8LdsmTransposeMap {
  using LayoutV = typename T::SmemLayoutK1;   // (n, d), one stage
  using LayoutVt = typename T::SmemLayoutVt;  // (d, n, stages)
  static constexpr int kWarps = 2;
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
// previous tile's permutes (a load's latency per tile). On 32 registers (the hd256 128-key tile)
// one at a time, with the tiles' XORed offsets formed per block (per_block): hoisted out of the
// block loop they spilled 28 B.
template <class T>
CUTE_DEVICE void fwd_transpose_block_ldsm(uint32_t v, uint32_t vt, uint32_t x_ld, uint32_t x_st) {
  using Map = Fp8LdsmTransposeMap<T>;
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

// Run by the transposer threads: warps 1-3 of warpgroup 0 (warps 1-2 with kLdsmTranspose).
template <class T>
CUTE_DEVICE void fwd_transpose_v(typename T::Params const& p, typename T::SharedStorage& ss,
                                 typename T::Pipeline& pipe_v, typename T::PipelineVt& pipe_vt) {
  using Map = Fp8TransposeMap<T>;
  int const tid = threadIdx.x - 32;
  Fp8TransposeOffsets<T> offs;
  // kLdsmTranspose: this lane's tile-0 offsets in its warp (Fp8LdsmTransposeMap).
  uint32_t x_ld = 0, x_st = 0;
  if constexpr (T::kLdsmTranspose) {
    using Ldsm = Fp8LdsmTransposeMap<T>;
    x_ld = Ldsm::ld_offset(tid % 32, tid / 32, 0);
    x_st = Ldsm::st_offset(tid % 32, tid / 32, 0);
  } else if constexpr (!T::kLeanTranspose) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < Map::kUnitsPerThread; ++i) offs[i] = Map::thread_unit_offsets(tid, i);
  }
  uint32_t const v0 = cute::cast_smem_ptr_to_uint(ss.v.data());
  uint32_t const vt0 = cute::cast_smem_ptr_to_uint(ss.vt.data());
  typename T::PipelineState read;  // of pipe_v: starts at phase 0 like the consumers'
  int const num_tiles = p.sched.num_tiles();
  static_assert(!T::kDynamicSchedule, "the transposers follow the producer's tiles on their own");
  for (int t = blockIdx.x; t < num_tiles; t = p.sched.template next<false>(t)) {
    FwdTile const tile = fwd_tile<T>(p, t);
    for (int n = tile.n_begin; n < tile.n_end; ++n) {
      pipe_v.consumer_wait(read);
      // The Vt ring has the V ring's stages and advances with it: its producer state is read's
      // with the phase flipped (a producer starts at phase 1). One state less to keep: the
      // 224-key tile's transposers spilled 8 B on 40 registers with two.
      typename T::PipelineState const write(read.index(), read.phase() ^ 1u, read.count());
      pipe_vt.producer_acquire(write);
      uint32_t const v = v0 + read.index() * Map::kStageBytes, vt = vt0 + write.index() * Map::kStageBytes;
      if constexpr (T::kLdsmTranspose) fwd_transpose_block_ldsm<T>(v, vt, x_ld, x_st);
      else fwd_transpose_block<T>(v, vt, offs, tid);
      cutlass::arch::fence_view_async_shared();  // the consumers' WGMMAs read these stores
      pipe_vt.producer_commit(write);
      pipe_v.consumer_release(read);
      ++read;
    }
  }
}

}  // namespace fa3
