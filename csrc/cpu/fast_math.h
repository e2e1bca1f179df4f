// Small math helpers for the C++ CPU kernels (tree_attention, distill_loss).
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

}  // namespace osd
