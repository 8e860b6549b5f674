// Host side of the forward kernel: the tile table, TMA descriptors, the persistent grid, launch.
// Each generated instantiation file includes this and instantiates run_fwd_impl<Element, d>.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>

#include "fa3/launch.h"
#include "fa3/params.h"
#include "fwd/fwd_kernel.cuh"

namespace fa3 {

// Tile table: (kBlockM, kBlockN, kStages) per head dim. kBlockM / 64 consumer warpgroups.
// Limits that drive it: 227 KB of shared memory (Q tile + kStages x (K + V) blocks); registers
// per consumer thread (240 with 2 consumer warpgroups, 160 with 3), which must hold the O
// accumulator (d/2 fp32), S (kBlockN/2 fp32) and P (kBlockN/4 packed) at once.
template <typename Element, int kHeadDim>
struct FwdTileTable;

// d = 64: 128 x 128 for now. 192 x 128 (three consumer warpgroups at 160 registers) spilled
// 48 bytes under the 128-register entry cap of a 512-thread CTA.
template <typename E>
struct FwdTileTable<E, 64> { using type = FwdTraits<E, 64, 128, 128, 2>; };
// d = 96: 128 x 128 keeps RS P in registers with room to spare (O 48 + S 64 + P 32); 112 KB.
template <typename E>
struct FwdTileTable<E, 96> { using type = FwdTraits<E, 96, 128, 128, 2>; };
// d = 128: 128 x 128, 2 stages: 32 + 2 x 2 x 32 = 160 KB; registers O 64 + S 64 + P 32.
template <typename E>
struct FwdTileTable<E, 128> { using type = FwdTraits<E, 128, 128, 128, 2>; };
// d = 192: 128 x 96, 2 stages: 48 + 2 x 2 x 36 = 192 KB; registers O 96 + S 48 + P 24.
template <typename E>
struct FwdTileTable<E, 192> { using type = FwdTraits<E, 192, 128, 96, 2>; };
// d = 256: 128 x 80 is what smem allows with 2 stages: 64 + 2 x 2 x 40 = 224 KB; registers
// O 128 + S 40 + P 20.
template <typename E>
struct FwdTileTable<E, 256> { using type = FwdTraits<E, 256, 128, 80, 2>; };

template <class T>
typename T::Params make_fwd_params(const FwdParams& fp) {
  using Element = typename T::Element;
  using D = typename T::D;
  const AttentionShape& s = fp.shape;
  constexpr int64_t d = T::kHeadDim;
  auto q_shape = make_shape(s.seqlen_q, D{}, s.heads_q, s.batch);
  auto q_stride = make_stride(int64_t(s.heads_q) * d, _1{}, d, int64_t(s.seqlen_q) * s.heads_q * d);
  auto k_shape = make_shape(s.seqlen_k, D{}, s.heads_kv, s.batch);
  auto k_stride = make_stride(int64_t(s.heads_kv) * d, _1{}, d, int64_t(s.seqlen_k) * s.heads_kv * d);
  Tensor mQ = make_tensor(make_gmem_ptr(static_cast<Element const*>(fp.q)), q_shape, q_stride);
  Tensor mK = make_tensor(make_gmem_ptr(static_cast<Element const*>(fp.k)), k_shape, k_stride);
  Tensor mV = make_tensor(make_gmem_ptr(static_cast<Element const*>(fp.v)), k_shape, k_stride);
  Tensor mO = make_tensor(make_gmem_ptr(static_cast<Element*>(fp.out)), q_shape, q_stride);

  // The band limits the work per tile only if one of its sides cuts into the key range.
  bool varying = (int64_t)fp.opts.window_left < (int64_t)s.seqlen_q + s.seqlen_k ||
                 (int64_t)fp.opts.window_right < (int64_t)s.seqlen_q + s.seqlen_k;
  StaticTileScheduler sched;
  sched.num_m_blocks = (s.seqlen_q + T::kBlockM - 1) / T::kBlockM;
  sched.num_heads = s.heads_q;
  sched.num_batch = s.batch;
  sched.longest_first = varying ? 1 : 0;
  // K+V bytes of one head; keep about 32 MB of them (half the 50 MB L2) in flight.
  int64_t kv_bytes = 2 * int64_t(s.seqlen_k) * d * int64_t(sizeof(Element));
  int64_t heads = std::max<int64_t>(1, (int64_t(32) << 20) / std::max<int64_t>(kv_bytes, 1));
  sched.heads_per_section = int(std::min<int64_t>(heads, int64_t(s.heads_q) * s.batch));

  typename T::Params p{
      make_tma_copy(SM90_TMA_LOAD{}, mQ, typename T::SmemLayoutQ1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mK, typename T::SmemLayoutK1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mV, typename T::SmemLayoutK1{}),
      make_tma_copy(SM90_TMA_STORE{}, mO, typename T::SmemLayoutQ1{}),
      s.seqlen_q,
      s.seqlen_k,
      s.heads_q,
      s.heads_kv,
      s.batch,
      s.heads_q / s.heads_kv,
      BandMask{s.seqlen_q, s.seqlen_k, fp.opts.window_left, fp.opts.window_right},
      SoftmaxScale::make(fp.opts.softmax_scale, fp.opts.softcap),
      fp.lse,
      sched,
  };
  return p;
}

template <typename Element, int kHeadDim>
cudaError_t run_fwd_impl(const FwdParams& fp, cudaStream_t stream) {
  using T = typename FwdTileTable<Element, kHeadDim>::type;
  typename T::Params p = make_fwd_params<T>(fp);
  int num_tiles = p.sched.num_tiles();
  int num_sms = fp.num_sms > 0 ? fp.num_sms : 132;
  int grid = std::min(num_tiles, num_sms);
  auto kernel = fwd_kernel<T>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
      e != cudaSuccess)
    return e;
  kernel<<<grid, T::kNumThreads, T::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fa3
