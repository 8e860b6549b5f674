// Plain-data parameters of the attention kernels. The FFI layer fills these; kernels read them.
// No JAX/XLA and no CuTe types here, so every layer can include it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fa3 {

// kE4M3: float8_e4m3fn q, k, v (forward only); its out is bfloat16 (FwdParams::out).
enum class DType : int { kBF16 = 0, kFP16 = 1, kE4M3 = 2 };

// Shapes shared by forward and backward. Tensors are dense row-major:
//   q, dq     : (batch, seqlen_q, heads_q,  head_dim)
//   k, dk     : (batch, seqlen_k, heads_kv, head_dim)
//   v, dv     : (batch, seqlen_k, heads_kv, head_dim_v)
//   out, dout : (batch, seqlen_q, heads_q,  head_dim_v)
//   lse       : (batch, heads_q, seqlen_q) float32
// GQA/MQA: query head h reads key/value head h / (heads_q / heads_kv).
// Head dims are multiples of 8 (16-byte rows for TMA) up to 256. A call runs on the smallest
// compiled kernel head dim that holds both (kernel_head_dim in fa3/launch.h): its loads zero-fill
// the columns past a tensor's own head dim and its stores clip them, so nothing is padded in
// memory (MLA's 192/128 runs on the 192 kernel, head dim 80 on the 96 kernel).
struct AttentionShape {
  int batch = 0;
  int seqlen_q = 0;
  int seqlen_k = 0;
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;    // of q and k
  int head_dim_v = 0;  // of v and out
};

// Masking and scaling options. The mask is a band around the bottom-right-aligned diagonal:
//   query i sees key j  iff  -window_left <= j - i - (seqlen_k - seqlen_q) <= window_right.
// Bounds are already normalised by Python (jax_fa3/_masks.py): causal is window_right = 0, an
// unbounded side is kUnbounded, and bounds may be negative (ring attention shifts the diagonal),
// so some query rows may see no key at all: their out is 0 and their lse is -inf.
constexpr int kUnbounded = 1 << 30;

struct AttentionOptions {
  float softmax_scale = 1.0f;
  float softcap = 0.0f;  // 0: off; else scores become softcap * tanh(scores / softcap)
  int window_left = kUnbounded;
  int window_right = kUnbounded;
};

// Whether the band cuts into some query row's key range (causal, local, shifted): then blocks
// need the band mask and the work per query/key block varies. A window reaching at least
// seqlen_q + seqlen_k on both sides cuts nothing (only the end of the key range is masked).
inline bool band_limits_work(const AttentionShape& s, const AttentionOptions& o) {
  const int64_t reach = int64_t(s.seqlen_q) + s.seqlen_k;
  return int64_t(o.window_left) < reach || int64_t(o.window_right) < reach;
}

// Packed documents (segment ids, varlen; jax_fa3/segments.py builds these): which keys each
// query row may see, as intervals, on top of the band. Four int32 arrays, or all nullptr:
//   q_rows   (batch, seqlen_q, 2): [lo, hi), the keys query row i may see; a row that sees none
//            is (2^30, 0), so that group minima and maxima ignore it; hi == -1 marks a row whose
//            segment ids broke the kernels' contract (one contiguous run per id, ids increasing
//            along the row): its out and lse are NaN, never a silently wrong answer;
//   q_groups (batch, ceil(seqlen_q / 64), 4): per 64 rows (the last group repeats the last row)
//            (min lo, max lo, min hi, max hi): a tile's key range and its blocks without a mask;
//   k_rows   (batch, seqlen_k, 2) and k_groups (batch, ceil(seqlen_k / 64), 4): the same for the
//            query rows that see key j (the relation transposed), for the backward.
// 64 rows: a warpgroup's rows in the forward, half a tile (128 query rows forward, 128 keys
// backward), so that a tile start reads two group summaries.
constexpr int kBandGroupRows = 64;

struct DocBands {
  const int32_t* q_rows = nullptr;
  const int32_t* q_groups = nullptr;
  const int32_t* k_rows = nullptr;
  const int32_t* k_groups = nullptr;
  bool present() const { return q_rows != nullptr; }
};

// Whether the work per query/key block varies (the band cuts, or documents do): then the kernels
// take their banded tiles and longest-first orders.
inline bool work_varies(const AttentionShape& s, const AttentionOptions& o, const DocBands& d) {
  return band_limits_work(s, o) || d.present();
}

struct FwdParams {
  AttentionShape shape;
  AttentionOptions opts;
  DType dtype = DType::kBF16;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  // Attention sinks (heads_q) float32, or nullptr: the softmax of each row of query head h also
  // takes a key whose logit (in the units of the scaled scores) is sinks[h] and whose value is
  // zero (gpt-oss). The LSE includes it; the backward needs only that LSE.
  const float* sinks = nullptr;
  DocBands docs;  // packed documents, or none (the forward reads q_rows and q_groups)
  // kE4M3 only, float32: x = x_fp8 * descale. q_descale (batch, heads_q), k_descale and v_descale
  // (batch, heads_kv); scores are (q_fp8 k_fp8^T) * q_descale * k_descale * softmax_scale and O is
  // scaled by v_descale. Per-block descales are not taken (jax_fa3 runs them on the portable path).
  const float* q_descale = nullptr;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  // Device memory of at least fwd_workspace_bytes() (0: none needed): the FFI call's workspace
  // result, so that the handler needs no scratch allocator and stays command-buffer compatible.
  void* workspace = nullptr;
  int num_sms = 0;  // multiprocessors of the device, for the persistent grid
};

struct BwdParams {
  AttentionShape shape;
  AttentionOptions opts;
  DType dtype = DType::kBF16;
  bool deterministic = false;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* out = nullptr;
  const void* dout = nullptr;
  const float* lse = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  // (batch, heads_q, seqlen_q) float32 or nullptr: receives D = rowsum(dout o out), which the
  // gradient of the attention sinks needs (jax_fa3/_ops.py).
  float* dpsum = nullptr;
  DocBands docs;  // packed documents, or none (not with deterministic)
  // Scratch from the FFI ScratchAllocator, sized by bwd_workspace_bytes().
  void* workspace = nullptr;
  int num_sms = 0;  // multiprocessors of the device, for the main kernel's tail split (bwd_order.cuh)
};

}  // namespace fa3
