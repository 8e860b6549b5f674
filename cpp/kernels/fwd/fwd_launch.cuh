// Host side of the forward kernel: the tile table per head dim and the choice of tile per
// problem (run_fwd_impl), the kernel Params (TMA descriptors, mask, scheduler), the grid and the
// launch. Each generated instantiation file (cpp/instantiations/fwd.cu.in) includes this and
// instantiates run_fwd_impl<Element, d> and fwd_workspace_bytes_impl<Element, d>.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "fa3/launch.h"
#include "fa3/params.h"
#include "fwd/fwd_kernel.cuh"

namespace fa3 {

// Tile table per head dim: `full` runs unmasked problems, `banded` problems whose band cuts
// into the key range (causal, local, shifted). FwdTraits<Element, d, kBlockM, kBlockN, kStages,
// kPingPong, kBanded>; kBlockM / 64 consumer warpgroups; a `full` type may set kBanded = false
// (only the seqlen_k mask compiled in), a `banded` one must not.
// Limits that drive it: 227 KB of shared memory (Q tile + kStages x (K + V) blocks); registers
// per consumer thread (240 with 2 consumer warpgroups), which must hold the O accumulator
// (d/2 fp32), S (kBlockN/2 fp32) and P (kBlockN/4 packed) at once, plus S of the next block
// while P V is in flight (intra-warpgroup overlap).
// Ping-pong between the two consumer warpgroups pays when the softmax is a large share of a
// block's time, i.e. for d <= 128; at d = 192/256 the GEMMs dominate and the extra barrier
// round trips cost more than they hide (FA3 makes the same call).
template <typename Element, int kHeadDim>
struct FwdTileTable;

// d = 64: unmasked 192 x 128 (FA3's choice): three consumer warpgroups (setmaxnreg 160; O 32 +
// S 64 + P 32 registers) share each K/V block, so a block's load and the producer's work serve
// 1.5x the query rows, and the round-robin turn order keeps two warpgroups' GEMMs queued behind
// one's softmax (at d = 64 the softmax is half of a block's work). 4 stages (24 + 4 x 2 x 16 =
// 152 KB; one CTA per SM anyway): the persistent producer runs up to 4 blocks ahead, i.e. into
// the next tile, which hides the tile switch at short key lengths (4 blocks at 512).
// Banded problems: 128 x 128 with 4 stages (16 + 4 x 2 x 16 = 144 KB; square tiles also waste
// the least on a causal diagonal and a short band). Short causal problems switch tiles every few
// blocks; with 2 stages the persistent producer is at most 2 blocks ahead, so the next tile's
// first K/V wait on this tile's tail: 4 stages gave causal 512-2k +3..+10% on the H200 (4k-8k
// within noise; 6 stages measured within noise). Long bands (at least kLongBand = 4096 query
// rows and keys per row) take the 192 x 128 tile with 4 stages, spill-free (R153): causal 4k
// +6%, 8k +12%, 16k +17% over the 128-row tile, which wins at 512-2k (192 rows: -35..-3%).
// (every k-th exponential on the FMA pipe instead of MUFU measured -6..+1% at k = 8: not taken.)
template <typename E>
struct FwdTileTable<E, 64> {
  using full = FwdTraits<E, 64, 192, 128, 4, true, false>;
  using banded = FwdTraits<E, 64, 128, 128, 4, true, true>;
  using long_banded = FwdTraits<E, 64, 192, 128, 4, true, true>;
  static constexpr int kLongBand = 4096;  // a long-band threshold of 8k measured within noise
};
// d = 96: 128 x 128 (O 48 + S 64 + P 32 registers); 3 stages (24 + 3 x 2 x 24 = 168 KB) so the
// persistent producer runs into the next tile (see d = 64).
template <typename E>
struct FwdTileTable<E, 96> {
  using full = FwdTraits<E, 96, 128, 128, 3, true, true>;
  using banded = full;
};
// d = 128: unmasked 128 x 176 (FA3's choice: fewer, wider blocks; 32 + 2 x 2 x 44 = 208 KB of
// smem; O 64 + S 88 + P 44 registers), with the seqlen_k-only mask. Banded problems: 128 x 128
// with 3 stages (32 + 3 x 2 x 32 = 224 KB): square tiles waste least on the causal diagonal, and
// the deeper ring (2 would fit 160 KB) gave short causal +4..+5% as for d = 64. The 128 x 176
// tile for bands (spill-free, R219, but only 2 stages fit) gained only at causal 8k (+13%) and
// lost at short causal (up to -13%); on bands of >= 4096 rows and keys only, it measured level
// at causal 4k / 8k (session 29).
// Short bands (a row sees at most kShortBandMaxKeys = 512 keys, so a tile runs at most 4 key
// blocks) run `short_banded`: the same tile on 2 stages, where two Q buffers fit (2 x 32 + 2 x 2
// x 32 = 192 KB), so the next tile's Q loads a tile ahead. There Q prefetch outweighs the third
// stage; from 1k the third stage wins (H100, ABBA, three calls, 2 stages + Q prefetch over 3
// stages: causal 512 +4.0 / +2.8 / +3.4%, 1k +0.9 / -1.7 / -1.6%, 2k -1.1 / +0.6 / -2.8%).
// Unbanded problems whose key length 176 divides badly (fwd_pad_prefers_narrow: non-causal
// 512-4k keys) up to kNarrowMaxKeys = 2k run the narrow tile on its own kernel: 128 x 128, 2
// stages, unbanded, so two Q buffers fit (2 x 32 + 2 x 2 x 32 = 192 KB) and the producer loads
// the next tile's Q a tile ahead (H200, against the banded kernel with 3 stages and one Q
// buffer: nc 512 / 1k / 4k +2.3 / +2.5 / +1.1%). 176-key blocks pad 3.1% at every length from
// 512 to 4k, so the padded-work model cannot tell 4k from 512; measured, the 176-key tile
// wins at 4k, where each tile runs twice the blocks of 2k and the Q prefetch counts half as much
// (H100, ABBA: 176 keys over the narrow tile at nc 512 / 1k / 2k / 4k -1.4 / -2.6 / +0.8 /
// +7.0%).
template <typename E>
struct FwdTileTable<E, 128> {
  using full = FwdTraits<E, 128, 128, 176, 2, true, false>;
  using banded = FwdTraits<E, 128, 128, 128, 3, true, true>;
  using short_banded = FwdTraits<E, 128, 128, 128, 2, true, true>;
  static_assert(short_banded::kQPrefetch);
  static constexpr int64_t kShortBandMaxKeys = 512;
  using narrow = FwdTraits<E, 128, 128, 128, 2, true, false>;
  static_assert(narrow::kQPrefetch);
  static constexpr int64_t kNarrowMaxKeys = 2048;
};
// d = 192 and 256: no ping-pong (the GEMMs dominate a block; see kPingPong above) and one
// kernel with the band mask for all problems. Compiled spill-free but not measured on a quiet
// host, so not taken: ping-pong (R195 / R222) and an unbanded kernel with only the seqlen_k
// mask (main loop 758 -> 698 / 719 -> 662 SASS instructions).
template <typename E, int kHeadDim, int kBlockN>
struct FwdTileTableLarge {
  using banded = FwdTraits<E, kHeadDim, 128, kBlockN, 2, false, true>;
  using full = banded;
};
// d = 192: 128 x 96, 2 stages: 48 + 2 x 2 x 36 = 192 KB; registers O 96 + S 48 + P 24.
template <typename E>
struct FwdTileTable<E, 192> : FwdTileTableLarge<E, 192, 96> {};
// d = 256: 128 x 80 is what smem allows with 2 stages: 64 + 2 x 2 x 40 = 224 KB; registers
// O 128 + S 40 + P 20. Its blocks divide no power of two: 512 keys are 7 blocks = 560 keys of
// work (+9.4%), 1k-4k +1.6%. 128 x 64 (64 + 2 x 2 x 32 = 192 KB; 3 stages would need 256 KB;
// O 128 + S 32 + P 16) for every problem lost 6% from 4k keys; it runs as `narrow` for the
// unbanded problems where the padded work outweighs the extra blocks (fwd_pad_prefers_narrow:
// 512 keys).
template <typename E>
struct FwdTileTable<E, 256> : FwdTileTableLarge<E, 256, 80> {
  using narrow = typename FwdTileTableLarge<E, 256, 64>::full;
};

// FP8 (e4m3): 128 query rows on two consumer warpgroups (the V transposers take the producer
// warpgroup's spare warps), except hd64 / hd128 unbanded and hd64 long bands: 192 rows on three;
// kBlockN a multiple of 32 (the P V WGMMA's K). Shared memory per stage is K + V + transposed V,
// each kBlockN x d bytes. Ping-pong as for bf16.
//   d = 64 unbanded: 192 x 160 (FA3's FP8 tile), 4 stages: 12 (Q) + 4 x 30 = 132 KB; three
//   consumer warpgroups on 160 registers (O 32 + S 80 + P 20), the transposers on 32 (the
//   ldmatrix transposer needs few). At hd64 a block's softmax chain is long next to its GEMMs,
//   which the third warpgroup hides, as at bf16 (H200, 16k tokens: +25% at 2k, +47% at 16k over
//   128 x 128; 192 x 128 level at 2k, -3% at 16k).
//   Banded: 128 x 128, 4 stages: 2 x 8 (two Q buffers) + 4 x 24 = 112 KB; O 32 + S 64 + P 16.
//   Long bands (at least 4096 rows and keys per row): the unbanded 192 x 160 tile with the band
//   mask, one CTA per tile (one Q buffer: 132 KB; the producer warpgroup spills 8 B). The third
//   warpgroup's gain carries over to long bands (H100, ABBA, causal 4k / 8k / 16k over
//   128 x 128: +7.4 / +18.0 / +25.5%; 192 x 128 +7.0 / +16.1 / +22.5%).
//   d = 128 long bands: 128 x 192, 2 stages: 2 x 16 + 2 x 72 = 176 KB; O 64 + S 96 + P 24,
//   spill-free at 224. Wider blocks share each row's max, rescale and hand-offs over more keys,
//   which FP8's twice-as-fast GEMMs expose (measured when it was the unbanded tile too, H200, 16k
//   tokens: 2k +14%, 8k +11%, 16k +14% over 128 x 128; FA3's 128 x 224 level at 16k, -5% at 2k).
//   Banded: 128 x 128, 3 stages: 2 x 16 + 3 x 48 = 176 KB; O 64 + S 64 + P 16.
//   d = 256: with ping-pong, which at d = 256 the bf16 tiles do without: short blocks' GEMMs are
//   short next to their softmax (64-key blocks, H200, 16k tokens: +14% non-causal); 96-key blocks
//   below.
using Fp8 = cutlass::float_e4m3_t;
// d = 64 narrow: 192 x 128 for short unbanded problems, where 160-key blocks pad the most (512
// keys: 640 of work, 1k: 1120); a block's fixed cost of ~24 keys (kPadBlockKeys) puts the switch
// between 1k and 2k (H200: +22.9 / +6.2% at 512 / 1k over 192 x 160).
template <>
struct FwdTileTable<Fp8, 64> {
  using full = FwdTraits<Fp8, 64, 192, 160, 4, true, false>;
  using banded = FwdTraits<Fp8, 64, 128, 128, 4, true, true>;
  using narrow = FwdTraits<Fp8, 64, 192, 128, 4, true, false>;
  static constexpr int64_t kPadBlockKeys = 24;
  using long_banded = FwdTraits<Fp8, 64, 192, 160, 4, true, true>;
  static constexpr int kLongBand = 4096;
};
// d = 128 long bands (at least 4096 query rows and keys per row) run on the 192-key block with
// the band mask: the 128-key blocks' per-row overheads (H200, causal 16k: 780 -> 885 TFLOP/s).
// d = 128 unbanded: 192 x 96 on three consumer warpgroups, 4 stages (24 + 4 x 36 = 168 KB; O 64 +
// S 48 + P 12 of 160 registers, spill-free; the producer warpgroup, on 32, spills 20 B). hd128 ran
// at ~45% of both its MUFU and its tensor bound on 128 x 192, so latency bound it, and a third
// warpgroup hides it as at hd64 (H100, ABBA: 16k +5.5%, 2k +1.2% over 128 x 192).
// (Long bands on that shape, 192 x 96 on three warpgroups with the band mask, measured level:
// H100, ABBA, causal 16k +0.6%.)
// d = 128 unbanded up to kNarrowMaxKeys = 1k keys: the banded 128 x 128 kernel (as `narrow`, on
// the static schedule), which pads neither rows nor keys there: 192 x 96 computes 576 x 576 of a
// 512 x 512 problem, 1152 x 1056 of 1k. H100, ABBA, over 192 x 96: nc 512 / 1k / 2k / 4k +12.4 /
// +2.5 / -7.0 / -10.3%.
template <>
struct FwdTileTable<Fp8, 128> {
  using full = FwdTraits<Fp8, 128, 192, 96, 4, true, false>;
  using banded = FwdTraits<Fp8, 128, 128, 128, 3, true, true>;
  using narrow = banded;
  static constexpr int64_t kNarrowMaxKeys = 1024;
  using long_banded = FwdTraits<Fp8, 128, 128, 192, 2, true, true>;
  static constexpr int kLongBand = 4096;
};
// d = 256: 128 x 96, 2 stages (2 x 32 + 2 x 72 = 208 KB; O 128 + S 48 + P 12 of 224 registers,
// spill-free), banded or not: a block's row max, rescale and hand-offs shared over 96 keys, not
// 64 (H100, ABBA, over 128 x 64 with 3 stages: non-causal 2k +6.7%, 16k +9.3%; causal 2k
// +4.8%, 16k +7.1%).
template <>
struct FwdTileTable<Fp8, 256> {
  using full = FwdTraits<Fp8, 256, 128, 96, 2, true, false>;
  using banded = FwdTraits<Fp8, 256, 128, 96, 2, true, true>;
};

// Banded problems on a persistent grid with a dynamic tile counter (TileScheduler::
// tile_counter: FwdParams::workspace, fwd_workspace_bytes() of the FFI call's small workspace
// result, zeroed by a memset before the kernel) instead of one CTA per tile: the same greedy
// longest-first order, without a CTA start and a cold Q load per tile, and with the next
// tile's Q and K loaded under this tile's end (H200: causal 512-2k +3..+22%).
static_assert(sizeof(int) <= kFwdWorkspaceBytes, "the tile counter lives in the workspace result");

inline bool fwd_uses_dynamic_schedule(const FwdParams& fp) {
  return work_varies(fp.shape, fp.opts, fp.docs);
}

template <typename Element, int kHeadDim>
size_t fwd_workspace_bytes_impl(const FwdParams& fp) {
  return fwd_uses_dynamic_schedule(fp) ? kFwdWorkspaceBytes : 0;  // the counter: one int
}

template <class T>
typename T::Params make_fwd_params(const FwdParams& fp) {
  using Element = typename T::Element;
  const AttentionShape& s = fp.shape;
  // Each tensor with its own head dim (at most the kernel's: TMA zero-fills the rest).
  auto bshd = [](const void* ptr, int seqlen, int heads, int batch, int64_t d) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)), make_shape(seqlen, int(d), heads, batch),
                       make_stride(int64_t(heads) * d, _1{}, d, int64_t(seqlen) * heads * d));
  };
  Tensor mQ = bshd(fp.q, s.seqlen_q, s.heads_q, s.batch, s.head_dim);
  Tensor mK = bshd(fp.k, s.seqlen_k, s.heads_kv, s.batch, s.head_dim);
  Tensor mV = bshd(fp.v, s.seqlen_k, s.heads_kv, s.batch, s.head_dim_v);
  constexpr int64_t d = T::kHeadDim;  // the K and V tiles' width in shared memory

  bool varying = work_varies(fp.shape, fp.opts, fp.docs);
  TileScheduler sched;
  sched.num_m_blocks = (s.seqlen_q + T::kBlockM - 1) / T::kBlockM;
  sched.num_heads = s.heads_q;
  sched.num_batch = s.batch;
  sched.longest_first = varying ? 1 : 0;
  // K+V bytes of one head; keep about 32 MB of them (half the 50 MB L2) in flight.
  int64_t kv_bytes = 2 * int64_t(s.seqlen_k) * d * int64_t(sizeof(Element));
  int64_t heads = std::max<int64_t>(1, (int64_t(32) << 20) / std::max<int64_t>(kv_bytes, 1));
  sched.heads_per_section = int(std::min<int64_t>(heads, int64_t(s.heads_q) * s.batch));
  sched.tile_counter = T::kDynamicSchedule && fwd_uses_dynamic_schedule(fp) ? static_cast<int*>(fp.workspace) : nullptr;

  typename T::Params p{
      make_tma_copy(SM90_TMA_LOAD{}, mQ, typename T::SmemLayoutQ1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mK, typename T::SmemLayoutK1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mV, typename T::SmemLayoutK1{}),
      s.seqlen_q,
      s.seqlen_k,
      s.heads_q,
      s.heads_kv,
      s.batch,
      s.heads_q / s.heads_kv,
      BandMask{s.seqlen_q, s.seqlen_k, fp.opts.window_left, fp.opts.window_right},
      SoftmaxScale::make(fp.opts.softmax_scale, fp.opts.softcap),
      fp.lse,
      static_cast<typename T::OutElement*>(fp.out),
      s.head_dim_v,
      fp.sinks,
      sched,
      DocMask::of(fp.docs, s.seqlen_q, s.seqlen_k),
      fp.q_descale,
      fp.k_descale,
      fp.v_descale,
  };
  return p;
}

