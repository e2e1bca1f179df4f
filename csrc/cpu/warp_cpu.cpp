// Per-row helpers shared by the C++ CPU sampling kernels; see warp_cpu.h.
#include "cpu/warp_cpu.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <limits>
#include <vector>

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

int64_t row_argmax(const float* x, int64_t n) {
  const float m = row_max(x, n);
  for (int64_t v = 0; v < n; ++v) {
    if (x[v] == m) return v;
  }
  return 0;
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
