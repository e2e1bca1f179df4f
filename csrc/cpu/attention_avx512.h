// tree_attention's AVX-512 block routines (head dims that are a multiple of 16, one zmm per
// 16 dims), in two layouts of a task's query rows:
//  - one row at a time (decode: a few rows per KV head): a row's scores are dot products
//    of eight keys at a time, reduced across lanes;
//  - rows in lanes (verify blocks and prefill, at least kLaneRows rows per KV head): the
//    task's queries, transposed once to qt[D][W] (W = 16 or 32 lanes, one per row), score
//    each key by broadcasting its elements, so the scores st[j][lanes], the online softmax
//    and its running max and sum are vertical: no reduction across lanes. P.V then
//    broadcasts each row's probabilities against the value rows, four rows at a time.
// Either way a row's result is computed by the same instructions whatever the block's key
// count and whichever rows share its task, so it does not depend on them.
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu/fast_math.h"

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_* values, which its
// (maybe-)uninitialized warnings report.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace osd {
namespace attention_avx512 {

// One row at a time. Whatever the block's key count n, a key's score is
// always one of eight lanes of a group (a short group repeats its last key), and the
// tails of exp_sum and P.V run masked, the invisible keys adding exact zeros.

// s[i] = the sum of a[i]'s 16 lanes, for i < 8: fold to 8 lanes, then the hadd tree.
OSD_AVX512 inline void sums8_avx512(const __m512* a, float* s) {
  __m256 h[8];
  for (int i = 0; i < 8; ++i) {
    h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm512_extractf32x8_ps(a[i], 1));
  }
  for (int g = 0; g < 8; g += 4) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(h[g], h[g + 1]),
                                    _mm256_hadd_ps(h[g + 2], h[g + 3]));
    _mm_storeu_ps(s + g, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  }
}

// 16 elements of a key or value row as float32: a float32 row loaded, a float16 row
// (IEEE half bits as uint16_t) widened, which is exact, so a half cache gives what a
// float32 cache holding the same rounded values gives.
OSD_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
OSD_AVX512 inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// s[j] = q . k[j] for j < n (dim % 16 == 0): eight keys at a time, eight FMA chains.
// KT: the cache's element type (float, or uint16_t for float16).
template <typename KT>
OSD_AVX512 inline void scores_avx512(const float* q, const KT* const* k, int64_t n,
                                     int64_t dim, float* s) {
  for (int64_t j = 0; j < n; j += 8) {
    const KT* kj[8];
    for (int i = 0; i < 8; ++i) kj[i] = k[std::min<int64_t>(j + i, n - 1)];
    __m512 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 x = _mm512_loadu_ps(q + d);
      for (int i = 0; i < 8; ++i) a[i] = _mm512_fmadd_ps(x, load16(kj[i] + d), a[i]);
    }
    float out[8];
    sums8_avx512(a, out);
    for (int64_t i = 0; i < std::min<int64_t>(8, n - j); ++i) s[j + i] = out[i];
  }
}

// exp_nonpos_avx2 in 16 lanes.
OSD_AVX512 inline __m512 exp_nonpos_avx512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  const __m512 xc = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), p, _mm512_castsi512_ps(bits));
}

// Lanes j < n of a 16-key group starting at 0.
OSD_AVX512 inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}

// max(mx, s[0, n)).
OSD_AVX512 inline float max_avx512(const float* s, int64_t n, float mx) {
  __m512 m = _mm512_set1_ps(mx);
  for (int64_t j = 0; j < n; j += 16) {
    m = _mm512_mask_max_ps(m, first_lanes(n - j), m, _mm512_maskz_loadu_ps(first_lanes(n - j),
                                                                           s + j));
  }
  return _mm512_reduce_max_ps(m);
}

// s[j] = e^(s[j] - mx) for j < n (every s[j] <= mx); returns their sum.
OSD_AVX512 inline float exp_sum_avx512(float* s, int64_t n, float mx) {
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 live = first_lanes(n - j);
    const __m512 e = _mm512_maskz_mov_ps(
        live, exp_nonpos_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), m)));
    _mm512_mask_storeu_ps(s + j, live, e);
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}

