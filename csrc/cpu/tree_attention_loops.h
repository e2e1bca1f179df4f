// tree_attention's portable and AVX2 block routines: the scores of one query row against a
// block of keys, the block's max and exp-sum, and P.V into the row's accumulator. The
// AVX-512 ones are in attention_avx512.h; tree_attention.cpp chooses at run time.
//
// Private to tree_attention.cpp (its only includer): everything here has internal
// linkage, as the rest of that translation unit.
#pragma once
#include <algorithm>
#include <cstdint>

#include "cpu/fast_math.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace osd {
namespace {

// Dot product with sixteen independent partial sums, so it vectorises without reassociation.
OSD_INLINE float dot(const float* a, const float* b, int64_t n) {
  float part[16] = {};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    for (int u = 0; u < 16; ++u) part[u] += a[d + u] * b[d + u];
  }
  float s = 0.f;
  for (; d < n; ++d) s += a[d] * b[d];
  for (int u = 0; u < 16; ++u) s += part[u];
  return s;
}

// acc[0, dim) += sum_j p[j] * v[j][0, dim).
OSD_INLINE void accumulate_pv(const float* p, const float* const* v, int64_t n, int64_t dim,
                              float* acc) {
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
    const float* vj = v[j];
    for (int64_t d = 0; d < dim; ++d) acc[d] += pj * vj[d];
  }
}

#if defined(__x86_64__)
// AVX2 versions of scores / accumulate_pv; accumulators stay in registers.
// scores_avx2: four keys at a time, so each load of q feeds four independent FMA chains;
// the four 8-lane sums are reduced together with two rounds of hadd.
OSD_AVX2 inline void scores_avx2(const float* q, const float* const* k, int64_t n, int64_t dim,
                                 float* s) {
  const int64_t dv = dim - dim % 8;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
    for (int64_t d = 0; d < dv; d += 8) {
      const __m256 x = _mm256_loadu_ps(q + d);
      for (int i = 0; i < 4; ++i) a[i] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[j + i] + d), a[i]);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    _mm_storeu_ps(s + j, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    for (int i = 0; i < 4; ++i) {
      for (int64_t d = dv; d < dim; ++d) s[j + i] += q[d] * k[j + i][d];
    }
  }
  for (; j < n; ++j) s[j] = dot(q, k[j], dim);
}

template <int kVecs>
OSD_AVX2 inline void accumulate_pv_avx2_cols(const float* p, const float* const* v, int64_t n,
                                             int64_t d0, float* acc) {
  __m256 a[kVecs];
  for (int i = 0; i < kVecs; ++i) a[i] = _mm256_loadu_ps(acc + d0 + 8 * i);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = v[j] + d0;
    for (int i = 0; i < kVecs; ++i) a[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), a[i]);
  }
  for (int i = 0; i < kVecs; ++i) _mm256_storeu_ps(acc + d0 + 8 * i, a[i]);
}

// e^x for x <= 0 in 8 lanes, exp_nonpos's Cephes polynomial; x < -87 (and -inf) gives 0.
OSD_AVX2 inline __m256 exp_nonpos_avx2(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 xc = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

OSD_AVX2 inline float hmax8(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

OSD_AVX2 inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// max(mx, s[0, n)).
OSD_AVX2 inline float max_avx2(const float* s, int64_t n, float mx) {
  __m256 m = _mm256_set1_ps(mx);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
  mx = hmax8(m);
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  return mx;
}

// s[j] = e^(s[j] - mx) for j < n (every s[j] <= mx); returns their sum.
OSD_AVX2 inline float exp_sum_avx2(float* s, int64_t n, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpos_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum8(acc);
  for (; j < n; ++j) {
    s[j] = exp_nonpos(s[j] - mx);
    sum += s[j];
  }
  return sum;
}

OSD_AVX2 inline void accumulate_pv_avx2(const float* p, const float* const* v, int64_t n,
                                        int64_t dim, float* acc) {
  int64_t d = 0;
  for (; d + 64 <= dim; d += 64) accumulate_pv_avx2_cols<8>(p, v, n, d, acc);
  for (; d + 32 <= dim; d += 32) accumulate_pv_avx2_cols<4>(p, v, n, d, acc);
  for (; d + 8 <= dim; d += 8) accumulate_pv_avx2_cols<1>(p, v, n, d, acc);
  for (; d < dim; ++d) {
    float x = acc[d];
    for (int64_t j = 0; j < n; ++j) x += p[j] * v[j][d];
    acc[d] = x;
  }
}
#endif

}  // namespace
}  // namespace osd
