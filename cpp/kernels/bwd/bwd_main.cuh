// The backward main kernel: one CTA per (key block of 128, kv head, batch), warp specialised.
//   warpgroup 0, warp 0: producer. TMA loads K, V once, then for every (pass, query head of the
//     group, query block) Q, dO (2D TMA) and the block's LSE and D (1D bulk copies) into a ring
//     of kStages shared-memory stages (full/empty mbarriers).
//   warpgroups 1, 2: consumers (registers raised with setmaxnreg), 64 keys each; see
//     bwd_traits.cuh for the GEMMs. dK/dV stay in registers over the whole loop (GQA: summed over
//     the query heads of the group inside the CTA, so no fp32 dK/dV workspace and no atomics for
//     them); dQ goes to the fp32 accumulator by float4 atomics in a fragment-ordered layout that
//     bwd_postprocess reads back.
// Masks: query blocks that see none of the CTA's keys are never visited; the per-element mask
// runs only on blocks that straddle the band or the end of the keys.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "bwd/bwd_traits.cuh"
#include "common/mask.cuh"
#include "common/utils.cuh"

namespace fa3 {
namespace bwd {

template <class Tr>
struct MainParams {
  typename Tr::TmaQ tma_q;
  typename Tr::TmaQ tma_do;
  typename Tr::TmaK tma_k;
  typename Tr::TmaV tma_v;
  const float* lse_log2;  // (b, hq, m_blocks * kBlockM), +inf where P must be 0
  const float* dpsum;     // (b, hq, m_blocks * kBlockM)
  float* dq_accum;        // (b, hq, m_blocks, chunk, warpgroup, fragment)
  int* dq_sem;            // (b, hq, m_blocks): deterministic turn counters
  typename Tr::Element* dk;
  typename Tr::Element* dv;
  int batch, seqlen_q, seqlen_k, heads_q, heads_kv, m_blocks;
  int window_left, window_right;
  float scale_log2;        // softmax_scale * log2 e, or softcap * log2 e with softcap
  float pre_tanh;          // softmax_scale / softcap
  float softmax_scale;
  int deterministic;
};

// Query blocks [m_begin, m_end) holding a row that sees some key of key block n_block.
CUTE_HOST_DEVICE void query_block_range(BandMask const& band, int n_block, int block_n, int block_m,
                                        int& m_begin, int& m_end) {
  m_begin = m_end = 0;
  if ((long long)band.left + band.right < 0) return;  // empty band
  int n0 = n_block * block_n;
  int n_last = min(n0 + block_n, band.seqlen_k) - 1;
  long long lo = (long long)n0 - band.offset() - band.right;
  long long hi = (long long)n_last - band.offset() + band.left;
  if (lo < 0) lo = 0;
  if (hi > band.seqlen_q - 1) hi = band.seqlen_q - 1;
  if (hi < lo) return;
  m_begin = int(lo / block_m);
  m_end = int(hi / block_m) + 1;
}

CUTE_DEVICE int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
CUTE_DEVICE void red_release_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// fp32 fragment -> 16-bit fragment of the same layout (packed-pair conversion).
template <class TIn, class TOut>
CUTE_DEVICE void convert_fragment(TIn const& in, TOut& out) {
  using To = typename TOut::value_type;
  constexpr int N = decltype(size(in))::value;
  cutlass::NumericArrayConverter<To, float, N> conv;
  *reinterpret_cast<cutlass::Array<To, N>*>(out.data()) =
      conv(*reinterpret_cast<cutlass::Array<float, N> const*>(in.data()));
}

// Named barrier ids (CUTLASS adds its reserved offset).
enum : uint32_t { kBarDsFull = 0, kBarDsFree = 1, kBarDetIn = 2, kBarDetOut = 3 };

template <class Tr>
__global__ void __launch_bounds__(Tr::kNumThreads, 1)
    bwd_main_kernel(const __grid_constant__ MainParams<Tr> p) {
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  constexpr int kStages = Tr::kStages, kStagesdS = Tr::kStagesdS;
  using ClusterBar = cutlass::arch::ClusterBarrier;
  using TxBar = cutlass::arch::ClusterTransactionBarrier;
  using Storage = typename Tr::SharedStorage;

  extern __shared__ char smem_raw[];
  // Everything a role needs is (re)computed after its setmaxnreg, so that no value lives across
  // the register reallocation (ptxas would spill it).
  auto storage = [&]() -> Storage& {
    return *reinterpret_cast<Storage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  };
  const int warp_group = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    Storage& ss = storage();
    TxBar::init(&ss.kv_full, 1);
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < kStages; ++s) {
      TxBar::init(&ss.full[s], 1);
      ClusterBar::init(&ss.empty[s], Tr::kNumMmaWG * 4);  // one arrive per consumer warp
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warp_group == 0) {
    // ------------------------------------------------------------------ producer
    cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
    Storage& ss = storage();
    const int n_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int group = p.heads_q / p.heads_kv;
    BandMask band{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
    int m_begin, m_end;
    query_block_range(band, n_block, kBlockN, kBlockM, m_begin, m_end);
    const bool has_work = m_end > m_begin;
    const int sq_pad = p.m_blocks * kBlockM;
    if (threadIdx.x == 0 && has_work) {
      Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
      Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutV{});
      Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
      Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Tr::SmemLayoutQ{});
      Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seqlen_k, kHeadDim, p.heads_kv, p.batch));
      Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.seqlen_k, kHeadDim, p.heads_kv, p.batch));
      Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.seqlen_q, kHeadDim, p.heads_q, p.batch));
      Tensor mdO = p.tma_do.get_tma_tensor(make_shape(p.seqlen_q, kHeadDim, p.heads_q, p.batch));
      Tensor gK = local_tile(mK(_, _, hk, b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
      Tensor gV = local_tile(mV(_, _, hk, b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
      auto tma_k = p.tma_k.get_slice(_0{});
      auto tma_v = p.tma_v.get_slice(_0{});
      TxBar::arrive_and_expect_tx(&ss.kv_full, 2 * Tr::kBytesK);
      copy(p.tma_k.with(ss.kv_full), tma_k.partition_S(gK), tma_k.partition_D(sK));
      copy(p.tma_v.with(ss.kv_full), tma_v.partition_S(gV), tma_v.partition_D(sV));

      auto tma_q = p.tma_q.get_slice(_0{});
      auto tma_do = p.tma_do.get_slice(_0{});
      Tensor tQsQ = tma_q.partition_D(sQ);     // (TMA, TMA_M, TMA_K, stage)
      Tensor tdOsdO = tma_do.partition_D(sdO);
      int stage = 0;
      uint32_t phase = 0;
      for (int pass = 0; pass < Tr::kPasses; ++pass) {
        for (int hi = 0; hi < group; ++hi) {
          const int h = hk * group + hi;
          Tensor gQ = local_tile(mQ(_, _, h, b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, _0{}));
          Tensor gdO = local_tile(mdO(_, _, h, b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, _0{}));
          Tensor tQgQ = tma_q.partition_S(gQ);  // (TMA, TMA_M, TMA_K, m_blocks)
          Tensor tdOgdO = tma_do.partition_S(gdO);
          const int64_t row_base = (int64_t(b) * p.heads_q + h) * sq_pad;
          for (int m = m_begin; m < m_end; ++m) {
            ClusterBar::wait(&ss.empty[stage], phase ^ 1);
            TxBar::arrive_and_expect_tx(&ss.full[stage], Tr::kBytesStage);
            copy(p.tma_q.with(ss.full[stage]), tQgQ(_, _, _, m), tQsQ(_, _, _, stage));
            copy(p.tma_do.with(ss.full[stage]), tdOgdO(_, _, _, m), tdOsdO(_, _, _, stage));
            SM90_BULK_COPY_G2S::copy(p.lse_log2 + row_base + int64_t(m) * kBlockM, &ss.full[stage],
                                     ss.lse.data() + stage * kBlockM, Tr::kBytesRow);
            SM90_BULK_COPY_G2S::copy(p.dpsum + row_base + int64_t(m) * kBlockM, &ss.full[stage],
                                     ss.dpsum.data() + stage * kBlockM, Tr::kBytesRow);
            if (++stage == kStages) { stage = 0; phase ^= 1; }
          }
        }
      }
    }
  } else {
    // ------------------------------------------------------------------ consumers
    cutlass::arch::warpgroup_reg_alloc<Tr::kMmaRegs>();
    Storage& ss = storage();
    const int n_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int group = p.heads_q / p.heads_kv;
    BandMask band{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
    int m_begin, m_end;
    query_block_range(band, n_block, kBlockN, kBlockM, m_begin, m_end);
    const bool has_work = m_end > m_begin;
    const int ct = threadIdx.x - 128;  // 0..255
    const int wg = ct / 128;
    const int t_in_wg = ct % 128;

    Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
    Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutKt{});
    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutV{});
    Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQt{});
    Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Tr::SmemLayoutQ{});
    Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename Tr::SmemLayoutQt{});
    Tensor sdS = make_tensor(make_smem_ptr(ss.ds.data()), typename Tr::SmemLayoutdS{});
    Tensor sdSt = make_tensor(make_smem_ptr(ss.ds.data()), typename Tr::SmemLayoutdSt{});

    typename Tr::MmaSdP mma_sdp;
    typename Tr::MmadKV mma_dkv;
    typename Tr::MmadQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(ct);
    auto thr_dkv = mma_dkv.get_thread_slice(ct);
    auto thr_dq = mma_dq.get_thread_slice(ct);

    Tensor tSrK = thr_sdp.partition_fragment_A(sK);    // descriptors
    Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);    // (MMA, N, K, stage)
    Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
    Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);  // (MMA, M, K, dS stage)

    // Coordinates (key row, query column) of this thread's S^T accumulator elements.
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
    // Coordinates (key row, column) of this thread's dK/dV accumulator elements.
    Tensor tdKVc = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<Tr::kHdPass>>{}));

    auto ds_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto thr_ds_copy = ds_copy.get_thread_slice(ct);
    Tensor tdSsdS = thr_ds_copy.partition_D(as_position_independent_swizzle_tensor(sdSt));  // (CPY, M, N, stage)

    const int n0 = n_block * kBlockN;
    const bool n_partial = n0 + kBlockN > p.seqlen_k;

    if (has_work) TxBar::wait(&ss.kv_full, 0);

    int stage = 0;
    uint32_t phase = 0;
    int ds_stage = 0;
    for (int pass = 0; pass < Tr::kPasses; ++pass) {
      Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<Tr::kHdPass>>{});
      Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<Tr::kHdPass>>{});
      clear(tdKrdK);
      clear(tdVrdV);
      const bool dq_pass = pass == 0;
      for (int hi = 0; hi < group; ++hi) {
        const int h = hk * group + hi;
        for (int m = m_begin; m < m_end; ++m) {
          const int m0 = m * kBlockM;
          const bool need_mask =
              n_partial || !band.block_is_interior(m0, min(m0 + kBlockM, p.seqlen_q) - 1, n0, kBlockN);
          TxBar::wait(&ss.full[stage], phase);

          Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
          Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
          wgmma_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS);
          wgmma_gemm<true, -1>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), tdPrdP);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tSrS);
          warpgroup_fence_operand(tdPrdP);

          // P^T = exp2(S^T * scale_log2 - lse_log2) and dS^T = P^T o (dP^T - D) (o tanh' with
          // softcap), rows = keys, columns = queries. Done after both GEMMs so that only S^T and
          // dP^T are live next to the dK/dV accumulators (register pressure).
          const float* lse = ss.lse.data() + stage * kBlockM;
          const float* dpsum = ss.dpsum.data() + stage * kBlockM;
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(tSrS); ++i) {
            const int kr = get<0>(tScS(i)), qc = get<1>(tScS(i));
            float pv, dtanh = 1.f;
            if constexpr (Tr::kSoftcap) {
              float t = tanhf(tSrS(i) * p.pre_tanh);
              dtanh = 1.f - t * t;
              pv = exp2f(t * p.scale_log2 - lse[qc]);
            } else {
              pv = exp2f(tSrS(i) * p.scale_log2 - lse[qc]);
            }
            if (need_mask) {
              const int j = n0 + kr, qi = m0 + qc;
              const int rel = (j - p.seqlen_k) - (qi - p.seqlen_q);  // j - i - (sk - sq)
              if (j >= p.seqlen_k || rel < -p.window_left || rel > p.window_right) pv = 0.f;
            }
            tSrS(i) = pv;
            tdPrdP(i) = pv * dtanh * (tdPrdP(i) - dpsum[qc]);
          }
          Tensor rP = make_tensor<Element>(tSrS.layout());
          convert_fragment(tSrS, rP);
          Tensor rdS = make_tensor<Element>(tdPrdP.layout());
          convert_fragment(tdPrdP, rdS);
          // dV += P^T dO (this pass's columns).
          {
            Tensor sdOt_p = local_tile(sdOt(_, _, stage), Shape<Int<Tr::kHdPass>, Int<kBlockM>>{},
                                       make_coord(pass, _0{}));
            Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOt_p);
            Tensor tdVrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
            wgmma_gemm<false, -1>(mma_dkv, tdVrP, tdVrdO, tdVrdV);
          }

          if (dq_pass) {
            if constexpr (kStagesdS == 1) {
              // The other warpgroup may still read the single dS buffer (previous dQ GEMM).
              cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDsFree);
            }
            Tensor tdSrdS = thr_ds_copy.retile_S(rdS);
            copy(ds_copy, tdSrdS, tdSsdS(_, _, _, ds_stage));
            cutlass::arch::fence_view_async_shared();
            cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDsFull);
          }
          // dK += dS^T Q (this pass's columns); issued after the first dQ chunk below when dq_pass.
          Tensor sQt_p = local_tile(sQt(_, _, stage), Shape<Int<Tr::kHdPass>, Int<kBlockM>>{},
                                    make_coord(pass, _0{}));
          Tensor tdKrQ = thr_dkv.partition_fragment_B(sQt_p);
          Tensor tdKrdS = make_tensor(rdS.data(), acc_as_operand_a(rdS.layout()));

          if (dq_pass) {
            const int64_t acc_base =
                ((int64_t(b) * p.heads_q + h) * p.m_blocks + m) * int64_t(kBlockM * kHeadDim);
            int* sem = p.dq_sem + (int64_t(b) * p.heads_q + h) * p.m_blocks + m;
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < Tr::kDQChunks; ++c) {
              Tensor sKt_c = local_tile(sKt, Shape<Int<Tr::kHdChunk>, Int<kBlockN>>{}, make_coord(c, _0{}));
              Tensor tdQrK = thr_dq.partition_fragment_B(sKt_c);
              Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<Tr::kHdChunk>>{});
              wgmma_gemm<true, -1>(mma_dq, tdQrdS(_, _, _, ds_stage), tdQrK, tdQrdQ);
              if (c == 0) {
                wgmma_gemm<false, -1>(mma_dkv, tdKrdS, tdKrQ, tdKrdK);
                warpgroup_wait<1>();  // dV and dQ chunk 0 done; dK may still run
              } else {
                warpgroup_wait<0>();
              }
              warpgroup_fence_operand(tdQrdQ);
              if (c == 0 && p.deterministic) {
                int nb, ne;
                band.key_block_range(m0, min(m0 + kBlockM, p.seqlen_q) - 1, kBlockN, nb, ne);
                if (ct == 0) {
                  while (ld_acquire(sem) != n_block - nb) __nanosleep(40);
                }
                cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDetIn);
              }
              float4* acc = reinterpret_cast<float4*>(
                  p.dq_accum + acc_base + int64_t(c) * (kBlockM * Tr::kHdChunk) +
                  int64_t(wg) * (kBlockM * Tr::kHdChunk / 2));
              CUTLASS_PRAGMA_UNROLL
              for (int j = 0; j < Tr::kDQFrag / 4; ++j) {
                atomicAdd(acc + j * 128 + t_in_wg,
                          make_float4(tdQrdQ(4 * j), tdQrdQ(4 * j + 1), tdQrdQ(4 * j + 2), tdQrdQ(4 * j + 3)));
              }
            }
            if (p.deterministic) {
              __threadfence();
              cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDetOut);
              if (ct == 0) red_release_add(sem, 1);
            }
            if constexpr (kStagesdS > 1) ds_stage = (ds_stage + 1) % kStagesdS;
          } else {
            wgmma_gemm<false, -1>(mma_dkv, tdKrdS, tdKrQ, tdKrdK);
          }
          warpgroup_wait<0>();
          warpgroup_fence_operand(tdKrdK);
          warpgroup_fence_operand(tdVrdV);
          // Q, dO, LSE, D of this stage are no longer read.
          __syncwarp();
          if (cute::elect_one_sync()) ClusterBar::arrive(&ss.empty[stage]);
          if (++stage == kStages) { stage = 0; phase ^= 1; }
        }
      }

      // Epilogue of the pass: this pass's columns of dK (scaled) and dV, in the input dtype.
      const int64_t kv_stride_row = int64_t(p.heads_kv) * kHeadDim;
      Element* dk = p.dk + (int64_t(b) * p.seqlen_k * p.heads_kv + hk) * kHeadDim;
      Element* dv = p.dv + (int64_t(b) * p.seqlen_k * p.heads_kv + hk) * kHeadDim;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tdKrdK); i += 2) {
        const int key = n0 + get<0>(tdKVc(i));
        const int col = pass * Tr::kHdPass + get<1>(tdKVc(i));  // col, col + 1 in registers i, i+1
        if (key < p.seqlen_k) {
          const int64_t off = int64_t(key) * kv_stride_row + col;
          cutlass::Array<Element, 2> k2, v2;
          k2[0] = Element(tdKrdK(i) * p.softmax_scale);
          k2[1] = Element(tdKrdK(i + 1) * p.softmax_scale);
          v2[0] = Element(tdVrdV(i));
          v2[1] = Element(tdVrdV(i + 1));
          *reinterpret_cast<cutlass::Array<Element, 2>*>(dk + off) = k2;
          *reinterpret_cast<cutlass::Array<Element, 2>*>(dv + off) = v2;
        }
      }
    }
  }
}

}  // namespace bwd
}  // namespace fa3
