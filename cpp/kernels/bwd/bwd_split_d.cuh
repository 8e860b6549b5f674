// The split-D backward main kernel (head dim 256; traits and GEMM list in bwd_split_d_traits.cuh).
// One CTA per (64 keys, kv head, batch), warp specialised like bwd_main_kernel:
//   warpgroup 0, warp 0: producer (TMA: K, V once; Q, dO, LSE, D per step into a 2-stage ring),
//     the same code as bwd_main_kernel's (80 keys, FA3_BWD_HD256_BLOCK_N=80: dO + D in their own
//     one-stage ring instead, split_d_producer_sep_do in bwd_split_d_sep_do.cuh).
//   warpgroups 1, 2: consumers. Per step (query block of 64 rows, one query head of the group):
//     S, dP for 32 keys each -> P, dS into shared memory -> sync -> each warpgroup accumulates
//     dV^T and dK^T for its 128 head-dim rows over all 64 keys, and adds its columns of
//     dQ = dS K to the fp32 accumulator with float4 atomics.
// Shared with bwd_main.cuh: MainParams, the producer (load_kv_and_steps; its TMA types and
// byte counts are BwdLoads in bwd_traits.cuh), query_block_range, the named-barrier ids, the
// deterministic turn protocol (identical to the atomic dQ path there) and the dQ accumulator
// layout (so preprocess/postprocess are the same kernels).
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "bwd/bwd_main.cuh"
#include "bwd/bwd_split_d_sep_do.cuh"
#include "bwd/bwd_split_d_traits.cuh"
#include "common/mask.cuh"
#include "common/utils.cuh"

namespace fa3 {
namespace bwd {

// The query blocks [m_begin, m_end) a CTA walks. Without clusters its own query_block_range.
// In a cluster (Tr::kCluster CTAs on adjacent key blocks, cluster rank = key block % kCluster)
// every CTA walks the range of the cluster's keys taken as one block, the hull of the CTAs'
// ranges: all CTAs take the same steps in the same order, so each multicast tile lands in the same
// stage of every CTA and the pipeline phases agree. The band is monotone and adjacent key blocks'
// ranges touch or overlap, so the hull is their union (emulate_bwd.py checks it, BWD_CLUSTER=2);
// a key block at or past seqlen_k (the grid rounds the key-block count up to the cluster size)
// adds nothing (the block's last key is clamped to seqlen_k - 1). Steps outside a CTA's own range
// are fully masked (no row of such a block sees a key of this one): they add exact zeros.
template <class Tr>
CUTE_DEVICE void cta_query_block_range(BandMask const& band, int n_block, int& m_begin, int& m_end) {
  if constexpr (Tr::kCluster > 1)
    query_block_range(band, n_block / Tr::kCluster, Tr::kBlockN * Tr::kCluster, Tr::kBlockM, m_begin, m_end);
  else
    query_block_range(band, n_block, Tr::kBlockN, Tr::kBlockM, m_begin, m_end);
}

// FA3_BWD_HD256_CLUSTER_DQ: the dQ pair sum through distributed shared memory (SplitDClusterTraits).
// This CTA's shared address `smem` as the same offset in cluster CTA `rank`.
CUTE_DEVICE uint32_t smem_addr_in_cta(const void* smem, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(rank));
  return r;
}
// A 16-byte store into another CTA's shared memory that completes 16 transaction bytes on its
// mbarrier `bar` (both shared::cluster addresses from smem_addr_in_cta).
CUTE_DEVICE void st_async_f32x4(uint32_t addr, float a, float b, float c, float d, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
               ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d), "r"(bar) : "memory");
}
// Arrive on cluster CTA `rank`'s copy of `bar`, releasing this thread's earlier shared-memory
// reads at cluster scope (the peer overwrites what they read once the phase completes).
CUTE_DEVICE void arrive_in_cta_release_cluster(const uint64_t* bar, uint32_t rank) {
  asm volatile("{\n\t.reg .b32 ra;\n\tmapa.shared::cluster.u32 ra, %0, %1;\n\t"
               "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n\t}"
               ::"r"(cute::cast_smem_ptr_to_uint(bar)), "r"(rank) : "memory");
}

