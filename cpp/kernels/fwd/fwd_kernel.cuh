// FlashAttention-3 style forward kernel for Hopper (sm_90a): the __global__ entry.
//
// One CTA = 1 producer warpgroup + kNumMmaWG (2 or 3) consumer warpgroups, one CTA per SM,
// persistent over output tiles of kBlockM query rows of one (batch, head) (common/scheduler.cuh):
//   * producer (fwd_producer.cuh; one thread, registers lowered with setmaxnreg): TMA loads of
//     Q and of the K / V blocks; for FP8 warps 1-2 of its warpgroup transpose V
//     (fwd_transpose.cuh);
//   * consumers (fwd_consumer.cuh; registers raised): 64 query rows each, Q K^T, mask, online
//     softmax, P V, then the epilogue (fwd_epilogue.cuh);
//   * their synchronisation (K / V rings, Q hand-off, ping-pong barriers): fwd_pipeline.cuh;
//     the compile-time configuration of a tile: fwd_traits.cuh; the host side: fwd_launch.cuh.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "fwd/fwd_consumer.cuh"
#include "fwd/fwd_pipeline.cuh"
#include "fwd/fwd_producer.cuh"
#include "fwd/fwd_traits.cuh"
#include "fwd/fwd_transpose.cuh"

namespace fa3 {

template <class T>
__global__ void __launch_bounds__(T::kNumThreads, 1) fwd_kernel(__grid_constant__ typename T::Params const p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ss = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  int const warp_group = cutlass::canonical_warp_group_idx();

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    fwd_q_barriers_init<T>(ss);
    if constexpr (T::kFp8) {
      for (int s = 0; s < T::kStages; ++s) ss.v_end[s] = 0;
    }
  }
  typename T::Pipeline::Params const pp = fwd_kv_pipeline_params<T>(warp_group);
  typename T::Pipeline pipe_k(ss.pipe_k, pp, Shape<_1, _1, _1>{});
  typename T::Pipeline pipe_v(ss.pipe_v, fwd_kv_pipeline_params<T>(warp_group, true), Shape<_1, _1, _1>{});
  auto pipe_vt = fwd_vt_pipeline<T>(ss, warp_group);
  __syncthreads();

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (threadIdx.x == 0) fwd_producer<T>(p, ss, pipe_k, pipe_v);
    if constexpr (T::kFp8) {
      if (fwd_is_v_transposer<T>()) fwd_transpose_v<T>(ss, pipe_v, pipe_vt);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    if constexpr (T::kFp8) fwd_consumer<T>(p, ss, pipe_k, pipe_vt, warp_group - 1);
    else fwd_consumer<T>(p, ss, pipe_k, pipe_v, warp_group - 1);
  }
}

}  // namespace fa3
