// Unit test (host, no GPU) of exp2_fma (common/softmax.cuh), the FMA-pipe 2^x of the
// FA3_FP8_HD64_EXP2_EMU experiment, over the FP8 softmax's exponents (x <= 8 after the max offset):
//   * relative error at most 1.1e-4 against exp2 in double wherever 2^x is a normal float, and
//     exactly 2^n at integers n (the max element's P = 2^8 is exact, as with MUFU);
//   * exactly 0 at and below -127, and at -inf (a masked score), so masked keys add nothing to
//     the row sums and a row without keys keeps l = 0.
#include <cmath>
#include <cstdio>

#include "common/softmax.cuh"

int main() {
  int bad = 0;
  double worst = 0;
  for (int i = 0; i <= 2000000; ++i) {
    float const x = -126.f + 134.f * float(i) / 2000000.f;  // [-126, 8]
    double const exact = std::exp2(double(x));
    double const rel = std::fabs(double(fa3::exp2_fma(x)) / exact - 1.0);
    worst = rel > worst ? rel : worst;
  }
  bad += worst > 1.1e-4;
  for (int n = -126; n <= 8; ++n) bad += fa3::exp2_fma(float(n)) != std::ldexp(1.f, n);
  for (float x : {-INFINITY, -1e30f, -1000.f, -127.f}) bad += fa3::exp2_fma(x) != 0.f;
  for (float x : {-126.9f, -126.6f}) bad += !(fa3::exp2_fma(x) >= 0.f && fa3::exp2_fma(x) <= std::ldexp(1.f, -126));
  std::printf("exp2_fma: worst relative error %.3g on [-126, 8]; %d failures\n%s\n", worst, bad, bad ? "FAILED" : "OK");
  return bad ? 1 : 0;
}
