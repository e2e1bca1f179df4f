// decode_linear over a weight packed into panels: W [N, K] stored as [N / 16, K, 16], panel p
// holding weight rows 16p..16p+15 column by column, so the 16 weights that meet x[m, k] are
// one 64-byte line and a panel streams from memory in order.
//
// A micro-kernel serves MR rows of x and NP panels: per k it loads NP lines of W, broadcasts
// x[m, k] and accumulates MR x 16 NP outputs in registers, with no horizontal sum at the
// end. AVX2 holds up to 6 rows (MR * 2 NP of its 16 registers); AVX-512, one line per
// register, up to 12 (MR * NP of its 32), so a verify forward of up to 12 rows streams each
// weight from memory once. Every output is summed over k in order with one FMA per step,
// whatever the ISA, MR, NP, the thread split or the number of rows, so a row's result does
// not depend on the rows beside it (greedy verification equals one-row decoding bit for
// bit). The vector clones are picked at load time; the portable loop sums in the same order
// without FMA.
#pragma once
#include <algorithm>
#include <cstdint>

#include "cpu/fast_math.h"
#include "cpu/row_dispatch.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace osd {
namespace linear_panels {

constexpr int kPanel = 16;   // weight rows per panel: one cache line of float32
constexpr int kMaxPass = 6;  // rows per pass: 6 x 2 accumulators + 2 weights + 1 input
constexpr int kMaxPass512 = 12;  // AVX-512: 12 x 2 accumulators of 32 registers
// Panels per tile when the rows take several passes: a tile read from memory by the first
// pass is still in the core's L2 for the others.
constexpr int64_t kTileBytes = 256 * 1024;
// How far ahead (in k steps of one line) each panel stream is prefetched: 4 KB, so that a
// pass of 7 to 12 rows, whose FMAs take several cycles per line, still has the next lines
// in flight while it computes (docs/benchmarks.md).
constexpr int kPrefetchSteps = 64;

struct Args {
  const float* x;      // [M, K], rows ldx apart
  const float* w;      // [N / 16, K, 16] contiguous
  const float* bias;   // [N] or nullptr
  float* y;            // [M, *], rows ldy apart
  int64_t M, N, K, ldx, ldy;
};

// Panels per micro-kernel for MR rows: enough accumulators to cover the FMA latency, and
// for one row (bound by memory) only two streams, which reads long panels faster.
template <int MR>
constexpr int panels_per_step() {
  return MR <= 2 ? (MR == 1 ? 2 : 3) : (MR == 3 ? 2 : 1);
}

template <int MR, int NP>
void micro_portable(const Args& a, const float* x, float* y, int64_t p0) {
  float acc[MR][NP * kPanel] = {};
  const int64_t K = a.K;
  for (int64_t k = 0; k < K; ++k) {
    for (int p = 0; p < NP; ++p) {
      const float* wk = a.w + ((p0 + p) * K + k) * kPanel;
      for (int m = 0; m < MR; ++m) {
        const float xv = x[m * a.ldx + k];
        for (int j = 0; j < kPanel; ++j) acc[m][p * kPanel + j] += xv * wk[j];
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NP * kPanel; ++j) {
      const int64_t n = p0 * kPanel + j;
      y[m * a.ldy + n] = acc[m][j] + (a.bias != nullptr ? a.bias[n] : 0.0f);
    }
}

#if defined(__x86_64__)
template <int MR, int NP>
OSD_AVX2 void micro_avx2(const Args& a, const float* x, float* y, int64_t p0) {
  __m256 acc[MR][NP][2];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[m][p][0] = acc[m][p][1] = _mm256_setzero_ps();
  const int64_t K = a.K;
  const float* w0 = a.w + p0 * K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[NP][2];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      const float* wk = w0 + (p * K + k) * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchSteps * kPanel), _MM_HINT_T0);
      w[p][0] = _mm256_loadu_ps(wk);
      w[p][1] = _mm256_loadu_ps(wk + 8);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * a.ldx + k);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        acc[m][p][0] = _mm256_fmadd_ps(xv, w[p][0], acc[m][p][0]);
        acc[m][p][1] = _mm256_fmadd_ps(xv, w[p][1], acc[m][p][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) {
    const int64_t n = (p0 + p) * kPanel;
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    if (a.bias != nullptr) {
      b0 = _mm256_loadu_ps(a.bias + n);
      b1 = _mm256_loadu_ps(a.bias + n + 8);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      _mm256_storeu_ps(y + m * a.ldy + n, _mm256_add_ps(acc[m][p][0], b0));
      _mm256_storeu_ps(y + m * a.ldy + n + 8, _mm256_add_ps(acc[m][p][1], b1));
    }
  }
}

// AVX-512: one panel line is one zmm register, and 32 registers hold up to 12 rows x 2
// panels of accumulators, so a verify forward of up to 12 rows reads each weight once.
// The same FMA per lane in the same k order as the AVX2 kernel: results are bit-identical.
template <int MR, int NP>
OSD_AVX512 void micro_avx512(const Args& a, const float* x, float* y, int64_t p0) {
  __m512 acc[MR][NP];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  const int64_t K = a.K;
  const float* w0 = a.w + p0 * K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      const float* wk = w0 + (p * K + k) * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchSteps * kPanel), _MM_HINT_T0);
      w[p] = _mm512_loadu_ps(wk);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * a.ldx + k]);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_fmadd_ps(xv, w[p], acc[m][p]);
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) {
    const int64_t n = (p0 + p) * kPanel;
    const __m512 b = a.bias != nullptr ? _mm512_loadu_ps(a.bias + n) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + m * a.ldy + n, _mm512_add_ps(acc[m][p], b));
  }
}
#endif

