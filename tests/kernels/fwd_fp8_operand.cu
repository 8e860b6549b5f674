// Unit test (host, no GPU) of the FP8 forward's two index maps, for every FP8 tile of the table:
//   * P to the e4m3 A operand (common/utils.cuh): the A element that convert_into_fp8_operand_a
//     fills from accumulator register c (of MmaQK's C layout) is, in MmaPV's A layout, at c's row
//     and at k = 16 (col / 16) + fp8_key_slot(col % 16) of c's column; every A element of the
//     warpgroup's 64 x kBlockN P is filled once; fp8_key_slot is a permutation of 0..15;
//   * the V transpose (fwd_transpose.cuh), by ldmatrix.trans / stmatrix replayed as the PTX ISA
//     defines those instructions: it writes every Vt byte once and puts V(key, d) at
//     Vt(d, 16 (key / 16) + fp8_key_slot(key % 16)), the same permutation, so that P V sums
//     matching pairs; each matrix's rows (the tiles' swizzled layouts, 32 banks of 4 bytes) have
//     at most 2-way bank conflicts.
#include <algorithm>
#include <cstring>
#include <cstdio>
#include <map>
#include <set>
#include <vector>

#include "fwd/fwd_launch.cuh"
#include "fwd/fwd_transpose.cuh"
using namespace cute;

template <class Tr>
int check_operand() {
  constexpr int N = Tr::kBlockN;
  typename Tr::MmaQK mma_qk;
  typename Tr::MmaPV mma_pv;
  constexpr int kCByte[4] = {0, 1, 4, 5};  // accumulator registers of an A register's bytes, from 8j + 2h
  int bad = 0;
  std::vector<int> seen(64 * N, 0);
  for (int t = 0; t < 128; ++t) {
    Tensor cS = mma_qk.get_thread_slice(t).partition_C(make_identity_tensor(Shape<_64, Int<N>>{}));
    Tensor cA = mma_pv.get_thread_slice(t).partition_A(make_identity_tensor(Shape<_64, Int<N>>{}));
    auto const a_layout = fa3::acc_as_fp8_operand_a(cS.layout());
    if (size(cA) != size(cS) || size(a_layout) != size(cS)) ++bad;
    for (int v = 0; v < 16; ++v) {
      for (int kb = 0; kb < N / 32; ++kb) {
        int const idx = a_layout(v, 0, kb);  // byte idx % 4 of A register idx / 4
        int const reg = idx / 4, j = reg / 2, h = reg % 2;
        auto const c = cS(8 * j + 2 * h + kCByte[idx % 4]);
        auto const a = cA(v, 0, kb);
        int const col = get<1>(c);
        if (get<0>(a) != get<0>(c) || get<1>(a) != 16 * (col / 16) + fa3::fp8_key_slot(col % 16)) ++bad;
        seen[get<0>(a) * N + get<1>(a)]++;
      }
    }
  }
  for (int s : seen) bad += s != 1;
  return bad;
}

// Shared-memory images of one V stage (distinct bytes, in its swizzled layout) and of one Vt
// stage that a replayed transpose writes (store counts every byte it writes).
template <class Tr>
struct TransposeImages {
  static constexpr int N = Tr::kBlockN, D = Tr::kHeadDim, kBytes = N * D;
  std::vector<uint8_t> v = std::vector<uint8_t>(kBytes), smem_v = std::vector<uint8_t>(kBytes),
                       smem_vt = std::vector<uint8_t>(kBytes, 0);
  std::vector<int> written = std::vector<int>(kBytes, 0);
  TransposeImages() {
    auto const sV = typename Tr::SmemLayoutK1{};
    for (int i = 0; i < kBytes; ++i) v[i] = uint8_t(i * 37 + i / 256);
    for (int key = 0; key < N; ++key)
      for (int d = 0; d < D; ++d) smem_v[int(sV(key, d))] = v[key * D + d];
  }
  void store(uint32_t at, uint32_t word) {
    std::memcpy(&smem_vt[at], &word, 4);
    for (int i = 0; i < 4; ++i) written[at + i]++;
  }
  // Bytes written other than once, and keys not at Vt(d, 16 (key / 16) + fp8_key_slot(key % 16)).
  int mismatches() const {
    auto const sVt = typename Tr::SmemLayoutVt{};
    int bad = 0;
    for (int w : written) bad += w != 1;
    for (int key = 0; key < N; ++key)
      for (int d = 0; d < D; ++d)
        bad += smem_vt[int(sVt(d, 16 * (key / 16) + fa3::fp8_key_slot(key % 16), 0))] != v[key * D + d];
    return bad;
  }
};