template <class T>
cudaError_t launch_fwd(const FwdParams& fp, cudaStream_t stream) {
  typename T::Params p = make_fwd_params<T>(fp);
  int num_tiles = p.sched.num_tiles();
  int num_sms = fp.num_sms > 0 ? fp.num_sms : 132;
  // Unbanded (equal tiles) or with the dynamic counter: a persistent grid, one CTA per SM.
  // Banded without it (kernels without the dynamic code): one CTA per tile, so that the hardware
  // hands the next tile, in longest-first order, to whichever SM frees up first.
  int grid = p.sched.longest_first && p.sched.tile_counter == nullptr ? num_tiles : std::min(num_tiles, num_sms);
  if (p.sched.tile_counter != nullptr) {
    if (cudaError_t e = cudaMemsetAsync(p.sched.tile_counter, 0, sizeof(int), stream); e != cudaSuccess) return e;
  }
  auto kernel = fwd_kernel<T>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
      e != cudaSuccess)
    return e;
  kernel<<<grid, T::kNumThreads, T::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// A table's tile for long bands (`long_banded`, used from `kLongBand` query rows and keys per
// row), where it has one; else its `banded` tile throughout.
template <class Table, class = void>
struct LongBandTile {
  using type = typename Table::banded;
  static constexpr int64_t kMin = INT64_MAX;
};
template <class Table>
struct LongBandTile<Table, std::void_t<typename Table::long_banded>> {
  using type = typename Table::long_banded;
  static constexpr int64_t kMin = Table::kLongBand;
};

