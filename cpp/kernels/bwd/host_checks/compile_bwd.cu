// Compile check of one backward instantiation (no GPU): the preprocess, main (with and without
// softcap) and postprocess kernels of one (element, head dim) and its workspace size, as the
// build instantiates them.
// Driven by compile_bwd.sh next to this file (BWD_HEAD_DIM, BWD_ELEMENT come from -D).
#include <cutlass/numeric_types.h>
#include "bwd/bwd_launch.cuh"
namespace fa3 {
template cudaError_t run_bwd_impl<BWD_ELEMENT, BWD_HEAD_DIM>(const BwdParams&, cudaStream_t);
template size_t bwd_workspace_bytes_impl<BWD_ELEMENT, BWD_HEAD_DIM>(const BwdParams&);
}
