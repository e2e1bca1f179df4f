// quant_linear on 16-row interleaved blocks with int8 activations (ggml_type 1002, 1003,
// 1006, 1008, 1012, 1014: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K regrouped by
// osd_kernels.quant_x16.repack_x16, whose docstring has the layout and the arithmetic).
//
// The float32 path (cpu/quant_linear_blocks.cpp) turns every weight into a float and
// multiplies it into each row of x with an FMA: exact, but a verify forward of a few rows
// is then bound by FMAs (16 a cycle a core). Here each row of x is quantized to int8 per
// block of 32 (dx = max|x| / 127, qx = round-half-even(x * (1 / dx)), sx = dx * sum(qx)
// per sub-block), and a block's weights are multiplied as unsigned 8-bit codes u with
// VNNI's dot products of four bytes (64 multiply-adds an instruction), exactly in int32;
// then per sub-block s (the whole block of 32, or Q6_K's two halves of 16)
//
//     acc = fma(float(isum_s), d_s * dx, acc);  acc = fma(m_s, sx_s, acc)
//
// where the sub-block's weights are d_s * u + m_s, both float32 values that ggml's own
// dequantization computes exactly (Q4_K: d * scale and -(dmin * min); Q6_K: d * scale and
// -32 d_s; the others their float16 d and m, or m = c * d). So y = sum over blocks of
// (dequantized W) times (x as int8 times dx), in ascending order, then + bias. Every step
// is exact or one IEEE rounding that the portable path repeats in the same order, so the
// AVX-512 path and the portable one agree bit for bit, and a row's result never depends
// on the other rows.
//
// Layout (uint8 [N, K / U * B], N a multiple of 16): weight rows in groups of 16; a
// group's blocks of 32 one after another (the K-quants: after each run of 8, the 16 rows'
// super-block factors first), each the 16 rows' block b: the codes as 64-byte chunks,
// chunk j holding row r's codes 4j..4j+3 at bytes 4r..4r+3 (nibble formats: 4 chunks,
// low nibbles codes 4j.., high ones 16 + 4j..; Q8_0: 8 chunks of u), the high bits
// above the nibbles (Q5_0: one chunk, bit j of byte 4r+i for code 4j+i; Q6_K: two, chunk
// h bits 2(j - 4h)..), then the block's factors.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "checks.h"
#include "cpu/fast_math.h"
#include "cpu/linear_rows.h"
#include "cpu/quant_linear_x16.h"
#include "cpu/quant_x16_format.h"
#include "cpu/row_dispatch.h"

namespace osd {
namespace {

using namespace x16;  // NOLINT: the block formats (cpu/quant_x16_format.h)

// rows of x a pass over a group's blocks, at most: a pass holds 8 code registers, two per
// row (its dot product and its running sum) and the factors
constexpr int kPass = 10;
// the same with two sub-blocks a block (two dot products a row): fewer rows, no spills
constexpr int kPassHalves = 6;


void quantize_portable(const float* x, int64_t ldx, int64_t M, int64_t K, Quantized& out) {
  const int64_t nb = K / 32;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + m * ldx + 32 * b;
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int32_t sum[2] = {0, 0};
      for (int i = 0; i < 32; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(v[i] * id));
        out.q[m * K + 32 * b + i] = static_cast<int8_t>(q);
        sum[i / 16] += q;
      }
      out.d[m * nb + b] = d;
      out.s[m * nb + b] = d * static_cast<float>(sum[0] + sum[1]);
      out.h[2 * (m * nb + b)] = d * static_cast<float>(sum[0]);
      out.h[2 * (m * nb + b) + 1] = d * static_cast<float>(sum[1]);
      out.n[2 * (m * nb + b)] = sum[0];
      out.n[2 * (m * nb + b) + 1] = sum[1];
    }
  }
}


void group_portable(const Format& f, const uint8_t* w, int64_t nb, const Quantized& qx,
                    int64_t K, int64_t m0, int64_t rows, float* y, int64_t ldy,
                    const float* bias) {
  const int subs = f.halves() ? 2 : 1, width = 32 / subs;
  for (int64_t m = m0; m < m0 + rows; ++m) {
    for (int64_t r = 0; r < kGroup; ++r) {
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const Block v = block_at(f, w, b);
        const int8_t* q = qx.q.data() + m * K + 32 * b;
        const float dx = qx.d[m * nb + b];
        for (int s = 0; s < subs; ++s) {
          int32_t isum = 0;
          for (int64_t k = s * width; k < (s + 1) * width; ++k) isum += code_of(f, v, r, k) * q[k];
          if (f.factors == Factors::kFloat) isum -= 128 * sub_sum(qx, m * nb + b, s, subs);
          float d = 0.0f, mn = 0.0f;
          factors_of(f, v, r, s, &d, &mn);
          const float sx = subs == 1 ? qx.s[m * nb + b] : qx.h[2 * (m * nb + b) + s];
          acc = std::fma(static_cast<float>(isum), d * dx, acc);
          acc = std::fma(mn, sx, acc);
        }
      }
      y[(m - m0) * ldy + r] = bias != nullptr ? acc + bias[r] : acc;
    }
  }
}