// acc[0, dim) += sum_j p[j] * v[j][0, dim) (dim % 16 == 0, at most 128): even and odd keys
// in two sets of accumulators (twice the FMA chains), added at the end.
OSD_AVX512 inline void accumulate_pv_avx512(const float* p, const float* const* v, int64_t n,
                                            int64_t dim, float* acc) {
  for (int64_t d0 = 0; d0 < dim; d0 += 64) {
    const int vecs = static_cast<int>(std::min<int64_t>(64, dim - d0) / 16);
    __m512 a[4], b[4];
    for (int i = 0; i < 4; ++i) a[i] = b[i] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      const __m512 p0 = _mm512_set1_ps(p[j]), p1 = _mm512_set1_ps(p[j + 1]);
      const float* v0 = v[j] + d0;
      const float* v1 = v[j + 1] + d0;
      for (int i = 0; i < vecs; ++i) {
        a[i] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * i), a[i]);
        b[i] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * i), b[i]);
      }
    }
    if (j < n) {
      const __m512 p0 = _mm512_set1_ps(p[j]);
      for (int i = 0; i < vecs; ++i) {
        a[i] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v[j] + d0 + 16 * i), a[i]);
      }
    }
    for (int i = 0; i < vecs; ++i) {
      float* out = acc + d0 + 16 * i;
      _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), _mm512_add_ps(a[i], b[i])));
    }
  }
}

// Rows in lanes. qt: [dim][W] a task's scaled queries, transposed (W = 16 * kVecs; lanes
// past the task's rows hold zeros and are never read back); st: [n][W].

// st[j][lanes] = qt . k[j] for j < n: eight keys at a time (a short group repeats its last
// key), each key element broadcast against kVecs vectors of rows; 8 * kVecs FMA chains.
template <int kVecs>
OSD_AVX512 inline void scores_lanes(const float* qt, const float* const* k, int64_t n,
                                    int64_t dim, float* st) {
  constexpr int64_t W = 16 * kVecs;
  constexpr int kKeys = 8;
  for (int64_t j = 0; j < n; j += kKeys) {
    const float* kj[kKeys];
    for (int i = 0; i < kKeys; ++i) kj[i] = k[std::min<int64_t>(j + i, n - 1)];
    __m512 a[kVecs][kKeys];
    for (int v = 0; v < kVecs; ++v) {
      for (int i = 0; i < kKeys; ++i) a[v][i] = _mm512_setzero_ps();
    }
    for (int64_t d = 0; d < dim; ++d) {
      for (int v = 0; v < kVecs; ++v) {
        const __m512 q = _mm512_loadu_ps(qt + d * W + 16 * v);
        for (int i = 0; i < kKeys; ++i) {
          a[v][i] = _mm512_fmadd_ps(q, _mm512_set1_ps(kj[i][d]), a[v][i]);
        }
      }
    }
    for (int64_t i = 0; i < std::min<int64_t>(kKeys, n - j); ++i) {
      for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(st + (j + i) * W + 16 * v, a[v][i]);
    }
  }
}

// Online-softmax update of every lane from its scores st[0, n)[lane]: m' = max(m, max_j
// s_j), st[j] = e^(s_j - m'), l' = l * corr + sum_j st[j], corr = e^(m - m'). A lane that
// has seen no key yet (m' = -inf) keeps zeros: p = 0, corr = 0, l = 0.
template <int kVecs>
OSD_AVX512 inline void softmax_lanes(float* st, int64_t n, float* m, float* l, float* corr) {
  constexpr int64_t W = 16 * kVecs;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int v = 0; v < kVecs; ++v) {
    float* s = st + 16 * v;
    const __m512 m0 = _mm512_loadu_ps(m + 16 * v);
    __m512 mx = m0;
    for (int64_t j = 0; j < n; ++j) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j * W));
    const __mmask16 live = _mm512_cmp_ps_mask(mx, neg_inf, _CMP_NEQ_OQ);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m512 p = _mm512_maskz_mov_ps(
          live, exp_nonpos_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + j * W), mx)));
      _mm512_storeu_ps(s + j * W, p);
      sum = _mm512_add_ps(sum, p);
    }
    const __m512 c = _mm512_maskz_mov_ps(live, exp_nonpos_avx512(_mm512_sub_ps(m0, mx)));
    _mm512_storeu_ps(l + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(l + 16 * v), c, sum));
    _mm512_storeu_ps(m + 16 * v, mx);
    _mm512_storeu_ps(corr + 16 * v, c);
  }
}

