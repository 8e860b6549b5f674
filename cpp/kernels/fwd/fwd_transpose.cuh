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
template <class T, class TV, class TVt>
CUTE_DEVICE void fwd_transpose_block(TV const& sV, TVt& sVt, int tid) {
  constexpr int kGroups = T::kHeadDim / 4;                 // column groups of a key
  constexpr int kUnits = T::kBlockN / 16 * 4 * kGroups;  // chunks x quads x column groups
  CUTLASS_PRAGMA_NO_UNROLL
  for (int u = tid; u < kUnits; u += T::kNumTransposeThreads) {
    int const d0 = 4 * (u % kGroups);
    int const cq = u / kGroups;  // chunk * 4 + q
    int const key0 = (cq / 4) * 16 + 2 * (cq % 4);
    static_assert(fp8_key_slot(0) == 0 && fp8_key_slot(1) == 1 && fp8_key_slot(8) == 2 && fp8_key_slot(9) == 3);
    auto word = [&](int key) { return *reinterpret_cast<uint32_t const*>(&sV(key, d0)); };
    uint32_t const w0 = word(key0), w1 = word(key0 + 1), w2 = word(key0 + 8), w3 = word(key0 + 9);
    // Byte j of word i is (key i, column d0 + j); out word j is (column d0 + j, keys 0..3).
    uint32_t const lo01 = __byte_perm(w0, w1, 0x5140), hi01 = __byte_perm(w0, w1, 0x7362);
    uint32_t const lo23 = __byte_perm(w2, w3, 0x5140), hi23 = __byte_perm(w2, w3, 0x7362);
    int const slot = (cq / 4) * 16 + 4 * (cq % 4);  // fp8_key_slot(key0 % 16) + the chunk
    *reinterpret_cast<uint32_t*>(&sVt(d0 + 0, slot)) = __byte_perm(lo01, lo23, 0x5410);
    *reinterpret_cast<uint32_t*>(&sVt(d0 + 1, slot)) = __byte_perm(lo01, lo23, 0x7632);
    *reinterpret_cast<uint32_t*>(&sVt(d0 + 2, slot)) = __byte_perm(hi01, hi23, 0x5410);
    *reinterpret_cast<uint32_t*>(&sVt(d0 + 3, slot)) = __byte_perm(hi01, hi23, 0x7632);
  }
}

// Run by the 96 threads of warps 1-3 of warpgroup 0.
template <class T>
CUTE_DEVICE void fwd_transpose_v(typename T::Params const& p, typename T::SharedStorage& ss,
                                 typename T::Pipeline& pipe_v, typename T::PipelineVt& pipe_vt) {
  int const tid = threadIdx.x - 32;
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutK{});     // (n, d, stages)
  Tensor sVt = make_tensor(make_smem_ptr(ss.vt.data()), typename T::SmemLayoutVt{});  // (d, n, stages)
  typename T::PipelineState read;  // of pipe_v: starts at phase 0 like the consumers'
  auto write = cutlass::make_producer_start_state<typename T::PipelineVt>();
  int const num_tiles = p.sched.num_tiles();
  for (int t = blockIdx.x; t < num_tiles; t += int(gridDim.x)) {
    FwdTile const tile = fwd_tile<T>(p, t);
    for (int n = tile.n_begin; n < tile.n_end; ++n) {
      pipe_v.consumer_wait(read);
      pipe_vt.producer_acquire(write);
      Tensor sVt_w = sVt(_, _, write.index());
      fwd_transpose_block<T>(sV(_, _, read.index()), sVt_w, tid);
      cutlass::arch::fence_view_async_shared();  // the consumers' WGMMAs read these stores
      pipe_vt.producer_commit(write);
      pipe_v.consumer_release(read);
      ++read;
      ++write;
    }
  }
}

}  // namespace fa3