// Panels per AVX-512 micro-kernel for MR rows of a call that takes one pass (decode,
// verify): the weights come from memory, and on the 2-core AVX-512 machine more
// concurrent panel streams read them slower (4 streams took 13-20% longer than one at 5
// to 9 rows, docs/benchmarks.md), so one stream, or two for one or two rows, whose few
// FMA chains would not cover the FMA latency alone. Calls of several passes (prefill
// pieces) read each tile from L2 after the first pass and are bound by the FMAs: two
// panels, so that each broadcast input feeds two FMAs.
template <int MR>
constexpr int panels_per_step_512() {
  return MR <= 2 ? 2 : 1;
}
constexpr int kPanelsPerStepPasses = 2;

// Vector level of a call: 0 portable, 1 AVX2 + FMA, 2 AVX-512.
enum Level : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// One pass of MR rows (x, y point at its first row) over panels [p_begin, p_end).
template <int MR>
void pass(const Args& a, const float* x, float* y, int64_t p_begin, int64_t p_end, int level) {
  int64_t p = p_begin;
#if defined(__x86_64__)
  if (level == kAvx512) {
    constexpr int NP = panels_per_step_512<MR>();
    if (a.M > kMaxPass512) {
      constexpr int NW = kPanelsPerStepPasses;
      for (; p + NW <= p_end; p += NW) micro_avx512<MR, NW>(a, x, y, p);
    } else {
      for (; p + NP <= p_end; p += NP) micro_avx512<MR, NP>(a, x, y, p);
    }
    for (; p < p_end; ++p) micro_avx512<MR, 1>(a, x, y, p);
    return;
  }
  if constexpr (MR <= kMaxPass) {
    constexpr int NP = panels_per_step<MR>();
    if (level == kAvx2) {
      for (; p + NP <= p_end; p += NP) micro_avx2<MR, NP>(a, x, y, p);
      for (; p < p_end; ++p) micro_avx2<MR, 1>(a, x, y, p);
      return;
    }
  }
#endif
  (void)level;
  constexpr int NP = MR <= kMaxPass ? panels_per_step<MR>() : 1;
  for (; p + NP <= p_end; p += NP) micro_portable<MR, NP>(a, x, y, p);
  for (; p < p_end; ++p) micro_portable<MR, 1>(a, x, y, p);
}

inline void run_pass(const Args& a, int64_t row, int rows, int64_t p_begin, int64_t p_end,
                     int level) {
  const float* x = a.x + row * a.ldx;
  float* y = a.y + row * a.ldy;
  with_rows<kMaxPass512>(rows, [&](auto mr) {
    pass<decltype(mr)::value>(a, x, y, p_begin, p_end, level);
  });
}

// Every row of x times panels [p_begin, p_end): passes of at most kMaxPass rows (AVX2,
// portable) or kMaxPass512 (AVX-512), balanced, tile by tile over the panels, so W streams
// from memory once.
inline void all_rows(const Args& a, int64_t p_begin, int64_t p_end, int level) {
  // A multiple of 4 panels, so that every micro-kernel of a tile runs at its full width.
  const int64_t tile = std::max<int64_t>(4, kTileBytes / (a.K * kPanel * 4) / 4 * 4);
  const int64_t most = level == kAvx512 ? kMaxPass512 : kMaxPass;
  const int64_t passes = (a.M + most - 1) / most;
  const int64_t per_pass = passes > 0 ? (a.M + passes - 1) / passes : 0;
  for (int64_t p0 = p_begin; p0 < p_end; p0 += tile) {
    const int64_t p1 = std::min(p0 + tile, p_end);
    for (int64_t row = 0; row < a.M; row += per_pass) {
      run_pass(a, row, static_cast<int>(std::min<int64_t>(per_pass, a.M - row)), p0, p1, level);
    }
  }
}

}  // namespace linear_panels
}  // namespace osd
