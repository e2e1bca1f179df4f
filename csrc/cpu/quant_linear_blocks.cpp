// quant_linear on GGUF blocks as stored (ggml_type != 0: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K,
// Q6_K): y = x W^T + b for few rows, W [N, K] held as the file's bytes, [N, K / U * B]
// (U weights in B bytes a unit: a block of 32 or a K-quant super-block of 256).
//
// Each unit of a weight row is decoded in registers (cpu/quant_linear_blocks.h: 8-bit
// codes of 32 weights at a time, float32 factors per 16 or 32 weights) and multiplied into
// every row's running sums at once, in decode_linear's order (k ascending, 8 lanes a
// running sum, the same final reduction), so the result equals decode_linear on the
// dequantized matrix bit for bit: the codes times the factors are exactly the reference
// dequantizer's weights. The AVX-512 path (with VBMI's byte permutations) holds two weight
// rows per register, row n in lanes 0..7 and row n + 1 in lanes 8..15, each half doing
// what the AVX2 path's register does for its row. The portable path dequantizes a few
// weight rows into a buffer and runs decode_linear's portable loop. Past kFusedMaxRows
// rows (prefill) each thread dequantizes tiles of weight rows into its own buffer and
// multiplies them by a single-threaded GEMM, which then sets the summation order.
#include "cpu/quant_linear_blocks_op.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <algorithm>
#include <cstring>
#include <vector>

#include "checks.h"
#include "cpu/linear_rows.h"
#include "cpu/quant_linear_blocks.h"
#include "cpu/row_dispatch.h"

namespace osd {
namespace {

using namespace gguf_blocks;

constexpr int64_t kGroupRows = 12;  // weight rows the portable path dequantizes at a time
constexpr int64_t kFusedMaxRows = 64;
// Prefill tiles: about this many float32 weights (1 MiB) a tile, so that a thread's tile
// and the rows of x it multiplies mostly stay in its L2 between the dequantizer's writes
// and the GEMM's reads.
constexpr int64_t kPrefillTileWeights = 256 * 1024;
// With several passes over the rows of x, weight rows go tile by tile (this many bytes of
// blocks), so a tile read from memory by the first pass is still cached for the others.
constexpr int64_t kPassTileBytes = 64 * 1024;

struct Raw {
  const uint8_t* w;   // [N, row_bytes]
  int64_t row_bytes;  // units * F::kBytes
  int64_t units;      // K / F::kWeights
};

// Weight rows [n, n + rows) into out [rows, K] (portable; exactly the reference weights).
template <class F>
void dequant_portable(const Raw& q, int64_t n, int64_t rows, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = q.w + (n + r) * q.row_bytes;
    for (int64_t u = 0; u < q.units; ++u) {
      F::dequant(row + u * F::kBytes, out + (r * q.units + u) * F::kWeights);
    }
  }
}

#if defined(__x86_64__)
// The 8 codes of step s (weights 8s..8s+7) of a sub-block's 32, as float32.
OSD_BLK_AVX2 inline __m256 step8(__m256i c, int s) {
  const __m128i half = s < 2 ? _mm256_castsi256_si128(c) : _mm256_extracti128_si256(c, 1);
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32((s & 1) ? _mm_srli_si128(half, 8) : half));
}

template <class F>
OSD_BLK_AVX2 void dequant_avx2(const Raw& q, int64_t n, int64_t rows, float* out) {
  constexpr int64_t kFactors = F::kWeights / F::kGroup;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = q.w + (n + r) * q.row_bytes;
    for (int64_t u = 0; u < q.units; ++u) {
      const uint8_t* unit = row + u * F::kBytes;
      float sc[kFactors], mn[kFactors];
      F::factors(unit, sc, mn);
      float* o = out + (r * q.units + u) * F::kWeights;
      for (int j = 0; j < F::kWeights / 32; ++j) {
        const __m256i c = F::codes(unit, j);
        for (int s = 0; s < 4; ++s) {
          const int g = (32 * j + 8 * s) / F::kGroup;
          const __m256 w =
              _mm256_fmadd_ps(step8(c, s), _mm256_set1_ps(sc[g]), _mm256_set1_ps(mn[g]));
          _mm256_storeu_ps(o + 32 * j + 8 * s, w);
        }
      }
    }
  }
}

