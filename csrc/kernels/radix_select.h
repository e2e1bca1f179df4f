// Radix selection of the top-k and top-p thresholds (torch-free, host and device).
//
// Both thresholds are order statistics of a row of floats. They are found digit by digit
// on the float's order-preserving 32-bit key (radix_key), most significant 8-bit digit
// first. At each level a 256-bin histogram h over the keys that share the digits chosen so
// far picks the one digit d with
//     above + G(d) < target <= above + G(d) + h[d],     G(d) = sum of h[d'] over d' > d,
// where `above` is what the keys above the current range hold; `above` grows by G(d) and
// the next level looks inside digit d. After the last level the chosen digits are the
// threshold key:
//   top-k: h counts keys, target = k: the k-th largest key (ties counted);
//   top-p: h sums fixed-point masses, target = top_p in fixed point: the key t at which
//          the mass of the row taken in descending order first reaches top_p, i.e. the
//          smallest key t with mass(key > t) < top_p; when the whole row holds less than
//          top_p no digit qualifies at the first level and the threshold is 0 (keep all).
// Masses are integers (radix_mass: floor(p * 2^kMassFracBits)), so every sum is exact and
// independent of the order it is taken in: the CPU kernels (histograms built serially,
// radix_select_serial) and the CUDA kernels (shared-memory atomics and a block-wide scan,
// kernels/block_reduce.cuh) pick the same digits. Fixed point moves a row's mass by less
// than V * 2^-48, far below float32 rounding of the mass.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/common.h"

