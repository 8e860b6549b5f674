// Maps (dtype, head dims) to the instantiations this build compiled (listed in the generated
// fa3_configs.inc): a call runs on the smallest compiled head dim that holds both of its head dims
// (q/k's and v's). None: cudaErrorNotSupported; the FFI handler checks *_kernel_head_dim() first
// and reports it by name.
#include <algorithm>

#include <cutlass/numeric_types.h>

#include "fa3/launch.h"

#define FA3_FWD_CONFIG(Element, kDType, kHeadDim)
#define FA3_BWD_CONFIG(Element, kDType, kHeadDim)

namespace fa3 {

bool fwd_compiled(DType dtype, int head_dim) {
#undef FA3_FWD_CONFIG
#define FA3_FWD_CONFIG(Element, kDType, kHeadDim) \
  if (dtype == DType::kDType && head_dim == kHeadDim) return true;
#include "fa3_configs.inc"
  return false;
}

bool bwd_compiled(DType dtype, int head_dim) {
#undef FA3_FWD_CONFIG
#define FA3_FWD_CONFIG(Element, kDType, kHeadDim)
#undef FA3_BWD_CONFIG
#define FA3_BWD_CONFIG(Element, kDType, kHeadDim) \
  if (dtype == DType::kDType && head_dim == kHeadDim) return true;
#include "fa3_configs.inc"
  return false;
}

namespace {

// The smallest head dim with a tile table that `compiled` holds for this dtype and that is at
// least both head dims, or 0.
int smallest_compiled(bool (*compiled)(DType, int), DType dtype, int head_dim, int head_dim_v) {
  for (int d : kKernelHeadDims)
    if (d >= std::max(head_dim, head_dim_v) && compiled(dtype, d)) return d;
  return 0;
}

}  // namespace

int fwd_kernel_head_dim(DType dtype, int head_dim, int head_dim_v) {
  return smallest_compiled(fwd_compiled, dtype, head_dim, head_dim_v);
}

int bwd_kernel_head_dim(DType dtype, int head_dim, int head_dim_v) {
  return smallest_compiled(bwd_compiled, dtype, head_dim, head_dim_v);
}

int fwd_key_block(const FwdParams& p) {
  const int d = fwd_kernel_head_dim(p.dtype, p.shape.head_dim, p.shape.head_dim_v);
#undef FA3_BWD_CONFIG
#define FA3_BWD_CONFIG(Element, kDType, kHeadDim)
#undef FA3_FWD_CONFIG
#define FA3_FWD_CONFIG(Element, kDType, kHeadDim) \
  if (p.dtype == DType::kDType && d == kHeadDim) return fwd_key_block_impl<Element, kHeadDim>(p);
#include "fa3_configs.inc"
  return 0;
}

size_t fwd_workspace_bytes(const FwdParams& p) {
  const int d = fwd_kernel_head_dim(p.dtype, p.shape.head_dim, p.shape.head_dim_v);
#undef FA3_BWD_CONFIG
#define FA3_BWD_CONFIG(Element, kDType, kHeadDim)
#undef FA3_FWD_CONFIG
#define FA3_FWD_CONFIG(Element, kDType, kHeadDim) \
  if (p.dtype == DType::kDType && d == kHeadDim) return fwd_workspace_bytes_impl<Element, kHeadDim>(p);
#include "fa3_configs.inc"
  return 0;
}

cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream) {
  const int d = fwd_kernel_head_dim(p.dtype, p.shape.head_dim, p.shape.head_dim_v);
#undef FA3_FWD_CONFIG
#define FA3_FWD_CONFIG(Element, kDType, kHeadDim) \
  if (p.dtype == DType::kDType && d == kHeadDim) return run_fwd_impl<Element, kHeadDim>(p, stream);
#include "fa3_configs.inc"
  return cudaErrorNotSupported;
}

size_t bwd_workspace_bytes(const BwdParams& p) {
  const int d = bwd_kernel_head_dim(p.dtype, p.shape.head_dim, p.shape.head_dim_v);
#undef FA3_FWD_CONFIG
#define FA3_FWD_CONFIG(Element, kDType, kHeadDim)
#undef FA3_BWD_CONFIG
#define FA3_BWD_CONFIG(Element, kDType, kHeadDim) \
  if (p.dtype == DType::kDType && d == kHeadDim) return bwd_workspace_bytes_impl<Element, kHeadDim>(p);
#include "fa3_configs.inc"
  return 0;
}

cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream) {
  const int d = bwd_kernel_head_dim(p.dtype, p.shape.head_dim, p.shape.head_dim_v);
#undef FA3_BWD_CONFIG
#define FA3_BWD_CONFIG(Element, kDType, kHeadDim) \
  if (p.dtype == DType::kDType && d == kHeadDim) return run_bwd_impl<Element, kHeadDim>(p, stream);
#include "fa3_configs.inc"
  return cudaErrorNotSupported;
}

}  // namespace fa3
