// Unit test (host, no GPU) of the forward launcher's tile choice (fwd/fwd_launch.cuh
// with_fwd_tile): which tile of a head dim's table runs a problem. bf16 hd128: unbanded 512-2k
// keys on the narrow 128-key tile, from 4k on 176 keys; bands a row of which sees at most 512
// keys on the 2-stage banded tile with Q prefetch (short_banded), longer bands on the 3-stage
// one; documents on the banded tile's document form. FP8 hd128: long bands (>= 4096 rows and
// keys) on 192 keys, unbanded up to 1k keys on the banded kernel (128 rows, not 192); FP8 takes
// no documents. A table without a short or long band tile (bf16
// hd64's short side, hd256) runs every band on `banded`. Every table's tiles are instantiated,
// so their traits' static checks (among them the setmaxnreg split, register_split_fits) hold
// for each.
#include <cstdio>
#include <type_traits>
#include "fwd/fwd_launch.cuh"
using namespace fa3;

struct Choice {
  int block_m = 0, block_n = 0, stages = 0;
  bool banded = false, docs = false, none = false;
};

template <typename E, int D>
Choice choose(int sq, int sk, int left, int right, bool docs = false) {
  FwdParams fp;
  fp.shape = AttentionShape{1, sq, sk, 2, 2, D, D};
  fp.opts.window_left = left;
  fp.opts.window_right = right;
  static const int32_t rows[1] = {0};
  if (docs) fp.docs.q_rows = rows;
  return with_fwd_tile<E, D>(fp, [](auto tile) {
    using T = typename decltype(tile)::type;
    Choice c;
    if constexpr (std::is_void_v<T>) {
      c.none = true;
    } else {
      c.block_m = T::kBlockM, c.block_n = T::kBlockN, c.stages = T::kStages, c.banded = T::kBanded;
      c.docs = T::kDocs;
    }
    return c;
  });
}

// The setmaxnreg split a tile may take (common/utils.cuh): the two-consumer splits in use fill
// the 384 x 168 pool exactly, the three-consumer one 512 x 128; 32 / 240 (which hung) does not fit.
static_assert(register_split_fits(24, 256, 240) && register_split_fits(40, 256, 232) &&
              register_split_fits(56, 256, 224) && register_split_fits(32, 384, 160));
static_assert(!register_split_fits(32, 256, 240) && !register_split_fits(24, 256, 248) &&
              !register_split_fits(40, 384, 160));

static int failures = 0;
static void expect(const char* what, Choice got, Choice want) {
  bool ok = got.block_m == want.block_m && got.block_n == want.block_n && got.stages == want.stages &&
            got.banded == want.banded && got.docs == want.docs && got.none == want.none;
  if (!ok) {
    ++failures;
    std::printf("FAIL %s: got %dx%d, %d stages, banded %d, docs %d, none %d; want %dx%d, %d stages, banded %d, docs %d, none %d\n",
                what, got.block_m, got.block_n, got.stages, got.banded, got.docs, got.none, want.block_m,
                want.block_n, want.stages, want.banded, want.docs, want.none);
  }
}

