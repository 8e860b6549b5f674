// Unit test (host, no GPU) of the backward's CTA order and tail split (bwd/bwd_order.cuh):
//   1. decode is a bijection of [0, num_tiles) onto (key block, kv head, batch), for random
//      shapes and every section width (also ones that do not divide the head count);
//   2. section 1 is the 3D grid's order (key block fastest);
//   3. deterministic safety: for each (kv head, batch), lower key blocks have lower indices;
//   4. longest first: with a causal band, the work (query blocks visited,
//      BandMask::query_block_range) never grows along the linear order inside a section;
//   5. bwd_order_section: 1 without a band, else a power of two in [1, heads_kv * batch];
//   6. the tail split (BwdTailSplit): every (unit, query block) is run by exactly one CTA, no CTA
//      is empty, tail slots are distinct and below num_slots(), only units past the last full
//      wave split, and the split's modelled makespan is never longer than without it.
// With the argument --model it also prints a model of the schedule (132 SMs take CTAs in linear
// order, a CTA costs a fixed start plus its steps) for the benchmark shapes: whole vs split tail,
// default vs longest-first makespan (informational, not checked).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <queue>
#include <string>
#include <vector>
#include "bwd/bwd_order.cuh"
#include "common/mask.cuh"
#include "fa3/params.h"
using namespace fa3;
using namespace fa3::bwd;

static int steps_of(const BandMask& band, int n, int BN, int BM, int group) {
  int mb, me;
  band.query_block_range(n, BN, BM, mb, me);
  return group * (me - mb);
}

// Makespan of greedy in-order list scheduling on `sms` SMs, one CTA per SM at a time.
static double makespan(const std::vector<double>& cost, int sms) {
  std::priority_queue<double, std::vector<double>, std::greater<double>> free_at;
  for (int i = 0; i < sms; ++i) free_at.push(0.0);
  double end = 0;
  for (double c : cost) {
    double t = free_at.top();
    free_at.pop();
    free_at.push(t + c);
    end = std::max(end, t + c);
  }
  return end;
}

