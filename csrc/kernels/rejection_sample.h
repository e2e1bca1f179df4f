// rejection_sample: fused chain speculative-sampling verification (torch-free).
//
// Per sequence b with n = num_draft[b] drafts x_0 .. x_{n-1} and target logits rows
// l_0 .. l_n (row i scores the prefix followed by i drafts):
//   s_v      = l_v / temperature                      (float32 division, as the reference)
//   top-k    : keep s_v >= the k-th largest s (ties kept)
//   p_v      = exp(s_v - max s) / Z over the kept set
//   top-p    : keep v iff (mass of tokens with p > p_v) < top_p, then renormalise
// Stochastic rows (temperature > 0), for i = 0 .. n-1:
//   accept x_i iff log u_i + log q_i(x_i) < log p_i(x_i)      (log 0 = -inf; q = 1 one-hot)
//   u_i = philox_uniform(seed, offset, stream(i, kPhiloxAccept), 0)
// At the first rejection j (or j = n, the bonus): emit argmax_v r_v / E_v over r_v > 0
// (lowest index on ties), E_v = -log philox_uniform(seed, offset, stream(j, kPhiloxSample), v),
// with r = max(0, p_j - q_j) (one-hot: p_j with x_j zeroed) after a rejection, or p_j for
// the bonus; a residual with no positive entry falls back to p_j. This exponential race
// selects v with probability r_v / sum(r) and needs no normalisation. Greedy rows: accept
// while x_i == argmax l_i (lowest index on ties), then emit that argmax.
//
// Thresholds without sorting, by the radix selection of kernels/radix_select.h (the same
// on the CPU and the GPU): top-k's is the k-th largest raw logit, whose scaled value is
// the k-th largest s (division by t > 0 is monotone), applied as a floor on raw logit keys
// (top_k_logit_floor); top-p's is the smallest probability key T with mass(p > T) < top_p,
// masses summed exactly in fixed point. Only the draft token's log-probability is formed
// for the accept test, so past the thresholds a row costs one pass for (max, sum exp) plus
// one race pass for the single resampled row.
#pragma once
#include <cmath>
#include <cstdint>

#include "kernels/common.h"
#include "kernels/philox.h"
#include "kernels/radix_select.h"

namespace osd {

struct RejectionSampleArgs {
  const void* logits;          // [B, K+1, V] target logits
  DType logits_dtype;
  int64_t logits_stride_b, logits_stride_k, logits_stride_v;
  const int64_t* draft_ids;    // [B, K]
  int64_t draft_ids_stride_b, draft_ids_stride_k;
  const void* draft_probs;     // [B, K, V] or nullptr (one-hot drafts)
  DType draft_probs_dtype;
  int64_t draft_probs_stride_b, draft_probs_stride_k, draft_probs_stride_v;
  const int32_t* num_draft;    // [B], clamped to [0, K]
  const float* temperature;    // [B], 0 = greedy
  const int32_t* top_k;        // [B], <= 0 or >= V = off
  const float* top_p;          // [B], >= 1 = off
  const int64_t* seed;         // [B]
  const int64_t* offset;       // [B]
  int64_t* out_tokens;         // [B, K+1] contiguous, -1 padded
  int32_t* num_accepted;       // [B]
  int64_t batch;
  int64_t num_draft_max;       // K
  int64_t vocab;               // V
  // CUDA split-vocabulary path (kernels/rejection_sample_cuda.h: split_layout); nullptr
  // elsewhere. counters must be zero when the kernels start.
  void* workspace;
  int32_t* counters;
};

// CPU kernel (parallel over the batch); split: whether sequences take the split-vocabulary
// path where it applies (kernels/chunk_stats.h). Defined in csrc/cpu/rejection_sample.cpp.
void rejection_sample_cpu(const RejectionSampleArgs& args, bool split = true);

// ---- element loads ----------------------------------------------------------------

OSD_HD float bf16_bits_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}

