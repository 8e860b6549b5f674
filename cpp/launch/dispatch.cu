// Maps (dtype, head_dim) to the instantiations this build compiled (listed in the generated
// fa3_configs.inc). An uncompiled combination returns cudaErrorNotSupported; the FFI handler
// checks fwd_compiled()/bwd_compiled() first and reports it by name.
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

size_t fwd_workspace_bytes(const FwdParams& p) {
#undef FA3_BWD_CONFIG
#define FA3_BWD_CONFIG(Element, kDType, kHeadDim)
#undef FA3_FWD_CONFIG
#define FA3_FWD_CONFIG(Element, kDType, kHeadDim)              \
  if (p.dtype == DType::kDType && p.shape.head_dim == kHeadDim) \
    return fwd_workspace_bytes_impl<Element, kHeadDim>(p);
#include "fa3_configs.inc"
  return 0;
}

cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream) {
#undef FA3_BWD_CONFIG
#define FA3_BWD_CONFIG(Element, kDType, kHeadDim)
#undef FA3_FWD_CONFIG
#define FA3_FWD_CONFIG(Element, kDType, kHeadDim)              \
  if (p.dtype == DType::kDType && p.shape.head_dim == kHeadDim) \
    return run_fwd_impl<Element, kHeadDim>(p, stream);
#include "fa3_configs.inc"
  return cudaErrorNotSupported;
}

size_t bwd_workspace_bytes(const BwdParams& p) {
#undef FA3_FWD_CONFIG
#define FA3_FWD_CONFIG(Element, kDType, kHeadDim)
#undef FA3_BWD_CONFIG
#define FA3_BWD_CONFIG(Element, kDType, kHeadDim)              \
  if (p.dtype == DType::kDType && p.shape.head_dim == kHeadDim) \
    return bwd_workspace_bytes_impl<Element, kHeadDim>(p);
#include "fa3_configs.inc"
  return 0;
}

cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream) {
#undef FA3_BWD_CONFIG
#define FA3_BWD_CONFIG(Element, kDType, kHeadDim)              \
  if (p.dtype == DType::kDType && p.shape.head_dim == kHeadDim) \
    return run_bwd_impl<Element, kHeadDim>(p, stream);
#include "fa3_configs.inc"
  return cudaErrorNotSupported;
}

}  // namespace fa3