int main() {
  using B = cutlass::bfloat16_t;
  using F8 = cutlass::float_e4m3_t;
  const int U = kUnbounded;
  const Choice narrow{128, 128, 2, false}, wide{128, 176, 2, false};
  const Choice short_band{128, 128, 2, true};
  const Choice band{128, 128, 3, true}, band_docs{128, 128, 3, true, true};
  expect("bf16 128 nc 512", choose<B, 128>(512, 512, U, U), narrow);
  expect("bf16 128 nc 2k", choose<B, 128>(2048, 2048, U, U), narrow);
  expect("bf16 128 nc 4k", choose<B, 128>(4096, 4096, U, U), wide);
  expect("bf16 128 causal 512", choose<B, 128>(512, 512, U, 0), short_band);
  expect("bf16 128 causal 513", choose<B, 128>(513, 513, U, 0), band);
  expect("bf16 128 causal 1k", choose<B, 128>(1024, 1024, U, 0), band);
  expect("bf16 128 causal 16k", choose<B, 128>(16384, 16384, U, 0), band);
  expect("bf16 128 causal sq 16k sk 512", choose<B, 128>(16384, 512, U, 0), short_band);
  expect("bf16 128 causal sq 512 sk 16k", choose<B, 128>(512, 16384, U, 0), band);
  expect("bf16 128 window (255, 256) over 16k", choose<B, 128>(16384, 16384, 255, 256), short_band);
  expect("bf16 128 window (256, 256) over 16k", choose<B, 128>(16384, 16384, 256, 256), band);
  expect("bf16 128 shifted past the keys", choose<B, 128>(300, 300, U, -700), short_band);
  expect("bf16 128 docs causal 512", choose<B, 128>(512, 512, U, 0, true), band_docs);
  expect("bf16 64 causal 512", choose<B, 64>(512, 512, U, 0), {128, 128, 4, true});
  expect("bf16 256 causal 512", choose<B, 256>(512, 512, U, 0), {128, 80, 2, true});
  expect("fp8 128 nc 512", choose<F8, 128>(512, 512, U, U), {128, 128, 3, true});  // the banded kernel
  expect("fp8 128 nc 1k", choose<F8, 128>(1024, 1024, U, U), {128, 128, 3, true});
  expect("fp8 128 nc 1025", choose<F8, 128>(1024, 1025, U, U), {192, 96, 4, false});
  expect("fp8 128 nc sq 16k sk 1k", choose<F8, 128>(16384, 1024, U, U), {128, 128, 3, true});
  expect("fp8 128 nc 16k", choose<F8, 128>(16384, 16384, U, U), {192, 96, 4, false});
  expect("fp8 128 causal 512", choose<F8, 128>(512, 512, U, 0), {128, 128, 3, true});
  expect("fp8 128 causal 4096", choose<F8, 128>(4096, 4096, U, 0), {128, 192, 2, true});
  expect("fp8 64 causal 4096", choose<F8, 64>(4096, 4096, U, 0), {192, 160, 4, true});  // long band
  expect("fp8 64 causal 4000", choose<F8, 64>(4000, 4000, U, 0), {128, 128, 4, true});
  expect("fp8 128 docs", choose<F8, 128>(512, 512, U, 0, true), {0, 0, 0, false, false, true});
  // Every table's tiles instantiated (their traits' static_asserts, the register split's among
  // them): each kernel head dim runs something for an unbanded, a causal and a document problem;
  // FP8 takes no documents.
  auto runs = [](const char* what, Choice c) {
    if (c.none || c.block_n < 16) ++failures, std::printf("FAIL %s: no tile\n", what);
  };
  runs("bf16 64", choose<B, 64>(4096, 4096, U, U)), runs("bf16 64 docs", choose<B, 64>(512, 512, U, 0, true));
  runs("bf16 96", choose<B, 96>(512, 512, U, 0)), runs("bf16 96 docs", choose<B, 96>(512, 512, U, 0, true));
  runs("bf16 192", choose<B, 192>(512, 512, U, U)), runs("bf16 192 docs", choose<B, 192>(512, 512, U, 0, true));
  runs("bf16 256 docs", choose<B, 256>(512, 512, U, 0, true)), runs("fp16 128", choose<cutlass::half_t, 128>(512, 512, U, 0));
  runs("fp8 64", choose<F8, 64>(512, 512, U, U)), runs("fp8 64 causal", choose<F8, 64>(4096, 4096, U, 0));
  runs("fp8 256", choose<F8, 256>(512, 512, U, U)), runs("fp8 256 causal", choose<F8, 256>(4096, 4096, U, 0));
  if (failures) return 1;
  std::printf("fwd_tile_choice: all choices as expected\n");
  return 0;
}
