// Compile check of forward kernel instantiations (no GPU): ptxas -v registers/spills and, with
// cuobjdump, the SASS. Either one traits type (-include a header defining FWD_TRAITS) or the
// whole tile table of one head dim as the build instantiates it (FWD_HEAD_DIM, FWD_ELEMENT).
// Driven by compile_fwd.sh next to this file.
#include <cutlass/numeric_types.h>

#ifdef FWD_HEAD_DIM
#include "fwd/fwd_launch.cuh"
namespace fa3 {
template cudaError_t run_fwd_impl<FWD_ELEMENT, FWD_HEAD_DIM>(const FwdParams&, cudaStream_t);
}
#else
#include "fwd/fwd_kernel.cuh"
#ifndef FWD_TRAITS
#define FWD_TRAITS fa3::FwdTraits<cutlass::bfloat16_t, 128, 128, 128, 2, true>
#endif
using Traits = FWD_TRAITS;
template __global__ void fa3::fwd_kernel<Traits>(__grid_constant__ typename Traits::Params const);
#endif
