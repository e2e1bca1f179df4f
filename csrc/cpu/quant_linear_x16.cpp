// quant_linear on 16-row interleaved blocks with int8 activations (ggml_type 1002, 1003,
// 1008: Q4_0, Q4_1 and Q8_0 regrouped by osd_kernels.quant_linear.repack_x16).
//
// The float32 path (cpu/quant_linear_blocks.cpp) turns every weight into a float and
// multiplies it into each row of x with an FMA: exact, but a verify forward of a few rows
// is then bound by FMAs (16 a cycle a core). Here each row of x is quantized to int8 per
// block of 32 (dx = max|x| / 127, qx = round-half-even(x * (1 / dx)), sx = dx * sum(qx)), and
// a block's weights are multiplied as unsigned 8-bit codes u with VNNI's dot products of
// four bytes (64 multiply-adds an instruction), exactly in int32; then per block
//
//     acc = fma(float(isum), d * dx, acc);  acc = fma(m, sx, acc)
//
// where the block's weights are d * u + m (Q4_1: d and m as stored; Q4_0: m = -8 d, codes
// 0..15; Q8_0: u = code + 128, m = -128 d). So y = sum over blocks of (dequantized W) times
// (x as int8 times dx), blocks in ascending order, then + bias. Every step is exact or one
// IEEE rounding that the portable path repeats in the same order, so the AVX-512 path and
// the portable one agree bit for bit, and a row's result never depends on the other rows.
//
// Layout (uint8 [N, K / 32 * B], N a multiple of 16): weight rows in groups of 16; a
// group's blocks one after another, each the 16 rows' block b: the codes as 64-byte chunks,
// chunk j holding row r's codes 4j..4j+3 at bytes 4r..4r+3 (Q4_0 / Q4_1: 4 chunks of the
// file's bytes, low nibbles weights 4j.., high ones 16 + 4j..; Q8_0: 8 chunks of u), then
// the 16 rows' d as float16, then (Q4_1) their m. A group's block is B * 16 bytes, the
// file's own size.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "checks.h"
#include "cpu/fast_math.h"
#include "cpu/linear_rows.h"
#include "cpu/quant_linear_x16.h"
#include "cpu/row_dispatch.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define OSD_X16_VNNI \
  __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,avx512vnni,avx2,fma,f16c")))
#endif

namespace osd {
namespace {

constexpr int64_t kGroup = 16;  // weight rows a group (one float32 lane each)
// rows of x a pass over a group's blocks, at most: a pass holds 8 code registers, two per
// row (its dot product and its running sum) and the factors
constexpr int kPass = 10;

struct Format {
  int64_t base;       // the GGUF type: 2, 3 or 8
  int64_t bytes;      // a block's bytes a row (18, 20, 34)
  int64_t code_bytes; // a group's block's code bytes (256 or 512)
  bool nibbles;       // two 4-bit codes a byte
  float min_per_d;    // m = min_per_d * d (0: m stored after the d's)
};

bool format_of(int64_t ggml_type, Format* f) {
  switch (ggml_type) {
    case kX16Offset + 2: *f = {2, 18, 256, true, -8.0f}; return true;
    case kX16Offset + 3: *f = {3, 20, 256, true, 0.0f}; return true;
    case kX16Offset + 8: *f = {8, 34, 512, false, -128.0f}; return true;
    default: return false;
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// x [M, K] (ldx apart) -> qx int8 [M, K], dx and sx [M, K / 32].
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

void quantize_portable(const float* x, int64_t ldx, int64_t M, int64_t K, Quantized& out) {
  const int64_t nb = K / 32;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + m * ldx + 32 * b;
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(v[i] * id));
        out.q[m * K + 32 * b + i] = static_cast<int8_t>(q);
        sum += q;
      }
      out.d[m * nb + b] = d;
      out.s[m * nb + b] = d * static_cast<float>(sum);
    }
  }
}

// Row n0 + r of a group: the 16-row group starts at w, block b at w + b * 16 * bytes.
void group_portable(const Format& f, const uint8_t* w, int64_t nb, const Quantized& qx,
                    int64_t K, int64_t m0, int64_t rows, float* y, int64_t ldy,
                    const float* bias) {
  const int64_t gb_bytes = kGroup * f.bytes;
  for (int64_t m = m0; m < m0 + rows; ++m) {
    for (int64_t r = 0; r < kGroup; ++r) {
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* gb = w + b * gb_bytes;
        const int8_t* q = qx.q.data() + m * K + 32 * b;
        int32_t isum = 0;
        for (int64_t k = 0; k < 32; ++k) {
          const int64_t j = k / 4, i = k % 4;
          int32_t u;
          if (f.nibbles) {
            const uint8_t byte = gb[64 * (j % 4) + 4 * r + i];
            u = j < 4 ? (byte & 15) : (byte >> 4);
          } else {
            u = gb[64 * j + 4 * r + i];
          }
          isum += u * q[k];
        }
        const float d = half_at(gb + f.code_bytes + 2 * r);
        const float mn = f.min_per_d != 0.0f ? f.min_per_d * d
                                             : half_at(gb + f.code_bytes + 32 + 2 * r);
        acc = std::fma(static_cast<float>(isum), d * qx.d[m * (K / 32) + b], acc);
        acc = std::fma(mn, qx.s[m * (K / 32) + b], acc);
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
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      out.d[m * nb + b] = d;
      out.s[m * nb + b] = d * static_cast<float>(sum);
    }
  }
}