// FA3_BWD_HD256_CLUSTER_DQ: add dQ chunk kChunk of the step (this thread's fragment `frag`, 8
// float4s; float4 j of consumer thread t of warpgroup w at acc_wg[j * 128 + t]) together with the
// peer CTA's, which holds the same fragment elements of the same query block (same thread map).
// CTA r owns float4s [4r, 4r + 4) of every thread: each thread sends the other four to the peer
// (st.async into the peer's receive buffer, slot i * 256 + ct, completing on its dq_full), waits
// for the peer's four, adds them to its own and issues the atomics. Every thread does the same
// work (no branch per warpgroup: ptxas spilled the step loop with one). Chunk c of a step is the
// (2 * step + c)-th use of each receive buffer, so the phase parity is c.
template <class Tr, uint32_t kChunk, class Frag>
CUTE_DEVICE void dq_pair_sum(typename Tr::SharedStorage& ss, Frag const& frag, float4* acc, int ct) {
  using TxBar = cutlass::arch::ClusterTransactionBarrier;
  using ClusterBar = cutlass::arch::ClusterBarrier;
  constexpr int kHalf = Tr::kDQFrag / 8;  // float4s per CTA and thread: 4
  // Addresses from an opaque copy of the thread index: computed here, not hoisted out of the step
  // loop into registers live across it (the loop spilled).
  asm volatile("" : "+r"(ct));
  const uint32_t rank = cute::block_rank_in_cluster();
  const bool r1 = rank != 0;
  // Send the peer's half (float4s [4 (1 - r), 4 (1 - r) + 4)) once it has read the last one.
  ClusterBar::wait(&ss.dq_empty, kChunk ^ 1);
  {
    const uint32_t dst = smem_addr_in_cta(ss.dq_recv.data(), rank ^ 1) + ct * 16;
    const uint32_t bar = smem_addr_in_cta(&ss.dq_full, rank ^ 1);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kHalf; ++i) {
      const int lo = 4 * i, hi = 4 * (i + kHalf);  // float4 i of the low half, of the high half
      st_async_f32x4(dst + i * Tr::kNumMmaThreads * 16, r1 ? frag(lo) : frag(hi), r1 ? frag(lo + 1) : frag(hi + 1),
                     r1 ? frag(lo + 2) : frag(hi + 2), r1 ? frag(lo + 3) : frag(hi + 3), bar);
    }
  }
  if (ct == 0) TxBar::arrive_and_expect_tx(&ss.dq_full, Tr::kDQRecvFloats * 4);
  TxBar::wait(&ss.dq_full, kChunk);
  const uint32_t recv = cute::cast_smem_ptr_to_uint(ss.dq_recv.data()) + ct * 16;
  float4* acc_own = acc + (r1 ? kHalf * 128 : 0) + ct % 128;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kHalf; ++i) {
    const int lo = 4 * i, hi = 4 * (i + kHalf);
    float4 v;  // ld.shared (a generic load of the same address costs the address-space check)
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(recv + i * Tr::kNumMmaThreads * 16));
    atomicAdd(acc_own + i * 128, make_float4((r1 ? frag(hi) : frag(lo)) + v.x, (r1 ? frag(hi + 1) : frag(lo + 1)) + v.y,
                                             (r1 ? frag(hi + 2) : frag(lo + 2)) + v.z, (r1 ? frag(hi + 3) : frag(lo + 3)) + v.w));
  }
  // Free the buffer for the peer's next fragment: one arrive per warp, after its reads.
  __syncwarp();
  if (cute::elect_one_sync()) arrive_in_cta_release_cluster(&ss.dq_empty, rank ^ 1);
}

