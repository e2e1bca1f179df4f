// Small math helpers for the C++ CPU kernels (tree_attention, distill_loss): exp and log
// (cephes.h) and bfloat16 conversions. A file that wants loops over them vectorised
// compiles with no-trapping-math (see distill_loss.cpp), so that GCC may if-convert their
// selects.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu/cephes.h"

#if defined(__x86_64__)
#define OSD_AVX2 __attribute__((target("avx2,fma")))
#define OSD_AVX512 __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma")))
#endif

namespace osd {

// True when the AVX2 + FMA clones of the vector loops may run: the CPU has both and
// OSD_NO_AVX2 is unset (tests set it to cover the portable paths). Read per call, so a
// test can switch it.
inline bool use_avx2_fma() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has && std::getenv("OSD_NO_AVX2") == nullptr;
#else
  return false;
#endif
}

// True when the CPU has the AVX-512 subsets the kernels use (F, DQ, VL, BW).
inline bool cpu_has_avx512() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
  return has;
#else
  return false;
#endif
}

// True when AVX-512 clones may run as well: use_avx2_fma() holds, the CPU has AVX-512 and
// OSD_NO_AVX512 is unset (tests set it to cover the AVX2 paths).
inline bool use_avx512() {
  return cpu_has_avx512() && use_avx2_fma() && std::getenv("OSD_NO_AVX512") == nullptr;
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