// MP rows of x (from m0) times a group of 16 weight rows: lane r of a register is row r.
template <int MP>
OSD_X16_VNNI void group_512(const Format& f, const uint8_t* w, int64_t nb, const Quantized& qx,
                            int64_t K, int64_t m0, float* y, int64_t ldy, const float* bias) {
  const int64_t gb_bytes = kGroup * f.bytes;
  const int64_t ns = K / 32;
  __m512 acc[MP];
  for (int m = 0; m < MP; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* gb = w + b * gb_bytes;
    _mm_prefetch(reinterpret_cast<const char*>(gb + 4 * gb_bytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(gb + 4 * gb_bytes + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(gb + 4 * gb_bytes + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(gb + 4 * gb_bytes + 192), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(gb + 4 * gb_bytes + 256), _MM_HINT_T0);
    __m512i c[8];
    if (f.nibbles) {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(gb + 64 * j);
        c[j] = _mm512_and_si512(v, low);
        c[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int j = 0; j < 8; ++j) c[j] = _mm512_loadu_si512(gb + 64 * j);
    }
    const __m512 d = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + f.code_bytes)));
    const __m512 mn =
        f.min_per_d != 0.0f
            ? _mm512_mul_ps(d, _mm512_set1_ps(f.min_per_d))
            : _mm512_cvtph_ps(
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + f.code_bytes + 32)));
    // the rows' dot products interleaved, one chain a row (plus a second for one row, to
    // keep a decode step's chain short); integer sums, so their order does not matter
    constexpr int kChains = MP == 1 ? 2 : 1;
    __m512i s[MP][kChains];
    const int32_t* q32[MP];
    for (int m = 0; m < MP; ++m) {
      q32[m] = reinterpret_cast<const int32_t*>(qx.q.data() + (m0 + m) * K + 32 * b);
      for (int h = 0; h < kChains; ++h) s[m][h] = _mm512_setzero_si512();
    }
    for (int j = 0; j < 8; ++j) {
      for (int m = 0; m < MP; ++m) {
        __m512i& acc_j = s[m][j % kChains];
        acc_j = _mm512_dpbusd_epi32(acc_j, c[j], _mm512_set1_epi32(q32[m][j]));
      }
    }
    for (int m = 0; m < MP; ++m) {
      const __m512i si = kChains == 1 ? s[m][0] : _mm512_add_epi32(s[m][0], s[m][kChains - 1]);
      const __m512 fs = _mm512_cvtepi32_ps(si);
      const int64_t at = (m0 + m) * ns + b;
      acc[m] = _mm512_fmadd_ps(fs, _mm512_mul_ps(d, _mm512_set1_ps(qx.d[at])), acc[m]);
      acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(qx.s[at]), acc[m]);
    }
  }
  const __m512 bv = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int m = 0; m < MP; ++m) {
    _mm512_storeu_ps(y + m * ldy, bias != nullptr ? _mm512_add_ps(acc[m], bv) : acc[m]);
  }
}
#pragma GCC diagnostic pop
#endif

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

at::Tensor quant_linear_x16_cpu(const at::Tensor& x, const at::Tensor& qweight, int64_t ggml_type,
                                const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& norm_weight, double eps) {
  Format f;
  OSD_CHECK(format_of(ggml_type, &f),
            "quant_linear reads 16-row interleaved blocks of types 1002 (Q4_0), 1003 (Q4_1) "
            "and 1008 (Q8_0), got ggml_type ",
            ggml_type);
  const int64_t K = x.size(1);
  OSD_CHECK(K % 32 == 0, "ggml_type ", ggml_type, " holds rows of whole blocks of 32 weights, got K = ",
            K);
  check_same_device(x, qweight, "x", "qweight");
  OSD_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous() &&
                qweight.size(1) == K / 32 * f.bytes && qweight.size(0) % kGroup == 0,
            "qweight of ggml_type ", ggml_type, " must be contiguous uint8 [N, ",
            K / 32 * f.bytes, "] with N a multiple of 16, got ", qweight.scalar_type(), " ",
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
  Quantized qx;
  qx.q.resize(static_cast<size_t>(M * K));
  qx.d.resize(static_cast<size_t>(M * nb));
  qx.s.resize(static_cast<size_t>(M * nb));
  const bool vnni = use_vnni();
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
  const int64_t passes = (M + kPass - 1) / kPass, per_pass = (M + passes - 1) / passes;
  at::parallel_for(0, groups, 4, [&](int64_t g_begin, int64_t g_end) {
    for (int64_t g = g_begin; g < g_end; ++g) {
      const uint8_t* gw = w + g * kGroup * qweight.size(1);
      const float* gbias = bias_p != nullptr ? bias_p + g * kGroup : nullptr;
      // every pass over the group's blocks reads them from L1 / L2 after the first
      for (int64_t m0 = 0; m0 < M; m0 += per_pass) {
        const int rows = static_cast<int>(std::min<int64_t>(per_pass, M - m0));
        float* yg = yp + m0 * N + g * kGroup;
#if defined(__x86_64__)
        if (vnni) {
          with_rows<kPass>(rows, [&](auto mr) {
            group_512<decltype(mr)::value>(f, gw, nb, qx, K, m0, yg, N, gbias);
          });
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