// The kernel's transpose (fwd_transpose_block), replayed with ldmatrix.x4.trans and stmatrix.x4
// as the PTX ISA defines them (lane 8 m + r gives matrix m's row r; ldmatrix.trans gives lane t
// of matrix m the 16-bit words (row 2 (t % 4) + h, column t / 4), h = 0, 1; stmatrix takes from
// lane 4 r + i the word at bytes 4 i of matrix m's row r): each lane's addresses as the kernel
// forms them (Fp8TransposeMap::at) equal the layouts' offsets, a stage moves every offset by
// kStageBytes (the kernel adds it to the stage's base), every Vt byte is written once with V(key,
// d) at its slot, and the worst bank conflict of one matrix (8 rows of 16 bytes; 4-byte banks) is
// returned in `conflict`.
template <class Tr>
int check_transpose(int& conflict) {
  using Map = fa3::Fp8TransposeMap<Tr>;
  constexpr int kBytes = TransposeImages<Tr>::kBytes;
  auto const sV = typename Tr::SmemLayoutK{};    // (n, d, stages)
  auto const sVt = typename Tr::SmemLayoutVt{};  // (d, n, stages)
  int bad = 0;
  for (int s = 0; s < Tr::kStages; ++s)
    for (int key = 0; key < Tr::kBlockN; ++key)
      for (int d = 0; d < Tr::kHeadDim; ++d)
        bad += int(sV(key, d, s)) != int(sV(key, d, 0)) + s * Map::kStageBytes ||
               int(sVt(d, key, s)) != int(sVt(d, key, 0)) + s * Map::kStageBytes;
  conflict = 0;
  TransposeImages<Tr> img;
  auto worst_of = [](uint32_t const* rows) {  // one matrix: 8 rows of 16 bytes
    std::map<int, std::set<int>> banks;
    for (int r = 0; r < 8; ++r)
      for (int k = 0; k < 4; ++k) banks[(rows[r] / 4 + k) % 32].insert(rows[r] / 4 + k);
    int worst = 0;
    for (auto const& b : banks) worst = std::max(worst, int(b.second.size()));
    return worst;
  };
  for (int w = 0; w < Map::kWarps; ++w) {
    for (int j = 0; j < Map::kTilesPerWarp; ++j) {
      uint32_t ld[32], st[32], r[32][4], words[32][4];
      for (int lane = 0; lane < 32; ++lane) {
        ld[lane] = Map::template at<false>(Map::ld_offset(lane, w, 0), j);
        st[lane] = Map::template at<true>(Map::st_offset(lane, w, 0), j);
        bad += ld[lane] != Map::ld_offset(lane, w, j) || st[lane] != Map::st_offset(lane, w, j);
        bad += ld[lane] % 16 != 0 || st[lane] % 16 != 0 || ld[lane] + 16 > kBytes || st[lane] + 16 > kBytes;
      }
      if (bad) return bad;
      for (int m = 0; m < 4; ++m) conflict = std::max({conflict, worst_of(ld + 8 * m), worst_of(st + 8 * m)});
      for (int t = 0; t < 32; ++t)
        for (int m = 0; m < 4; ++m) {
          uint16_t lo, hi;
          std::memcpy(&lo, &img.smem_v[ld[8 * m + 2 * (t % 4)] + 2 * (t / 4)], 2);
          std::memcpy(&hi, &img.smem_v[ld[8 * m + 2 * (t % 4) + 1] + 2 * (t / 4)], 2);
          r[t][m] = uint32_t(lo) | uint32_t(hi) << 16;
        }
      for (int t = 0; t < 32; ++t) fa3::ldsm_tile_to_vt_words(r[t], words[t]);
      for (int m = 0; m < 4; ++m)
        for (int row = 0; row < 8; ++row)
          for (int i = 0; i < 4; ++i) img.store(st[8 * m + row] + 4 * i, words[4 * row + i][m]);
    }
  }
  return bad + img.mismatches();
}

template <class Tr>
int check(const char* name) {
  int const a = check_operand<Tr>();
  int conflict = 0;
  int const b = check_transpose<Tr>(conflict);
  std::printf("%s (d %d, kBlockN %d): operand %d, transpose %d mismatches, bank conflicts %d-way\n", name,
              Tr::kHeadDim, Tr::kBlockN, a, b, conflict);
  return a + b + (conflict > 2);
}

int main() {
  int bad = 0;
  std::vector<int> slots(16, 0);
  for (int k = 0; k < 16; ++k) slots[fa3::fp8_key_slot(k)]++;
  for (int s : slots) bad += s != 1;
  using fa3::Fp8;
  bad += check<fa3::FwdTileTable<Fp8, 64>::full>("hd64 full");
  bad += check<fa3::FwdTileTable<Fp8, 64>::banded>("hd64 banded");
  bad += check<fa3::FwdTileTable<Fp8, 128>::full>("hd128 full");
  bad += check<fa3::FwdTileTable<Fp8, 128>::banded>("hd128 banded");
  bad += check<fa3::FwdTileTable<Fp8, 256>::full>("hd256 full");
  bad += check<fa3::FwdTileTable<Fp8, 256>::banded>("hd256 banded");
  std::printf(bad ? "FAILED\n" : "OK\n");
  return bad ? 1 : 0;
}