// Weight rows [n, n + rows) into out [rows, K], 16 weights a store: the AVX2 path's codes
// and factors, so the same weights.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <class F>
OSD_BLK_512 void dequant_512(const Raw& q, int64_t n, int64_t rows, float* out) {
  constexpr int64_t kFactors = F::kWeights / F::kGroup;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = q.w + (n + r) * q.row_bytes;
    for (int64_t u = 0; u < q.units; ++u) {
      const uint8_t* unit = row + u * F::kBytes;
      alignas(32) float sc[kFactors], mn[kFactors];
      F::factors(unit, sc, mn);
      float* o = out + (r * q.units + u) * F::kWeights;
#pragma GCC unroll 8
      for (int j = 0; j < F::kWeights / 32; ++j) {
        const __m256i c = F::codes(unit, j);
        for (int h = 0; h < 2; ++h) {
          const __m128i b = h == 0 ? _mm256_castsi256_si128(c) : _mm256_extracti128_si256(c, 1);
          const int g = (32 * j + 16 * h) / F::kGroup;
          const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)),
                                           _mm512_set1_ps(sc[g]), _mm512_set1_ps(mn[g]));
          _mm512_storeu_ps(o + 32 * j + 16 * h, w);
        }
      }
    }
  }
}
#pragma GCC diagnostic pop

