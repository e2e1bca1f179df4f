// topk_probs: the k most probable tokens of softmax(logits) per row and their
// probabilities, what online learning stores of the target's distribution at each
// verified position (osd_kernels/topk_probs.py has the contract and the reference).
//
// One row at a time, two passes over its V logits and no [V] output. The first selects:
// it keeps the k largest logits seen so far in a sorted array and compares each later
// logit with the smallest kept one, 16 at a time with AVX-512 where the CPU has it (after
// the first few hundred logits almost none passes, so the pass costs about one read of
// the row); the largest kept is the row's max. The second sums e^(x - max) (Cephes' expf
// polynomial, 16 lanes with AVX-512, else exp_and_sum into a per-thread scratch row). A logit equal to the smallest kept one does not
// pass, and insertion shifts only strictly smaller ones: among equal logits the lower index
// ranks first. The kept probabilities are e^(x - max) / sum with std::exp. A row holding a
// NaN gives unspecified results (the engine fails such rows before collecting them).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "checks.h"
#include "cpu/attention_avx512.h"
#include "cpu/fast_math.h"
#include "cpu/sample_vec.h"

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_* values, which its
// (maybe-)uninitialized warnings report.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace osd {
namespace {

// The k largest values offered so far, in descending order (ties: the earlier offer first).
struct Kept {
  int64_t k = 0;
  int64_t count = 0;
  float* vals = nullptr;
  int64_t* ids = nullptr;

  void offer(float x, int64_t v) {
    if (count == k && !(x > vals[k - 1])) return;
    int64_t j = count < k ? count++ : k - 1;
    for (; j > 0 && x > vals[j - 1]; --j) {
      vals[j] = vals[j - 1];
      ids[j] = ids[j - 1];
    }
    vals[j] = x;
    ids[j] = v;
  }
};

// Offers x[first, n) to `kept` (already full): only the values above its smallest.
void scan_portable(const float* x, int64_t first, int64_t n, Kept& kept) {
  for (int64_t v = first; v < n; ++v) {
    if (x[v] > kept.vals[kept.k - 1]) kept.offer(x[v], v);
  }
}

#if defined(__x86_64__)
OSD_AVX512 void scan_avx512(const float* x, int64_t first, int64_t n, Kept& kept) {
  int64_t v = first;
  __m512 floor = _mm512_set1_ps(kept.vals[kept.k - 1]);
  for (; v + 16 <= n; v += 16) {
    __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + v), floor, _CMP_GT_OQ);
    while (above) {  // lanes in index order; each offer may raise the floor
      const int lane = __builtin_ctz(above);
      above &= above - 1;
      if (x[v + lane] > kept.vals[kept.k - 1]) kept.offer(x[v + lane], v + lane);
    }
    floor = _mm512_set1_ps(kept.vals[kept.k - 1]);
  }
  scan_portable(x, v, n, kept);
}

// sum over v < n of e^(x[v] - mx), every x[v] <= mx.
OSD_AVX512 float exp_sum_row_avx512(const float* x, int64_t n, float mx) {
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 live = attention_avx512::first_lanes(n - j);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(live, attention_avx512::exp_nonpos_avx512(_mm512_sub_ps(
                                                           _mm512_maskz_loadu_ps(live, x + j), m))));
  }
  return _mm512_reduce_add_ps(acc);
}
#endif

std::tuple<at::Tensor, at::Tensor> topk_probs_cpu(const at::Tensor& logits, int64_t k) {
  OSD_CHECK(logits.device().is_cpu(), "topk_probs CPU kernel got a ", logits.device(),
            " tensor");
  check_dtype(logits, at::kFloat, "logits");
  OSD_CHECK(logits.dim() >= 1 && logits.size(-1) >= 1,
            "logits must be [..., V] with V >= 1, got ", logits.sizes());
  OSD_CHECK(k >= 1, "k must be >= 1, got ", k);
  const int64_t V = logits.size(-1);
  const int64_t K = std::min(k, V);
  std::vector<int64_t> shape(logits.sizes().begin(), logits.sizes().end());
  shape.back() = K;
  at::Tensor ids = at::empty(shape, logits.options().dtype(at::kLong));
  at::Tensor probs = at::empty(shape, logits.options());
  const int64_t M = logits.numel() / V;
  if (M == 0) return {ids, probs};
  at::Tensor rows = logits.reshape({M, V});
  if (V > 1 && rows.stride(1) != 1) rows = rows.contiguous();
  const int64_t ld = rows.stride(0);
  const float* x0 = rows.data_ptr<float>();
  int64_t* id0 = ids.data_ptr<int64_t>();
  float* p0 = probs.data_ptr<float>();
#if defined(__x86_64__)
  const bool avx512 = use_avx512();
#endif
  at::parallel_for(0, M, std::max<int64_t>(1, 131072 / V), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;  // exp_and_sum's output, unread
#if defined(__x86_64__)
    if (!avx512) scratch.resize(V);
#else
    scratch.resize(V);
#endif
    for (int64_t m = begin; m < end; ++m) {
      const float* x = x0 + m * ld;
      float* p = p0 + m * K;
      int64_t* id = id0 + m * K;
      Kept kept{K, 0, p, id};  // kept logits live in the output until they become probs
      for (int64_t v = 0; v < K; ++v) kept.offer(x[v], v);
      float z;
#if defined(__x86_64__)
      if (avx512) {
        scan_avx512(x, K, V, kept);
        z = exp_sum_row_avx512(x, V, p[0]);
      } else {
        scan_portable(x, K, V, kept);
        z = exp_and_sum(x, p[0], V, scratch.data());
      }
#else
      scan_portable(x, K, V, kept);
      z = exp_and_sum(x, p[0], V, scratch.data());
#endif
      const float mx = p[0];
      const float inv_z = 1.0f / z;
      for (int64_t j = 0; j < K; ++j) p[j] = std::exp(p[j] - mx) * inv_z;
    }
  });
  return {ids, probs};
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_IMPL(osd, CPU, m) { m.impl("topk_probs", &osd::topk_probs_cpu); }
