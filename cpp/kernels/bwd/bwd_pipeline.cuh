// How the backward kernels' roles synchronise, in one place: the shared-memory rings and their
// mbarriers, the named barriers (ids below), the deterministic dQ turn counters and the bulk-async
// operations of the dQ writer; also where each role finds the shared storage and its thread index.
//
// Rings (mbarriers in SharedStorage; the producer's side is bwd_producer.cuh):
//   kv_full        K and V of the CTA, once (TMA transaction bytes).
//   full[s]/empty[s]  stage s of the Q/dO/LSE/D ring, kStages deep (split-D: Q/LSE only). full
//                  completes on the TMA bytes of Q and LSE, full_do[s] (main kernel) on those of
//                  dO and D, so that S^T is issued before dO lands; empty once every consumer
//                  thread has released the stage (release_stage).
//   do_full/do_empty  split-D only: its one-stage dO/D ring, released as soon as dV^T has read dO.
// A step counter `it` carries the ring state: stage it % kStages, phase (it / kStages) & 1.
// Named barriers: the two consumer warpgroups around the shared dS tile, the deterministic turn
// taking of the paths without the dQ writer, and each consumer warpgroup with the dQ writer warp.
#pragma once

#include "common/utils.cuh"

#include <cutlass/arch/barrier.h>