// acc[r][d0, d0 + 16 kCols) = acc[r] * corr[r] + sum_j st[j][r] v[j] for rows r0 .. r0 +
// kRows: each value vector loaded once for kRows rows.
template <int kRows, int kCols>
OSD_AVX512 inline void pv_lanes_block(const float* st, int64_t W, const float* const* v,
                                      int64_t n, int64_t d0, int64_t dim, const float* corr,
                                      int64_t r0, float* acc) {
  __m512 c[kRows][kCols];
  for (int i = 0; i < kRows; ++i) {
    const __m512 ci = _mm512_set1_ps(corr[r0 + i]);
    for (int u = 0; u < kCols; ++u) {
      c[i][u] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + i) * dim + d0 + 16 * u), ci);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    __m512 x[kCols];
    for (int u = 0; u < kCols; ++u) x[u] = _mm512_loadu_ps(v[j] + d0 + 16 * u);
    const float* p = st + j * W + r0;
    for (int i = 0; i < kRows; ++i) {
      const __m512 pi = _mm512_set1_ps(p[i]);
      for (int u = 0; u < kCols; ++u) c[i][u] = _mm512_fmadd_ps(pi, x[u], c[i][u]);
    }
  }
  for (int i = 0; i < kRows; ++i) {
    for (int u = 0; u < kCols; ++u) {
      _mm512_storeu_ps(acc + (r0 + i) * dim + d0 + 16 * u, c[i][u]);
    }
  }
}

template <int kRows>
OSD_AVX512 inline void pv_lanes_rows(const float* st, int64_t W, const float* const* v,
                                     int64_t n, int64_t d0, int64_t dim, const float* corr,
                                     int64_t r0, float* acc) {
  switch ((std::min<int64_t>(64, dim - d0)) / 16) {
    case 4: pv_lanes_block<kRows, 4>(st, W, v, n, d0, dim, corr, r0, acc); break;
    case 3: pv_lanes_block<kRows, 3>(st, W, v, n, d0, dim, corr, r0, acc); break;
    case 2: pv_lanes_block<kRows, 2>(st, W, v, n, d0, dim, corr, r0, acc); break;
    default: pv_lanes_block<kRows, 1>(st, W, v, n, d0, dim, corr, r0, acc); break;
  }
}

// acc[r] = acc[r] * corr[r] + sum_j st[j][r] v[j] for the rows r < R (dim % 16 == 0).
OSD_AVX512 inline void pv_lanes(const float* st, int64_t W, const float* const* v, int64_t n,
                                int64_t R, int64_t dim, const float* corr, float* acc) {
  for (int64_t d0 = 0; d0 < dim; d0 += 64) {
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) pv_lanes_rows<4>(st, W, v, n, d0, dim, corr, r, acc);
    switch (R - r) {
      case 3: pv_lanes_rows<3>(st, W, v, n, d0, dim, corr, r, acc); break;
      case 2: pv_lanes_rows<2>(st, W, v, n, d0, dim, corr, r, acc); break;
      case 1: pv_lanes_rows<1>(st, W, v, n, d0, dim, corr, r, acc); break;
      default: break;
    }
  }
}

}  // namespace attention_avx512
}  // namespace osd

#pragma GCC diagnostic pop
#endif
