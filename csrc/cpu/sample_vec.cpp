// Vectorised row loops of the C++ chain sampler; see cpu/sample_vec.h.
#include "cpu/sample_vec.h"

#include <bit>

#include "cpu/cephes.h"
#include "cpu/warp_cpu.h"
#include "kernels/philox.h"

namespace osd {
namespace {

// exp(x) in float for x <= 0 (the callers pass s - max), Cephes expf polynomial, within
// 1 ulp, written without float comparisons so the compiler vectorises the loops that
// call it. Below -104 (and for -inf) the result is exactly 0.
inline float fast_exp(float x) {
  // n = round(x / ln 2) by the 1.5 * 2^23 trick; its integer value sits in the low bits
  const float shifted = x * 1.44269504088896341f + 12582912.0f;
  const float n = shifted - 12582912.0f;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  const float y = exp_poly(r) * (r * r) + r + 1.0f;
  const int32_t ni = std::bit_cast<int32_t>(shifted) - 0x4B400000;
  const int32_t n1 = ni >> 1;
  const int32_t n2 = ni - n1;
  const float s1 = std::bit_cast<float>((n1 + 127) << 23);
  const float s2 = std::bit_cast<float>((n2 + 127) << 23);
  // zero below -104 (where the scale factors are no longer valid), by the sign of x + 104
  const int32_t keep = ~(std::bit_cast<int32_t>(x + 104.0f) >> 31);
  return std::bit_cast<float>(std::bit_cast<int32_t>(y * s1 * s2) & keep);
}

// 2^y for y <= 0, the same way: y = n + f with |f| <= 1/2, e^(f ln 2) by the polynomial,
// times 2^n in two factors. Below -150 (and for -inf) exactly 0.
inline float fast_exp2(float y) {
  const float shifted = y + 12582912.0f;
  const float n = shifted - 12582912.0f;
  const float r = (y - n) * 0.693147180559945309f;
  const float e = exp_poly(r) * (r * r) + r + 1.0f;
  const int32_t ni = std::bit_cast<int32_t>(shifted) - 0x4B400000;
  const int32_t n1 = ni >> 1;
  const int32_t n2 = ni - n1;
  const float s1 = std::bit_cast<float>((n1 + 127) << 23);
  const float s2 = std::bit_cast<float>((n2 + 127) << 23);
  const int32_t keep = ~(std::bit_cast<int32_t>(y + 150.0f) >> 31);
  return std::bit_cast<float>(std::bit_cast<int32_t>(e * s1 * s2) & keep);
}

}  // namespace

OSD_VECTOR_CLONES float exp_and_sum(const float* s, float max, int64_t n, float* e) {
  for (int64_t v = 0; v < n; ++v) e[v] = fast_exp(s[v] - max);
  return row_sum(e, n);
}

OSD_VECTOR_CLONES float exp2_and_sum(const float* l, float max, float c, int64_t n, float* e) {
  for (int64_t v = 0; v < n; ++v) e[v] = fast_exp2((l[v] - max) * c);
  return row_sum(e, n);
}

OSD_VECTOR_CLONES void scale_row(const float* x, float f, int64_t n, float* y) {
  for (int64_t v = 0; v < n; ++v) y[v] = x[v] * f;
}

// Non-positive differences are zeroed by their sign bit so the loop vectorises.
OSD_VECTOR_CLONES void residual_row(const float* p, float* d, int64_t n) {
  for (int64_t v = 0; v < n; ++v) {
    const int32_t diff = std::bit_cast<int32_t>(p[v] - d[v]);
    d[v] = std::bit_cast<float>(diff & ~(diff >> 31));
  }
}

// The rounds are spelled out on plain integers so the compiler vectorises across blocks.
OSD_VECTOR_CLONES
void philox_row(uint64_t seed, uint64_t offset, uint32_t stream, int64_t first,
                int64_t nblocks, float* u) {
  const uint32_t o0 = static_cast<uint32_t>(offset), o1 = static_cast<uint32_t>(offset >> 32);
  const uint32_t s0 = static_cast<uint32_t>(seed), s1 = static_cast<uint32_t>(seed >> 32);
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    uint32_t c0 = static_cast<uint32_t>(first + blk), c1 = stream, c2 = o0, c3 = o1;
    uint32_t k0 = s0, k1 = s1;
    for (int r = 0; r < 10; ++r) {
      const uint64_t pa = static_cast<uint64_t>(kPhiloxMulA) * c0;
      const uint64_t pb = static_cast<uint64_t>(kPhiloxMulB) * c2;
      c0 = static_cast<uint32_t>(pb >> 32) ^ c1 ^ k0;
      c1 = static_cast<uint32_t>(pb);
      c2 = static_cast<uint32_t>(pa >> 32) ^ c3 ^ k1;
      c3 = static_cast<uint32_t>(pa);
      k0 += kPhiloxWeylA;
      k1 += kPhiloxWeylB;
    }
    u[4 * blk + 0] = philox_to_uniform(c0);
    u[4 * blk + 1] = philox_to_uniform(c1);
    u[4 * blk + 2] = philox_to_uniform(c2);
    u[4 * blk + 3] = philox_to_uniform(c3);
  }
}

OSD_VECTOR_CLONES void race_keys(const float* r, float* u, int64_t n) {
  for (int64_t v = 0; v < n; ++v) u[v] = r[v] / -log_pos(u[v]);
}

int64_t race_sparse(const float* r, int64_t n, uint64_t seed, uint64_t offset, uint32_t stream) {
  int64_t live = 0;
  for (int64_t v = 0; v < n; ++v) live += r[v] > 0.0f;
  if (live * kSparseRaceShare > n) return -1;
  int64_t best = -1;
  float best_key = 0.0f;
  for (int64_t v = 0; v < n; ++v) {
    if (!(r[v] > 0.0f)) continue;
    const float u = philox_uniform(seed, offset, stream, static_cast<uint32_t>(v));
    const float key = r[v] / -log_pos(u);
    if (best < 0 || key > best_key) {
      best = v;
      best_key = key;
    }
  }
  return best;
}

}  // namespace osd