#if defined(__x86_64__)
// (GCC's _mm512 conversion intrinsics read an undefined register they then overwrite)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
OSD_X16_VNNI void quantize_512(const float* x, int64_t ldx, int64_t M, int64_t K,
                               Quantized& out) {
  const int64_t nb = K / 32;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + m * ldx + 32 * b;
      const __m512 a0 = _mm512_loadu_ps(v), a1 = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_andnot_ps(sign, a0), _mm512_andnot_ps(sign, a1)));
      const float d = amax / 127.0f;
      const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
      // round half to even: the default MXCSR mode, as nearbyint in the portable path
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, id));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, id));
      int8_t* dst = out.q.data() + m * K + 32 * b;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(q1));
      const int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
      out.d[m * nb + b] = d;
      out.s[m * nb + b] = d * static_cast<float>(s0 + s1);
      out.h[2 * (m * nb + b)] = d * static_cast<float>(s0);
      out.h[2 * (m * nb + b) + 1] = d * static_cast<float>(s1);
      out.n[2 * (m * nb + b)] = s0;
      out.n[2 * (m * nb + b) + 1] = s1;
    }
  }
}


// MP rows of x (from m0) times a group of 16 weight rows: lane r of a register is row r.
// Halves: two sub-blocks of 16 codes a block (Q6_K), registers 0-3 and 4-7.
template <int MP, bool Halves>
OSD_X16_VNNI void group_512(const Format& f, const uint8_t* w, int64_t nb, const Quantized& qx,
                            int64_t K, int64_t m0, float* y, int64_t ldy, const float* bias) {
  const int64_t ns = K / 32;
  const int64_t ahead = 4 * f.block_bytes();
  __m512 acc[MP];
  for (int m = 0; m < MP; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Block v = block_at(f, w, b);
    for (int64_t at = 0; at < f.block_bytes(); at += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(v.codes + ahead + at), _MM_HINT_T0);
    }
    __m512i c[8];
    codes_512(f, v, c);
    // the rows' dot products interleaved, one chain a row and sub-block (plus a second
    // for one row, to keep a decode step's chain short); integer sums, so their order
    // does not matter
    constexpr int kChains = (MP == 1 || Halves) ? 2 : 1;
    __m512i s[MP][kChains];
    const int32_t* q32[MP];
    for (int m = 0; m < MP; ++m) {
      q32[m] = reinterpret_cast<const int32_t*>(qx.q.data() + (m0 + m) * K + 32 * b);
      for (int h = 0; h < kChains; ++h) s[m][h] = _mm512_setzero_si512();
    }
    for (int j = 0; j < 8; ++j) {
      for (int m = 0; m < MP; ++m) {
        __m512i& acc_j = s[m][Halves ? j / 4 : j % kChains];
        acc_j = _mm512_dpbusd_epi32(acc_j, c[j], _mm512_set1_epi32(q32[m][j]));
      }
    }
    if constexpr (Halves) {
      __m512 d[2], mn[2];
      factors_512(f, v, 0, &d[0], &mn[0]);
      factors_512(f, v, 1, &d[1], &mn[1]);
      for (int m = 0; m < MP; ++m) {
        const int64_t at = (m0 + m) * ns + b;
        const __m512 dx = _mm512_set1_ps(qx.d[at]);
        for (int h = 0; h < 2; ++h) {
          const __m512i si =
              f.factors == Factors::kFloat
                  ? _mm512_sub_epi32(s[m][h], _mm512_set1_epi32(128 * qx.n[2 * at + h]))
                  : s[m][h];
          const __m512 fs = _mm512_cvtepi32_ps(si);
          acc[m] = _mm512_fmadd_ps(fs, _mm512_mul_ps(d[h], dx), acc[m]);
          acc[m] = _mm512_fmadd_ps(mn[h], _mm512_set1_ps(qx.h[2 * at + h]), acc[m]);
        }
      }
    } else {
      __m512 d, mn;
      factors_512(f, v, 0, &d, &mn);
      for (int m = 0; m < MP; ++m) {
        const __m512i si =
            kChains == 1 ? s[m][0] : _mm512_add_epi32(s[m][0], s[m][kChains - 1]);
        acc[m] = scale_block(f, qx, (m0 + m) * ns + b, si, d, mn, acc[m]);
      }
    }
  }
  const __m512 bv = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int m = 0; m < MP; ++m) {
    _mm512_storeu_ps(y + m * ldy, bias != nullptr ? _mm512_add_ps(acc[m], bv) : acc[m]);
  }
}
#pragma GCC diagnostic pop
#endif

// Calls of at least this many rows of x run on AMX tiles where the CPU has them (formats
// of one sub-block a block). A tile load, product and store cost a few nanoseconds each
// whatever the rows, and a block's sums go through memory to be scaled: with fewer rows
// VNNI's 8 dot products a row and block are as fast, and Q6_K's halves (twice the tiles)
// are slower on tiles (bench/bench_quant_linear.py -k amx).
constexpr int64_t kAmxMinRows = 32;

