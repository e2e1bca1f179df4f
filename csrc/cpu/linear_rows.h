// The few-row linear micro-kernel shared by decode_linear (float32 weights) and
// quant_linear (block-quantized weights, dequantized a few rows at a time into a buffer).
//
// One pass serves up to kMaxPass rows of x: each block of NB weight rows is loaded once per
// 8-float step and multiplied into M x NB running sums, which stay in registers, while a
// later block is prefetched. Both users run the same loops, so a quantized weight gives
// bit for bit the result of its dequantized float32 matrix.
// The AVX2 + FMA clone is picked at load time (OSD_NO_AVX2=1 forces the portable loop);
// the two round differently (FMA), which a linear layer tolerates.
#pragma once
#include <ATen/ops/empty.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include "checks.h"
#include "cpu/fast_math.h"
#include "cpu/row_dispatch.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace osd {
namespace linear_rows {

constexpr int kMaxPass = 12;  // rows served by one pass over W
// Decode streams every weight matrix from DRAM once per forward (a model's weights exceed
// the cache). The hardware prefetcher alone leaves one core waiting on memory, more so
// when several rows share each load, so the AVX2 loop prefetches this many weight blocks
// ahead (docs/benchmarks.md).
constexpr int kPrefetchBlocks = 4;

// y[m, n] = x[m] . w[n] + bias[n] for m < M, n < N (a slice of the op's output).
struct Args {
  const float* x;      // [M, K], rows ldx apart
  const float* w;      // [N, K] contiguous
  const float* bias;   // [N] or nullptr
  float* y;            // [M, *], rows ldy apart
  int64_t M, N, K, ldx, ldy;
};

// Weight rows per block for a pass of M rows: M * NB sums + NB weights + 1 input in the
// 16 vector registers of AVX2.
template <int M>
constexpr int block_rows() {
  return M <= 2 ? 4 : (M <= 4 ? 3 : (M <= 6 ? 2 : 1));
}

// Portable: 8 partial sums per (row, weight row), the same association as the AVX2 path.
template <int M, int NB>
void block_portable(const Args& a, const float* x, float* y, int64_t n0) {
  float acc[M][NB][8] = {};
  const int64_t K = a.K;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    for (int m = 0; m < M; ++m) {
      const float* xr = x + m * a.ldx + k;
      for (int j = 0; j < NB; ++j) {
        const float* wr = a.w + (n0 + j) * K + k;
        for (int l = 0; l < 8; ++l) acc[m][j][l] += xr[l] * wr[l];
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < NB; ++j) {
      float s = ((acc[m][j][0] + acc[m][j][4]) + (acc[m][j][2] + acc[m][j][6])) +
                ((acc[m][j][1] + acc[m][j][5]) + (acc[m][j][3] + acc[m][j][7]));
      for (int64_t t = k; t < K; ++t) s += x[m * a.ldx + t] * a.w[(n0 + j) * K + t];
      y[m * a.ldy + n0 + j] = s + (a.bias != nullptr ? a.bias[n0 + j] : 0.0f);
    }
  }
}

#if defined(__x86_64__)
// Prefetch of the weight block kPrefetchBlocks ahead, 32 * NB bytes of it per 8-float step.
// Few rows go into L1 (T0); with more rows, whose inputs fill much of L1, into L2 only (T1).
template <int M, int NB>
OSD_AVX2 inline void prefetch_step(const char* p) {
  if constexpr (M <= 2) {
    _mm_prefetch(p, _MM_HINT_T0);
    if constexpr (NB > 2) _mm_prefetch(p + 64, _MM_HINT_T0);
  } else {
    _mm_prefetch(p, _MM_HINT_T1);
    if constexpr (NB > 2) _mm_prefetch(p + 64, _MM_HINT_T1);
  }
}

// The sum of v's 8 lanes: (0+4, 2+6, 1+5, 3+7), then pairs, the portable path's
// association.
OSD_AVX2 inline float hsum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

template <int M, int NB>
OSD_AVX2 void block_avx2(const Args& a, const float* x, float* y, int64_t n0) {
  __m256 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  const int64_t K = a.K;
  const char* ahead = reinterpret_cast<const char*>(
      a.w + std::min<int64_t>(n0 + kPrefetchBlocks * NB, a.N - NB) * K);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    prefetch_step<M, NB>(ahead + k * 4 * NB);
    __m256 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = _mm256_loadu_ps(a.w + (n0 + j) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * a.ldx + k);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_fmadd_ps(xv, w[j], acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < NB; ++j) {
      float s = hsum8(acc[m][j]);
      for (int64_t t = k; t < K; ++t) s += x[m * a.ldx + t] * a.w[(n0 + j) * K + t];
      y[m * a.ldy + n0 + j] = s + (a.bias != nullptr ? a.bias[n0 + j] : 0.0f);
    }
  }
}
#endif