// A table's tile for short bands (`short_banded`, used while a row sees at most
// `kShortBandMaxKeys` keys), where it has one; else its `banded` tile throughout.
template <class Table, class = void>
struct ShortBandTile {
  using type = typename Table::banded;
  static constexpr int64_t kMaxKeys = 0;
};
template <class Table>
struct ShortBandTile<Table, std::void_t<typename Table::short_banded>> {
  using type = typename Table::short_banded;
  static constexpr int64_t kMaxKeys = Table::kShortBandMaxKeys;
};

// The most keys a query row can see under the band (window_left + 1 + window_right, at most
// seqlen_k; 0 or less: rows without keys).
inline int64_t band_width(const FwdParams& fp) {
  int64_t w = int64_t(fp.opts.window_left) + 1 + fp.opts.window_right;
  return std::min<int64_t>(w, fp.shape.seqlen_k);
}

// Padded work of the ragged last key block. A key block is computed in full, its keys past
// seqlen_k included (TMA fills zeros, the GEMMs run the whole block, the mask sets those scores
// to -inf): at seqlen_k = 512, d = 128's 128 x 176 tile does 3 blocks = 528 keys of work (+3.1%,
// also at 1k-4k; +1.0% at 8k-16k), d = 256's 128 x 80 tile 7 blocks = 560 (+9.4%; +1.6% at
// 1k-4k, +0.6% at 8k). A narrower tile that divides seqlen_k wastes nothing but runs more
// blocks, each with a fixed cost (pipeline waits, GEMM issue and drain, the O rescale vote):
// model a tile's time per query row as blocks x (kBlockN + kFwdPadBlockKeys), that fixed cost
// counted in key columns, and take the narrow tile when it is cheaper. Break-even costs: d = 128
// (176 vs 128) 16 keys at 512-4k, 4.7 at 8k-16k; d = 256 (80 vs 64) 48 at 512, 5.3 at 1k-4k,
// 1.9 at 8k. With 8: narrow at d = 128 512-4k (kNarrowMaxKeys caps it at 2k) and d = 256 512,
// the wide tile elsewhere (H200, with the 8-byte O stores and the one-compare mask: hd256
// non-causal 512 +14%, hd128 512-1k +4..+8%). Same query tile both ways (kBlockM 128), so only
// the key side differs.
constexpr int64_t kFwdPadBlockKeys = 8;

