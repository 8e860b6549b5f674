// The backward main kernel: one CTA per (key block of 128, kv head, batch), warp specialised.
//   warpgroup 0, warp 0: producer (load_kv_and_steps). TMA loads K, V
//     once, then for every (pass, query head of the group, query block) Q, dO (2D TMA) and the
//     block's LSE and D (1D bulk copies) into a ring of kStages shared-memory stages (full/empty
//     mbarriers).
//   warpgroups 1, 2: consumers (registers raised with setmaxnreg), 64 keys each; see
//     bwd_traits.cuh for the GEMMs. dK/dV stay in registers over the whole loop (GQA: summed over
//     the query heads of the group inside the CTA, so no fp32 dK/dV workspace and no atomics for
//     them); each warpgroup's dQ tile goes, in a fragment-ordered layout that bwd_postprocess
//     reads back, to the fp32 accumulator: through shared memory and a bulk reduce-add issued by
//     the dQ writer (kDQSmem), or by float4 atomics from the consumers (d >= 192).
//   warpgroup 0, warp 1 (kDQSmem): dQ writer. Per step and consumer warpgroup it waits for the
//     smem dQ tile (named barrier DQFull), issues one cp.reduce.async.bulk add.f32 into the
//     accumulator, and frees the tile (DQEmpty) once the bulk copy has read it. In deterministic
//     mode it, not the consumers, waits for the CTA's turn on the query block, so the consumers
//     run up to one step ahead of the turn order.
// Masks: query blocks that see none of the CTA's keys are never visited; the per-element mask
// runs only on blocks that straddle the band or the end of the keys.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "bwd/bwd_order.cuh"
#include "bwd/bwd_traits.cuh"
#include "common/mask.cuh"
#include "common/utils.cuh"

