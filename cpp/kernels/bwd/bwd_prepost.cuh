// Backward preprocess and postprocess kernels.
//   preprocess  (grid: query block, head, batch; 256 threads):
//     D[row] = rowsum(dO o O) in fp32 (0 on padding rows), also to PrePostParams::dpsum_out when
//       the caller asked for it (the attention sinks' gradient),
//     lse_log2[row] = lse * log2 e, or +inf where lse = -inf (fully masked rows) and on padding
//       rows, so that P = exp2(S * scale_log2 - lse_log2) is exactly 0 there (never NaN),
//     clears the block's dQ counter (dq_sem) and, where the consumers add dQ (!kDQSmem: hd192,
//     split-D), its fp32 dQ accumulator: the dQ writer's first store needs no clear (bwd_dq.cuh).
//   postprocess (same grid): dQ = softmax_scale * accumulator, converted to the input dtype and
//     written in (batch, seqlen_q, heads, head_dim) layout; 0 where no key block reached the
//     block (kDQSmem: its counter is 0, its accumulator never written). The accumulator holds each
//     dQ chunk in the register-fragment order of the main kernel's dQ WGMMA (so its adds and bulk
//     reductions are 16-byte, fully coalesced); the same tiled MMA's identity partition maps it back.
//   dK/dV of the split tail units (grid: tail unit x float4 of the fragment; 256 threads; only
//     when BwdTailSplit splits): the sum of the unit's fp32 workspace slots, in part order.
#pragma once

#include <cmath>

#include <cutlass/arch/barrier.h>

#include "bwd/bwd_order.cuh"
#include "bwd/bwd_traits.cuh"
#include "common/dependent_launch.cuh"

namespace fa3 {
namespace bwd {

struct PrePostParams {
  const void* out;
  const void* dout;
  const float* lse;  // (b, hq, sq)
  float* lse_log2;   // (b, hq, m_blocks * kBlockM)
  float* dpsum;      // (b, hq, m_blocks * kBlockM)
  float* dq_accum;   // (b, hq, m_blocks, kBlockM * head_dim)
  int* dq_sem;       // (b, hq, m_blocks)
  float* dpsum_out;  // (b, hq, sq) or nullptr
  void* dq;
  int seqlen_q, heads_q, m_blocks;
  int head_dim;    // of q, dq (<= the kernel's)
  int head_dim_v;  // of out, dout
  float softmax_scale;
};

// Element offset of (b, row, h, 0) in a (batch, seqlen_q, heads_q, head_dim) tensor: O, dO, dQ.
CUTE_DEVICE int64_t bshd_offset(PrePostParams const& p, int b, int row, int h, int head_dim) {
  return ((int64_t(b) * p.seqlen_q + row) * p.heads_q + h) * head_dim;
}

// 16 bytes from global memory, or zeros where !valid, as one predicated load. Written plainly
// (a branch around the load), nvcc 13.0 split the vector into 16-bit halves inside the branch, so
// every pass's load was waited for before the next one was issued.
CUTE_DEVICE uint4 load_16b_or_zero(const void* ptr, bool valid) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
      : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
      : "l"(ptr), "r"(int(valid)));
  return v;
}