// One pass of M rows (x, y point at its first row) over weight rows [n_begin, n_end).
template <int M>
void pass(const Args& a, const float* x, float* y, int64_t n_begin, int64_t n_end, bool avx2) {
  constexpr int NB = block_rows<M>();
  int64_t n = n_begin;
#if defined(__x86_64__)
  if (avx2) {
    for (; n + NB <= n_end; n += NB) block_avx2<M, NB>(a, x, y, n);
    for (; n < n_end; ++n) block_avx2<M, 1>(a, x, y, n);
    return;
  }
#endif
  (void)avx2;
  for (; n + NB <= n_end; n += NB) block_portable<M, NB>(a, x, y, n);
  for (; n < n_end; ++n) block_portable<M, 1>(a, x, y, n);
}

inline void run_pass(const Args& a, int64_t row, int rows, int64_t n_begin, int64_t n_end,
                     bool avx2) {
  const float* x = a.x + row * a.ldx;
  float* y = a.y + row * a.ldy;
  with_rows<kMaxPass>(rows, [&](auto mr) {
    pass<decltype(mr)::value>(a, x, y, n_begin, n_end, avx2);
  });
}

// Weight bytes per tile when the rows take several passes: small enough that a tile read
// from memory by the first pass is still in L2 for the others.
constexpr int64_t kTileBytes = 96 * 1024;

// Every row of x times weight rows [n_begin, n_end): more rows than one pass serves run in
// as few passes as possible, of equal size, tile by tile over the weight rows, so W still
// streams from memory once. A row's result does not depend on the others.
inline void all_rows(const Args& a, int64_t n_begin, int64_t n_end, bool avx2) {
  const int64_t passes = (a.M + kMaxPass - 1) / kMaxPass;
  const int64_t per_pass = (a.M + passes - 1) / passes;
  const int64_t tile = passes == 1 ? n_end - n_begin
                                   : std::max<int64_t>(16, kTileBytes / (a.K * 4));
  for (int64_t n0 = n_begin; n0 < n_end; n0 += tile) {
    const int64_t n1 = std::min(n0 + tile, n_end);
    for (int64_t row = 0; row < a.M; row += per_pass) {
      const int rows = static_cast<int>(std::min<int64_t>(per_pass, a.M - row));
      run_pass(a, row, rows, n0, n1, avx2);
    }
  }
}

// rows[m] = norm_weight * (x[m] / sqrt(mean(x[m]^2) + eps)), the order of transformers'
// LlamaRMSNorm (sum of squares in double, so within one rounding of the exact norm).
// x: [M, K] rows ldx apart; returns [M, K] contiguous.
inline at::Tensor rms_norm_rows(const float* x, int64_t M, int64_t K, int64_t ldx,
                                const at::Tensor& norm_weight, double eps) {
  check_dtype(norm_weight, at::kFloat, "norm_weight");
  OSD_CHECK(norm_weight.dim() == 1 && norm_weight.size(0) == K && norm_weight.is_contiguous(),
            "norm_weight must be contiguous [K=", K, "], got ", norm_weight.sizes());
  OSD_CHECK(eps >= 0.0, "eps must be >= 0, got ", eps);
  at::Tensor rows = at::empty({M, K}, norm_weight.options());
  const float* g = norm_weight.data_ptr<float>();
  float* out = rows.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    double ss = 0.0;
    for (int64_t k = 0; k < K; ++k) ss += static_cast<double>(xr[k]) * xr[k];
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(K)) +
                                       static_cast<float>(eps));
    for (int64_t k = 0; k < K; ++k) out[m * K + k] = g[k] * (xr[k] * inv);
  }
  return rows;
}

// The float32 [N] bias of an op's output, checked; nullptr without one.
inline const float* bias_data(const std::optional<at::Tensor>& bias, const at::Tensor& x,
                              int64_t N) {
  if (!bias.has_value()) return nullptr;
  const at::Tensor& b = *bias;
  check_dtype(b, at::kFloat, "bias");
  check_same_device(x, b, "x", "bias");
  OSD_CHECK(b.dim() == 1 && b.size(0) == N && b.is_contiguous(),
            "bias must be contiguous [N=", N, "], got ", b.sizes());
  return b.data_ptr<float>();
}

// With norm_weight, the RMS-normalised rows of a.x (a then points at them); returns the
// tensor holding them (undefined without norm_weight), which must outlive a's use.
inline at::Tensor apply_norm(Args& a, const at::Tensor& x,
                             const std::optional<at::Tensor>& norm_weight, double eps) {
  if (!norm_weight.has_value()) return at::Tensor();
  check_same_device(x, *norm_weight, "x", "norm_weight");
  at::Tensor normed = rms_norm_rows(a.x, a.M, a.K, a.ldx, *norm_weight, eps);
  a.x = normed.data_ptr<float>();
  a.ldx = a.K;
  return normed;
}

}  // namespace linear_rows
}  // namespace osd