namespace fa3 {
namespace bwd {

template <class Tr>
struct MainParams {
  typename BwdLoads<Tr>::TmaQ tma_q;
  typename BwdLoads<Tr>::TmaQ tma_do;
  typename BwdLoads<Tr>::TmaK tma_k;
  typename BwdLoads<Tr>::TmaV tma_v;
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
  BwdTileOrder order;  // the 1D grid's CTA order (bwd_order.cuh)
  BwdTailSplit split;  // the tail units' CTAs (bwd_order.cuh)
  float* dkv_part;     // (split slots, 2, kBlockN * head_dim): the tail CTAs' fp32 dK, dV
  // dK/dV TMA stores over (seqlen_k, head_dim, heads_kv, batch) (store_dkv_tma; placeholders for
  // traits without kTmaDKV). launch_main's last two initializers (dkv_tma_store).
  typename DKVStore<Tr>::TmaDK tma_dk;
  typename DKVStore<Tr>::TmaDV tma_dv;
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

// Whether the main kernel can run a tail unit split over several CTAs (BwdTailSplit): one pass
// over the query blocks (dK/dV whole in registers at the end) and the 1D grid.
template <class Tr>
constexpr bool kTailSplitOk = Tr::kPasses == 1;

// This CTA's work: the unit (key block, kv head, batch), decoded from the 1D grid in the
// longest-first section order (bwd_order.cuh), and its query blocks [m_begin, m_end);
// slot >= 0 when it runs a share of a tail unit (BwdTailSplit), its dK/dV workspace slot.
// Each role calls it after its setmaxnreg.
template <class Tr>
CUTE_DEVICE void cta_work(MainParams<Tr> const& p, int& n_block, int& hk, int& b, int& m_begin, int& m_end,
                          int& slot) {
  int unit = int(blockIdx.x);
  slot = -1;
  if constexpr (kTailSplitOk<Tr>) unit = p.split.unit_of(unit, slot);
  p.order.decode(unit, n_block, hk, b);
  BandMask band{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
  query_block_range(band, n_block, Tr::kBlockN, Tr::kBlockM, m_begin, m_end);
  if (slot >= 0) p.split.share(slot, m_begin, m_end);
}

CUTE_DEVICE int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
CUTE_DEVICE void red_release_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// One float4 of a dQ fragment added to the fp32 accumulator by the consumers (the paths without
// the smem dQ tile: split-D hd256, hd192), as a no-return reduction (REDG.E.ADD.F32x4). atomicAdd
// would stay a returning ATOMG next to the deterministic path's fence (as much L2 -> SM traffic
// as the adds themselves): the reduction made the hd256 backward 12-28% faster on the H200.
template <class F4>
CUTE_DEVICE void dq_add_f32x4(F4* p, F4 v) {
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w) : "memory");
}

// shfl.sync.idx with segment mask 3 (c = 0x31f): reads lane (lane & 3) | (base & ~3), i.e. lane
// base + lane % 4 for base a multiple of 4 (PTX ISA, shfl.sync: j = minLane | (b & ~segmask)).
CUTE_DEVICE float shfl_idx_seg3(uint32_t mask, float v, int base) {
  float r;
  asm("shfl.sync.idx.b32 %0, %1, %2, 0x31f, %3;" : "=f"(r) : "f"(v), "r"(base), "r"(mask));
  return r;
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

// dQ writer helpers: bulk reduce-add of a shared-memory fp32 tile into global memory (async
// proxy, bulk-group completion), and the proxy fence that orders it with generic accesses.
// The dQ accumulator lines are hit again by the other key blocks of the same query block (other
// CTAs, soon after): keep them in L2 (evict_last), as FA3 does.
CUTE_DEVICE void bulk_reduce_add_f32(float* gmem, const float* smem, uint32_t bytes) {
  const uint32_t s = cute::cast_smem_ptr_to_uint(smem);
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.f32 [%0], [%1], %2, %3;"
               ::"l"(gmem), "r"(s), "r"(bytes), "l"(policy) : "memory");
}
CUTE_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// All committed bulk operations have finished reading shared memory.
CUTE_DEVICE void bulk_wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// All committed bulk operations are complete (their global writes performed).
CUTE_DEVICE void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
CUTE_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// L2 policy of the Q/dO tile loads. Every key block of the head reads them again (the CTAs of a
// section of heads run at about the same time), while K/V are read once per CTA: so L2 is asked
// to keep Q/dO (as FA3 does).
CUTE_HOST_DEVICE constexpr TMA::CacheHintSm90 qdo_hint() { return TMA::CacheHintSm90::EVICT_LAST; }

// K and V of key block n_block (kv head hk, batch b), once per CTA, completing on kv_full; the
// first thing each producer (load_kv_and_steps, split_d_producer_sep_do) issues.
template <class Tr>
CUTE_DEVICE void load_kv(MainParams<Tr> const& p, typename Tr::SharedStorage& ss, int n_block, int hk, int b) {
  using TxBar = cutlass::arch::ClusterTransactionBarrier;
  using Loads = BwdLoads<Tr>;
  constexpr int kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutV{});
  Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seqlen_k, kHeadDim, p.heads_kv, p.batch));
  Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.seqlen_k, kHeadDim, p.heads_kv, p.batch));
  Tensor gK = local_tile(mK(_, _, hk, b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
  Tensor gV = local_tile(mV(_, _, hk, b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
  auto tma_k = p.tma_k.get_slice(_0{});
  auto tma_v = p.tma_v.get_slice(_0{});
  TxBar::arrive_and_expect_tx(&ss.kv_full, 2 * Loads::kBytesK);
  copy(p.tma_k.with(ss.kv_full), tma_k.partition_S(gK), tma_k.partition_D(sK));
  copy(p.tma_v.with(ss.kv_full), tma_v.partition_S(gV), tma_v.partition_D(sV));
}

// TMA destination partitions (TMA, TMA_M, TMA_K, stage) of the Q and dO rings, dO in the
// kernel's layout (SmemLayoutQ when it shares Q's ring, SmemLayoutdO in its own).
template <class Tr, class SmemLayoutdO>
CUTE_DEVICE auto qdo_ring_tiles(MainParams<Tr> const& p, typename Tr::SharedStorage& ss) {
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), SmemLayoutdO{});
  return cute::make_tuple(p.tma_q.get_slice(_0{}).partition_D(sQ), p.tma_do.get_slice(_0{}).partition_D(sdO));
}

// TMA source partitions (TMA, TMA_M, TMA_K, m_blocks) of Q and dO of query head h, batch b: what
// both producers (load_kv_and_steps, split_d_producer_sep_do) walk per head.
template <class Tr>
CUTE_DEVICE auto qdo_head_tiles(MainParams<Tr> const& p, int h, int b) {
  constexpr int kBlockM = Tr::kBlockM, kHeadDim = Tr::kHeadDim;
  const auto shape = make_shape(p.seqlen_q, kHeadDim, p.heads_q, p.batch);
  Tensor gQ = local_tile(p.tma_q.get_tma_tensor(shape)(_, _, h, b), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                         make_coord(_, _0{}));
  Tensor gdO = local_tile(p.tma_do.get_tma_tensor(shape)(_, _, h, b), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                          make_coord(_, _0{}));
  return cute::make_tuple(p.tma_q.get_slice(_0{}).partition_S(gQ), p.tma_do.get_slice(_0{}).partition_S(gdO));
}

// Producer, one elected thread: K and V of key block n_block once, then for every (pass, query
// head of kv head hk's group, query block in [m_begin, m_end)) Q and dO (TMA) and the block's
// LSE and D (1D bulk copies) into the kStages ring, in the order the consumers walk the steps.
// (The split-D kernel's producer, split_d_producer_sep_do, splits each stage in two rings.)
template <class Tr>
CUTE_DEVICE void load_kv_and_steps(MainParams<Tr> const& p, typename Tr::SharedStorage& ss, int n_block, int hk,
                                   int b, int group, int m_begin, int m_end) {
  using TxBar = cutlass::arch::ClusterTransactionBarrier;
  using ClusterBar = cutlass::arch::ClusterBarrier;
  using Loads = BwdLoads<Tr>;
  constexpr int kBlockM = Tr::kBlockM;
  load_kv(p, ss, n_block, hk, b);
  auto [tQsQ, tdOsdO] = qdo_ring_tiles<Tr, typename Tr::SmemLayoutQ>(p, ss);
  int stage = 0;
  uint32_t phase = 0;
  #pragma unroll 1
  for (int pass = 0; pass < Tr::kPasses; ++pass) {
    // Walk the group's query heads by head index, and LSE/D rows by a running offset: with
    // hk and b decoded from a 1D grid rather than read from blockIdx, fewer
    // loop values keep the 24-register producer free of spills.
    const int h_first = hk * group, h_end = h_first + group;
    int64_t row0 = ((int64_t(b) * p.heads_q + h_first) * p.m_blocks + m_begin) * kBlockM;
    #pragma unroll 1
    for (int h = h_first; h < h_end; ++h, row0 += int64_t(p.m_blocks) * kBlockM) {
      auto [tQgQ, tdOgdO] = qdo_head_tiles(p, h, b);
      const float* lse = p.lse_log2 + row0;
      const float* dpsum = p.dpsum + row0;
      #pragma unroll 1
      for (int m = m_begin; m < m_end; ++m, lse += kBlockM, dpsum += kBlockM) {
        ClusterBar::wait(&ss.empty[stage], phase ^ 1);
        TxBar::arrive_and_expect_tx(&ss.full[stage], Loads::kBytesStage);
        copy(p.tma_q.with(ss.full[stage], 0, qdo_hint()), tQgQ(_, _, _, m), tQsQ(_, _, _, stage));
        copy(p.tma_do.with(ss.full[stage], 0, qdo_hint()), tdOgdO(_, _, _, m), tdOsdO(_, _, _, stage));
        SM90_BULK_COPY_G2S::copy(lse, &ss.full[stage], ss.lse.data() + stage * kBlockM, Loads::kBytesRow);
        SM90_BULK_COPY_G2S::copy(dpsum, &ss.full[stage], ss.dpsum.data() + stage * kBlockM, Loads::kBytesRow);
        if (++stage == Tr::kStages) { stage = 0; phase ^= 1; }
      }
    }
  }
}

// The empty barriers of the Q/dO/LSE/D ring(s) complete when every consumer thread (kNumMmaThreads)
// has arrived: each thread arrives for itself after its own last read of the stage, so its
// reads of LSE and D are ordered before the producer's next bulk copy into the stage by a direct
// release/acquire pair, as CUTLASS's PipelineTmaAsync does without a cluster. (One elected lane
// per warp after __syncwarp, which ptxas compiles to no instruction, left the other lanes'
// reads ordered only through the step's named barriers: issue 24's racecheck report.)
CUTE_DEVICE void release_stage(uint64_t* empty) { cutlass::arch::ClusterBarrier::arrive(empty); }

// Named barrier ids (CUTLASS adds its reserved offset of 8; ids 0..7 are ours, 8 in all).
//   DsFull/DsFree: the two consumer warpgroups around the shared dS tile (256 threads).
//   DetIn/DetOut: deterministic turn taking in the consumers (atomic dQ path, 256 threads).
//   DQFull0/1, DQEmpty0/1: consumer warpgroup w and the dQ writer warp (128 + 32 threads).
enum : uint32_t {
  kBarDsFull = 0, kBarDsFree = 1, kBarDetIn = 2, kBarDetOut = 3,
  kBarDQFull0 = 4, kBarDQEmpty0 = 6  // + warpgroup
};
constexpr int kDQBarThreads = 128 + 32;

// A consumer thread's index ct (0..255), its warpgroup wg (0..1) and its thread t_in_wg in the
// warpgroup. kUniformWg: wg through a shuffle, which ptxas knows is
// warp-uniform, and ct built from it so that the MMA thread slices' (ct / 128) % 2 folds to wg:
// the per-warpgroup WGMMA descriptors then live in uniform registers (no R2UR per step).
template <bool kUniformWg>
CUTE_DEVICE void consumer_thread(int& ct, int& wg, int& t_in_wg) {
  if constexpr (kUniformWg) {
    const unsigned wg_u = unsigned(cutlass::canonical_warp_group_idx()) - 1u;
    __builtin_assume(wg_u < 2u);
    wg = int(wg_u);
    t_in_wg = int(threadIdx.x % 128u);
    ct = int((wg_u << 7) | (threadIdx.x % 128u));
  } else {
    ct = threadIdx.x - 128;
    wg = ct / 128;
    t_in_wg = ct % 128;
  }
}

// The kernel's shared storage at the first 1024-byte boundary of the dynamic smem window (the
// swizzled TMA tiles need it). kSharedSpace (the consumers): reach it by indexing the __shared__
// array, so the compiler keeps the shared space (LDS/STS for the statistics and the dQ tile, not
// generic LD.E/ST.E through the LSU's global queue); else through an integer (the producer, whose
// accesses are TMA/bulk/mbarrier operands anyway: the shared-space form spilled 20 B there).
template <class Storage, bool kSharedSpace>
__device__ __forceinline__ Storage& aligned_storage(char* smem_raw) {
  if constexpr (kSharedSpace) {
    const uint32_t pad = (0u - cute::cast_smem_ptr_to_uint(smem_raw)) & 1023u;
    return *reinterpret_cast<Storage*>(smem_raw + pad);
  } else {
    return *reinterpret_cast<Storage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  }
}

// dK (scaled by softmax_scale) and dV of consumer warpgroup wg, through shared memory and TMA
// stores (one-pass tiles; DKVStore in bwd_traits.cuh). Called once per CTA after
// the main loop's final warpgroup_wait<0>, by all 128 threads of the warpgroup; `steps` is the
// number of steps the CTA ran (the step counter `it`).
// Why the staging memory is free without a barrier between the warpgroups:
//  - dV goes to this warpgroup's own 64 rows of V. Only this warpgroup reads them (dP^T = V dO^T
//    takes V rows of its own keys as the A operand), and its final wait<0> retired those reads.
//    The K/V TMA completed before the first step (kv_full), or was never issued (no steps).
//  - dK goes to stage fs = steps % kStages of the Q/dO ring (Q for wg 0, dO for wg 1), which the
//    last step (stage (steps - 1) % kStages) does not use. TMA: the producer issues exactly one
//    load per step and every step's load was waited for (full barrier), so no load is in flight
//    and none will come. Readers: the latest step that used stage fs is steps - kStages (or none).
//    This warpgroup retired all its reads. The other warpgroup's reads of that step (S^T, dP^T,
//    dV, and dK, which the dK overlap keeps in flight into the next step) are retired by its first
//    WGMMA wait of step steps - 1, before it arrives on that step's DsFull barrier. This warpgroup
//    has passed that barrier (a 256-thread sync) before leaving the loop, so the other warpgroup
//    reads only stage (steps - 1) % kStages, its dS buffer, K and its own V rows from now on.
//    kPasses == 1 makes the DsFull barrier part of every step; kStages >= 2 makes fs a second stage.
// Each warp owns 16 key rows of the WGMMA C layout, so it writes its rows with stmatrix, fences
// (generic -> async proxy), and one lane stores its (16, head dim) boxes of dK and dV by TMA:
// no barrier beyond __syncwarp. Rows past seqlen_k are clipped by TMA (out-of-bounds box rows are
// not written); a box that starts past seqlen_k is not issued. The lane waits until the stores
// have read shared memory (tma_store_wait<0>) so the CTA outlives the reads; the global writes
// complete on their own before the grid does.
template <class Tr, class FragK, class FragV>
CUTE_DEVICE void store_dkv_tma(MainParams<Tr> const& p, typename Tr::SharedStorage& ss, FragK& tdKrdK,
                               FragV const& tdVrdV, int steps, int n_block, int hk, int b, int wg, int t_in_wg) {
  using St = DKVStore<Tr>;
  using Element = typename Tr::Element;
  constexpr int kHeadDim = Tr::kHeadDim;
  const int fs = steps % Tr::kStages;
  Element* dk_buf = (wg == 0 ? ss.q.data() : ss.dout.data()) + fs * St::kStageElems;
  Element* dv_buf = ss.v.data() + wg * St::kVHalf;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= p.softmax_scale;
  Tensor rdK = make_tensor<Element>(tdKrdK.layout());
  convert_fragment(tdKrdK, rdK);
  Tensor rdV = make_tensor<Element>(tdVrdV.layout());
  convert_fragment(tdVrdV, rdV);
  auto stsm = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, typename St::MmaWg{});
  auto thr = stsm.get_thread_slice(t_in_wg);
  Tensor sdK = as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(dk_buf), typename St::SmemLayoutdK{}));
  Tensor sdV = as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(dv_buf), typename St::SmemLayoutdV{}));
  copy(stsm, thr.retile_S(rdK), thr.partition_D(sdK));
  copy(stsm, thr.retile_S(rdV), thr.partition_D(sdV));
  cutlass::arch::fence_view_async_shared();  // stmatrix writes -> visible to the TMA stores
  __syncwarp();
  const int warp = t_in_wg / 32;
  const int row_blk = n_block * (Tr::kBlockN / St::kWarpRows) + wg * (64 / St::kWarpRows) + warp;
  if (row_blk * St::kWarpRows < p.seqlen_k) {  // warp-uniform
    if (cute::elect_one_sync()) {
      auto shape = make_shape(p.seqlen_k, Int<kHeadDim>{}, p.heads_kv, p.batch);
      Tensor mdK = p.tma_dk.get_tma_tensor(shape);
      Tensor mdV = p.tma_dv.get_tma_tensor(shape);
      Tensor gdK = local_tile(mdK(_, _, hk, b), Shape<Int<St::kWarpRows>, Int<kHeadDim>>{}, make_coord(row_blk, _0{}));
      Tensor gdV = local_tile(mdV(_, _, hk, b), Shape<Int<St::kWarpRows>, Int<kHeadDim>>{}, make_coord(row_blk, _0{}));
      Tensor sdK_w = make_tensor(make_smem_ptr(dk_buf + warp * St::kWarpOffset), typename St::SmemLayoutdK16{});
      Tensor sdV_w = make_tensor(make_smem_ptr(dv_buf + warp * St::kWarpOffset), typename St::SmemLayoutdV16{});
      auto [tKg, tKs] = tma_partition(p.tma_dk, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdK_w), group_modes<0, 2>(gdK));
      auto [tVg, tVs] = tma_partition(p.tma_dv, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdV_w), group_modes<0, 2>(gdV));
      copy(p.tma_dk, tKs, tKg);
      copy(p.tma_dv, tVs, tVg);
      tma_store_arrive();
      tma_store_wait<0>();  // shared memory read: the CTA may exit
    }
  }
}

