// Host side of the backward for one (Element, head dim): the choice of traits (tile table,
// split-D for hd256, the 80-row hd128 tile for unbanded problems), the workspace layout and the
// launches (preprocess, main, postprocess, and the dK/dV tail kernel when the last wave is split)
// on the caller's stream. No host sync, no allocation, no state.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "bwd/bwd_main.cuh"
#include "bwd/bwd_prepost.cuh"
#include "bwd/bwd_split_d.cuh"
#include "common/dependent_launch.cuh"
#include "common/softmax.cuh"
#include "fa3/launch.h"
#include "fa3/params.h"

namespace fa3 {
namespace bwd {

// The main kernel's CTA order (bwd_order.cuh) for this call.
template <class Tr>
BwdTileOrder tile_order(const BwdParams& p) {
  const auto& s = p.shape;
  return BwdTileOrder{(s.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN, s.heads_kv, s.batch,
                      bwd_order_section(s, p.opts, int(sizeof(typename Tr::Element)), p.docs)};
}

// The main kernel's tail split (bwd_order.cuh BwdTailSplit) for this call: the one choice that
// the workspace layout, the grid and the dK/dV tail kernel share.
template <class Tr>
BwdTailSplit tail_split(const BwdParams& p) {
  const auto& s = p.shape;
  const int num_tiles = tile_order<Tr>(p).num_tiles();
  if constexpr (IsSplitD<Tr>::value || !kTailSplitOk<Tr>) {
    return BwdTailSplit{num_tiles, 0, 1};
  } else {
    const int m_blocks = (s.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
    return bwd_tail_split(num_tiles, m_blocks, s.heads_q / s.heads_kv, p.num_sms, work_varies(s, p.opts, p.docs));
  }
}

// Workspace (each part 256-byte aligned), sq_pad = m_blocks * kBlockM:
//   lse_log2 (b, hq, sq_pad) f32 | dpsum (b, hq, sq_pad) f32 | dq_accum (b, hq, sq_pad, d) f32 |
//   dq_sem (b, hq, m_blocks) i32 | dkv_part (tail slots, 2, kBlockN * d) f32 (none unless split)
struct Workspace {
  size_t lse_off, dpsum_off, dq_off, sem_off, dkv_off, total;
};

inline size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

template <class Tr>
Workspace workspace_layout(const BwdParams& p) {
  const size_t m_blocks = (size_t(p.shape.seqlen_q) + Tr::kBlockM - 1) / Tr::kBlockM;
  const size_t bh = size_t(p.shape.batch) * p.shape.heads_q;
  const size_t rows = bh * m_blocks * Tr::kBlockM;
  Workspace w;
  w.lse_off = 0;
  w.dpsum_off = align256(w.lse_off + rows * sizeof(float));
  w.dq_off = align256(w.dpsum_off + rows * sizeof(float));
  w.sem_off = align256(w.dq_off + rows * Tr::kHeadDim * sizeof(float));
  w.dkv_off = align256(w.sem_off + bh * m_blocks * sizeof(int));
  const size_t slots = size_t(tail_split<Tr>(p).num_slots());
  w.total = align256(w.dkv_off + slots * 2 * Tr::kBlockN * Tr::kHeadDim * sizeof(float));
  return w;
}

// A (batch, seqlen, heads, head_dim) tensor as TMA sees it: (seqlen, head_dim, heads, batch).
// head_dim is the tensor's own (at most the kernel's): loads zero-fill the box's columns past it,
// stores clip them.
template <class T>
auto bshd_view(T* ptr, int seqlen, int heads, int batch, int head_dim) {
  return make_tensor(make_gmem_ptr(ptr), make_shape(seqlen, head_dim, heads, batch),
                     make_stride(int64_t(heads) * head_dim, _1{}, int64_t(head_dim), int64_t(seqlen) * heads * head_dim));
}

// The dK or dV TMA store of MainParams (bwd_epilogue.cuh, store_dkv_tma): over (seqlen_k, head_dim,
// heads_kv, batch) with DKVStore's 16-row shared-memory view as the box; the empty placeholder for
// traits without kTmaDKV.
template <class Tr, bool kDV>
auto dkv_tma_store(void* ptr, const AttentionShape& s) {
  using St = DKVStore<Tr>;
  using Tma = std::conditional_t<kDV, typename St::TmaDV, typename St::TmaDK>;
  if constexpr (St::kEnabled) {
    auto g = bshd_view(static_cast<typename Tr::Element*>(ptr), s.seqlen_k, s.heads_kv, s.batch,
                       kDV ? s.head_dim_v : s.head_dim);
    using SmemLayout = std::conditional_t<kDV, typename St::SmemLayoutdV16, typename St::SmemLayoutdK16>;
    return Tma(make_tma_copy(SM90_TMA_STORE{}, g, SmemLayout{}));
  } else {
    return Tma{};
  }
}

template <class Tr>
cudaError_t launch_main(const BwdParams& p, const PrePostParams& pp, BwdTailSplit split, float* dkv_part,
                        cudaStream_t stream) {
  using Element = typename Tr::Element;
  const auto& s = p.shape;
  auto gtensor = [&](const void* ptr, int seqlen, int heads, int head_dim) {
    return bshd_view(static_cast<Element const*>(ptr), seqlen, heads, s.batch, head_dim);
  };
  SoftmaxScale sc = SoftmaxScale::make(p.opts.softmax_scale, p.opts.softcap);
  MainParams<Tr> mp{
      make_tma_copy(SM90_TMA_LOAD{}, gtensor(p.q, s.seqlen_q, s.heads_q, s.head_dim), typename Tr::SmemLayoutQ1{}),
      make_tma_copy(SM90_TMA_LOAD{}, gtensor(p.dout, s.seqlen_q, s.heads_q, s.head_dim_v), typename Tr::SmemLayoutQ1{}),
      make_tma_copy(SM90_TMA_LOAD{}, gtensor(p.k, s.seqlen_k, s.heads_kv, s.head_dim), typename Tr::SmemLayoutK{}),
      make_tma_copy(SM90_TMA_LOAD{}, gtensor(p.v, s.seqlen_k, s.heads_kv, s.head_dim_v), typename Tr::SmemLayoutV{}),
      pp.lse_log2,
      pp.dpsum,
      pp.dq_accum,
      pp.dq_sem,
      static_cast<Element*>(p.dk),
      static_cast<Element*>(p.dv),
      s.batch,
      s.seqlen_q,
      s.seqlen_k,
      s.heads_q,
      s.heads_kv,
      pp.m_blocks,
      s.head_dim,
      s.head_dim_v,
      p.opts.window_left,
      p.opts.window_right,
      sc.scale_log2,
      sc.pre_tanh,
      p.opts.softmax_scale,
      p.deterministic ? 1 : 0,
      !p.deterministic && !work_varies(s, p.opts, p.docs) ? 1 : 0,  // rotate_walk
      tile_order<Tr>(p),
      split,
      dkv_part,
      dkv_tma_store<Tr, false>(p.dk, s),
      dkv_tma_store<Tr, true>(p.dv, s),
      DocMask::of(p.docs, s.seqlen_q, s.seqlen_k)};
  auto kernel = [&] {
    if constexpr (IsSplitD<Tr>::value)
      return p.docs.present() ? bwd_split_d_kernel<Tr, true> : bwd_split_d_kernel<Tr, false>;
    else if constexpr (Tr::kNoBand || Tr::kPingPong) return bwd_main_kernel<Tr, false>;  // never has documents
    else return p.docs.present() ? bwd_main_kernel<Tr, true> : bwd_main_kernel<Tr, false>;
  }();
  // Per call (cheap, no sync): the attribute is per device, and a static flag would be global state.
  if (auto err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
      err != cudaSuccess)
    return err;
  // One linear index per CTA, decoded in the longest-first section order (bwd_order.cuh); the
  // tail units' CTAs follow the whole units (split.num_ctas()).
  const dim3 grid(split.num_ctas());
  return launch_dependent(kernel, grid, dim3(Tr::kNumThreads), Tr::kSmemBytes, stream, mp);
}

// A traits class passed as a value (with_bwd_traits' callback arguments).
template <class T>
struct TraitsTag {
  using type = T;
};

// The one choice of traits for a backward call, so that its workspace size, workspace layout,
// pre/postprocess and main kernel agree: f(TraitsTag<Tr>{}, TraitsTag<TrCap>{}), TrCap being
// what softcap calls launch. The tile table's traits (BwdTraitsFor: split-D for hd256), except
// that hd128 problems without a band and without softcap run 80-row steps (BwdTraitsHd128Full;
// FA3 does the same; its TrCap is never launched: softcap calls keep the 64-row kernel). hd128
// problems in which some key is seen by at least kBwdPingPongMinRows query rows run out of
// lockstep (bwd_traits.cuh): those of the 80-row tile on BwdTileHd128FullPingPong, the banded
// ones without documents on BwdTileHd128PingPong.
template <typename Element, int kHeadDim, class F>
auto with_bwd_traits(const BwdParams& p, F&& f) {
  if constexpr (kHeadDim == 128) {
    const int64_t rows_per_key =
        BandMask{p.shape.seqlen_q, p.shape.seqlen_k, p.opts.window_left, p.opts.window_right}.max_rows_per_key();
    if (!(p.opts.softcap > 0.f) && !work_varies(p.shape, p.opts, p.docs)) {
      if (rows_per_key >= kBwdPingPongMinRows) {
        using FullPingPong = BwdTraitsHd128FullPingPong<Element, false>;
        return f(TraitsTag<FullPingPong>{}, TraitsTag<FullPingPong>{});
      }
      using Full = BwdTraitsHd128Full<Element, false>;
      return f(TraitsTag<Full>{}, TraitsTag<Full>{});
    }
    if (work_varies(p.shape, p.opts, p.docs) && !p.docs.present() && rows_per_key >= kBwdPingPongMinRows)
      return f(TraitsTag<BwdTraitsHd128PingPong<Element, false>>{},
               TraitsTag<BwdTraitsHd128PingPong<Element, true>>{});
  }
  return f(TraitsTag<BwdTraitsFor<Element, kHeadDim, false>>{},
           TraitsTag<BwdTraitsFor<Element, kHeadDim, true>>{});
}

template <class Tr, class TrCap>
cudaError_t run_bwd_with(const BwdParams& p, cudaStream_t stream) {
  const auto& s = p.shape;
  const Workspace w = workspace_layout<Tr>(p);
  char* ws = static_cast<char*>(p.workspace);
  PrePostParams pp;
  pp.out = p.out;
  pp.dout = p.dout;
  pp.lse = p.lse;
  pp.lse_log2 = reinterpret_cast<float*>(ws + w.lse_off);
  pp.dpsum = reinterpret_cast<float*>(ws + w.dpsum_off);
  pp.dq_accum = reinterpret_cast<float*>(ws + w.dq_off);
  pp.dq_sem = reinterpret_cast<int*>(ws + w.sem_off);
  pp.dpsum_out = p.dpsum;
  pp.dq = p.dq;
  pp.seqlen_q = s.seqlen_q;
  pp.head_dim = s.head_dim;
  pp.head_dim_v = s.head_dim_v;
  pp.heads_q = s.heads_q;
  pp.m_blocks = (s.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  pp.softmax_scale = p.opts.softmax_scale;

  // Tr and TrCap share the tile (kBlockM, kBlockN, passes), so one split serves both.
  const BwdTailSplit split = tail_split<Tr>(p);
  float* dkv_part = reinterpret_cast<float*>(ws + w.dkv_off);

  dim3 grid_q(pp.m_blocks, s.heads_q, s.batch);
  if (auto err = launch_dependent(bwd_preprocess_kernel<Tr>, grid_q, dim3(256), 0, stream, pp); err != cudaSuccess)
    return err;
  cudaError_t err = p.opts.softcap > 0.f ? launch_main<TrCap>(p, pp, split, dkv_part, stream)
                                         : launch_main<Tr>(p, pp, split, dkv_part, stream);
  if (err != cudaSuccess) return err;
  if (auto err = launch_dependent(bwd_postprocess_kernel<Tr>, grid_q, dim3(256), 0, stream, pp); err != cudaSuccess)
    return err;
  if constexpr (!IsSplitD<Tr>::value && kTailSplitOk<Tr>) {
    if (split.tail > 0) {
      static_assert(Tr::kBlockM == TrCap::kBlockM && Tr::kBlockN == TrCap::kBlockN && Tr::kPasses == TrCap::kPasses);
      const DKVTailParams tp{dkv_part, p.dk, p.dv, tile_order<Tr>(p), split, s.seqlen_k, s.head_dim, s.head_dim_v};
      return launch_dependent(bwd_dkv_tail_kernel<Tr>, dim3(split.tail, 2 * kDKVTailVec<Tr>), dim3(256), 0, stream, tp);
    }
  }
  return cudaSuccess;  // every launch above returned its own error
}

}  // namespace bwd

template <typename Element, int kHeadDim>
size_t bwd_workspace_bytes_impl(const BwdParams& p) {
  return bwd::with_bwd_traits<Element, kHeadDim>(p, [&](auto tr, auto) {
    return bwd::workspace_layout<typename decltype(tr)::type>(p).total;
  });
}

template <typename Element, int kHeadDim>
cudaError_t run_bwd_impl(const BwdParams& p, cudaStream_t stream) {
  if (p.shape.head_dim > kHeadDim || p.shape.head_dim_v > kHeadDim) return cudaErrorInvalidValue;
  if (p.workspace == nullptr) return cudaErrorInvalidValue;
  return bwd::with_bwd_traits<Element, kHeadDim>(p, [&](auto tr, auto tr_cap) {
    return bwd::run_bwd_with<typename decltype(tr)::type, typename decltype(tr_cap)::type>(p, stream);
  });
}

}  // namespace fa3
