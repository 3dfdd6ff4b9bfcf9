// exp2_by_fma (src/common/exp2.h), the sigmoid's exponential, on the host: the bits the GPU computes
// (fp32 adds and FMAs, correctly rounded on both).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "common/exp2.h"

namespace lynx {
namespace {

// Every 61st fp32 value of t in the unclamped range, both signs, and each integer and half-integer:
// within 2^-22 of 2^t (ex2.approx, which it replaces, is within about 2^-22.5).
TEST(Exp2, RelativeErrorBelow2ToTheMinus22) {
  double worst = 0.0;
  float at = 0.0f;
  const auto check = [&](float t) {
    const double want = std::exp2(double(t));
    const double err = std::fabs(double(exp2_by_fma(t)) - want) / want;
    if (err > worst) {
      worst = err;
      at = t;
    }
  };
  for (uint32_t u = 0; u < 0x7F800000u; u += 61) {
    const float t = bits_to_float(u);
    if (t > 127.0f) break;
    check(t);
    if (t <= 125.0f) check(-t);
  }
  for (int i = -250; i <= 254; ++i) check(0.5f * float(i));
  EXPECT_LT(worst, std::ldexp(1.0, -22)) << "at t = " << at;
}

// Past the range: the clamp's ends (normal numbers); a NaN gives the lower end; integers exactly powers
// of two up to the polynomial's value at 0.
TEST(Exp2, ClampsAndIntegers) {
  const float low = exp2_by_fma(-125.0f), high = exp2_by_fma(127.0f);
  EXPECT_EQ(float_to_bits(exp2_by_fma(-1000.0f)), float_to_bits(low));
  EXPECT_EQ(float_to_bits(exp2_by_fma(-std::numeric_limits<float>::infinity())), float_to_bits(low));
  EXPECT_EQ(float_to_bits(exp2_by_fma(std::numeric_limits<float>::quiet_NaN())), float_to_bits(low));
  EXPECT_EQ(float_to_bits(exp2_by_fma(1000.0f)), float_to_bits(high));
  EXPECT_EQ(float_to_bits(exp2_by_fma(std::numeric_limits<float>::infinity())), float_to_bits(high));
  EXPECT_TRUE(std::isnormal(low));
  EXPECT_TRUE(std::isfinite(high));
  const float one = exp2_by_fma(0.0f);
  EXPECT_NEAR(one, 1.0f, 2e-7f);
  for (int n = -125; n <= 127; ++n) {
    EXPECT_EQ(exp2_by_fma(float(n)), std::ldexp(one, n)) << "2^" << n;
  }
}

}  // namespace
}  // namespace lynx
