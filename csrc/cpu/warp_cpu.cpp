// Per-row helpers shared by the C++ CPU sampling kernels; see warp_cpu.h.
#include "cpu/warp_cpu.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <functional>
#include <limits>

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

// The k-th largest value of s (1 <= k < n). Small k: a size-k min-heap, where almost every
// element is rejected by one comparison with the heap's top; large k: nth_element on a copy.
float kth_largest(const float* s, int64_t n, int64_t k, float* tmp) {
  if (k > 1024) {
    std::copy(s, s + n, tmp);
    std::nth_element(tmp, tmp + (k - 1), tmp + n, std::greater<float>());
    return tmp[k - 1];
  }
  float* heap = tmp;
  std::copy(s, s + k, heap);
  std::make_heap(heap, heap + k, std::greater<float>());
  for (int64_t v = k; v < n; ++v) {
    if (s[v] > heap[0]) {
      std::pop_heap(heap, heap + k, std::greater<float>());
      heap[k - 1] = s[v];
      std::push_heap(heap, heap + k, std::greater<float>());
    }
  }
  return heap[0];
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

int64_t row_argmax(const float* x, int64_t n) {
  const float m = row_max(x, n);
  for (int64_t v = 0; v < n; ++v) {
    if (x[v] == m) return v;
  }
  return 0;
}

void keep_top_k(float* s, int64_t n, int64_t k, float* tmp) {
  const float kth = kth_largest(s, n, k, tmp);
  for (int64_t v = 0; v < n; ++v) s[v] = s[v] < kth ? kNegInf : s[v];
}

float top_p_threshold(const float* e, int64_t n, float inv_z, float top_p, float* tmp) {
  int64_t m = 0;
  for (int64_t v = 0; v < n; ++v) {
    if (e[v] > 0.0f) tmp[m++] = e[v] * inv_z;
  }
  const double target = top_p;
  double above = 0.0;  // mass of every value greater than those left in [lo, lo + m)
  float best = 0.0f;
  float* lo = tmp;
  while (m > 0) {
    const float a = lo[0], b = lo[m / 2], c = lo[m - 1];
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));
    // [0, g): > pivot, [g, g + q): == pivot, [g + q, m): < pivot
    float* mid = std::partition(lo, lo + m, [pivot](float x) { return x > pivot; });
    float* low = std::partition(mid, lo + m, [pivot](float x) { return x == pivot; });
    double mass_g = 0.0, mass_e = 0.0;
    for (float* p = lo; p < mid; ++p) mass_g += *p;
    for (float* p = mid; p < low; ++p) mass_e += *p;
    if (above + mass_g >= target) {
      m = mid - lo;  // the pivot is dropped: the threshold lies among the larger values
      continue;
    }
    best = pivot;  // the pivot is kept; try the smaller values
    above += mass_g + mass_e;
    if (above >= target) break;
    m = (lo + m) - low;
    lo = low;
  }
  return best;
}

}  // namespace osd
