// Launch entry points: one per direction, dispatching on (dtype, head_dim) to the compiled
// instantiations. Host code; no CUDA kernel code and no XLA types.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "fa3/params.h"

namespace fa3 {

// The head dims that have a tile table, ascending (CMake's FA3_HEAD_DIMS picks among them).
constexpr int kKernelHeadDims[] = {64, 96, 128, 192, 256};

// Whether an instantiation for this (dtype, head_dim) was compiled into this build.
bool fwd_compiled(DType dtype, int head_dim);
bool bwd_compiled(DType dtype, int head_dim);

// The compiled head dim a call with these head dims (q/k's, v's) runs on: the smallest
// instantiation of this dtype at least as large as both; 0 when this build has none.
int fwd_kernel_head_dim(DType dtype, int head_dim, int head_dim_v);
int bwd_kernel_head_dim(DType dtype, int head_dim, int head_dim_v);

// Keys per block (kBlockN) of the forward tile that run_fwd launches for these params (their
// dtype, shape, options and documents; no pointer is read); 0 when no kernel runs them. The FP8
// numerics depend on the key blocks (P is rounded against each block's running max): the GPU
// tests' oracle takes them from here.
int fwd_key_block(const FwdParams& params);

// Bytes of workspace the forward needs for these params (a tile counter for the dynamic
// schedule, or 0), at most kFwdWorkspaceBytes; the caller provides it as params.workspace.
size_t fwd_workspace_bytes(const FwdParams& params);
// Size of the forward FFI call's workspace result (jax_fa3/_ops.py declares it as 4 int32).
constexpr size_t kFwdWorkspaceBytes = 16;
// Enqueue the forward kernel(s) on `stream`. Never synchronises, never allocates.
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream);

// Bytes of scratch the backward needs for these params (the fp32 dQ accumulator and
// softmax-derivative row sums); the caller allocates and sets params.workspace.
size_t bwd_workspace_bytes(const BwdParams& params);
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream);

// Templates each instantiation file defines for one (Element, HeadDim); Element is
// cutlass::bfloat16_t or cutlass::half_t.
template <typename Element, int kHeadDim>
size_t fwd_workspace_bytes_impl(const FwdParams& params);
template <typename Element, int kHeadDim>
int fwd_key_block_impl(const FwdParams& params);
template <typename Element, int kHeadDim>
cudaError_t run_fwd_impl(const FwdParams& params, cudaStream_t stream);
template <typename Element, int kHeadDim>
size_t bwd_workspace_bytes_impl(const BwdParams& params);
template <typename Element, int kHeadDim>
cudaError_t run_bwd_impl(const BwdParams& params, cudaStream_t stream);

}  // namespace fa3