template <class Tr>
__global__ void __launch_bounds__(Tr::kNumThreads, 1)
    bwd_split_d_kernel(const __grid_constant__ MainParams<Tr> p) {
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  constexpr int kStages = Tr::kStages, kStagesPdS = Tr::kStagesPdS;
  constexpr bool kSepdO = Tr::kSepdO;  // 80 keys: dO + D in their own one-stage ring
  constexpr int kCluster = Tr::kCluster;  // > 1: Q/dO multicast over a cluster (SplitDClusterTraits)
  static_assert(kCluster == 1 || (kCluster == 2 && kSepdO), "clusters: pairs, 80-key producer");
  using ClusterBar = cutlass::arch::ClusterBarrier;
  using TxBar = cutlass::arch::ClusterTransactionBarrier;
  using Storage = typename Tr::SharedStorage;

  extern __shared__ char smem_raw[];
  auto storage = [&]() -> Storage& {
    return *reinterpret_cast<Storage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  };
  if (threadIdx.x == 0) {
    Storage& ss = storage();
    TxBar::init(&ss.kv_full, 1);
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < kStages; ++s) {
      TxBar::init(&ss.full[s], 1);
      // one arrive per consumer warp (of every CTA of the cluster: each multicasts into all)
      ClusterBar::init(&ss.empty[s], Tr::kNumMmaWG * 4 * kCluster);
    }
    if constexpr (kSepdO) {
      TxBar::init(&ss.do_full, 1);
      ClusterBar::init(&ss.do_empty, Tr::kNumMmaWG * 4 * kCluster);
    }
    if constexpr (Tr::kDQPairSum) {
      TxBar::init(&ss.dq_full, 1);     // one consumer thread's expect_tx + the peer's 16 KB
      ClusterBar::init(&ss.dq_empty, Tr::kNumMmaWG * 4);  // the peer's consumer warps
    }
    cutlass::arch::fence_barrier_init();
  }
  if constexpr (kCluster > 1) {
    // The peer's multicasts and remote arrives may target this CTA's barriers only once they exist.
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  } else {
    __syncthreads();
  }

  if (threadIdx.x / 128 == 0) {
    // ------------------------------------------------------------------ producer warpgroup
    cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
    if (threadIdx.x == 0) {
      // main's producer, on this kernel's 3D grid (the launch keeps it: no FA3_BWD_LPT decode).
      const int n_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
      const int group = p.heads_q / p.heads_kv;
      BandMask band{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
      int m_begin, m_end;
      cta_query_block_range<Tr>(band, n_block, m_begin, m_end);
      if (m_end > m_begin) {
        if constexpr (kCluster == 2) {
          if (n_block % 2 == 0) split_d_producer_sep_do<Tr, 0>(p, storage(), n_block, hk, b, group, m_begin, m_end);
          else split_d_producer_sep_do<Tr, 1>(p, storage(), n_block, hk, b, group, m_begin, m_end);
        } else if constexpr (kSepdO) split_d_producer_sep_do(p, storage(), n_block, hk, b, group, m_begin, m_end);
        else load_kv_and_steps(p, storage(), n_block, hk, b, group, m_begin, m_end);
      }
    }
    if constexpr (kCluster > 1) {
      __syncwarp();
      cute::cluster_arrive_relaxed();  // the exit barrier (the consumers wait on it)
    }
    return;
  }

  // -------------------------------------------------------------------- consumers
  cutlass::arch::warpgroup_reg_alloc<Tr::kMmaRegs>();
  Storage& ss = storage();
  const int n_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int group = p.heads_q / p.heads_kv;
  BandMask band{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
  int m_begin, m_end;
  cta_query_block_range<Tr>(band, n_block, m_begin, m_end);
  const int ct = threadIdx.x - 128;  // 0..255
  const int t_in_wg = ct % 128;

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQt{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Tr::SmemLayoutdO{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename Tr::SmemLayoutdOt{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutV{});
  Tensor sP = make_tensor(make_smem_ptr(ss.p.data()), typename Tr::SmemLayoutPdS{});
  Tensor sPt = make_tensor(make_smem_ptr(ss.p.data()), typename Tr::SmemLayoutPdSt{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.ds.data()), typename Tr::SmemLayoutPdS{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.ds.data()), typename Tr::SmemLayoutPdSt{});

  typename Tr::MmaSdP mma_sdp;
  typename Tr::MmadKV mma_dkv;
  typename Tr::MmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(ct);
  auto thr_dkv = mma_dkv.get_thread_slice(ct);
  auto thr_dq = mma_dq.get_thread_slice(ct);

  // Operand descriptors. (MMA, M|N, K, stage|buffer)
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  Tensor tdVrdO = thr_dkv.partition_fragment_A(sdOt);
  Tensor tdVrP = thr_dkv.partition_fragment_B(sPt);
  Tensor tdKrQ = thr_dkv.partition_fragment_A(sQt);
  Tensor tdKrdS = thr_dkv.partition_fragment_B(sdSt);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);

  // (query, key) of this thread's S/dP accumulator elements; (d, key) of its dK^T/dV^T ones.
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tdKVc = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kHeadDim>, Int<kBlockN>>{}));

  // P and dS: accumulator fragments -> (queries, keys) tiles with stmatrix.
  auto pds_copy = make_tiled_copy_C(Copy_Atom<typename Tr::StsmAtom, Element>{}, mma_sdp);
  auto thr_pds_copy = pds_copy.get_thread_slice(ct);
  Tensor tPsP = thr_pds_copy.partition_D(as_position_independent_swizzle_tensor(sP));     // (CPY, M, N, buf)
  Tensor tdSsdS = thr_pds_copy.partition_D(as_position_independent_swizzle_tensor(sdS));

  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kHeadDim>, Int<kBlockN>>{});
  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kHeadDim>, Int<kBlockN>>{});
  clear(tdKrdK);
  clear(tdVrdV);

  const int n0 = n_block * kBlockN;
  const bool n_partial = n0 + kBlockN > p.seqlen_k;
  // The accumulator rows of a thread: element i sits on row get<0>(tScS(2 * ((i / 2) % 2)))
  // (value mode (column pair, row +8, column group)); host_checks/split_d_check.cu checks it.
  const int row_lo = get<0>(tScS(0)), row_hi = get<0>(tScS(2));

  if (m_end > m_begin) TxBar::wait(&ss.kv_full, 0);

  int it = 0;  // step counter: Q/dO stage and phase, P/dS buffer
  for (int hi = 0; hi < group; ++hi) {
    const int h = hk * group + hi;
    if constexpr (kSepdO) {
      // Recomputed per query head (a few integer ops): kept live across the step loop, the
      // range spilled at 80 keys.
      if constexpr (kCluster > 1) {
        // ptxas hoisted parts of this loop-invariant range out of the head loop and spilled
        // them (4 B): opaque copies of its inputs keep the whole recomputation inside.
        BandMask band_h = band;
        int n_h = n_block;
        asm volatile("" : "+r"(n_h), "+r"(band_h.seqlen_q), "+r"(band_h.seqlen_k), "+r"(band_h.left),
                     "+r"(band_h.right));
        cta_query_block_range<Tr>(band_h, n_h, m_begin, m_end);
      } else {
        cta_query_block_range<Tr>(band, n_block, m_begin, m_end);
      }
    }
    for (int m = m_begin; m < m_end; ++m, ++it) {
      const int m0 = m * kBlockM;
      const bool need_mask =
          n_partial || !band.block_is_interior(m0, min(m0 + kBlockM, p.seqlen_q) - 1, n0, kBlockN);
      const int stage = it % kStages;
      const int do_stage = kSepdO ? 0 : stage;
      const int buf = it % kStagesPdS;
      TxBar::wait(&ss.full[stage], (it / kStages) & 1);

      Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      wgmma_gemm<true, -1>(mma_sdp, tSrQ(_, _, _, stage), tSrK, tSrS);
      // Separate dO ring: its load started when the last step's dV^T retired; S runs meanwhile.
      if constexpr (kSepdO) TxBar::wait(&ss.do_full, it & 1);
      wgmma_gemm<true, -1>(mma_sdp, tdPrdO(_, _, _, do_stage), tdPrV, tdPrdP);
      const float* lse = ss.lse.data() + stage * kBlockM;
      const float* dpsum = ss.dpsum.data() + do_stage * kBlockM;
      const float lse_r[2] = {lse[row_lo], lse[row_hi]};
      const float dpsum_r[2] = {dpsum[row_lo], dpsum[row_hi]};
      auto masked = [&](int i) {
        const int qi = m0 + get<0>(tScS(i)), j = n0 + get<1>(tScS(i));
        const int rel = (j - p.seqlen_k) - (qi - p.seqlen_q);  // j - i - (sk - sq)
        return j >= p.seqlen_k || rel < -p.window_left || rel > p.window_right;
      };
      if constexpr (!Tr::kSoftcap) {
        // P while dP is still on the tensor cores; the mask is its own pass (boundary blocks).
        warpgroup_wait<1>();
        warpgroup_fence_operand(tSrS);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tSrS); ++i) tSrS(i) = exp2f(tSrS(i) * p.scale_log2 - lse_r[(i / 2) % 2]);
        if (need_mask) {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(tSrS); ++i)
            if (masked(i)) tSrS(i) = 0.f;
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(tdPrdP);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tSrS); ++i) tdPrdP(i) = tSrS(i) * (tdPrdP(i) - dpsum_r[(i / 2) % 2]);
      } else {
        // Softcap: tanh' must meet dP, so P and dS in one pass after both GEMMs.
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrS);
        warpgroup_fence_operand(tdPrdP);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tSrS); ++i) {
          const float s = tanhf(tSrS(i) * p.pre_tanh);
          float pv = exp2f(s * p.scale_log2 - lse_r[(i / 2) % 2]);
          if (need_mask && masked(i)) pv = 0.f;
          tSrS(i) = pv;
          tdPrdP(i) = pv * (1.f - s * s) * (tdPrdP(i) - dpsum_r[(i / 2) % 2]);
        }
      }
      if constexpr (kStagesPdS == 1) {
        // One P/dS buffer (the dQ pair sum's receive buffer took the second): both warpgroups
        // have finished the last step (wait<0>) and so read its P/dS.
        cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDsFree);
      }
      {
        Tensor rP = make_tensor<Element>(tSrS.layout());
        convert_fragment(tSrS, rP);
        Tensor rdS = make_tensor<Element>(tdPrdP.layout());
        convert_fragment(tdPrdP, rdS);
        copy(pds_copy, thr_pds_copy.retile_S(rP), tPsP(_, _, _, buf));
        copy(pds_copy, thr_pds_copy.retile_S(rdS), tdSsdS(_, _, _, buf));
      }
      cutlass::arch::fence_view_async_shared();  // generic smem writes -> WGMMA operand reads
      // Both warpgroups' keys are in P/dS. The buffer written next step is the other one; the one
      // after that is this one again, which both warpgroups have finished reading (wait<0> at
      // the end of this step) before either passes the next step's sync.
      cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDsFull);

      // dQ chunk 0 first, so its atomics run while dV^T and dK^T are on the tensor cores.
      Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<Tr::kHdChunk>>{});
      {
        Tensor tdQrK = thr_dq.partition_fragment_B(
            local_tile(sKt, Shape<Int<Tr::kHdChunk>, Int<kBlockN>>{}, make_coord(0, _0{})));
        wgmma_gemm<true, -1>(mma_dq, tdQrdS(_, _, _, buf), tdQrK, tdQrdQ);
      }
      wgmma_gemm<false, -1>(mma_dkv, tdVrdO(_, _, _, do_stage), tdVrP(_, _, _, buf), tdVrdV);
      wgmma_gemm<false, -1>(mma_dkv, tdKrQ(_, _, _, stage), tdKrdS(_, _, _, buf), tdKrdK);

      const int64_t acc_base = ((int64_t(b) * p.heads_q + h) * p.m_blocks + m) * int64_t(kBlockM * kHeadDim);
      int* sem = p.dq_sem + (int64_t(b) * p.heads_q + h) * p.m_blocks + m;
      float4* acc = reinterpret_cast<float4*>(p.dq_accum + acc_base + int64_t(ct / 128) * Tr::kDQWgFloats);
      warpgroup_wait<2>();  // dQ chunk 0 done; dV^T, dK^T may still run
      warpgroup_fence_operand(tdQrdQ);
      if (kCluster == 1 && p.deterministic) {  // clusters: deterministic calls never get here
        // Same turn protocol as bwd_main_kernel's atomic path (key blocks of kBlockN = 64 here).
        int nb, ne;
        band.key_block_range(m0, min(m0 + kBlockM, p.seqlen_q) - 1, kBlockN, nb, ne);
        if (ct == 0) {
          while (ld_acquire(sem) != n_block - nb) __nanosleep(40);
        }
        cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDetIn);
      }
      if constexpr (Tr::kDQPairSum) {
        dq_pair_sum<Tr, 0>(ss, tdQrdQ, acc, ct);
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < Tr::kDQFrag / 4; ++j)
          atomicAdd(acc + j * 128 + t_in_wg, make_float4(tdQrdQ(4 * j), tdQrdQ(4 * j + 1), tdQrdQ(4 * j + 2), tdQrdQ(4 * j + 3)));
      }
      if constexpr (kSepdO) {
        // dV^T (issued before dK^T) is the last reader of dO: free the slot now, so the next
        // step's dO load runs under dK^T, dQ chunk 1 and the next S. dK^T stays in flight.
        warpgroup_wait<1>();
        warpgroup_fence_operand(tdVrdV);
        __syncwarp();
        if (cute::elect_one_sync()) {
          ClusterBar::arrive(&ss.do_empty);
          if constexpr (kCluster > 1) ClusterBar::arrive(&ss.do_empty, cute::block_rank_in_cluster() ^ 1, 1);
        }
      }
      {
        Tensor tdQrK = thr_dq.partition_fragment_B(
            local_tile(sKt, Shape<Int<Tr::kHdChunk>, Int<kBlockN>>{}, make_coord(1, _0{})));
        wgmma_gemm<true, -1>(mma_dq, tdQrdS(_, _, _, buf), tdQrK, tdQrdQ);
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(tdQrdQ);
      warpgroup_fence_operand(tdVrdV);
      warpgroup_fence_operand(tdKrdK);
      // Q, dO, LSE, D of this stage are no longer read: one arrive per consumer warp.
      __syncwarp();
      if (cute::elect_one_sync()) {
        ClusterBar::arrive(&ss.empty[stage]);
        // Clusters: the peer's producer multicasts its half into this slot too.
        if constexpr (kCluster > 1) ClusterBar::arrive(&ss.empty[stage], cute::block_rank_in_cluster() ^ 1, 1);
      }
      acc += (kBlockM * Tr::kHdChunk) / 4;  // chunk 1
      if constexpr (Tr::kDQPairSum) {
        dq_pair_sum<Tr, 1>(ss, tdQrdQ, acc, ct);
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < Tr::kDQFrag / 4; ++j)
          atomicAdd(acc + j * 128 + t_in_wg, make_float4(tdQrdQ(4 * j), tdQrdQ(4 * j + 1), tdQrdQ(4 * j + 2), tdQrdQ(4 * j + 3)));
      }
      if (kCluster == 1 && p.deterministic) {  // clusters: deterministic calls never get here
        __threadfence();
        cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDetOut);
        if (ct == 0) red_release_add(sem, 1);
      }
    }
  }

  // Clusters: this CTA's last remote arrive is done; the CTA may exit once the peer's are too
  // (they target this CTA's barriers). The wait is at the end, after the epilogue.
  if constexpr (kCluster > 1) cute::cluster_arrive();

  // Epilogue: dK (scaled) and dV, transposed back from (d, key) fragments, in the input dtype.
  // Plain 2-byte stores (adjacent registers are adjacent keys, not adjacent columns); once per CTA.
  const int64_t kv_stride_row = int64_t(p.heads_kv) * kHeadDim;
  Element* dk = p.dk + (int64_t(b) * p.seqlen_k * p.heads_kv + hk) * kHeadDim;
  Element* dv = p.dv + (int64_t(b) * p.seqlen_k * p.heads_kv + hk) * kHeadDim;
  if constexpr (kSepdO) {
    // 80 keys: with 160 accumulators live, the per-element global stores below spilled (their
    // addresses and key predicates are hoisted). Instead: dK, dV -> shared memory as (key, d)
    // rows over the dead K and Q tiles (each address = a per-thread base + a constant), then
    // 16-byte coalesced global stores of the valid key rows.
    cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDsFull);  // both WGs done with K, Q
    Element* sdk = ss.q.data();  // 64 KB >= 40 KB
    Element* sdv = ss.k.data();  // exactly 80 x 256
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tdKrdK); ++i) {
      const int off = get<1>(tdKVc(i)) * kHeadDim + get<0>(tdKVc(i));
      sdk[off] = Element(tdKrdK(i) * p.softmax_scale);
      sdv[off] = Element(tdVrdV(i));
    }
    cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDsFull);
    constexpr int kVecRow = kHeadDim / 8;  // 16-byte vectors per key row
    const int n_vec = min(kBlockN, p.seqlen_k - n0) * kVecRow;
    #pragma unroll 1
    for (int c = ct; c < n_vec; c += Tr::kNumMmaThreads) {
      const int r = c / kVecRow, col = (c % kVecRow) * 8;
      const int64_t off = int64_t(n0 + r) * kv_stride_row + col;
      *reinterpret_cast<uint4*>(dk + off) = *reinterpret_cast<const uint4*>(sdk + r * kHeadDim + col);
      *reinterpret_cast<uint4*>(dv + off) = *reinterpret_cast<const uint4*>(sdv + r * kHeadDim + col);
    }
  } else {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tdKrdK); ++i) {
      const int d = get<0>(tdKVc(i)), key = n0 + get<1>(tdKVc(i));
      if (key < p.seqlen_k) {
        const int64_t off = int64_t(key) * kv_stride_row + d;
        dk[off] = Element(tdKrdK(i) * p.softmax_scale);
        dv[off] = Element(tdVrdV(i));
      }
    }
  }
  if constexpr (kCluster > 1) cute::cluster_wait();
}

}  // namespace bwd
}  // namespace fa3