inline bool fwd_pad_prefers_narrow(int64_t seqlen_k, int64_t wide_n, int64_t narrow_n,
                                   int64_t pad_keys = kFwdPadBlockKeys) {
  if (narrow_n >= wide_n) return false;
  int64_t wide_blocks = (seqlen_k + wide_n - 1) / wide_n;
  int64_t narrow_blocks = (seqlen_k + narrow_n - 1) / narrow_n;
  return narrow_blocks * (narrow_n + pad_keys) < wide_blocks * (wide_n + pad_keys);
}

// A table's fixed block cost in key columns (`kPadBlockKeys`), where it measured its own; else
// kFwdPadBlockKeys.
template <class Table, class = void>
struct PadBlockKeys : std::integral_constant<int64_t, kFwdPadBlockKeys> {};
template <class Table>
struct PadBlockKeys<Table, std::void_t<decltype(Table::kPadBlockKeys)>>
    : std::integral_constant<int64_t, Table::kPadBlockKeys> {};

// The longest key length a table runs its narrow tile at (`kNarrowMaxKeys`), where it measured
// one; else no bound.
template <class Table, class = void>
struct NarrowMaxKeys : std::integral_constant<int64_t, INT64_MAX> {};
template <class Table>
struct NarrowMaxKeys<Table, std::void_t<decltype(Table::kNarrowMaxKeys)>>
    : std::integral_constant<int64_t, Table::kNarrowMaxKeys> {};