// A tail CTA's share of its unit's dK (scaled by softmax_scale) and dV, in fp32 to workspace slot
// `slot` (BwdTailSplit): float4 j of consumer thread ct at j * 256 + ct (coalesced), dK's
// fragment then dV's, as bwd_dkv_tail_kernel reads them back. ct is the dK/dV MMA's thread index.
template <class Tr, class FragK, class FragV>
CUTE_DEVICE void store_dkv_part(MainParams<Tr> const& p, FragK const& tdKrdK, FragV const& tdVrdV, int slot,
                                int ct) {
  constexpr int kVec = decltype(size(tdKrdK))::value / 4;
  static_assert(Tr::kNumMmaThreads == 256 && kVec * 4 * 256 == Tr::kBlockN * Tr::kHeadDim);
  float4* dst = reinterpret_cast<float4*>(p.dkv_part + int64_t(slot) * (2 * Tr::kBlockN * Tr::kHeadDim));
  const float sc = p.softmax_scale;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kVec; ++j) {
    dst[j * 256 + ct] = make_float4(tdKrdK(4 * j) * sc, tdKrdK(4 * j + 1) * sc, tdKrdK(4 * j + 2) * sc,
                                    tdKrdK(4 * j + 3) * sc);
    dst[(kVec + j) * 256 + ct] = make_float4(tdVrdV(4 * j), tdVrdV(4 * j + 1), tdVrdV(4 * j + 2), tdVrdV(4 * j + 3));
  }
}