template <class Tr>
__global__ void __launch_bounds__(256) bwd_preprocess_kernel(const PrePostParams p) {
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM, kHeadDim = Tr::kHeadDim;
  // A copy at the bandwidth roofline: each thread moves one 16-byte piece of a row of O and of dO,
  // a row spans kThreadsPerRow lanes (a power of two, so the shuffle reduction stays within the
  // row), and all of a thread's loads are in flight before the first product.
  constexpr int kPieces = kHeadDim / 8;
  constexpr int kThreadsPerRow = kPieces <= 8 ? 8 : kPieces <= 16 ? 16 : 32;
  static_assert(kHeadDim % 8 == 0 && kPieces <= kThreadsPerRow);
  constexpr int kRowsPerPass = 256 / kThreadsPerRow;
  constexpr int kPasses = (kBlockM + kRowsPerPass - 1) / kRowsPerPass;
  wait_for_previous_grid();
  allow_next_grid();  // the main kernel's prologue under this grid's last CTAs
  const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int part = threadIdx.x % kThreadsPerRow, col0 = part * 8;  // out's head dim: whole vectors
  auto block_row = [&](int pass) -> int { return pass * kRowsPerPass + threadIdx.x / kThreadsPerRow; };
  uint4 ov[kPasses], dv[kPasses];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kPasses; ++i) {
    const int r = block_row(i), row = m * kBlockM + r;
    const bool valid = r < kBlockM && row < p.seqlen_q && col0 < p.head_dim_v;
    const int64_t off = bshd_offset(p, b, row, h, p.head_dim_v) + col0;
    ov[i] = load_16b_or_zero(static_cast<const Element*>(p.out) + off, valid);
    dv[i] = load_16b_or_zero(static_cast<const Element*>(p.dout) + off, valid);
  }
  const int64_t bh = int64_t(b) * p.heads_q + h;
  // The dQ clears and the LSE conversion go out while those loads are in flight.
  if constexpr (!Tr::kDQSmem) {
    float4* dq = reinterpret_cast<float4*>(p.dq_accum + (bh * p.m_blocks + m) * int64_t(kBlockM * kHeadDim));
    CUTLASS_PRAGMA_UNROLL
    for (int i = threadIdx.x; i < kBlockM * kHeadDim / 4; i += 256) dq[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (threadIdx.x == 0) p.dq_sem[bh * p.m_blocks + m] = 0;
  // lse_log2 needs no product: thread t converts row t's LSE while the O/dO loads are in flight
  // (read by each pass's row owner after its reduction, it cost every pass one memory latency).
  static_assert(kBlockM <= 256);
  if (threadIdx.x < kBlockM) {
    const int row = m * kBlockM + threadIdx.x;
    const float l = row < p.seqlen_q ? p.lse[bh * p.seqlen_q + row] : -INFINITY;
    p.lse_log2[bh * (int64_t(p.m_blocks) * kBlockM) + row] = l == -INFINITY ? INFINITY : l * 1.4426950408889634f;
  }
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kPasses; ++i) {
    const Element* oe = reinterpret_cast<const Element*>(&ov[i]);
    const Element* de = reinterpret_cast<const Element*>(&dv[i]);
    float acc = 0.f;
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < 8; ++e) acc += float(oe[e]) * float(de[e]);
    CUTLASS_PRAGMA_UNROLL
    for (int s = 1; s < kThreadsPerRow; s *= 2) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    const int r = block_row(i), row = m * kBlockM + r;
    if (part == 0 && r < kBlockM) {
      const int64_t idx = bh * (int64_t(p.m_blocks) * kBlockM) + row;
      p.dpsum[idx] = acc;
      if (p.dpsum_out != nullptr && row < p.seqlen_q) p.dpsum_out[bh * p.seqlen_q + row] = acc;
    }
  }
}

