// Which stage-release patterns compute-sanitizer's racecheck can follow (issue 24). A producer
// thread refills a shared-memory buffer that two consumer warps read, in rounds, handed over by
// a full/empty mbarrier pair as in the kernels' Q/dO/LSE/D ring. The consumers release the
// buffer in one of three ways:
//   0 elected:     __syncwarp, then one elected lane per warp arrives (count 2);
//   1 per-thread:  every consumer thread arrives (count 64), as CUTLASS's PipelineTmaAsync;
//   2 bar-chain:   a named barrier over both warps, then one elected lane per warp (count 2).
// All three are ordered under the PTX memory model (bar.warp.sync and bar.sync order the lanes'
// reads before the elected arrive); a hazard report for 0 or 2 means the tool does not follow
// that chain. Build and run on a Hopper machine:
//   nvcc -std=c++17 -arch=sm_90a -I<cutlass>/include scripts/racecheck_probe.cu -o /tmp/probe
//   compute-sanitizer --tool racecheck /tmp/probe
#include <cstdio>

#include <cuda_runtime.h>
#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/barrier.h>

constexpr int kRounds = 8;

template <int kMode>
__global__ void release_probe(int* out) {
  __shared__ int buf[64];
  __shared__ alignas(8) uint64_t full, empty;
  using Bar = cutlass::arch::ClusterBarrier;
  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    Bar::init(&full, 1);
    Bar::init(&empty, kMode == 1 ? 64 : 2);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  if (warp == 2) {  // producer: lane 0
    if (threadIdx.x == 64) {
      for (int r = 0; r < kRounds; ++r) {
        Bar::wait(&empty, (r & 1) ^ 1);
        for (int i = 0; i < 64; ++i) buf[i] = r * 64 + i;
        Bar::arrive(&full);
      }
    }
    return;
  }
  int sum = 0;
  for (int r = 0; r < kRounds; ++r) {
    Bar::wait(&full, r & 1);
    sum += buf[threadIdx.x];
    if constexpr (kMode == 1) {
      Bar::arrive(&empty);
    } else {
      if constexpr (kMode == 2) asm volatile("bar.sync 1, 64;" ::: "memory");
      else __syncwarp();
      if (cute::elect_one_sync()) Bar::arrive(&empty);
    }
  }
  out[threadIdx.x] = sum;
}

int main() {
  int* out;
  cudaMalloc(&out, 64 * sizeof(int));
  release_probe<0><<<1, 96>>>(out);
  release_probe<1><<<1, 96>>>(out);
  release_probe<2><<<1, 96>>>(out);
  cudaError_t err = cudaDeviceSynchronize();
  printf("release_probe: %s\n", cudaGetErrorString(err));
  cudaFree(out);
  return err == cudaSuccess ? 0 : 1;
}