// AMX unless OSD_NO_AMX is set (read per call; tests set it to cover the VNNI paths).
bool use_amx() { return amx_available() && std::getenv("OSD_NO_AMX") == nullptr; }

bool use_vnni() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
  return has && use_avx512();
#else
  return false;
#endif
}

}  // namespace

bool x16_vnni_available() { return use_vnni(); }

bool x16_amx_available() { return use_vnni() && amx_available(); }

at::Tensor quant_linear_x16_cpu(const at::Tensor& x, const at::Tensor& qweight, int64_t ggml_type,
                                const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& norm_weight, double eps) {
  Format f;
  OSD_CHECK(format_of(ggml_type, &f),
            "quant_linear reads 16-row interleaved blocks of types 1002 (Q4_0), 1003 (Q4_1), "
            "1006 (Q5_0), 1008 (Q8_0), 1012 (Q4_K), 1014 (Q6_K), and codes with float32 "
            "factors 1132 / 1116 (groups of 32 / 16), got ggml_type ",
            ggml_type);
  const int64_t K = x.size(1);
  OSD_CHECK(K % f.unit == 0, "ggml_type ", ggml_type, " holds rows of whole blocks of ", f.unit,
            " weights, got K = ", K);
  check_same_device(x, qweight, "x", "qweight");
  OSD_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous() &&
                qweight.size(1) == K / f.unit * f.bytes && qweight.size(0) % kGroup == 0,
            "qweight of ggml_type ", ggml_type, " must be contiguous uint8 [N, ",
            K / f.unit * f.bytes, "] with N a multiple of 16, got ", qweight.scalar_type(), " ",
            qweight.sizes());
  const int64_t N = qweight.size(0), M = x.size(0), nb = K / 32;
  linear_rows::Args a;
  a.M = M;
  a.K = K;
  a.ldx = x.stride(0);
  a.x = x.data_ptr<float>();
  const float* bias_p = linear_rows::bias_data(bias, x, N);
  const at::Tensor normed = linear_rows::apply_norm(a, x, norm_weight, eps);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const bool vnni = use_vnni();
  const bool amx = vnni && M >= kAmxMinRows && !f.halves() && use_amx();
  const int64_t most = amx ? kAmxRows : f.halves() ? kPassHalves : kPass;
  const int64_t passes = (M + most - 1) / most, per_pass = (M + passes - 1) / passes;
  // AMX runs whole passes (one tile configuration a call): rows past M are zeros
  const int64_t Mq = amx ? passes * per_pass : M;
  Quantized qx;
  qx.q.resize(static_cast<size_t>(Mq * K));
  qx.d.resize(static_cast<size_t>(Mq * nb));
  qx.s.resize(static_cast<size_t>(Mq * nb));
  qx.h.resize(static_cast<size_t>(2 * Mq * nb));
  qx.n.resize(static_cast<size_t>(2 * Mq * nb));
#if defined(__x86_64__)
  if (vnni) {
    quantize_512(a.x, a.ldx, M, K, qx);
  } else {
    quantize_portable(a.x, a.ldx, M, K, qx);
  }
#else
  quantize_portable(a.x, a.ldx, M, K, qx);
#endif
  float* yp = y.data_ptr<float>();
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const int64_t groups = N / kGroup;
  at::parallel_for(0, groups, 4, [&](int64_t g_begin, int64_t g_end) {
    if (amx) {
      amx_configure(static_cast<int>(per_pass));
      for (int64_t g = g_begin; g < g_end; ++g) {
        amx_group(f, w + g * kGroup * qweight.size(1), nb, qx, K, M, static_cast<int>(per_pass),
                  yp + g * kGroup, N, bias_p != nullptr ? bias_p + g * kGroup : nullptr);
      }
      amx_release();
      return;
    }
    for (int64_t g = g_begin; g < g_end; ++g) {
      const uint8_t* gw = w + g * kGroup * qweight.size(1);
      const float* gbias = bias_p != nullptr ? bias_p + g * kGroup : nullptr;
      // every pass over the group's blocks reads them from L1 / L2 after the first
      for (int64_t m0 = 0; m0 < M; m0 += per_pass) {
        const int rows = static_cast<int>(std::min<int64_t>(per_pass, M - m0));
        float* yg = yp + m0 * N + g * kGroup;
#if defined(__x86_64__)
        if (vnni) {
          if (f.halves()) {
            with_rows<kPassHalves>(rows, [&](auto mr) {
              group_512<decltype(mr)::value, true>(f, gw, nb, qx, K, m0, yg, N, gbias);
            });
          } else {
            with_rows<kPass>(rows, [&](auto mr) {
              group_512<decltype(mr)::value, false>(f, gw, nb, qx, K, m0, yg, N, gbias);
            });
          }
          continue;
        }
#endif
        group_portable(f, gw, nb, qx, K, m0, rows, yg, N, gbias);
      }
    }
  });
  return y;
}

}  // namespace osd