// Prefetch of unit u of the NB weight rows from `ahead` on (linear_rows::kPrefetchBlocks
// blocks of rows ahead), a cache line per 64 bytes of the unit.
template <class F, int NB>
OSD_BLK_AVX2 inline void prefetch_unit(const Raw& q, const uint8_t* ahead, int64_t u) {
  for (int j = 0; j < NB; ++j) {
    const char* p = reinterpret_cast<const char*>(ahead + j * q.row_bytes + u * F::kBytes);
    for (int64_t b = 0; b < F::kBytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
  }
}

// M rows of x (ldx apart) times weight rows [n0, n0 + NB): one 8-lane running sum per
// (row, weight row), as decode_linear's AVX2 loop.
template <class F, int M, int NB>
OSD_BLK_AVX2 void block_avx2(const Raw& q, const linear_rows::Args& a, const float* x, float* y,
                             int64_t n0, int64_t N) {
  constexpr int64_t kFactors = F::kWeights / F::kGroup;
  __m256 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  const uint8_t* row0 = q.w + n0 * q.row_bytes;
  const uint8_t* ahead =
      q.w + std::min<int64_t>(n0 + linear_rows::kPrefetchBlocks * NB, N - NB) * q.row_bytes;
  for (int64_t u = 0; u < q.units; ++u) {
    prefetch_unit<F, NB>(q, ahead, u);
    alignas(32) float sc[NB][kFactors], mn_[NB][kFactors];
    for (int j = 0; j < NB; ++j) {
      F::factors(row0 + j * q.row_bytes + u * F::kBytes, sc[j], mn_[j]);
    }
#pragma GCC unroll 8
    for (int sub = 0; sub < F::kWeights / 32; ++sub) {
      __m256i c[NB];
      __m256 d[NB][2], mn[NB][2];  // factors of weights 0..15 and 16..31 of the sub-block
      for (int j = 0; j < NB; ++j) {
        c[j] = F::codes(row0 + j * q.row_bytes + u * F::kBytes, sub);
        for (int h = 0; h < 2; ++h) {
          d[j][h] = _mm256_set1_ps(sc[j][(32 * sub + 16 * h) / F::kGroup]);
          mn[j][h] = _mm256_set1_ps(mn_[j][(32 * sub + 16 * h) / F::kGroup]);
        }
      }
      for (int s = 0; s < 4; ++s) {
        const int64_t k = u * F::kWeights + 32 * sub + 8 * s;
        __m256 w[NB];
        for (int j = 0; j < NB; ++j) {
          w[j] = _mm256_fmadd_ps(step8(c[j], s), d[j][s / 2], mn[j][s / 2]);
        }
        for (int m = 0; m < M; ++m) {
          const __m256 xv = _mm256_loadu_ps(x + m * a.ldx + k);
          for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_fmadd_ps(xv, w[j], acc[m][j]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < NB; ++j) {
      const float s = linear_rows::hsum8(acc[m][j]);
      y[m * a.ldy + n0 + j] = s + (a.bias != nullptr ? a.bias[n0 + j] : 0.0f);
    }
  }
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// The factors of a unit of two weight rows, each one as a register of row n's factor in
// lanes 0..7 and row n + 1's in lanes 8..15, picked from registers built once a unit.
template <class F>
struct PairFactors {
  static constexpr int kF = F::kWeights / F::kGroup;
  static constexpr int kRegs = (kF + 7) / 8;
  __m512 sc[kRegs], mn[kRegs];  // [row n's factors 8i..8i+7 | row n + 1's] (kF = 1: 0, 0)

  // the fp16 at byte `at` of both rows' units: [row n's, row n + 1's, 0, 0]
  OSD_BLK_VBMI static __m512 pair_f16(const uint8_t* u0, const uint8_t* u1, int at) {
    uint16_t lo, hi;
    std::memcpy(&lo, u0 + at, 2);
    std::memcpy(&hi, u1 + at, 2);
    return _mm512_castps128_ps512(
        _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(lo | (hi << 16)))));
  }
  OSD_BLK_VBMI static __m512 halves(const float* a, const float* b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
  }
  OSD_BLK_VBMI void load(const uint8_t* u0, const uint8_t* u1) {
    if constexpr (kF == 1) {
      sc[0] = pair_f16(u0, u1, 0);
      mn[0] = F::kMinAt >= 0 ? pair_f16(u0, u1, F::kMinAt)
                             : _mm512_mul_ps(_mm512_set1_ps(-F::kOffset), sc[0]);
    } else {
      alignas(32) float s0[kF], m0[kF], s1[kF], m1[kF];
      F::factors(u0, s0, m0);
      F::factors(u1, s1, m1);
      for (int i = 0; i < kRegs; ++i) {
        sc[i] = halves(s0 + 8 * i, s1 + 8 * i);
        mn[i] = halves(m0 + 8 * i, m1 + 8 * i);
      }
    }
  }
  // factor g of both rows, each in its half of the lanes
  OSD_BLK_VBMI static __m512 pick(const __m512* r, int g) {
    const int i = kF == 1 ? 0 : g % 8, j = kF == 1 ? 1 : 8 + g % 8;
    const __m512i idx = _mm512_setr_epi32(i, i, i, i, i, i, i, i, j, j, j, j, j, j, j, j);
    return _mm512_permutexvar_ps(idx, r[kF == 1 ? 0 : g / 8]);
  }
  OSD_BLK_VBMI __m512 scale(int g) const { return pick(sc, g); }
  OSD_BLK_VBMI __m512 min(int g) const { return pick(mn, g); }
};

// The codes of a sub-block of two weight rows in one register, as F::kPairLayout says;
// step(s): those of weights 8s..8s+7 as 16 int32 lanes, row n's in lanes 0..7 and row
// n + 1's in lanes 8..15, by a byte permutation that also zero-extends.
template <class F>
struct PairCodes {
  __m512i c;
  OSD_BLK_VBMI inline void set(const uint8_t* u0, const uint8_t* u1, int sub) {
    if constexpr (F::kPairLayout == 1) {
      c = F::pair_codes(u0, u1, sub);
    } else {
      c = _mm512_inserti64x4(_mm512_castsi256_si512(F::codes(u0, sub)), F::codes(u1, sub), 1);
    }
  }
  OSD_BLK_VBMI inline __m512i step(int s) const {
    // dword l: row n's weight 8s + l, dword 8 + l: row n + 1's; the byte holding it is
    // at(row, 8s + l): layout 0: 32 row + w; layout 1: 16 row + w, plus 16 for w >= 16
    alignas(64) static const uint8_t kIdx[4][64] = {
#define OSD_AT(r, w) (F::kPairLayout == 0 ? 32 * (r) + (w) : 16 * (r) + (w) + ((w) >= 16 ? 16 : 0))
#define OSD_PAIR_STEP(s)                                                                     \
  {OSD_AT(0, 8 * s + 0), 0, 0, 0, OSD_AT(0, 8 * s + 1), 0, 0, 0, OSD_AT(0, 8 * s + 2), 0, 0, 0, \
   OSD_AT(0, 8 * s + 3), 0, 0, 0, OSD_AT(0, 8 * s + 4), 0, 0, 0, OSD_AT(0, 8 * s + 5), 0, 0, 0, \
   OSD_AT(0, 8 * s + 6), 0, 0, 0, OSD_AT(0, 8 * s + 7), 0, 0, 0, OSD_AT(1, 8 * s + 0), 0, 0, 0, \
   OSD_AT(1, 8 * s + 1), 0, 0, 0, OSD_AT(1, 8 * s + 2), 0, 0, 0, OSD_AT(1, 8 * s + 3), 0, 0, 0, \
   OSD_AT(1, 8 * s + 4), 0, 0, 0, OSD_AT(1, 8 * s + 5), 0, 0, 0, OSD_AT(1, 8 * s + 6), 0, 0, 0, \
   OSD_AT(1, 8 * s + 7), 0, 0, 0}
        OSD_PAIR_STEP(0), OSD_PAIR_STEP(1), OSD_PAIR_STEP(2), OSD_PAIR_STEP(3)};
#undef OSD_PAIR_STEP
#undef OSD_AT
    const __m512i idx = _mm512_load_si512(kIdx[s]);
    return _mm512_maskz_permutexvar_epi8(0x1111111111111111ULL, idx, c);
  }
};

// M rows of x (ldx apart) times weight rows [n0, n0 + 2 NP): NP registers of two weight
// rows each (lanes 0..7: row n0 + 2p, 8..15: n0 + 2p + 1), each input step broadcast to
// both halves.
template <class F, int M, int NP>
OSD_BLK_VBMI void block_512(const Raw& q, const linear_rows::Args& a, const float* x, float* y,
                            int64_t n0, int64_t N) {
  constexpr int NB = 2 * NP;
  __m512 acc[M][NP];
  for (int m = 0; m < M; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  const uint8_t* row0 = q.w + n0 * q.row_bytes;
  const uint8_t* ahead =
      q.w + std::min<int64_t>(n0 + linear_rows::kPrefetchBlocks * NB, N - NB) * q.row_bytes;
  for (int64_t u = 0; u < q.units; ++u) {
    prefetch_unit<F, NB>(q, ahead, u);
    PairFactors<F> f[NP];
    for (int p = 0; p < NP; ++p) {
      const uint8_t* r = row0 + 2 * p * q.row_bytes + u * F::kBytes;
      f[p].load(r, r + q.row_bytes);
    }
#pragma GCC unroll 8
    for (int sub = 0; sub < F::kWeights / 32; ++sub) {
      PairCodes<F> codes[NP];
      __m512 d[NP][2], mn[NP][2];  // factors of weights 0..15 and 16..31 of the sub-block
      for (int p = 0; p < NP; ++p) {
        const uint8_t* r = row0 + 2 * p * q.row_bytes + u * F::kBytes;
        codes[p].set(r, r + q.row_bytes, sub);
        for (int h = 0; h < 2; ++h) {
          d[p][h] = f[p].scale((32 * sub + 16 * h) / F::kGroup);
          mn[p][h] = f[p].min((32 * sub + 16 * h) / F::kGroup);
        }
      }
      for (int s = 0; s < 4; ++s) {
        const int64_t k = u * F::kWeights + 32 * sub + 8 * s;
        __m512 w[NP];
        for (int p = 0; p < NP; ++p) {
          w[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes[p].step(s)), d[p][s / 2],
                                 mn[p][s / 2]);
        }
        for (int m = 0; m < M; ++m) {
          const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + m * a.ldx + k));
          for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_fmadd_ps(xv, w[p], acc[m][p]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int p = 0; p < NP; ++p) {
      for (int half = 0; half < 2; ++half) {
        const __m256 h = half == 0 ? _mm512_castps512_ps256(acc[m][p])
                                   : _mm512_extractf32x8_ps(acc[m][p], 1);
        const int64_t n = n0 + 2 * p + half;
        y[m * a.ldy + n] = linear_rows::hsum8(h) + (a.bias != nullptr ? a.bias[n] : 0.0f);
      }
    }
  }
}

#pragma GCC diagnostic pop

// One pass of M rows (x, y at its first row) over weight rows [n_begin, n_end).
template <class F, int M>
void pass_512(const Raw& q, const linear_rows::Args& a, const float* x, float* y,
              int64_t n_begin, int64_t n_end, int64_t N) {
  // registers (of 32): M * NP sums, NP codes, 2 or 4 NP factors (groups of 32 or 16), NP
  // weights, x, 4 permutations; more weight rows a block, more running sums in flight
  constexpr int NP = M <= 2 ? (F::kGroup == 16 ? 3 : 4) : (M <= 6 ? 2 : 1);
  int64_t n = n_begin;
  for (; n + 2 * NP <= n_end; n += 2 * NP) block_512<F, M, NP>(q, a, x, y, n, N);
  for (; n + 2 <= n_end; n += 2) block_512<F, M, 1>(q, a, x, y, n, N);
  for (; n < n_end; ++n) block_avx2<F, M, 1>(q, a, x, y, n, N);
}

template <class F, int M>
OSD_BLK_AVX2 void pass_avx2(const Raw& q, const linear_rows::Args& a, const float* x, float* y,
                            int64_t n_begin, int64_t n_end, int64_t N) {
  constexpr int NB = M <= 2 ? 2 : 1;  // M * NB sums, NB codes, 2 NB factors, w, x of 16
  int64_t n = n_begin;
  for (; n + NB <= n_end; n += NB) block_avx2<F, M, NB>(q, a, x, y, n, N);
  for (; n < n_end; ++n) block_avx2<F, M, 1>(q, a, x, y, n, N);
}
#endif

// Every row of x over weight rows [n_begin, n_end), in passes of at most kMaxPass rows
// (tile by tile over the weight rows when there are several). A row's result does not
// depend on the others.
template <class F>
void all_rows(const Raw& q, const linear_rows::Args& a, int64_t n_begin, int64_t n_end,
              int64_t N, bool avx2, bool avx512) {
  const int64_t passes = (a.M + linear_rows::kMaxPass - 1) / linear_rows::kMaxPass;
  const int64_t per_pass = (a.M + passes - 1) / passes;
  const int64_t tile = passes == 1 ? n_end - n_begin
                                   : std::max<int64_t>(16, kPassTileBytes / q.row_bytes);
  for (int64_t n0 = n_begin; n0 < n_end; n0 += tile) {
    const int64_t n1 = std::min(n0 + tile, n_end);
    for (int64_t row = 0; row < a.M; row += per_pass) {
      const int rows = static_cast<int>(std::min<int64_t>(per_pass, a.M - row));
      const float* x = a.x + row * a.ldx;
      float* y = a.y + row * a.ldy;
#if defined(__x86_64__)
      if (avx2) {
        with_rows<linear_rows::kMaxPass>(rows, [&](auto mr) {
          constexpr int M = decltype(mr)::value;
          if (avx512) return pass_512<F, M>(q, a, x, y, n0, n1, N);
          pass_avx2<F, M>(q, a, x, y, n0, n1, N);
        });
        continue;
      }
#endif
      (void)avx2, (void)avx512;
      thread_local std::vector<float> buffer;
      buffer.resize(static_cast<size_t>(kGroupRows * a.K));
      for (int64_t n = n0; n < n1; n += kGroupRows) {
        const int64_t g = std::min(kGroupRows, n1 - n);
        dequant_portable<F>(q, n, g, buffer.data());
        linear_rows::Args b = a;  // these rows of x, the group's rows of W, bias and y
        b.x = x;
        b.M = rows;
        b.w = buffer.data();
        b.N = g;
        b.bias = a.bias != nullptr ? a.bias + n : nullptr;
        b.y = y + n;
        linear_rows::all_rows(b, 0, g, false);
      }
    }
  }
}

// Past kFusedMaxRows rows: the weight rows dequantized by tiles (the ISA's dequantizer;
// the AVX-512 one only widens, it needs no VBMI) and multiplied per thread.
template <class F>
void prefill(const Raw& q, const linear_rows::Args& a, int64_t N, bool avx2, bool avx512) {
  gemm_dequantized_tiles(a.x, a.ldx, a.M, a.K, N, a.bias, a.y, a.ldy,
                         [&](int64_t n0, int64_t g, float* w) {
#if defined(__x86_64__)
                           if (avx512) return dequant_512<F>(q, n0, g, w);
                           if (avx2) return dequant_avx2<F>(q, n0, g, w);
#endif
                           (void)avx2, (void)avx512;
                           dequant_portable<F>(q, n0, g, w);
                         });
}

template <class F>
at::Tensor run(const at::Tensor& x, const Raw& q, int64_t N, linear_rows::Args a) {
  at::Tensor y = at::empty({a.M, N}, x.options());
  a.y = y.data_ptr<float>();
  a.ldy = N;
  if (a.M == 0 || N == 0) return y;
  const bool avx2 = use_avx2_fma() && __builtin_cpu_supports("f16c");
  if (a.M > kFusedMaxRows) {
    prefill<F>(q, a, N, avx2, avx2 && use_avx512());
    return y;
  }
  // the AVX-512 path permutes bytes (VBMI: Ice Lake, Zen 4 and later); AVX2 otherwise
  const bool avx512 = avx2 && use_avx512() && __builtin_cpu_supports("avx512vbmi");
  at::parallel_for(0, N, 4 * kGroupRows, [&](int64_t n_begin, int64_t n_end) {
    all_rows<F>(q, a, n_begin, n_end, N, avx2, avx512);
  });
  return y;
}

}  // namespace

// oneDNN's matmul on plain tensors (mkldnn::_linear_pointwise, registered where libtorch
// is built with oneDNN), or none: it picks its kernels by the CPU's ISA (AVX-512 where
// there is), where the BLAS behind at::mm may not.
static const c10::OperatorHandle* onednn_linear() {
  static const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findOp({"mkldnn::_linear_pointwise", ""});
  return op.has_value() ? &*op : nullptr;
}

void gemm_dequantized_tiles(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t N,
                            const float* bias, float* y, int64_t ldy,
                            const std::function<void(int64_t, int64_t, float*)>& dequant) {
  if (M == 0 || N == 0) return;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // tiles of about kPrefillTileWeights weights, a whole number of them per thread
  int64_t tiles = std::max<int64_t>(1, (N * K + kPrefillTileWeights - 1) / kPrefillTileWeights);
  tiles = (tiles + threads - 1) / threads * threads;
  const int64_t per = std::min(N, ((N + tiles - 1) / tiles + 7) / 8 * 8);
  tiles = (N + per - 1) / per;
  const at::TensorOptions opts = at::TensorOptions().dtype(at::kFloat);
  at::Tensor xs = at::from_blob(const_cast<float*>(x), {M, K}, {ldx, 1}, opts);
  if (ldx != K) xs = xs.contiguous();  // once, not per tile
  const c10::OperatorHandle* dnnl = onednn_linear();
  // the caller's dispatch state (inference mode, ...) for the GEMMs the worker threads run
  const at::ThreadLocalState state;
  at::parallel_for(0, tiles, 1, [&](int64_t t_begin, int64_t t_end) {
    const at::ThreadLocalStateGuard guard(state);
    thread_local std::vector<float> buffer;
    if (buffer.size() < static_cast<size_t>(per * K)) buffer.resize(static_cast<size_t>(per * K));
    float* w = buffer.data();
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t n0 = t * per, g = std::min(per, N - n0);
      dequant(n0, g, w);
      const at::Tensor wt = at::from_blob(w, {g, K}, opts);
      if (dnnl != nullptr) {
        std::vector<c10::IValue> stack{xs, wt, std::optional<at::Tensor>(), std::string("none"),
                                       c10::List<std::optional<c10::Scalar>>(),
                                       std::optional<std::string>()};
        dnnl->callBoxed(stack);
        const at::Tensor r = stack[0].toTensor().contiguous();  // [M, g]
        const float* rp = r.data_ptr<float>();
        for (int64_t m = 0; m < M; ++m) {
          std::memcpy(y + m * ldy + n0, rp + m * g, static_cast<size_t>(g) * sizeof(float));
        }
      } else {
        at::Tensor out = at::from_blob(y + n0, {M, g}, {ldy, 1}, opts);
        at::mm_out(out, xs, wt.t());
      }
      if (bias != nullptr) {
        for (int64_t m = 0; m < M; ++m) {
          float* row = y + m * ldy + n0;
          for (int64_t j = 0; j < g; ++j) row[j] += bias[n0 + j];
        }
      }
    }
  });
}

bool quant_blocks_supported(int64_t ggml_type) {
  return with_format(ggml_type, [](auto) {});
}

at::Tensor quant_linear_blocks_cpu(const at::Tensor& x, const at::Tensor& blocks,
                                   int64_t ggml_type, const std::optional<at::Tensor>& bias,
                                   const std::optional<at::Tensor>& norm_weight, double eps) {
  const int64_t K = x.size(1);
  int64_t weights = 0, bytes = 0;
  OSD_CHECK(with_format(ggml_type,
                        [&](auto f) {
                          weights = decltype(f)::kWeights;
                          bytes = decltype(f)::kBytes;
                        }),
            "quant_linear reads GGUF blocks of types 2 (Q4_0), 3 (Q4_1), 6 (Q5_0), 8 (Q8_0), "
            "12 (Q4_K) and 14 (Q6_K), got ggml_type ", ggml_type);
  OSD_CHECK(K % weights == 0, "ggml_type ", ggml_type, " holds rows of whole blocks of ", weights,
            " weights, got K = ", K);
  check_same_device(x, blocks, "x", "qweight");
  OSD_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                blocks.size(1) == K / weights * bytes,
            "qweight of ggml_type ", ggml_type, " must be contiguous uint8 blocks [N, ",
            K / weights * bytes, "], got ", blocks.scalar_type(), " ", blocks.sizes());
  const int64_t N = blocks.size(0);
  linear_rows::Args a;
  a.M = x.size(0);
  a.K = K;
  a.ldx = x.stride(0);
  a.x = x.data_ptr<float>();
  a.bias = linear_rows::bias_data(bias, x, N);
  const at::Tensor normed = linear_rows::apply_norm(a, x, norm_weight, eps);
  const Raw q{blocks.data_ptr<uint8_t>(), blocks.size(1), K / weights};
  at::Tensor y;
  with_format(ggml_type, [&](auto f) { y = run<decltype(f)>(x, q, N, a); });
  return y;
}

}  // namespace osd