// Postprocess. The accumulator holds each dQ chunk in the fragment order of the main kernel's
// dQ WGMMA (float4 j of thread t of warpgroup w at w * kDQWgFloats + j * 128 + t), so these reads
// are coalesced. Written straight from the fragment, dQ would leave as 4-byte pieces 8 rows apart
// (partial 32-byte sectors): the H200 took 165-170 us for 16k tokens x 2048 that way, against
// 52-56 us for cuDNN's conversion (ncu). So each chunk is scaled, converted and gathered
// into a (query, column) tile in shared memory first, and leaves as whole 16-byte row pieces.
// Tr::kDQSwapAB (hd128 at 80-row steps): the fragments are of dQ^T, registers 2k, 2k+1 adjacent
// queries of one column.
// kDQSmem: the block's accumulator (24-40 KB) comes into shared memory by one bulk copy, the proxy
// the dQ writer wrote it with, and the tile then reuses that buffer. compute-sanitizer's initcheck
// sees neither bulk side (scripts/sanitize.sh); that every block the kernel reads was written is
// what the GPU tests' NaN-poisoned workspace checks.
template <class Tr>
__global__ void __launch_bounds__(256) bwd_postprocess_kernel(const PrePostParams p) {
  using Element = typename Tr::Element;
  using TxBar = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kBlockM = Tr::kBlockM, kHeadDim = Tr::kHeadDim, kChunk = Tr::kHdChunk;
  constexpr bool kSwapAB = TileDQSwapAB<Tr>::value;
  static_assert(Tr::kNumMmaWG == 2 && kChunk % 8 == 0);
  // Row pitch: 16-byte aligned rows whose first banks, for 8 consecutive rows, are 8 distinct
  // multiples of 4 (pitch kChunk / 2 + 4 words: 4 mod 32 at kChunk 64/128/192, 20 at 96), so a
  // warp's fragment stores (8 rows x 4 column pairs) hit 32 distinct banks.
  constexpr int kPitch = kChunk + 8;
  constexpr int kTileBytes = kBlockM * kPitch * int(sizeof(Element));
  constexpr int kAccBytes = Tr::kDQSmem ? kBlockM * kHeadDim * int(sizeof(float)) : 0;
  __shared__ alignas(128) char buf[kAccBytes > kTileBytes ? kAccBytes : kTileBytes];
  __shared__ uint64_t acc_full;
  Element* tile = reinterpret_cast<Element*>(buf);
  wait_for_previous_grid();
  allow_next_grid();
  const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int ct = threadIdx.x, wg = ct / 128, t = ct % 128;
  const int64_t bh = int64_t(b) * p.heads_q + h;
  const float* acc_block = p.dq_accum + (bh * p.m_blocks + m) * int64_t(kBlockM * kHeadDim);
  const int rows = min(kBlockM, p.seqlen_q - m * kBlockM);
  Element* dq = static_cast<Element*>(p.dq) + bshd_offset(p, b, m * kBlockM, h, p.head_dim);
  const int64_t row_stride = int64_t(p.heads_q) * p.head_dim;
  // The chunk's rows from the tile (or zeros) to dQ as 16-byte pieces.
  constexpr int kVecPerRow = kChunk / 8;  // 16-byte pieces per row of the chunk
  auto store_rows = [&](int c, bool zeros) {
    for (int i = ct; i < rows * kVecPerRow; i += 256) {
      const int q = i / kVecPerRow, v8 = i % kVecPerRow;
      if (c * kChunk + 8 * v8 >= p.head_dim) continue;  // past q's head dim (a multiple of 8)
      *reinterpret_cast<uint4*>(dq + q * row_stride + c * kChunk + 8 * v8) =
          zeros ? make_uint4(0u, 0u, 0u, 0u) : *reinterpret_cast<const uint4*>(tile + q * kPitch + 8 * v8);
    }
  };
  if constexpr (Tr::kDQSmem) {
    if (p.dq_sem[bh * p.m_blocks + m] == 0) {  // no key block reached these rows
      store_rows(0, true);
      return;
    }
    if (ct == 0) {
      TxBar::init(&acc_full, 1);
      cutlass::arch::fence_barrier_init();
      TxBar::arrive_and_expect_tx(&acc_full, kAccBytes);
      SM90_BULK_COPY_G2S::copy(acc_block, &acc_full, buf, kAccBytes);
    }
    __syncthreads();  // the barrier is initialised before anyone waits on it
    TxBar::wait(&acc_full, 0);
  }
  typename Tr::MmadQ mma_dq;
  Tensor cdQ = mma_dq.get_thread_slice(ct).partition_C(make_identity_tensor(typename Tr::DQTileShape{}));
  static_assert(decltype(size(cdQ))::value == Tr::kDQFrag);
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < Tr::kDQChunks; ++c) {
    if (c > 0) __syncthreads();  // the previous chunk has left the tile
    const float4* acc = Tr::kDQSmem ? reinterpret_cast<const float4*>(buf) + wg * (Tr::kDQWgFloats / 4)
                                    : reinterpret_cast<const float4*>(acc_block + c * (kBlockM * kChunk) + wg * Tr::kDQWgFloats);
    float4 v[Tr::kDQFrag / 4];
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < Tr::kDQFrag / 4; ++j) v[j] = acc[j * 128 + t];
    if constexpr (Tr::kDQSmem) __syncthreads();  // every thread's reads are done: the tile reuses buf
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < Tr::kDQFrag / 4; ++j) {
      const float vals[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 4; e += 2) {
        const auto at = cdQ(4 * j + e);
        if constexpr (kSwapAB) {  // (column, query); e + 1 is the next query
          tile[get<1>(at) * kPitch + get<0>(at)] = Element(vals[e] * p.softmax_scale);
          tile[(get<1>(at) + 1) * kPitch + get<0>(at)] = Element(vals[e + 1] * p.softmax_scale);
        } else {  // (query, column); e + 1 is the next column
          cutlass::Array<Element, 2> pair;
          pair[0] = Element(vals[e] * p.softmax_scale);
          pair[1] = Element(vals[e + 1] * p.softmax_scale);
          *reinterpret_cast<cutlass::Array<Element, 2>*>(tile + get<0>(at) * kPitch + get<1>(at)) = pair;
        }
      }
    }
    __syncthreads();
    store_rows(c, false);
  }
}