OSD_HD float fp16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    exp = 113u;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}

OSD_HD float load_float(const void* base, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kFloat16:
      return fp16_bits_to_float(static_cast<const uint16_t*>(base)[index]);
    case DType::kBFloat16:
      return bf16_bits_to_float(static_cast<const uint16_t*>(base)[index]);
    default:
      return static_cast<const float*>(base)[index];
  }
}

// ---- per-row parameters -------------------------------------------------------------

struct RowSampling {
  bool greedy;
  float temperature;
  int32_t top_k;   // 0 = off
  float top_p;     // 1 = off
  uint64_t seed;
  uint64_t offset;
  int32_t num_draft;
};

// Sampling parameters of sequence b from the per-sequence arrays (temperature, top_k,
// top_p, seed, offset) and vocab of the kernel arguments Args (RejectionSampleArgs,
// TreeRejectionSampleArgs); num_draft = 0.
template <typename Args>
OSD_HD RowSampling sequence_sampling(const Args& a, int64_t b) {
  RowSampling r;
  r.temperature = a.temperature[b];
  r.greedy = !(r.temperature > 0.0f);
  const int32_t k = a.top_k[b];
  r.top_k = (k > 0 && k < a.vocab) ? k : 0;
  r.top_p = a.top_p[b] < 1.0f ? a.top_p[b] : 1.0f;
  r.seed = static_cast<uint64_t>(a.seed[b]);
  r.offset = static_cast<uint64_t>(a.offset[b]);
  r.num_draft = 0;
  return r;
}

OSD_HD RowSampling row_sampling(const RejectionSampleArgs& a, int64_t b) {
  RowSampling r = sequence_sampling(a, b);
  const int32_t n = a.num_draft[b];
  r.num_draft = n < 0 ? 0 : (n > a.num_draft_max ? static_cast<int32_t>(a.num_draft_max) : n);
  return r;
}

// ---- float helpers ------------------------------------------------------------------

// Online (max, sum exp) state for a log-sum-exp over a stream of values.
struct LseState {
  float max;
  float sum;
};

OSD_HD LseState lse_init() { return LseState{-INFINITY, 0.0f}; }

OSD_HD LseState lse_merge(LseState a, LseState b) {
  if (a.max == -INFINITY) return b;
  if (b.max == -INFINITY) return a;
  if (a.max >= b.max) return LseState{a.max, a.sum + b.sum * expf(b.max - a.max)};
  return LseState{b.max, b.sum + a.sum * expf(a.max - b.max)};
}

// ---- decisions ----------------------------------------------------------------------

// The accept test in log space: log u + log q(x) < log p(x). q(x) = 0 accepts whenever
// p(x) > 0 (min(1, p/0) = 1); p(x) = 0 always rejects.
OSD_HD bool accept_draft(float u, float q_x, float log_p_x) {
  return logf(u) + logf(q_x) < log_p_x;
}

// The exponential-race key of a candidate with residual mass r > 0 and uniform u:
// r / E with E = -log u ~ Exp(1); the largest key wins.
OSD_HD float race_key(float r, float u) { return r / -logf(u); }

// Race winner update with the lowest index on ties (candidates visited in any order).
OSD_HD void race_update(float key, int64_t v, float& best_key, int64_t& best_v) {
  if (key > best_key || (key == best_key && v < best_v)) {
    best_key = key;
    best_v = v;
  }
}

// Argmax update with the lowest index on ties (NaNs never win).
OSD_HD void argmax_update(float x, int64_t v, float& best_x, int64_t& best_v) {
  if (x > best_x || (x == best_x && v < best_v)) {
    best_x = x;
    best_v = v;
  }
}

// Residual entry: max(0, p - q) after a rejection (one-hot: p with the draft zeroed).
OSD_HD float residual_mass(float p, float q) { return p > q ? p - q : 0.0f; }

}  // namespace osd
