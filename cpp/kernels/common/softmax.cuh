// Online softmax over key blocks, in the exp2 domain with the softmax scale folded in.
//
// Scores arrive as raw Q K^T (or tanh(scale * Q K^T / softcap) when softcapping: then the
// "scale" below is softcap, see SoftmaxScale). For a block of scores S (rows x keys):
//   m_new = max(m, rowmax(S));  P = exp2(S * scale_log2 - m_new * scale_log2)
//   alpha = exp2((m - m_new) * scale_log2);  l = l * alpha + rowsum(P);  O = O * alpha + P V
// Row sums stay per thread (each thread holds a quarter of a row) until finalize(), which
// reduces them over the quad. Rows that have seen no visible key keep m = -inf: their P is 0,
// alpha is 1, and finalize() gives O = 0 and LSE = -inf (never NaN).
// kMaxOffset (FP8, FA3's max offset 8): P = exp2(S * scale_log2 - m_new * scale_log2 + 8) lies in
// [0, 2^8], so that P rounded to e4m3 keeps small probabilities in its normal range; l sums that
// unrounded P, and finalize() takes the 2^8 back out of the LSE (O / l is unchanged by it).
#pragma once

#include <cmath>

#include "common/utils.cuh"

namespace fa3 {

// How raw scores become log2-domain logits: logits_log2 = f(S) * scale_log2 with
// f(S) = S (no softcap) or tanh(S * pre_tanh) (softcap, pre_tanh = softmax_scale / softcap).
struct SoftmaxScale {
  float scale_log2;  // softmax_scale * log2(e), or softcap * log2(e) with softcap
  float pre_tanh;    // softmax_scale / softcap; unused without softcap
  bool softcap;

  CUTE_HOST_DEVICE static SoftmaxScale make(float softmax_scale, float softcap) {
    constexpr float kLog2e = 1.4426950408889634f;
    SoftmaxScale s;
    s.softcap = softcap > 0.f;
    s.scale_log2 = (s.softcap ? softcap : softmax_scale) * kLog2e;
    s.pre_tanh = s.softcap ? softmax_scale / softcap : 1.f;
    return s;
  }
};

// Applies the softcap transform in place (call before masking).
template <class TS>
CUTE_DEVICE void apply_softcap(TS& s, float pre_tanh) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(s); ++i) s(i) = tanhf(s(i) * pre_tanh);
}

