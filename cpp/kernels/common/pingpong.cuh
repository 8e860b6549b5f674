// Ping-pong of the consumer warpgroups, shared by the forward and the hd128 ping-pong backward
// tiles: they take turns to issue their GEMM batches, so that one warpgroup's softmax (or dS) math
// runs under another's GEMMs.
#pragma once

#include <cutlass/arch/barrier.h>

namespace fa3 {

// kEnabled; round robin with three consumer warpgroups: warpgroup wg may issue its GEMMs once the
// previous one, (wg - 1) mod kNumMmaWG, has issued its own; it then hands the turn to
// (wg + 1) mod kNumMmaWG. Named barrier kBar0 + w is synced by warpgroup w and arrived at by its
// predecessor (2 x 128 threads). The branches on wg keep the barrier ids immediates (a register
// id stayed live across the main loop and was spilled).
template <int kNumMmaWG, bool kEnabled, int kBar0>
struct WarpgroupPingPong {
  int wg;

  // Warpgroup 0 issues first: give it the turn that the last warpgroup would otherwise hand over.
  CUTE_DEVICE void start() const {
    if constexpr (kEnabled) {
      if (wg == kNumMmaWG - 1) cutlass::arch::NamedBarrier::arrive(2 * 128, kBar0 + 0);
    }
  }
  CUTE_DEVICE void wait() const {
    using cutlass::arch::NamedBarrier;
    if constexpr (kEnabled) {
      if (wg == 0) NamedBarrier::sync(2 * 128, kBar0 + 0);
      else if (kNumMmaWG == 2 || wg == 1) NamedBarrier::sync(2 * 128, kBar0 + 1);
      else NamedBarrier::sync(2 * 128, kBar0 + 2);
    }
  }
  CUTE_DEVICE void signal() const {
    using cutlass::arch::NamedBarrier;
    if constexpr (kEnabled) {
      if (wg == 0) NamedBarrier::arrive(2 * 128, kBar0 + 1);
      else if (kNumMmaWG == 3 && wg == 1) NamedBarrier::arrive(2 * 128, kBar0 + 2);
      else NamedBarrier::arrive(2 * 128, kBar0 + 0);
    }
  }
};

}  // namespace fa3
