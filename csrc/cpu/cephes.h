// Float exp and log for the C++ CPU kernels, by the Cephes expf / logf polynomials
// (exp_nonpos and log_pos for tree_attention and distill_loss through fast_math.h;
// exp_poly and log_pos for rejection_sample). Loops over them vectorise: log_pos has no
// float comparison, and a file that wants exp_nonpos's select if-converted compiles with
// no-trapping-math (see distill_loss.cpp).
#pragma once
#include <cstdint>
#include <cstring>

// Hot helpers are force-inlined so that they are compiled for the ISA of the entry point
// they end up in (the kernels compile an AVX2 entry point with a target attribute and a
// portable one, and choose at run time).
#define OSD_INLINE __attribute__((always_inline)) inline

namespace osd {

// Cephes expf polynomial: e^r = 1 + r + r^2 P(r) for |r| <= ln2 / 2; returns P(r).
OSD_INLINE float exp_poly(float r) {
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  return p * r + 5.0000001201e-1f;
}

// e^x for x <= 0, branch-free so loops over it vectorise; x < -87 (and -inf) gives 0.
// Cephes expf: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial, times 2^n.
// Relative error about 2e-7.
OSD_INLINE float exp_nonpos(float x) {
  const float xc = x < -87.f ? -87.f : x;
  const float n = __builtin_floorf(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = exp_poly(r);
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.f ? 0.f : p * scale;
}

// Natural log for x > 0, without float comparisons (vectorisable under trapping math).
// Cephes logf: x = 2^e m with m in [sqrt(1/2), sqrt(2)), log m by a degree-9 polynomial in
// m - 1. Within 2 ulp (relative error about 2e-7). x = 0 gives a large negative number,
// not -inf: callers handle 0 themselves.
OSD_INLINE float log_pos(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const int32_t mant = bits & 0x007fffff;
  const int32_t mbits = mant | 0x3f000000;  // m in [0.5, 1)
  float m;
  std::memcpy(&m, &mbits, sizeof(m));
  // 1 when m < sqrt(1/2), from the sign of an integer difference (a comparison would stop
  // the compiler from vectorising the loop)
  const float small = static_cast<float>(-((mant - 0x3504f3) >> 31));
  const float e = static_cast<float>(((bits >> 23) & 0xff) - 126) - small;
  const float t = (m - 1.f) + m * small;  // 2m - 1 below sqrt(1/2), else m - 1
  const float z = t * t;
  float y = 7.0376836292e-2f;
  y = y * t - 1.1514610310e-1f;
  y = y * t + 1.1676998740e-1f;
  y = y * t - 1.2420140846e-1f;
  y = y * t + 1.4249322787e-1f;
  y = y * t - 1.6668057665e-1f;
  y = y * t + 2.0000714765e-1f;
  y = y * t - 2.4999993993e-1f;
  y = y * t + 3.3333331174e-1f;
  y = y * t * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  return (t + y) + 0.693359375f * e;
}

}  // namespace osd
