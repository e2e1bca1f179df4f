// Per-row helpers shared by the C++ CPU sampling kernels; see warp_cpu.h.
#include "cpu/warp_cpu.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/fast_math.h"

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_* values, which its
// (maybe-)uninitialized warnings report.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace osd {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kLanes = 16;

template <typename T>
void load_row(const T* src, int64_t stride, int64_t n, float temperature, float* dst) {
  if (stride == 1) {
    for (int64_t v = 0; v < n; ++v) dst[v] = static_cast<float>(src[v]);
  } else {
    for (int64_t v = 0; v < n; ++v) dst[v] = static_cast<float>(src[v * stride]);
  }
  if (temperature != 1.0f) {
    for (int64_t v = 0; v < n; ++v) dst[v] = dst[v] / temperature;
  }
}

}  // namespace

void load_row_any(const void* base, DType dtype, int64_t offset, int64_t stride, int64_t n,
                  float temperature, float* dst) {
  switch (dtype) {
    case DType::kFloat16:
      load_row(static_cast<const c10::Half*>(base) + offset, stride, n, temperature, dst);
      break;
    case DType::kBFloat16:
      load_row(static_cast<const c10::BFloat16*>(base) + offset, stride, n, temperature, dst);
      break;
    default:
      load_row(static_cast<const float*>(base) + offset, stride, n, temperature, dst);
  }
}

OSD_VECTOR_CLONES float row_max(const float* x, int64_t n) {
  float acc[kLanes];
  for (int l = 0; l < kLanes; ++l) acc[l] = kNegInf;
  int64_t v = 0;
  for (; v + kLanes <= n; v += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] = std::max(acc[l], x[v + l]);
  }
  float m = kNegInf;
  for (int l = 0; l < kLanes; ++l) m = std::max(m, acc[l]);
  for (; v < n; ++v) m = std::max(m, x[v]);
  return m;
}

OSD_VECTOR_CLONES float row_sum(const float* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t v = 0;
  for (; v + kLanes <= n; v += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += x[v + l];
  }
  float total = 0.0f;
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  for (; v < n; ++v) total += x[v];
  return total;
}

namespace {

// The index of x[0, n)'s first -inf, or 0: the answer of a row whose largest non-NaN
// value is -inf (or that holds only NaNs).
int64_t first_neg_inf(const float* x, int64_t n) {
  for (int64_t v = 0; v < n; ++v) {
    if (x[v] == kNegInf) return v;
  }
  return 0;
}

int64_t argmax_row_portable(const float* x, int64_t n, bool* nonfinite) {
  float best = kNegInf;
  int64_t at = -1;
  float flag = 0.0f;
  for (int64_t v = 0; v < n; ++v) {
    flag += x[v] * 0.0f;
    if (x[v] > best) {
      best = x[v];
      at = v;
    }
  }
  *nonfinite = std::isnan(flag);
  return at >= 0 ? at : first_neg_inf(x, n);
}

#if defined(__x86_64__)
// Each lane keeps its largest value and that value's first index (replaced only by a
// strictly larger value); the answer is the lowest index among the lanes holding the
// row's maximum. Indices are int32 lanes (n < 2^31).
OSD_AVX512 int64_t argmax_row_avx512(const float* x, int64_t n, bool* nonfinite) {
  __m512 best = _mm512_set1_ps(kNegInf);
  __m512i at = _mm512_set1_epi32(-1);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  const __m512 zero = _mm512_setzero_ps();
  __m512 flag = zero;
  for (int64_t v = 0; v < n; v += 16) {
    const __mmask16 live = n - v >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - v)) - 1);
    const __m512 xv = _mm512_maskz_loadu_ps(live, x + v);  // dead lanes: 0, never compared
    flag = _mm512_fmadd_ps(xv, zero, flag);
    const __mmask16 up = _mm512_mask_cmp_ps_mask(live, xv, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, up, xv);
    at = _mm512_mask_mov_epi32(at, up, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  *nonfinite = _mm512_cmp_ps_mask(flag, flag, _CMP_UNORD_Q) != 0;  // a NaN lane
  const float m = _mm512_reduce_max_ps(best);
  if (!(m > kNegInf)) return first_neg_inf(x, n);
  const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
  const __m512i cand = _mm512_mask_mov_epi32(_mm512_set1_epi32(INT32_MAX), top, at);
  return _mm512_reduce_min_epi32(cand);
}
#endif

}  // namespace

int64_t row_argmax_nonfinite(const float* x, int64_t n, bool* nonfinite) {
#if defined(__x86_64__)
  if (n <= INT32_MAX && use_avx512()) return argmax_row_avx512(x, n, nonfinite);
#endif
  return argmax_row_portable(x, n, nonfinite);
}

int64_t row_argmax(const float* x, int64_t n) {
  bool unused;
  return row_argmax_nonfinite(x, n, &unused);
}

void top_k_scale(float* l, int64_t n, int64_t k, DType dtype, float temperature) {
  const uint32_t kth = radix_select_serial(
      n, radix_levels(dtype), static_cast<uint64_t>(k),
      [l](int64_t v, uint32_t& key, uint64_t& weight) {
        key = radix_key(l[v]);
        weight = 1;
      });
  const uint32_t floor = top_k_logit_floor(kth, temperature);
  for (int64_t v = 0; v < n; ++v) l[v] = radix_key(l[v]) >= floor ? l[v] / temperature : kNegInf;
}

void load_scaled_row(const void* base, DType dtype, int64_t offset, int64_t stride, int64_t n,
                     int64_t top_k, float temperature, float* dst) {
  if (top_k > 0) {
    load_row_any(base, dtype, offset, stride, n, 1.0f, dst);
    top_k_scale(dst, n, top_k, dtype, temperature);
  } else {
    load_row_any(base, dtype, offset, stride, n, temperature, dst);
  }
}

uint32_t top_p_key(const float* e, int64_t n, float inv_z, float top_p) {
  const uint64_t target = radix_mass_target(top_p);
  // One pass keeps the keys at or above that of kTopPFloor. Where their mass reaches the
  // target the selection lies among them: every key above the selected one is kept, and
  // the histograms differ only below it, which the selection never reads. So the
  // selection over them is the full row's (a vocabulary of 262,144 leaves at most 1/64
  // of the mass below the floor).
  constexpr float kTopPFloor = 0x1p-24f;
  const uint32_t floor_key = radix_key(kTopPFloor);
  thread_local std::vector<uint32_t> keys;
  thread_local std::vector<uint64_t> masses;
  keys.clear();
  masses.clear();
  uint64_t kept = 0;
  for (int64_t v = 0; v < n; ++v) {
    const float p = e[v] * inv_z;
    const uint32_t key = radix_key(p);
    if (key >= floor_key) {
      keys.push_back(key);
      masses.push_back(radix_mass(p));
      kept += masses.back();
    }
  }
  if (kept >= target) {
    return radix_select_serial(static_cast<int64_t>(keys.size()), 4, target,
                               [](int64_t i, uint32_t& key, uint64_t& weight) {
                                 key = keys[i];
                                 weight = masses[i];
                               });
  }
  return radix_select_serial(n, 4, target, [e, inv_z](int64_t v, uint32_t& key, uint64_t& weight) {
    const float p = e[v] * inv_z;
    key = radix_key(p);
    weight = radix_mass(p);
  });
}

}  // namespace osd
