// Unit test (host, no GPU) of the backward launcher's tile choice (bwd/bwd_launch.cuh
// with_bwd_traits): hd128 problems without a band and without softcap on the 80-row tile; banded
// problems in which some key is seen by at least kBwdPingPongMinRows (2048) query rows, without
// documents, on the ping-pong tile (softcap included), and such unbanded ones on the 80-row
// ping-pong tile; every other one on the 64-row tile; the most rows a key sees
// (BandMask::max_rows_per_key) against brute force.
#include <algorithm>
#include <cstdio>
#include "bwd/bwd_launch.cuh"
using namespace fa3;

struct Choice {
  int block_m = 0, stages_ds = 0;
  bool no_band = false, ping_pong = false;
  bool operator==(const Choice& o) const {
    return block_m == o.block_m && stages_ds == o.stages_ds && no_band == o.no_band && ping_pong == o.ping_pong;
  }
};

// The traits a call launches: Tr, or TrCap where softcap is on (run_bwd_with).
template <typename E, int D>
Choice choose(int sq, int sk, int left, int right, float softcap = 0.f, bool docs = false) {
  BwdParams p;
  p.shape = AttentionShape{1, sq, sk, 2, 2, D, D};
  p.opts.window_left = left;
  p.opts.window_right = right;
  p.opts.softcap = softcap;
  static const int32_t rows[1] = {0};
  if (docs) p.docs.q_rows = rows;
  return bwd::with_bwd_traits<E, D>(p, [&](auto tr, auto tr_cap) {
    using T = typename decltype(tr)::type;
    using C = typename decltype(tr_cap)::type;
    static_assert(T::kPingPong == C::kPingPong && T::kBlockM == C::kBlockM);
    Choice c;
    if (softcap > 0.f) c = {C::kBlockM, C::kStagesdS, C::kNoBand, C::kPingPong};
    else c = {T::kBlockM, T::kStagesdS, T::kNoBand, T::kPingPong};
    return c;
  });
}

static int failures = 0;
static void expect(const char* what, Choice got, Choice want) {
  if (!(got == want)) {
    ++failures;
    std::printf("FAIL %s: got %d rows, %d dS buffers, no band %d, ping-pong %d; want %d, %d, %d, %d\n", what,
                got.block_m, got.stages_ds, got.no_band, got.ping_pong, want.block_m, want.stages_ds, want.no_band,
                want.ping_pong);
  }
}

// BandMask::max_rows_per_key against counting every key's rows, on small shapes and windows.
static void check_rows_per_key() {
  uint32_t seed = 12345;
  auto rnd = [&](int n) { seed = seed * 1664525u + 1013904223u; return int((seed >> 8) % uint32_t(n)); };
  for (int t = 0; t < 20000; ++t) {
    BandMask band{1 + rnd(40), 1 + rnd(40), 0, 0};
    band.left = rnd(4) == 0 ? kUnbounded : rnd(60) - 20;
    band.right = rnd(4) == 0 ? kUnbounded : rnd(60) - 20;
    long long want = 0;
    for (int j = 0; j < band.seqlen_k; ++j) {
      long long n = 0;
      for (int i = 0; i < band.seqlen_q; ++i) {
        const long long r = (long long)j - i - (band.seqlen_k - band.seqlen_q);
        n += -(long long)band.left <= r && r <= band.right;
      }
      want = std::max(want, n);
    }
    const long long got = band.max_rows_per_key();
    if (got != want && failures++ < 10)
      std::printf("FAIL max_rows_per_key sq %d sk %d window (%d, %d): got %lld, want %lld\n", band.seqlen_q,
                  band.seqlen_k, band.left, band.right, got, want);
  }
}

int main() {
  check_rows_per_key();
  using B = cutlass::bfloat16_t;
  using H = cutlass::half_t;
  const int U = kUnbounded;
  const Choice full{80, 2, true, false}, band{64, 2, false, false}, ping{64, 3, false, true};
  const Choice full_ping{80, 2, true, true};
  expect("bf16 nc 16k", choose<B, 128>(16384, 16384, U, U), full_ping);
  expect("fp16 nc 2k", choose<H, 128>(2048, 2048, U, U), full_ping);
  expect("bf16 nc 2047", choose<B, 128>(2047, 2047, U, U), full);
  expect("bf16 nc sq 1k sk 16k", choose<B, 128>(1024, 16384, U, U), full);
  expect("bf16 nc sq 16k sk 1k", choose<B, 128>(16384, 1024, U, U), full_ping);
  expect("bf16 nc softcap 16k", choose<B, 128>(16384, 16384, U, U, 30.f), band);
  expect("bf16 causal 1k", choose<B, 128>(1024, 1024, U, 0), band);
  expect("bf16 causal 2047", choose<B, 128>(2047, 2047, U, 0), band);
  expect("bf16 causal 2k", choose<B, 128>(2048, 2048, U, 0), ping);
  expect("bf16 causal 16k", choose<B, 128>(16384, 16384, U, 0), ping);
  expect("fp16 causal 16k", choose<H, 128>(16384, 16384, U, 0), ping);
  expect("bf16 causal softcap 4k", choose<B, 128>(4096, 4096, U, 0, 30.f), ping);
  expect("bf16 causal docs 16k", choose<B, 128>(16384, 16384, U, 0, 0.f, true), band);
  // Rows per key: window_left + 1 + window_right at most, and causal at most min(seqlen_q, seqlen_k).
  expect("bf16 window (1023, 1024) over 16k", choose<B, 128>(16384, 16384, 1023, 1024), ping);
  expect("bf16 window (1023, 1023) over 16k", choose<B, 128>(16384, 16384, 1023, 1023), band);
  expect("bf16 causal sq 1k sk 16k", choose<B, 128>(1024, 16384, U, 0), band);
  expect("bf16 causal sq 16k sk 1k", choose<B, 128>(16384, 1024, U, 0), band);  // a key: <= 1k rows
  expect("bf16 causal sq 4k sk 16k", choose<B, 128>(4096, 16384, U, 0), ping);
  expect("bf16 shifted past the keys", choose<B, 128>(4096, 4096, U, -5000), band);
  expect("bf16 64 causal 16k", choose<B, 64>(16384, 16384, U, 0), {128, 2, false, false});
  expect("bf16 96 causal 16k", choose<B, 96>(16384, 16384, U, 0), {64, 2, false, false});
  if (failures) return 1;
  std::printf("bwd_tile_choice: all choices as expected\n");
  return 0;
}