namespace osd {

constexpr int kRadixBits = 8;
constexpr int kRadixBins = 1 << kRadixBits;
constexpr int kMassFracBits = 48;

// Order-preserving key: a < b (floats, no NaN) iff radix_key(a) < radix_key(b); -0 and +0
// share the key of +0. Non-negative floats map to [0x80000000, 0xFF800000].
OSD_HD uint32_t radix_key(float f) {
  const float g = f + 0.0f;  // -0 -> +0
  uint32_t u;
  __builtin_memcpy(&u, &g, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

OSD_HD float radix_key_float(uint32_t k) {
  const uint32_t u = (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k;
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
}

// Significant key digits of values read from `dtype`: the key of a bfloat16 (float16)
// value carries 16 (19) significant high bits, the rest being 0 for positive and 1 for
// negative values, so selecting over a row of them needs 2 (3) levels instead of 4.
OSD_HD int radix_levels(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return 2;
    case DType::kFloat16:
      return 3;
    default:
      return 4;
  }
}

// floor(p * 2^kMassFracBits) for p in [0, 256), exactly (0 below 2^-48).
OSD_HD uint64_t radix_mass(float p) {
  uint32_t u;
  __builtin_memcpy(&u, &p, sizeof(u));
  const int exp = static_cast<int>(u >> 23);  // p >= 0: no sign bit
  if (exp == 0) return 0;                     // zero or subnormal
  const uint64_t m = (u & 0x7FFFFFu) | 0x800000u;
  const int shift = exp - 150 + kMassFracBits;  // p = m * 2^(exp - 150)
  if (shift >= 0) return m << shift;
  return shift > -32 ? m >> -shift : 0;
}

// ceil(top_p * 2^kMassFracBits) for top_p in (0, 1]: mass_fixed < target iff the exact
// fixed-point mass is < top_p.
OSD_HD uint64_t radix_mass_target(float top_p) {
  uint32_t u;
  __builtin_memcpy(&u, &top_p, sizeof(u));
  const int exp = static_cast<int>(u >> 23);
  if (exp == 0) return 1;  // subnormal top_p: any positive mass reaches it
  const uint64_t m = (u & 0x7FFFFFu) | 0x800000u;
  const int shift = exp - 150 + kMassFracBits;
  if (shift >= 0) return m << shift;
  if (shift <= -32) return 1;
  return (m + ((uint64_t{1} << -shift) - 1)) >> -shift;
}

// Selection in progress: the digits chosen so far (in place, lower bits 0), how many, and
// the count or mass of the keys above their range.
struct RadixState {
  uint32_t prefix;
  int level;
  uint64_t above;
};

OSD_HD RadixState radix_init() { return RadixState{0u, 0, 0}; }

// Whether `key` shares the chosen digits (every key does at level 0).
OSD_HD bool radix_in_range(uint32_t key, const RadixState& s) {
  return s.level == 0 || ((key ^ s.prefix) >> (32 - kRadixBits * s.level)) == 0;
}

// The digit of `key` at this level.
OSD_HD uint32_t radix_digit(uint32_t key, const RadixState& s) {
  return (key >> (32 - kRadixBits * (s.level + 1))) & (kRadixBins - 1);
}

// Whether the bin holding h, with `greater` in the bins of larger digits, is where the
// running sum reaches `target` (exactly one bin is, when the range holds the target).
OSD_HD bool radix_bin_reaches(uint64_t above, uint64_t greater, uint64_t h, uint64_t target) {
  return above + greater < target && target <= above + greater + h;
}

OSD_HD void radix_descend(RadixState& s, uint32_t digit, uint64_t greater) {
  s.prefix |= digit << (32 - kRadixBits * (s.level + 1));
  s.above += greater;
  ++s.level;
}

// The selected key once `levels` digits are chosen: the low bits below them are those of
// every key of the row (see radix_levels).
OSD_HD uint32_t radix_result(const RadixState& s, int levels) {
  if (levels * kRadixBits >= 32) return s.prefix;
  const uint32_t low = (1u << (32 - kRadixBits * levels)) - 1u;
  return (s.prefix & 0x80000000u) ? s.prefix : (s.prefix | low);
}

// The top-k set as a test on raw logits: the smallest logit key L with
// value(L) / t >= kth / t, where kth (= radix_key_float(kth_key)) is the k-th largest raw
// logit. Division by t > 0 is monotone, so kth / t is the k-th largest scaled logit and
// l / t >= kth / t iff radix_key(l) >= L; L <= kth_key can be lower than kth_key where
// the division rounds neighbours of kth onto kth / t. Bisection on keys, no pass over V.
OSD_HD uint32_t top_k_logit_floor(uint32_t kth_key, float t) {
  const float kth_scaled = radix_key_float(kth_key) / t;
  uint32_t lo = 0, hi = kth_key;
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (radix_key_float(mid) / t >= kth_scaled) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// Serial selection over items v < n: item(v, key, weight) sets the item's key and its
// weight (1 for counts, radix_mass(p) for masses). Returns the selected key (0 when the
// items hold less than target) and, through `above` when given, the weight of the keys
// above the selected one's range (for a selection over every significant digit: the keys
// greater than it). The first two levels read every item; the second keeps the (key,
// weight) of the items in range, and the levels after it read only those: the same
// histograms from two passes over the row instead of one per level.
template <typename Item>
inline uint32_t radix_select_serial(int64_t n, int levels, uint64_t target, Item item,
                                    uint64_t* above = nullptr) {
  RadixState s = radix_init();
  uint64_t hist[kRadixBins];
  thread_local std::vector<uint32_t> kept_keys;
  thread_local std::vector<uint64_t> kept_weights;
  kept_keys.clear();
  kept_weights.clear();
  while (s.level < levels) {
    for (int d = 0; d < kRadixBins; ++d) hist[d] = 0;
    if (s.level < 2) {
      const bool keep = s.level == 1 && levels > 2;
      for (int64_t v = 0; v < n; ++v) {
        uint32_t key;
        uint64_t weight;
        item(v, key, weight);
        if (!radix_in_range(key, s)) continue;
        hist[radix_digit(key, s)] += weight;
        if (keep) {
          kept_keys.push_back(key);
          kept_weights.push_back(weight);
        }
      }
    } else {
      for (std::size_t i = 0; i < kept_keys.size(); ++i) {
        if (radix_in_range(kept_keys[i], s)) hist[radix_digit(kept_keys[i], s)] += kept_weights[i];
      }
    }
    uint64_t greater = 0;
    int d = kRadixBins - 1;
    for (; d >= 0 && !radix_bin_reaches(s.above, greater, hist[d], target); --d) {
      greater += hist[d];
    }
    if (d < 0) return 0;
    radix_descend(s, static_cast<uint32_t>(d), greater);
  }
  if (above != nullptr) *above = s.above;
  return radix_result(s, levels);
}

}  // namespace osd
