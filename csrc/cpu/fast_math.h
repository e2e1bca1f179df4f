// Small math helpers for the C++ CPU kernels (tree_attention, distill_loss). A file that
// wants loops over them vectorised compiles with no-trapping-math (see distill_loss.cpp),
// so that GCC may if-convert their selects.
#pragma once
#include <cstdint>
#include <cstring>

// Hot helpers are force-inlined so that they are compiled for the ISA of the entry point
// they end up in (the kernels compile an AVX2 entry point with a target attribute and a
// portable one, and choose at run time).
#define OSD_INLINE __attribute__((always_inline)) inline

#if defined(__x86_64__)
#define OSD_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace osd {

// e^x for x <= 0, branch-free so loops over it vectorise; x < -87 (and -inf) gives 0.
// Cephes expf: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial, times 2^n.
// Relative error about 2e-7.
OSD_INLINE float exp_nonpos(float x) {
  const float xc = x < -87.f ? -87.f : x;
  const float n = __builtin_floorf(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.f ? 0.f : p * scale;
}

// Natural log for x > 0, branch-free (vectorisable). Cephes logf: x = 2^e m with
// m in [sqrt(1/2), sqrt(2)), log m by a degree-9 polynomial in m - 1. Relative error
// about 2e-7. x = 0 gives a large negative number, not -inf: callers handle 0 themselves.
OSD_INLINE float log_pos(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  int32_t e = ((bits >> 23) & 0xff) - 126;
  bits = (bits & 0x007fffff) | 0x3f000000;  // m in [0.5, 1)
  float m;
  std::memcpy(&m, &bits, sizeof(m));
  const bool small = m < 0.707106781186547524f;
  e -= small ? 1 : 0;
  m = small ? m + m - 1.f : m - 1.f;
  const float fe = static_cast<float>(e);
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y += -2.12194440e-4f * fe;
  y += -0.5f * z;
  return m + y + 0.693359375f * fe;
}

// bfloat16 <-> float by bit manipulation (round to nearest even; NaN stays NaN), inlined
// where c10's out-of-line helpers would not be.
OSD_INLINE float bf16_bits_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

OSD_INLINE uint16_t float_to_bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(nan ? 0x7fc0u : rounded);
}

}  // namespace osd