template <int kRows, int kMaxOffset = 0>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];  // per-thread partial sums
  float scale_log2;

  CUTE_DEVICE explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {}

  CUTE_DEVICE void reset() {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // Exponentiates the (rows, cols) view `s` in place against the updated running max and writes
  // the factor by which the previous O rows must be multiplied into alpha[r]. kFirst: no history
  // (alpha is not written).
  template <bool kFirst, class TS>
  CUTE_DEVICE void update(TS& s, float (&alpha)[kRows]) {
    static_assert(decltype(size<0>(s))::value == kRows);
    constexpr int kCols = decltype(size<1>(s))::value;
    // Row max over 4 independent chains (then combined): a single fmax chain is kCols deep
    // (44 at 176-wide blocks), and its latency sits right before the exp2s on the critical path
    // of the softmax, with only 2-3 consumer warps per scheduler to hide it.
    constexpr int kChains = kCols % 4 == 0 ? 4 : (kCols % 2 == 0 ? 2 : 1);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float mc[kChains];
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kChains; ++k) mc[k] = s(r, k);
      CUTLASS_PRAGMA_UNROLL
      for (int c = kChains; c < kCols; ++c) mc[c % kChains] = fmaxf(mc[c % kChains], s(r, c));
      float m = kFirst ? -INFINITY : row_max[r];
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kChains; ++k) m = fmaxf(m, mc[k]);
      m = quad_max(m);
      // A row with no visible key so far keeps m = -inf; subtract 0 instead (P stays 0).
      float m_scaled = (m == -INFINITY) ? 0.f : m * scale_log2;
      if constexpr (!kFirst) {
        // Exactly 1 when the max did not move (the caller then skips the O rescale; with the
        // product fused into the subtraction the exponent would be a rounding residual, not 0);
        // exp2(-inf) = 0 when the row had no key before.
        alpha[r] = m == row_max[r] ? 1.f : exp2f(row_max[r] * scale_log2 - m_scaled);
        row_sum[r] *= alpha[r];
      }
      row_max[r] = m;
      float sum = kFirst ? 0.f : row_sum[r];
      float const m_exp = kMaxOffset != 0 ? m_scaled - float(kMaxOffset) : m_scaled;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        s(r, c) = exp2f(fmaf(s(r, c), scale_log2, -m_exp));
        sum += s(r, c);
      }
      row_sum[r] = sum;
    }
  }

  // Reduces the row sums over the quad; returns the factor that turns each row of O into the
  // output (1/l; 0 for rows with no visible key) and writes the natural-log LSE per row (-inf
  // for those rows). sink_log2: the row's attention-sink logit times log2 e (-inf: none), one
  // more term of the denominator whose value is 0; where it exceeds the row max it becomes the
  // reference of the exponents (so none overflows), and O's factor shrinks by the same ratio. A
  // row with a sink but no key gets O = 0 and LSE = the sink.
  CUTE_DEVICE void finalize(float (&inv_sum)[kRows], float (&lse)[kRows], float sink_log2 = -INFINITY) {
    constexpr float kLn2 = 0.6931471805599453f;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float l = quad_sum(row_sum[r]);
      float m = row_max[r] * scale_log2;  // -inf for a row with no key
      if constexpr (kMaxOffset != 0) m -= float(kMaxOffset);
      float o_scale = 1.f;
      if (sink_log2 != -INFINITY) {
        float const top = fmaxf(m, sink_log2);
        o_scale = exp2f(m - top);
        l = l * o_scale + exp2f(sink_log2 - top);
        m = top;
      }
      bool empty = !(l > 0.f);
      inv_sum[r] = empty ? 0.f : o_scale / l;
      lse[r] = empty ? -INFINITY : (m + __log2f(l)) * kLn2;
    }
  }
};

// A sink logit (natural units, like the scaled scores) in the log2 domain of OnlineSoftmax;
// -inf without sinks.
CUTE_DEVICE float sink_log2(float const* sinks, int head) {
  constexpr float kLog2e = 1.4426950408889634f;
  return sinks == nullptr ? -INFINITY : sinks[head] * kLog2e;
}

// Whether some row max of this warp moved in the last update (alpha == 1 exactly otherwise: exp2
// of an exact 0); only then does O need its rescale, which after the first blocks is rare.
template <int kRows>
CUTE_DEVICE bool warp_row_max_moved(float const (&alpha)[kRows]) {
  bool same_max = true;
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < kRows; ++r) same_max = same_max && alpha[r] == 1.f;
  return !__all_sync(0xffffffffu, same_max);
}

// Multiplies each row r of a (rows, cols) view by f[r].
template <int kRows, class TO>
CUTE_DEVICE void scale_rows(TO& o, float const (&f)[kRows]) {
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < kRows; ++r) {
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < size<1>(o); ++c) o(r, c) *= f[r];
  }
}

// ---- The backward's side: P recomputed from the scores and the forward's LSE, dS, and the
// softcap's derivative (bwd_main.cuh, bwd_split_d.cuh).

// P = exp2(s * scale_log2 - lse_log2): the probability of score s (raw, or softcap_score()'s)
// from its row's LSE in the log2 domain (the forward's LSE times log2 e; +inf for rows that saw
// no key, so that P is exactly 0).
CUTE_DEVICE float prob_from_lse(float s, float scale_log2, float lse_log2) {
  return exp2f(s * scale_log2 - lse_log2);
}

// dS = P o (dP - D), D = rowsum(dO o O): the softmax's backward for one element (p times the
// softcap's derivative where there is one).
CUTE_DEVICE float softmax_grad(float p, float dp, float d) { return p * (dp - d); }

// The softcap transform of one score, t = tanh(s * pre_tanh) (apply_softcap's element), and its
// derivative with respect to s * pre_tanh, 1 - t^2 (the factor on dS).
CUTE_DEVICE float softcap_score(float s, float pre_tanh) { return tanhf(s * pre_tanh); }
CUTE_DEVICE float softcap_grad(float t) { return 1.f - t * t; }

}  // namespace fa3