namespace fa3 {
namespace bwd {

// Named barrier ids (CUTLASS adds its reserved offset of 8; ids 0..7 are ours, 8 in all).
//   DsFull/DsFree: the two consumer warpgroups around the shared dS tile (256 threads).
//   DetIn/DetOut: deterministic turn taking in the consumers (dQ without the writer, 256 threads).
//   DQFull0/1, DQEmpty0/1: consumer warpgroup w and the dQ writer warp (128 + 32 threads).
enum : uint32_t {
  kBarDsFull = 0, kBarDsFree = 1, kBarDetIn = 2, kBarDetOut = 3,
  kBarDQFull0 = 4, kBarDQEmpty0 = 6  // + warpgroup
};
constexpr int kDQBarThreads = 128 + 32;

// K/V and Q/dO/LSE/D ring barriers (thread 0, before the CTA's __syncthreads).
template <class Tr>
CUTE_DEVICE void init_ring_barriers(typename Tr::SharedStorage& ss) {
  using TxBar = cutlass::arch::ClusterTransactionBarrier;
  using ClusterBar = cutlass::arch::ClusterBarrier;
  TxBar::init(&ss.kv_full, 1);
  CUTLASS_PRAGMA_UNROLL
  for (int s = 0; s < Tr::kStages; ++s) {
    TxBar::init(&ss.full[s], 1);
    ClusterBar::init(&ss.empty[s], Tr::kNumMmaThreads);  // release_stage: every consumer thread
  }
}

// The main kernel's: those above, full_do[s] (dO + D of stage s; split-D has its own dO ring)
// and the dS ring's ds_full (kDsFullMbar) and ds_empty (kPingPong): every consumer thread arrives.
template <class Tr>
CUTE_DEVICE void init_main_ring_barriers(typename Tr::SharedStorage& ss) {
  init_ring_barriers<Tr>(ss);
  CUTLASS_PRAGMA_UNROLL
  for (int s = 0; s < Tr::kStages; ++s) cutlass::arch::ClusterTransactionBarrier::init(&ss.full_do[s], 1);
  CUTLASS_PRAGMA_UNROLL
  for (int s = 0; s < Tr::kStagesdS; ++s) {
    if constexpr (Tr::kDsFullMbar) cutlass::arch::ClusterBarrier::init(&ss.ds_full[s], Tr::kNumMmaThreads);
    if constexpr (Tr::kPingPong) cutlass::arch::ClusterBarrier::init(&ss.ds_empty[s], Tr::kNumMmaThreads);
  }
}

// The empty barriers of the Q/dO/LSE/D ring(s) complete when every consumer thread (kNumMmaThreads)
// has arrived: each thread arrives for itself after its own last read of the stage, so its
// reads of LSE and D are ordered before the producer's next bulk copy into the stage by a direct
// release/acquire pair, as CUTLASS's PipelineTmaAsync does without a cluster. (One elected lane
// per warp after __syncwarp, which ptxas compiles to no instruction, left the other lanes'
// reads ordered only through the step's named barriers: issue 24's racecheck report.)
CUTE_DEVICE void release_stage(uint64_t* empty) { cutlass::arch::ClusterBarrier::arrive(empty); }

// The kernel's shared storage at the first 1024-byte boundary of the dynamic smem window (the
// swizzled TMA tiles need it). kSharedSpace (the consumers): reach it by indexing the __shared__
// array, so the compiler keeps the shared space (LDS/STS for the statistics and the dQ tile, not
// generic LD.E/ST.E through the LSU's global queue); else through an integer (the producer, whose
// accesses are TMA/bulk/mbarrier operands anyway: the shared-space form spilled 20 B there).
template <class Storage, bool kSharedSpace>
__device__ __forceinline__ Storage& aligned_storage(char* smem_raw) {
  if constexpr (kSharedSpace) {
    const uint32_t pad = (0u - cute::cast_smem_ptr_to_uint(smem_raw)) & 1023u;
    return *reinterpret_cast<Storage*>(smem_raw + pad);
  } else {
    return *reinterpret_cast<Storage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  }
}

// A consumer thread's index ct (0..255), its warpgroup wg (0..1) and its thread t_in_wg in the
// warpgroup. kUniformWg: wg through a shuffle, which ptxas knows is warp-uniform, and ct built
// from it so that the MMA thread slices' (ct / 128) % 2 folds to wg: the per-warpgroup WGMMA
// descriptors then live in uniform registers (no R2UR per step).
template <bool kUniformWg>
CUTE_DEVICE void consumer_thread(int& ct, int& wg, int& t_in_wg) {
  if constexpr (kUniformWg) {
    const unsigned wg_u = unsigned(cutlass::canonical_warp_group_idx()) - 1u;
    __builtin_assume(wg_u < 2u);
    wg = int(wg_u);
    t_in_wg = int(threadIdx.x % 128u);
    ct = int((wg_u << 7) | (threadIdx.x % 128u));
  } else {
    ct = threadIdx.x - 128;
    wg = ct / 128;
    t_in_wg = ct % 128;
  }
}

// Deterministic dQ: a counter per query block holds how many key blocks have added their dQ;
// each adds on its turn (bwd_dq.cuh) and publishes the next one.
CUTE_DEVICE int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
CUTE_DEVICE void red_release_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// The dQ writer's ticket (bwd_dq.cuh): the counter's value before this add (no ordering: what a
// ticket lets us read is acquired with the flag, ld_acquire).
CUTE_DEVICE int atom_relaxed_add(int* p, int v) {
  int old;
  asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// dQ writer: bulk store or bulk reduce-add of a shared-memory fp32 tile into global memory
// (async proxy, bulk-group completion), and the proxy fence that orders it with generic accesses.
// The dQ accumulator lines are hit again by the other key blocks of the same query block (other
// CTAs, soon after): keep them in L2 (evict_last), as FA3 does.
CUTE_DEVICE uint64_t evict_last_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
CUTE_DEVICE void bulk_reduce_add_f32(float* gmem, const float* smem, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.f32 [%0], [%1], %2, %3;"
               ::"l"(gmem), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes), "l"(evict_last_policy()) : "memory");
}
CUTE_DEVICE void bulk_store_f32(float* gmem, const float* smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;"
               ::"l"(gmem), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes), "l"(evict_last_policy()) : "memory");
}
CUTE_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// All committed bulk operations have finished reading shared memory.
CUTE_DEVICE void bulk_wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// All committed bulk operations are complete (their global writes performed).
CUTE_DEVICE void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
CUTE_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

}  // namespace bwd
}  // namespace fa3