int main(int argc, char** argv) {
  srand(3);
  int bad = 0, cases = 0;
  for (int it = 0; it < 3000; ++it) {
    BwdTileOrder o{1 + rand() % 40, 1 + rand() % 9, 1 + rand() % 7, 1};
    const int total = o.heads_kv * o.batch;
    o.section = 1 + rand() % (total + 2);  // also wider than the head count
    if (it % 5 == 0) o.section = 1;
    std::vector<int> seen(o.num_tiles(), 0), last(total, -1);
    const int bn = it % 2 ? 128 : 80;  // 80: the split-D (hd256) key block
    const int sq = 1 + rand() % 3000, sk = o.n_blocks * bn - rand() % bn;
    BandMask causal{sq, sk, kUnbounded, 0};
    std::vector<int> prev_work(total + 1, 1 << 30);
    for (int l = 0; l < o.num_tiles(); ++l) {
      int n, hk, b;
      o.decode(l, n, hk, b);
      ++cases;
      if (n < 0 || n >= o.n_blocks || hk < 0 || hk >= o.heads_kv || b < 0 || b >= o.batch) { ++bad; continue; }
      const int id = (b * o.heads_kv + hk) * o.n_blocks + n;
      seen[id]++;
      if (o.section == 1 && l != id) ++bad;                       // 2
      const int hb = b * o.heads_kv + hk;
      if (n <= last[hb]) ++bad;                                   // 3
      last[hb] = n;
      const int sec = hb / o.section;
      const int w = steps_of(causal, n, bn, 64, 1);
      if (w > prev_work[sec]) ++bad;                              // 4
      prev_work[sec] = w;
    }
    for (int v : seen) if (v != 1) ++bad;                         // 1
  }
  int sbad = 0;
  for (int it = 0; it < 2000; ++it) {
    int sq = 1 + rand() % 20000, sk = 1 + rand() % 20000, hkv = 1 + rand() % 16, g = 1 + rand() % 8;
    int batch = 1 + rand() % 64, d = 64 * (1 + rand() % 4);
    int wl = rand() % 3 ? kUnbounded : rand() % 500, wr = rand() % 2 ? kUnbounded : 0;
    AttentionShape shape{batch, sq, sk, hkv * g, hkv, d};
    AttentionOptions opts;
    opts.window_left = wl;
    opts.window_right = wr;
    int s = bwd_order_section(shape, opts, 2);
    bool banded = wl != kUnbounded || wr != kUnbounded;
    if (s < 1 || s > hkv * batch || (s != hkv * batch && (s & (s - 1))) || (!banded && s != 1)) ++sbad;  // clamped to all heads, else a power of two
  }

  // 6. Tail split: coverage, shares, slots; cost model (a CTA costs 2 + its steps, as
  // bwd_tail_split assumes) against the unsplit grid.
  int tbad = 0, split_cases = 0;
  for (int it = 0; it < 4000; ++it) {
    const int sms = it % 3 ? 132 : 1 + rand() % 200;
    const int units = 1 + rand() % (it % 2 ? 600 : 6000), m_len = 1 + rand() % 300, group = 1 + rand() % 4;
    const BwdTailSplit t = bwd_tail_split(units, m_len, group, sms, false);
    if (bwd_tail_split(units, m_len, group, sms, true).tail != 0) ++tbad;  // never with a band
    if (t.full + t.tail != units || (t.tail == 0) != (t.parts == 1) || t.parts > m_len) { ++tbad; continue; }
    if (t.tail > 0 && (t.tail != units % sms)) ++tbad;
    split_cases += t.tail > 0;
    std::vector<int> covered(size_t(units) * m_len, 0), slot_seen(t.num_slots(), 0);
    std::vector<double> cost_split, cost_whole(units, 2.0 + group * m_len);
    for (int cta = 0; cta < t.num_ctas(); ++cta) {
      int slot, mb = 0, me = m_len;
      const int u = t.unit_of(cta, slot);
      if (u < 0 || u >= units) { ++tbad; continue; }
      if (slot >= 0) {
        if (slot >= t.num_slots() || slot_seen[slot]++) ++tbad;
        t.share(slot, mb, me);
      }
      if (me <= mb) ++tbad;
      for (int m = mb; m < me; ++m) covered[size_t(u) * m_len + m]++;
      cost_split.push_back(2.0 + group * (me - mb));
    }
    for (int c : covered) if (c != 1) ++tbad;
    if (makespan(cost_split, sms) > makespan(cost_whole, sms) + 1e-9) ++tbad;
  }
  if (bad || sbad || tbad)
    printf("order: %d bad; section widths: %d bad; tail split: %d bad\n", bad, sbad, tbad);
  bad += tbad;
  printf("bwd order: %d tiles, 4000 tail splits (%d split) checked; %s (%d bad)\n", cases, split_cases,
         bad || sbad ? "FAIL" : "ok", bad + sbad);
  if (argc < 2 || std::string(argv[1]) != "--model") return bad || sbad;
  printf("model (132 SMs, no band, makespan in steps; split / whole):\n");
  for (int hd : {64, 128}) {
    const int bm = hd == 64 ? 128 : 80;  // hd128: the 80-row steps of unbanded problems
    for (int seq : {512, 1024, 2048, 4096, 8192, 16384}) {
      const int units = 16384 / seq * (2048 / hd) * (seq / 128), m_len = (seq + bm - 1) / bm;
      const BwdTailSplit t = bwd_tail_split(units, m_len, 1, 132, false);
      std::vector<double> whole(units, 2.0 + m_len), split;
      for (int cta = 0; cta < t.num_ctas(); ++cta) {
        int slot, mb = 0, me = m_len;
        t.unit_of(cta, slot);
        if (slot >= 0) t.share(slot, mb, me);
        split.push_back(2.0 + (me - mb));
      }
      const double mw = makespan(whole, 132), ms = makespan(split, 132);
      printf("  hd%-3d %5d: %5d units, tail %3d x %2d parts  whole %7.1f  split %7.1f  speedup %.3f\n", hd, seq,
             units, t.tail, t.parts, mw, ms, mw / ms);
    }
  }

  // Schedule model: a CTA costs `start` + its steps (one step = one query block of 64 rows).
  // start ~ 3 steps: K/V load, first Q/dO, dK/dV epilogue (a guess).
  printf("model (132 SMs, causal, makespan in steps; LPT / default):\n");
  const double start = 3.0;
  for (int hd : {64, 128, 256}) {
    const int bn = hd == 256 ? 80 : 128;  // hd256: split-D, 80 keys
    for (int seq : {512, 1024, 2048, 4096, 8192, 16384}) {
      const int batch = 16384 / seq, heads = 2048 / hd;
      const int nb = (seq + bn - 1) / bn;
      BandMask causal{seq, seq, kUnbounded, 0};
      AttentionOptions causal_opts;
      causal_opts.window_right = 0;
      const int sec = bwd_order_section(AttentionShape{batch, seq, seq, heads, heads, hd}, causal_opts, 2);
      BwdTileOrder def{nb, heads, batch, 1}, lpt{nb, heads, batch, sec};
      std::vector<double> c_def, c_lpt;
      double work = 0;
      for (int l = 0; l < def.num_tiles(); ++l) {
        int n, hk, b;
        def.decode(l, n, hk, b);
        c_def.push_back(start + steps_of(causal, n, bn, 64, 1));
        work += c_def.back();
        lpt.decode(l, n, hk, b);
        c_lpt.push_back(start + steps_of(causal, n, bn, 64, 1));
      }
      const double md = makespan(c_def, 132), ml = makespan(c_lpt, 132), ideal = work / 132;
      printf("  hd%-3d %5d: section %3d  default %7.1f (%.3f of ideal)  lpt %7.1f (%.3f)  speedup %.3f\n",
             hd, seq, sec, md, ideal / md, ml, ideal / ml, md / ml);
    }
  }
  return bad || sbad;
}