// The split tail units' dK/dV (BwdTailSplit, bwd_order.cuh), from the parts' fp32 workspace
// slots (store_dkv_part's layout: float4 j of thread ct at j * 256 + ct, dK then dV, dK already
// scaled). Grid (tail unit r, vector v of 2 * kDKVTailVec<Tr>): CTA (r, v) owns float4 v of every
// thread's fragment of unit split.full + r (v < kDKVTailVec: dK, else dV), 256 threads one
// fragment each. Why so wide: a tail has few units (4 at hd64 16k tokens) of up to 64 parts, and
// one CTA per unit walking the parts one load at a time was latency-bound (-8% at hd64 4k). The part loads are unrolled (in flight together); the adds stay in part order,
// so the sum does not depend on which CTA ended first. Thread ct writes where the main kernel's
// epilogue would have: the dK/dV MMA's identity partition gives each value's (key, column);
// values 2k, 2k + 1 are adjacent columns.
template <class Tr>
constexpr int kDKVTailVec = Tr::kBlockN * Tr::kHeadDim / (4 * 256);  // float4 per thread and tensor

struct DKVTailParams {
  const float* dkv_part;
  void* dk;
  void* dv;
  BwdTileOrder order;
  BwdTailSplit split;
  int seqlen_k;
  int head_dim, head_dim_v;  // of dk, dv (<= the kernel's)
};

template <class Tr>
__global__ void __launch_bounds__(256) bwd_dkv_tail_kernel(const DKVTailParams p) {
  using Element = typename Tr::Element;
  constexpr int kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim, kVec = kDKVTailVec<Tr>;
  static_assert(Tr::kPasses == 1 && Tr::kNumMmaThreads == 256 && kVec * 4 * 256 == kBlockN * kHeadDim);
  wait_for_previous_grid();
  const int ct = threadIdx.x, t = int(blockIdx.y) / kVec, j = int(blockIdx.y) % kVec;
  int n_block, hk, b;
  p.order.decode(p.split.full + int(blockIdx.x), n_block, hk, b);
  // Slot of part 0, this thread's float4; part q's is q * (2 * kVec * 256) further.
  const float4* src = reinterpret_cast<const float4*>(p.dkv_part) +
                      int64_t(blockIdx.x) * p.split.parts * (2 * kVec * 256) + (t * kVec + j) * 256 + ct;
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
  #pragma unroll 8
  for (int part = 0; part < p.split.parts; ++part) {
    const float4 v = src[int64_t(part) * (2 * kVec * 256)];
    sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
  }
  typename Tr::MmadKV mma_dkv;
  Tensor cKV = mma_dkv.get_thread_slice(ct).partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  static_assert(decltype(size(cKV))::value == 4 * kVec);
  const int d = t == 0 ? p.head_dim : p.head_dim_v;
  Element* out = static_cast<Element*>(t == 0 ? p.dk : p.dv) + (int64_t(b) * p.seqlen_k * p.order.heads_kv + hk) * d;
  const int64_t row_stride = int64_t(p.order.heads_kv) * d;
  const float vals[4] = {sum.x, sum.y, sum.z, sum.w};
  CUTLASS_PRAGMA_UNROLL
  for (int e = 0; e < 4; e += 2) {
    const auto at = cKV(4 * j + e);
    const int key = n_block * kBlockN + get<0>(at);
    if (key < p.seqlen_k && get<1>(at) < d) {
      cutlass::Array<Element, 2> pair;
      pair[0] = Element(vals[e]);
      pair[1] = Element(vals[e + 1]);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(out + key * row_stride + get<1>(at)) = pair;
    }
  }
}

}  // namespace bwd
}  // namespace fa3