// One step of the dQ writer: in deterministic mode wait for the block's turn, add the consumers'
// two shared-memory tiles into the fp32 accumulator acc, free the tiles for the next step (more:
// there is one), and in deterministic mode publish the turn once the adds are performed. Turn order: the key blocks of a query block one after the other,
// from the first (band.key_block_range's n_begin; the CTA's m range guarantees the band is not
// empty): its semaphore sem holds n_block - (first key block) when this key block's adds are next.
// The query block is m, the CTA's first m_begin; first_key0 the first key m_begin sees.
template <class Tr>
CUTE_DEVICE void dq_writer_step(MainParams<Tr> const& p, typename Tr::SharedStorage& ss, float* acc, int* sem,
                                long long first_key0, int m, int m_begin, int n_block, bool lane0, bool more) {
  if (p.deterministic) {
    const long long first_key = first_key0 + (long long)(m - m_begin) * Tr::kBlockM;
    const int my_turn = n_block - (first_key > 0 ? int(first_key / Tr::kBlockN) : 0);
    if (lane0) {
      while (ld_acquire(sem) != my_turn) __nanosleep(32);
      fence_proxy_async_global();  // the acquired bulk writes before our bulk op
    }
    __syncwarp();
  }
  cutlass::arch::NamedBarrier::sync(kDQBarThreads, kBarDQFull0);
  if (lane0) {
    bulk_reduce_add_f32(acc, ss.dq.data(), Tr::kDQWgBytes);
    bulk_commit();
  }
  cutlass::arch::NamedBarrier::sync(kDQBarThreads, kBarDQFull0 + 1);
  if (lane0) {
    bulk_reduce_add_f32(acc + Tr::kDQWgFloats, ss.dq.data() + Tr::kDQWgFloats, Tr::kDQWgBytes);
    bulk_commit();
    bulk_wait_read_all();
  }
  __syncwarp();
  if (more) {
    cutlass::arch::NamedBarrier::arrive(kDQBarThreads, kBarDQEmpty0);
    cutlass::arch::NamedBarrier::arrive(kDQBarThreads, kBarDQEmpty0 + 1);
  }
  if (p.deterministic && lane0) {
    bulk_wait_all();             // our adds are performed ...
    fence_proxy_async_global();  // ... ordered before generic accesses ...
    red_release_add(sem, 1);     // ... and published with the turn
  }
}