// A table's narrower tile for unbanded problems (`narrow`), where it has one; else `full`.
template <class Table, class = void>
struct NarrowTile {
  using type = typename Table::full;
};
template <class Table>
struct NarrowTile<Table, std::void_t<typename Table::narrow>> {
  using type = typename Table::narrow;
};

template <class T>
struct TileTag {
  using type = T;  // void: no tile runs the problem
};

// The tile of (Element, kHeadDim)'s table that a problem runs on, handed to `f` as a TileTag:
// run_fwd_impl launches it, fwd_key_block_impl reports its key block (the FP8 oracle's).
template <typename Element, int kHeadDim, class F>
auto with_fwd_tile(const FwdParams& fp, F&& f) {
  using Table = FwdTileTable<Element, kHeadDim>;
  using Long = LongBandTile<Table>;
  using Short = ShortBandTile<Table>;
  if (!work_varies(fp.shape, fp.opts, fp.docs)) {
    using Full = typename Table::full;
    using Narrow = typename NarrowTile<Table>::type;
    if constexpr (Narrow::kBlockM != Full::kBlockM) {  // other rows too: by the key length alone
      static_assert(NarrowMaxKeys<Table>::value < INT64_MAX, "a narrow tile of other rows needs kNarrowMaxKeys");
      if (fp.shape.seqlen_k <= NarrowMaxKeys<Table>::value) return f(TileTag<Narrow>{});
    } else {
      if (fp.shape.seqlen_k <= NarrowMaxKeys<Table>::value &&
          fwd_pad_prefers_narrow(fp.shape.seqlen_k, Full::kBlockN, Narrow::kBlockN, PadBlockKeys<Table>::value))
        return f(TileTag<Narrow>{});
    }
    return f(TileTag<Full>{});
  }
  // Documents bound each row's keys by their length, unknown here: the regular banded tile.
  // FP8 kernels take no documents (the FFI handler rejects them).
  if (fp.docs.present()) {
    if constexpr (Table::banded::kFp8) return f(TileTag<void>{});
    else return f(TileTag<FwdDocsTraits<typename Table::banded>>{});
  }
  const int64_t width = band_width(fp);
  if (fp.shape.seqlen_q >= Long::kMin && width >= std::max<int64_t>(Long::kMin, 1))
    return f(TileTag<typename Long::type>{});
  if (width <= Short::kMaxKeys) return f(TileTag<typename Short::type>{});
  return f(TileTag<typename Table::banded>{});
}

template <typename Element, int kHeadDim>
int fwd_key_block_impl(const FwdParams& fp) {
  return with_fwd_tile<Element, kHeadDim>(fp, [](auto tile) {
    using T = typename decltype(tile)::type;
    if constexpr (std::is_void_v<T>) return 0;
    else return int(T::kBlockN);
  });
}

template <typename Element, int kHeadDim>
cudaError_t run_fwd_impl(const FwdParams& fp, cudaStream_t stream) {
  return with_fwd_tile<Element, kHeadDim>(fp, [&](auto tile) {
    using T = typename decltype(tile)::type;
    if constexpr (std::is_void_v<T>) return cudaErrorNotSupported;
    else return launch_fwd<T>(fp, stream);
  });
}

}  // namespace fa3
