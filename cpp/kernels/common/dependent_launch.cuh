// Programmatic dependent launch: a kernel launched with launch_dependent may start while the
// previous kernel on the stream is still finishing, so that its CTAs' start and prologue
// (barrier init, descriptor prefetch) overlap that kernel's tail instead of following it.
// The backward launches each of its kernels so (preprocess, main, postprocess, dK/dV tail):
// three kernel boundaries per call (H200, hd128 512: +1.3% non-causal, +2.6% causal). The
// forward, one kernel after XLA's ops, gained nothing (-1% at 2k) and launches plainly.
//
// The contract, per kernel:
//   * no global memory access (read or write) before wait_for_previous_grid(), which returns
//     once the previous grid has completed and its writes are visible (at once when the kernel
//     was launched plainly, or the stream's previous op was not a kernel);
//   * allow_next_grid() lets the next dependent launch start before this grid ends (else it
//     starts as this grid's CTAs exit). It does not make this grid's writes visible early: the
//     next kernel's wait still waits for this grid to complete.
//
// Not CUTLASS's wait_on_dependent_grids / launch_dependent_grids: they compile to nothing unless
// CUTLASS_ENABLE_GDC_FOR_SM90 is defined, and a dependent launch whose wait vanished would race.
#pragma once

#include <cuda_runtime.h>

namespace fa3 {

__device__ __forceinline__ void wait_for_previous_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void allow_next_grid() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// kernel<<<grid, block, smem_bytes, stream>>>(params), as a programmatic dependent.
template <class Kernel, class Params>
cudaError_t launch_dependent(Kernel kernel, dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                             Params const& params) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, params);
}

}  // namespace fa3