template <class Tr>
__global__ void __launch_bounds__(Tr::kNumThreads, 1)
    bwd_main_kernel(const __grid_constant__ MainParams<Tr> p) {
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  constexpr int kStages = Tr::kStages, kStagesdS = Tr::kStagesdS, kBlockMSdP = Tr::kBlockMSdP;
  using ClusterBar = cutlass::arch::ClusterBarrier;
  using TxBar = cutlass::arch::ClusterTransactionBarrier;
  using Storage = typename Tr::SharedStorage;

  extern __shared__ char smem_raw[];
  // Everything a role needs is (re)computed after its setmaxnreg, so that no value lives across
  // the register reallocation (ptxas would spill it).
  auto storage = [&]() -> Storage& { return aligned_storage<Storage, false>(smem_raw); };
  // The producer warp, on 24 registers, spills 20 B with the shared-space form: it keeps the
  // generic one (its accesses are TMA/bulk/mbarrier operands through cvta anyway).
  auto consumer_storage = [&]() -> Storage& { return aligned_storage<Storage, true>(smem_raw); };
  const int warp_group = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    Storage& ss = storage();
    TxBar::init(&ss.kv_full, 1);
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < kStages; ++s) {
      TxBar::init(&ss.full[s], 1);
      ClusterBar::init(&ss.empty[s], Tr::kNumMmaThreads);  // release_stage: every consumer thread
    }
    cutlass::arch::fence_barrier_init();
    if constexpr (DKVStore<Tr>::kEnabled) {
      cute::prefetch_tma_descriptor(p.tma_dk.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_dv.get_tma_descriptor());
    }
  }
  __syncthreads();

  if (warp_group == 0) {
    // ------------------------------------------------------------------ producer warpgroup
    cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
    // Each role derives its block range itself, inside its branch: values shared by the two
    // branches would stay live through both on 24 registers (ptxas spilled the TMA loop).
    const int warp = threadIdx.x / 32;
    int m_begin, m_end;
    if (warp == 0) {
      Storage& ss = storage();
      int n_block, hk, b, slot;
      cta_work(p, n_block, hk, b, m_begin, m_end, slot);
      const int group = p.heads_q / p.heads_kv;
      if (threadIdx.x == 0 && m_end > m_begin) load_kv_and_steps(p, ss, n_block, hk, b, group, m_begin, m_end);
    } else if (Tr::kDQSmem && warp == 1) {
      Storage& ss = storage();
      int n_block, hk, b, slot;
      cta_work(p, n_block, hk, b, m_begin, m_end, slot);
      const int group = p.heads_q / p.heads_kv;
      if (m_end > m_begin) {
        // -------------------------------------------------------------- dQ writer (one warp)
        // Runs on the producer warpgroup's 24 registers: pointers advance incrementally and the
        // turn (first key block of the query block) is computed inline.
        const bool lane0 = threadIdx.x == 32;
        const int steps = group * (m_end - m_begin);
        // Both smem tiles start empty. The writer arrives on DQEmpty exactly once per consumer
        // sync (here for the first step, then after each step but the last), so the barrier
        // phases alternate strictly: the writer's next arrive follows its DQFull sync, which
        // follows the consumers' DQEmpty sync of the step before.
        cutlass::arch::NamedBarrier::arrive(kDQBarThreads, kBarDQEmpty0);
        cutlass::arch::NamedBarrier::arrive(kDQBarThreads, kBarDQEmpty0 + 1);
        const int64_t head_rows = int64_t(hk * group + b * p.heads_q) * p.m_blocks + m_begin;
        float* acc = p.dq_accum + head_rows * int64_t(kBlockM * kHeadDim);
        int* sem = p.dq_sem + head_rows;
        const long long first_key0 = (long long)m_begin * kBlockM + (p.seqlen_k - p.seqlen_q) - p.window_left;
        int m = m_begin;
        #pragma unroll 1
        for (int step = 0; step < steps; ++step) {
          dq_writer_step(p, ss, acc, sem, first_key0, m, m_begin, n_block, lane0, step + 1 < steps);
          // Next (head, query block): query blocks innermost, as the consumers walk them.
          acc += kBlockM * kHeadDim;
          ++sem;
          if (++m == m_end) {
            m = m_begin;
            const int skip = p.m_blocks - (m_end - m_begin);
            acc += int64_t(skip) * (kBlockM * kHeadDim);
            sem += skip;
          }
        }
        // The CTA may not exit while a bulk reduce still reads its shared memory; every step
        // already waited for that (wait_group.read 0 above). Deterministic mode also waited for
        // each step's adds to be performed (before publishing the turn). Wait here until the
        // last adds are performed too (leaving without it, as FA3's writer does, was level).
        if (lane0) bulk_wait_all();
      }
    }
  } else {
    // ------------------------------------------------------------------ consumers
    cutlass::arch::warpgroup_reg_alloc<Tr::kMmaRegs>();
    Storage& ss = consumer_storage();
    int n_block, hk, b, m_begin, m_end, slot;
    cta_work(p, n_block, hk, b, m_begin, m_end, slot);
    const int group = p.heads_q / p.heads_kv;
    BandMask band{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
    const bool has_work = m_end > m_begin;
    int ct, wg, t_in_wg;
    consumer_thread<Tr::kUniformWg>(ct, wg, t_in_wg);

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

    // Q/dO rows as (kBlockMSdP, head_dim, sub-step, 1, stage): the B operands of S^T/dP^T per
    // sub-step (kSubM = 1: the whole step).
    auto sub_rows = [](auto const& t) { return flat_divide(t, Shape<Int<kBlockMSdP>, Int<kHeadDim>>{}); };
    Tensor tSrK = thr_sdp.partition_fragment_A(sK);              // descriptors
    Tensor tSrQ = thr_sdp.partition_fragment_B(sub_rows(sQ));    // (MMA, N, K, sub, 1, stage)
    Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
    Tensor tdPrdO = thr_sdp.partition_fragment_B(sub_rows(sdO));
    // dS as the dQ GEMM's A operand (MMA, M, K, dS stage), or B when swapped (MMA, N, K, dS stage).
    Tensor tdQrdS = [&] {
      if constexpr (Tr::kDQSwapAB) return thr_dq.partition_fragment_B(sdS);
      else return thr_dq.partition_fragment_A(sdS);
    }();

    // Coordinates (key row, query column of the sub-step) of this thread's S^T accumulator elements.
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockMSdP>>{}));
    // Coordinates (key row, column) of this thread's dK/dV accumulator elements.
    Tensor tdKVc = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<Tr::kHdPass>>{}));

    auto ds_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto thr_ds_copy = ds_copy.get_thread_slice(ct);
    // dS^T destination per sub-step: (CPY, M, N, 1, sub, stage). The view is taken over the
    // whole (1024 B aligned) tile, so the swizzle still sees offsets from the tile base
    // (layout_check.cu compares it with SmemLayoutdSt).
    Tensor tdSsdS = thr_ds_copy.partition_D(as_position_independent_swizzle_tensor(
        flat_divide(sdSt, Shape<Int<kBlockN>, Int<kBlockMSdP>>{})));

    const int n0 = n_block * kBlockN;
    const bool n_partial = n0 + kBlockN > p.seqlen_k;
    // kMaskRows: a sub-step of rows [q0, q_hi] of this key block needs no element mask iff
    // q0 >= iq_min && q_hi <= iq_max (n_partial included: then iq_min = 2^30).
    int iq_min = 0, iq_max = 0;
    if constexpr (Tr::kMaskRows) band.interior_row_range(n0, kBlockN, iq_min, iq_max);

    if (has_work) TxBar::wait(&ss.kv_full, 0);

    // Q, dO, LSE, D of a stage are no longer read by this thread.
    auto release = [&](int s) { release_stage(&ss.empty[s]); };

    // One step counter carries the whole pipeline state (registers are the limit here): stage
    // and phase of the Q/dO ring, the dS buffer (dS is written only in pass 0, whose steps come
    // first), and the stage an in-flight dK still reads (the previous step's).
    int it = 0;
    for (int pass = 0; pass < Tr::kPasses; ++pass) {
      Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<Tr::kHdPass>>{});
      Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<Tr::kHdPass>>{});
      clear(tdKrdK);
      clear(tdVrdV);
      const bool dq_pass = pass == 0;
      const int it_pass = it;  // kOverlapDK: steps after the pass's first have a dK in flight
      for (int hi = 0; hi < group; ++hi) {
        const int h = hk * group + hi;
        for (int m = m_begin; m < m_end; ++m) {
          const int m0 = m * kBlockM;
          // Per sub-step: does the band or the key bound cut through its (query, key) tile?
          bool need_mask[Tr::kSubM];
          CUTLASS_PRAGMA_UNROLL
          for (int sub = 0; sub < Tr::kSubM; ++sub) {
            const int q0 = m0 + sub * kBlockMSdP;
            // kNoBand (the 80-row hd128 tile, launched only without a band): the key bound alone.
            if constexpr (Tr::kNoBand) need_mask[sub] = n_partial;
            else if constexpr (Tr::kMaskRows)  // rows [iq_min, iq_max] are interior
              need_mask[sub] = q0 < iq_min || min(q0 + kBlockMSdP, p.seqlen_q) - 1 > iq_max;
            else need_mask[sub] =
                n_partial || !band.block_is_interior(q0, min(q0 + kBlockMSdP, p.seqlen_q) - 1, n0, kBlockN);
          }
          const int stage = it % kStages;
          const uint32_t phase = (it / kStages) & 1;
          const int ds_stage = it % kStagesdS;
          const int prev_stage = (it + kStages - 1) % kStages;
          const bool pending = Tr::kOverlapDK && it != it_pass;
          TxBar::wait(&ss.full[stage], phase);

          // The step's query rows in kSubM sub-steps of kBlockMSdP columns (one for every tile but
          // hd64 at 128 rows, which has two): each computes S^T, dP^T, P^T, dS^T and dV and stores
          // its dS^T columns with the registers of a 64-row step. A sub-step's dK is issued at
          // once and retired by the next sub-step's first wait; the last one's follows the dQ
          // GEMM (and with kOverlapDK stays in flight into the next step). The dS barrier, the
          // dQ GEMM and its hand-off come once per step.
          // kSdPAhead (kSubM > 1): every sub-step's S^T and dP^T are issued here,
          // before the first exponential, so that the tensor cores run dP^T(0), S^T(1), dP^T(1) under
          // sub-step 0's exp2/dS math and dV(0), dK(0) under sub-step 1's (instead of dP^T alone).
          // Costs 64 accumulator registers per extra sub-step; the waits below then leave the
          // 2 (kSubM - 1) younger groups in flight (kAhead).
          constexpr int kAhead = Tr::kSdPAhead ? 2 * (Tr::kSubM - 1) : 0;
          using FragSdP = decltype(partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockMSdP>>{}));
          FragSdP tSrS_sub[Tr::kSdPAhead ? Tr::kSubM : 1], tdPrdP_sub[Tr::kSdPAhead ? Tr::kSubM : 1];
          if constexpr (Tr::kSdPAhead) {
            CUTLASS_PRAGMA_UNROLL
            for (int sub = 0; sub < Tr::kSubM; ++sub) {
              wgmma_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, sub, 0, stage), tSrS_sub[sub]);
              wgmma_gemm<true, -1>(mma_sdp, tdPrV, tdPrdO(_, _, _, sub, 0, stage), tdPrdP_sub[sub]);
            }
          }
          CUTLASS_PRAGMA_UNROLL
          for (int sub = 0; sub < Tr::kSubM; ++sub) {
            const bool last = sub == Tr::kSubM - 1;
            const int q0 = m0 + sub * kBlockMSdP;  // first query row of the sub-step
            FragSdP tSrS_own, tdPrdP_own;  // without kSdPAhead: this sub-step's own accumulators
            FragSdP& tSrS = Tr::kSdPAhead ? tSrS_sub[Tr::kSdPAhead ? sub : 0] : tSrS_own;
            FragSdP& tdPrdP = Tr::kSdPAhead ? tdPrdP_sub[Tr::kSdPAhead ? sub : 0] : tdPrdP_own;
            if constexpr (!Tr::kSdPAhead) {
              wgmma_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, sub, 0, stage), tSrS);
              wgmma_gemm<true, -1>(mma_sdp, tdPrV, tdPrdO(_, _, _, sub, 0, stage), tdPrdP);
            }
            // P^T = exp2(S^T * scale_log2 - lse_log2), dS^T = P^T o (dP^T - D) (o tanh' with
            // softcap); rows = keys, columns = queries.
            const float* lse = ss.lse.data() + stage * kBlockM + sub * kBlockMSdP;
            const float* dpsum = ss.dpsum.data() + stage * kBlockM + sub * kBlockMSdP;
            // Per-query statistics of accumulator element i (column get<1>(tScS(i))). Lane L keeps columns 64h + 2L, 64h + 2L + 1 (one float2 per 64 columns) and the thread
            // that needs column c = 8j + 2(lane % 4) + e (element i = e + 2 r + 4 j of the
            // ((2,2,kBlockMSdP/8),1,1) accumulator) takes it from lane (c % 64) / 2 by a shuffle:
            // kBlockMSdP/32 registers per statistic instead of up to kBlockMSdP/4 loaded values.
            // A partial last group of 64 columns (80 rows: columns 64..79) is not shuffled: each
            // thread reads its own 4 columns there from shared memory (fewer live registers).
            float2 lse_r[kBlockMSdP / 64], dpsum_r[kBlockMSdP / 64];
            CUTLASS_PRAGMA_UNROLL
            for (int c64 = 0; c64 < kBlockMSdP / 64; ++c64) {
              lse_r[c64] = *reinterpret_cast<const float2*>(lse + c64 * 64 + 2 * (ct % 32));
              dpsum_r[c64] = *reinterpret_cast<const float2*>(dpsum + c64 * 64 + 2 * (ct % 32));
            }
            // kStatsLds: the thread's own columns 8 j + 2 (lane % 4) + {0, 1}
            // (element i = e + 2 r + 4 j, as above) as kBlockMSdP / 8 float2 loads: LSE here, under
            // the S^T wait, D after the exponentials, under the dP^T wait.
            constexpr int kStatsV = Tr::kStatsLds ? kBlockMSdP / 8 : 1;
            float2 lse_v[kStatsV], dpsum_v[kStatsV];
            auto load_stat = [&](const float* sm, float2 (&v)[kStatsV]) {
              CUTLASS_PRAGMA_UNROLL
              for (int j = 0; j < kStatsV; ++j) v[j] = *reinterpret_cast<const float2*>(sm + 8 * j + 2 * (ct % 4));
            };
            if constexpr (Tr::kStatsLds) load_stat(lse, lse_v);
            auto stat = [&](const float* sm, float2 const (&r)[kBlockMSdP / 64], float2 const (&v)[kStatsV], int i) {
              if constexpr (Tr::kStatsLds) {
                return (i % 2) ? v[i / 4].y : v[i / 4].x;
              } else if constexpr (Tr::kShflSegLane) {
                // Source lane 4 (j % 8) + lane % 4 with the lane bits 0-1 taken from the reader
                // (segment mask 3 in shfl's c operand): 4 (j % 8) is an immediate, so no register
                // holds the 8 source lanes. Columns past the last full 64 (80 rows: 64..79) are
                // read from shared memory.
                if (i / 32 < kBlockMSdP / 64) {
                  const int j = i / 4;
                  const float2 v = r[j / 8];
                  return shfl_idx_seg3(0xffffffffu, (i % 2) ? v.y : v.x, 4 * (j % 8));
                }
                return sm[get<1>(tScS(i))];
              } else {
                const int j = i / 4;
                const float2 v = r[j / 8];
                return __shfl_sync(0xffffffffu, (i % 2) ? v.y : v.x, 4 * (j % 8) + ct % 4);
              }
            };
            // The band/key-bound mask runs as its own pass, only on boundary blocks, so the
            // exponentials of interior blocks carry no per-element coordinates or branches.
            auto apply_mask = [&]() {
              if (need_mask[sub]) {
                CUTLASS_PRAGMA_UNROLL
                for (int i = 0; i < size(tSrS); ++i) {
                  if constexpr (Tr::kNoBand) {  // the key bound only
                    if (n0 + get<0>(tScS(i)) >= p.seqlen_k) tSrS(i) = 0.f;
                  } else {
                    const int j = n0 + get<0>(tScS(i)), qi = q0 + get<1>(tScS(i));
                    const int rel = (j - p.seqlen_k) - (qi - p.seqlen_q);  // j - i - (sk - sq)
                    if (j >= p.seqlen_k || rel < -p.window_left || rel > p.window_right) tSrS(i) = 0.f;
                  }
                }
              }
            };
            if constexpr (Tr::kOverlapP && !Tr::kSoftcap) {
              // Groups in flight: [dK of the previous step | dV, dK of the previous sub-step,]
              // S^T, dP^T. Waiting down to one completes all but dP^T; P is computed while dP^T
              // runs (kAhead: the later sub-steps' S^T/dP^T, or this step's dV/dK of the previous
              // sub-step, stay in flight too).
              warpgroup_wait<1 + kAhead>();
              warpgroup_fence_operand(tSrS);
              if (sub == 0 && pending) {
                warpgroup_fence_operand(tdKrdK);
                release(prev_stage);
              }
              CUTLASS_PRAGMA_UNROLL
              for (int i = 0; i < size(tSrS); ++i) tSrS(i) = exp2f(tSrS(i) * p.scale_log2 - stat(lse, lse_r, lse_v, i));
              apply_mask();
              if constexpr (Tr::kStatsLds) load_stat(dpsum, dpsum_v);
              warpgroup_wait<0 + kAhead>();
              warpgroup_fence_operand(tdPrdP);
              CUTLASS_PRAGMA_UNROLL
              for (int i = 0; i < size(tSrS); ++i) tdPrdP(i) = tSrS(i) * (tdPrdP(i) - stat(dpsum, dpsum_r, dpsum_v, i));
            } else {
              // Softcap needs tanh' next to dP^T: P and dS^T in one pass after both GEMMs (v1),
              // which keeps only S^T and dP^T live next to dK/dV.
              warpgroup_wait<0 + kAhead>();
              warpgroup_fence_operand(tSrS);
              warpgroup_fence_operand(tdPrdP);
              if (sub == 0 && pending) {
                warpgroup_fence_operand(tdKrdK);
                release(prev_stage);
              }
              CUTLASS_PRAGMA_UNROLL
              for (int i = 0; i < size(tSrS); ++i) {
                float s = tSrS(i), dtanh = 1.f;
                if constexpr (Tr::kSoftcap) {
                  s = tanhf(s * p.pre_tanh);
                  dtanh = 1.f - s * s;
                }
                float pv = exp2f(s * p.scale_log2 - stat(lse, lse_r, lse_v, i));
                if (need_mask[sub]) {
                  if constexpr (Tr::kNoBand) {  // the key bound only
                    if (n0 + get<0>(tScS(i)) >= p.seqlen_k) pv = 0.f;
                  } else {
                    const int j = n0 + get<0>(tScS(i)), qi = q0 + get<1>(tScS(i));
                    const int rel = (j - p.seqlen_k) - (qi - p.seqlen_q);  // j - i - (sk - sq)
                    if (j >= p.seqlen_k || rel < -p.window_left || rel > p.window_right) pv = 0.f;
                  }
                }
                tSrS(i) = pv;
                tdPrdP(i) = pv * dtanh * (tdPrdP(i) - stat(dpsum, dpsum_r, dpsum_v, i));
              }
            }
            Tensor rP = make_tensor<Element>(tSrS.layout());
            convert_fragment(tSrS, rP);
            Tensor rdS = make_tensor<Element>(tdPrdP.layout());
            convert_fragment(tdPrdP, rdS);
            // dS^T of this sub-step to shared memory for the dQ GEMM; fence and barrier below.
            auto store_ds = [&] {
              // With one dS buffer the other warpgroup may still read it (previous dQ GEMM).
              if (kStagesdS == 1 && sub == 0) cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDsFree);
              copy(ds_copy, thr_ds_copy.retile_S(rdS), tdSsdS(_, _, _, 0, sub, ds_stage));
            };
            if constexpr (Tr::kDsBeforeDv) {
              if (dq_pass) store_ds();
            }
            // dV += P^T dO (this pass's columns).
            {
              Tensor sdOt_p = local_tile(sdOt(_, _, stage), Shape<Int<Tr::kHdPass>, Int<kBlockMSdP>>{},
                                         make_coord(pass, sub));
              Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOt_p);
              Tensor tdVrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
              wgmma_gemm<false, -1>(mma_dkv, tdVrP, tdVrdO, tdVrdV);
            }

            if (dq_pass) {
              if constexpr (!Tr::kDsBeforeDv) store_ds();
              if (last) {  // this warpgroup's part of the dS tile is complete
                cutlass::arch::fence_view_async_shared();
                cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDsFull);
              }
            }
            // dK += dS^T Q (this pass's columns); in the last sub-step of a dq_pass issued after
            // the first dQ chunk below.
            Tensor sQt_p = local_tile(sQt(_, _, stage), Shape<Int<Tr::kHdPass>, Int<kBlockMSdP>>{},
                                      make_coord(pass, sub));
            Tensor tdKrQ = thr_dkv.partition_fragment_B(sQt_p);
            Tensor tdKrdS = make_tensor(rdS.data(), acc_as_operand_a(rdS.layout()));

            if (dq_pass && last) {
              const int64_t acc_base =
                  ((int64_t(b) * p.heads_q + h) * p.m_blocks + m) * int64_t(kBlockM * kHeadDim);
              int* sem = p.dq_sem + (int64_t(b) * p.heads_q + h) * p.m_blocks + m;
              CUTLASS_PRAGMA_UNROLL
              for (int c = 0; c < Tr::kDQChunks; ++c) {
                Tensor sKt_c = local_tile(sKt, Shape<Int<Tr::kHdChunk>, Int<kBlockN>>{}, make_coord(c, _0{}));
                Tensor tdQrdQ = partition_fragment_C(mma_dq, typename Tr::DQTileShape{});
                if constexpr (Tr::kDQSwapAB) {  // dQ^T = K^T dS^T: this warpgroup's 64 columns x kBlockM
                  Tensor tdQrK = thr_dq.partition_fragment_A(sKt_c);
                  wgmma_gemm<true, -1>(mma_dq, tdQrK, tdQrdS(_, _, _, ds_stage), tdQrdQ);
                } else {
                  Tensor tdQrK = thr_dq.partition_fragment_B(sKt_c);
                  wgmma_gemm<true, -1>(mma_dq, tdQrdS(_, _, _, ds_stage), tdQrK, tdQrdQ);
                }
                if (c == 0) {
                  wgmma_gemm<false, -1>(mma_dkv, tdKrdS, tdKrQ, tdKrdK);
                  warpgroup_wait<1>();  // dV and dQ chunk 0 done; dK may still run
                } else {
                  warpgroup_wait<0>();
                }
                warpgroup_fence_operand(tdQrdQ);
                if constexpr (Tr::kDQSmem) {
                  // Hand the tile to the dQ writer: wait until it has read the previous one.
                  float4* dst = reinterpret_cast<float4*>(ss.dq.data() + wg * Tr::kDQWgFloats);
                  // Barrier ids as immediates (a warp-uniform branch): no registers held for them.
                  if (wg == 0) cutlass::arch::NamedBarrier::sync(kDQBarThreads, kBarDQEmpty0);
                  else cutlass::arch::NamedBarrier::sync(kDQBarThreads, kBarDQEmpty0 + 1);
                  CUTLASS_PRAGMA_UNROLL
                  for (int j = 0; j < Tr::kDQFrag / 4; ++j) {
                    dst[j * 128 + t_in_wg] =
                        make_float4(tdQrdQ(4 * j), tdQrdQ(4 * j + 1), tdQrdQ(4 * j + 2), tdQrdQ(4 * j + 3));
                  }
                  cutlass::arch::fence_view_async_shared();  // generic smem writes -> bulk copy
                  if (wg == 0) cutlass::arch::NamedBarrier::arrive(kDQBarThreads, kBarDQFull0);
                  else cutlass::arch::NamedBarrier::arrive(kDQBarThreads, kBarDQFull0 + 1);
                } else {
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
                      int64_t(wg) * Tr::kDQWgFloats);
                  CUTLASS_PRAGMA_UNROLL
                  for (int j = 0; j < Tr::kDQFrag / 4; ++j) {
                    dq_add_f32x4(acc + j * 128 + t_in_wg,
                                 make_float4(tdQrdQ(4 * j), tdQrdQ(4 * j + 1), tdQrdQ(4 * j + 2), tdQrdQ(4 * j + 3)));
                  }
                }
              }
              if (!Tr::kDQSmem && p.deterministic) {
                __threadfence();
                cutlass::arch::NamedBarrier::sync(Tr::kNumMmaThreads, kBarDetOut);
                if (ct == 0) red_release_add(sem, 1);
              }
            } else {
              wgmma_gemm<false, -1>(mma_dkv, tdKrdS, tdKrQ, tdKrdK);
            }
          }  // sub-steps
          if constexpr (Tr::kOverlapDK) {
            // dK stays in flight into the next step; its Q stage is released there.
          } else {
            warpgroup_wait<0>();
            warpgroup_fence_operand(tdKrdK);
            warpgroup_fence_operand(tdVrdV);
            release(stage);
          }
          ++it;
        }
      }
      warpgroup_wait<0>();  // unconditional: ptxas must see every GMMA retired before the epilogue
      if (Tr::kOverlapDK && it != it_pass) release((it + kStages - 1) % kStages);
      warpgroup_fence_operand(tdKrdK);
      warpgroup_fence_operand(tdVrdV);

      // Epilogue of the pass: this pass's columns of dK (scaled) and dV, in the input dtype; a
      // tail unit's share in fp32 to its workspace slot.
      if constexpr (kTailSplitOk<Tr>) {
        if (slot >= 0) {
          store_dkv_part(p, tdKrdK, tdVrdV, slot, ct);
          continue;  // kPasses == 1: the end of the kernel
        }
      }
      if constexpr (DKVStore<Tr>::kEnabled) {
        store_dkv_tma(p, ss, tdKrdK, tdVrdV, it, n_block, hk, b, wg, t_in_wg);
        continue;  // kPasses == 1: the end of the kernel
      }
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
