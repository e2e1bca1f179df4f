// quant_linear: checks and the C++ CPU kernel of y = x W^T + b for few rows, with W kept
// block-quantized in memory (the 4- and 8-bit formats of GGUF files).
//
// W's element (n, k) is q * scales[n, k / G] + mins[n, k / G] (mins absent: 0), q an
// unsigned 4-bit code (qweight uint8 [N, K / 2]: in each block of 32, byte j holds element
// j in its low nibble and element j + 16 in its high one, GGUF's Q4_0/Q4_1 order) or a
// signed 8-bit one (qweight int8 [N, K], Q8_0). G, the weights per scale, is 32 or 16
// (the K-quants whose sub-blocks are 16 weights: Q2_K, Q3_K, Q6_K); scales is [N, K / G]. Few-row decode and verify forwards are
// bound by reading W from DRAM: 4-bit codes with float32 scale and min per block are 0.75
// bytes a weight against float32's 4.
//
// The AVX2 and AVX-512 paths dequantize each block of 32 weights in registers and use it
// at once (block_fused, block_fused_512), in the order of decode_linear's AVX2 loop; the
// portable path dequantizes kGroup weight rows at a time into a buffer and runs
// decode_linear's portable loop over it (cpu/linear_rows.h). A code times a scale that came
// from float16 is exact in float32, so every path computes on exactly the dequantized
// weights and equals decode_linear on them bit for bit (AVX-512 and AVX2 agree as well).
// Past kFusedMaxRows rows (prefill) the weights are dequantized a tile at a time and
// multiplied by a GEMM, which then sets the summation order.
// With ggml_type != 0 the weight is a GGUF tensor's blocks as stored, which
// cpu/quant_linear_blocks.cpp multiplies by.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <optional>
#include <vector>

#include "checks.h"
#include "cpu/linear_rows.h"
#include "cpu/quant_linear_blocks.h"
#include "cpu/quant_linear_blocks_op.h"
#include "cpu/quant_linear_x16.h"

namespace osd {
namespace {

constexpr int64_t kBlock = 32;  // weights per block of codes (one or two scales, mins)
constexpr int64_t kGroup = 12;  // weight rows dequantized at a time (a multiple of 1..4)
// Up to this many rows the fused passes run (each pass of up to 12 rows dequantizes W
// again, in registers); more rows (prefill pieces, large batches) go to
// gemm_dequantized_tiles (cpu/quant_linear_blocks.h): cache-sized float32 tiles of weight
// rows, each multiplied by a GEMM on the thread that dequantized it.
constexpr int64_t kFusedMaxRows = 64;

struct QuantArgs {
  const uint8_t* q;      // [N, K / 2] (4-bit) or [N, K] (8-bit) codes
  const float* scales;   // [N, K / G]
  const float* mins;     // [N, K / G] or nullptr
  int64_t K;
  int bits;              // 4 or 8
  int halves;            // scales per block of 32: 1 (G = 32) or 2 (G = 16)
};

// Weight rows [n, n + rows) into out [rows, K].
void dequant_portable(const QuantArgs& a, int64_t n, int64_t rows, float* out) {
  const int64_t nb = a.K / kBlock;
  for (int64_t r = n; r < n + rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      float* o = out + (r - n) * a.K + b * kBlock;
      for (int h = 0; h < 2; ++h) {  // weights 16h .. 16h + 15 of the block
        const int64_t at = (r * nb + b) * a.halves + (a.halves == 2 ? h : 0);
        const float d = a.scales[at];
        const float m = a.mins != nullptr ? a.mins[at] : 0.0f;
        if (a.bits == 4) {
          const uint8_t* src = a.q + r * (a.K / 2) + b * (kBlock / 2);
          for (int j = 0; j < 16; ++j) {
            o[16 * h + j] = static_cast<float>(h == 0 ? src[j] & 0xF : src[j] >> 4) * d + m;
          }
        } else {
          const int8_t* src = reinterpret_cast<const int8_t*>(a.q) + r * a.K + b * kBlock;
          for (int j = 16 * h; j < 16 * h + 16; ++j) o[j] = static_cast<float>(src[j]) * d + m;
        }
      }
    }
  }
}

#if defined(__x86_64__)
// The codes of one block of 32 weights of one weight row, unpacked on demand 8 at a time:
// element 8s + i is lane i of step(s).
template <int BITS>
struct Codes {
  __m128i a, b;  // 4-bit: low and high nibbles; 8-bit: bytes 0..15 and 16..31

  OSD_AVX2 inline void load(const uint8_t* src) {
    if constexpr (BITS == 4) {
      const __m128i low4 = _mm_set1_epi8(0x0F);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      a = _mm_and_si128(raw, low4);
      b = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
    } else {
      a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    }
  }

  OSD_AVX2 inline __m256 step(int s) const {
    const __m128i half = s < 2 ? a : b;
    const __m128i part = (s & 1) ? _mm_srli_si128(half, 8) : half;
    return _mm256_cvtepi32_ps(BITS == 4 ? _mm256_cvtepu8_epi32(part)
                                        : _mm256_cvtepi8_epi32(part));
  }
};

// Weight rows [n, n + rows) into out [rows, K], as dequant_portable.
template <int BITS>
OSD_AVX2 void dequant_avx2(const QuantArgs& q, int64_t n, int64_t rows, float* out) {
  constexpr int64_t kCodeBytes = BITS * kBlock / 8;
  const int64_t nb = q.K / kBlock;
  for (int64_t r = n; r < n + rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      Codes<BITS> codes;
      codes.load(q.q + (r * nb + b) * kCodeBytes);
      float* o = out + (r - n) * q.K + b * kBlock;
      for (int s = 0; s < 4; ++s) {
        // steps 0, 1 are weights 0..15 of the block, steps 2, 3 weights 16..31
        const int64_t at = (r * nb + b) * q.halves + (q.halves == 2 ? s / 2 : 0);
        const __m256 d = _mm256_set1_ps(q.scales[at]);
        const __m256 m = _mm256_set1_ps(q.mins != nullptr ? q.mins[at] : 0.0f);
        _mm256_storeu_ps(o + 8 * s, _mm256_fmadd_ps(codes.step(s), d, m));
      }
    }
  }
}

// Fused: the block's weights are dequantized in registers and used at once, in the order
// of decode_linear's AVX2 loop (k ascending, one running sum per row and weight row, the
// same final reduction), so the result equals it on the dequantized matrix bit for bit.
// H: scales per block of 32 (1, or 2 for 16-weight groups: steps 0, 1 use the first).
template <int M, int NB, int BITS, int H>
OSD_AVX2 void block_fused(const QuantArgs& q, const linear_rows::Args& a, const float* x,
                          float* y, int64_t n0, int64_t N) {
  constexpr int64_t kCodeBytes = BITS * kBlock / 8;  // bytes of codes per block
  const int64_t nb = a.K / kBlock;
  const int64_t row_bytes = nb * kCodeBytes;
  __m256 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  // The codes of the block of rows linear_rows::kPrefetchBlocks blocks ahead, streamed in
  // step with this one.
  const char* ahead = reinterpret_cast<const char*>(q.q) +
      std::min<int64_t>(n0 + linear_rows::kPrefetchBlocks * NB, N - NB) * row_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    const char* p = ahead + b * kCodeBytes * NB;
    _mm_prefetch(p, _MM_HINT_T0);
    if constexpr (kCodeBytes * NB > 64) _mm_prefetch(p + 64, _MM_HINT_T0);
    Codes<BITS> codes[NB];
    __m256 d[NB][H], mn[NB][H];
    for (int j = 0; j < NB; ++j) {
      const int64_t r = n0 + j;
      codes[j].load(q.q + r * row_bytes + b * kCodeBytes);
      for (int h = 0; h < H; ++h) {
        const int64_t at = (r * nb + b) * H + h;
        d[j][h] = _mm256_set1_ps(q.scales[at]);
        mn[j][h] = _mm256_set1_ps(q.mins != nullptr ? q.mins[at] : 0.0f);
      }
    }
    for (int s = 0; s < 4; ++s) {
      const int64_t k = b * kBlock + 8 * s;
      const int h = H == 2 ? s / 2 : 0;
      __m256 w[NB];
      for (int j = 0; j < NB; ++j) w[j] = _mm256_fmadd_ps(codes[j].step(s), d[j][h], mn[j][h]);
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * a.ldx + k);
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_fmadd_ps(xv, w[j], acc[m][j]);
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

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_* values, which its
// (maybe-)uninitialized warnings report.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// AVX-512: two weight rows per register, row j in lanes 0..7 and row j + 1 in lanes 8..15,
// each input step broadcast to both halves. Each half performs exactly the operations of
// block_fused's register for its row, so the two ISA paths agree bit for bit, at half the
// instructions per weight.
template <int BITS>
struct CodePair {
  __m128i a0, b0, a1, b1;  // Codes<BITS>::a, b of the two rows

  OSD_AVX512 inline void load(const uint8_t* row0, const uint8_t* row1) {
    Codes<BITS> c0, c1;
    c0.load(row0);
    c1.load(row1);
    a0 = c0.a, b0 = c0.b, a1 = c1.a, b1 = c1.b;
  }

  OSD_AVX512 inline __m512 step(int s) const {
    const __m128i h0 = s < 2 ? a0 : b0, h1 = s < 2 ? a1 : b1;
    const __m128i both = (s & 1) ? _mm_unpackhi_epi64(h0, h1) : _mm_unpacklo_epi64(h0, h1);
    return _mm512_cvtepi32_ps(BITS == 4 ? _mm512_cvtepu8_epi32(both)
                                        : _mm512_cvtepi8_epi32(both));
  }
};

OSD_AVX512 inline __m512 pair_of(float lo, float hi) {
  return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1);
}

template <int M, int NP, int BITS, int H>
OSD_AVX512 void block_fused_512(const QuantArgs& q, const linear_rows::Args& a, const float* x,
                                float* y, int64_t n0, int64_t N) {
  constexpr int NB = 2 * NP;
  constexpr int64_t kCodeBytes = BITS * kBlock / 8;
  const int64_t nb = a.K / kBlock;
  const int64_t row_bytes = nb * kCodeBytes;
  __m512 acc[M][NP];
  for (int m = 0; m < M; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(q.q) +
      std::min<int64_t>(n0 + linear_rows::kPrefetchBlocks * NB, N - NB) * row_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    const char* pf = ahead + b * kCodeBytes * NB;
    _mm_prefetch(pf, _MM_HINT_T0);
    if constexpr (kCodeBytes * NB > 64) _mm_prefetch(pf + 64, _MM_HINT_T0);
    CodePair<BITS> codes[NP];
    __m512 d[NP][H], mn[NP][H];
    for (int p = 0; p < NP; ++p) {
      const int64_t r = n0 + 2 * p;
      codes[p].load(q.q + r * row_bytes + b * kCodeBytes,
                    q.q + (r + 1) * row_bytes + b * kCodeBytes);
      for (int h = 0; h < H; ++h) {
        const int64_t at0 = (r * nb + b) * H + h, at1 = ((r + 1) * nb + b) * H + h;
        d[p][h] = pair_of(q.scales[at0], q.scales[at1]);
        mn[p][h] = q.mins != nullptr ? pair_of(q.mins[at0], q.mins[at1]) : _mm512_setzero_ps();
      }
    }
    for (int s = 0; s < 4; ++s) {
      const int64_t k = b * kBlock + 8 * s;
      const int h = H == 2 ? s / 2 : 0;
      __m512 w[NP];
      for (int p = 0; p < NP; ++p) w[p] = _mm512_fmadd_ps(codes[p].step(s), d[p][h], mn[p][h]);
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + m * a.ldx + k));
        for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_fmadd_ps(xv, w[p], acc[m][p]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int p = 0; p < NP; ++p) {
      for (int half = 0; half < 2; ++half) {
        const __m256 v = half == 0 ? _mm512_castps512_ps256(acc[m][p])
                                   : _mm512_extractf32x8_ps(acc[m][p], 1);
        const int64_t n = n0 + 2 * p + half;
        y[m * a.ldy + n] = linear_rows::hsum8(v) + (a.bias != nullptr ? a.bias[n] : 0.0f);
      }
    }
  }
}

#pragma GCC diagnostic pop

// Register pairs per AVX-512 block: M * NP sums + 6 NP code, scale and min registers + 2
// of the 32.
template <int M>
constexpr int fused_pairs() {
  return M <= 6 ? 2 : 1;
}

template <int M, int BITS, int H>
OSD_AVX512 void pass_fused_512(const QuantArgs& q, const linear_rows::Args& a, const float* x,
                               float* y, int64_t n_begin, int64_t n_end, int64_t N) {
  // groups of 16 hold twice the scale and min registers: one pair per block then
  constexpr int NP = H == 2 ? 1 : fused_pairs<M>();
  int64_t n = n_begin;
  for (; n + 2 * NP <= n_end; n += 2 * NP) block_fused_512<M, NP, BITS, H>(q, a, x, y, n, N);
  for (; n + 2 <= n_end; n += 2) block_fused_512<M, 1, BITS, H>(q, a, x, y, n, N);
  for (; n < n_end; ++n) block_fused<M, 1, BITS, H>(q, a, x, y, n, N);
}

// Weight rows per fused block for a pass of M rows: M * NB sums + 4 NB code, scale and
// min registers + 2 in the 16 vector registers of AVX2.
template <int M>
constexpr int fused_block_rows() {
  return M <= 2 ? 2 : 1;
}

template <int M, int BITS, int H>
OSD_AVX2 void pass_fused(const QuantArgs& q, const linear_rows::Args& a, const float* x,
                         float* y, int64_t n_begin, int64_t n_end, int64_t N) {
  constexpr int NB = H == 2 ? 1 : fused_block_rows<M>();
  int64_t n = n_begin;
  for (; n + NB <= n_end; n += NB) block_fused<M, NB, BITS, H>(q, a, x, y, n, N);
  for (; n < n_end; ++n) block_fused<M, 1, BITS, H>(q, a, x, y, n, N);
}

template <int M, int BITS>
void pass_any(const QuantArgs& q, const linear_rows::Args& a, const float* x, float* y,
              int64_t n_begin, int64_t n_end, int64_t N, bool avx512) {
  if (q.halves == 2) {
    if (avx512) return pass_fused_512<M, BITS, 2>(q, a, x, y, n_begin, n_end, N);
    return pass_fused<M, BITS, 2>(q, a, x, y, n_begin, n_end, N);
  }
  if (avx512) return pass_fused_512<M, BITS, 1>(q, a, x, y, n_begin, n_end, N);
  pass_fused<M, BITS, 1>(q, a, x, y, n_begin, n_end, N);
}

template <int BITS>
void run_pass_fused(const QuantArgs& q, const linear_rows::Args& a, int64_t row, int rows,
                    int64_t n_begin, int64_t n_end, int64_t N, bool avx512) {
  const float* x = a.x + row * a.ldx;
  float* y = a.y + row * a.ldy;
  switch (rows) {
    case 1: pass_any<1, BITS>(q, a, x, y, n_begin, n_end, N, avx512); break;
    case 2: pass_any<2, BITS>(q, a, x, y, n_begin, n_end, N, avx512); break;
    case 3: pass_any<3, BITS>(q, a, x, y, n_begin, n_end, N, avx512); break;
    case 4: pass_any<4, BITS>(q, a, x, y, n_begin, n_end, N, avx512); break;
    case 5: pass_any<5, BITS>(q, a, x, y, n_begin, n_end, N, avx512); break;
    case 6: pass_any<6, BITS>(q, a, x, y, n_begin, n_end, N, avx512); break;
    case 7: pass_any<7, BITS>(q, a, x, y, n_begin, n_end, N, avx512); break;
    case 8: pass_any<8, BITS>(q, a, x, y, n_begin, n_end, N, avx512); break;
    case 9: pass_any<9, BITS>(q, a, x, y, n_begin, n_end, N, avx512); break;
    case 10: pass_any<10, BITS>(q, a, x, y, n_begin, n_end, N, avx512); break;
    case 11: pass_any<11, BITS>(q, a, x, y, n_begin, n_end, N, avx512); break;
    default: pass_any<12, BITS>(q, a, x, y, n_begin, n_end, N, avx512); break;
  }
}

// Every row of x (as linear_rows::all_rows splits them) over weight rows [n_begin, n_end).
void all_rows_fused(const QuantArgs& q, const linear_rows::Args& a, int64_t n_begin,
                    int64_t n_end, int64_t N, bool avx512) {
  const int64_t passes = (a.M + linear_rows::kMaxPass - 1) / linear_rows::kMaxPass;
  const int64_t per_pass = (a.M + passes - 1) / passes;
  for (int64_t row = 0; row < a.M; row += per_pass) {
    const int rows = static_cast<int>(std::min<int64_t>(per_pass, a.M - row));
    if (q.bits == 4) {
      run_pass_fused<4>(q, a, row, rows, n_begin, n_end, N, avx512);
    } else {
      run_pass_fused<8>(q, a, row, rows, n_begin, n_end, N, avx512);
    }
  }
}
#endif

at::Tensor quant_linear_cpu(const at::Tensor& x, const at::Tensor& qweight,
                            const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& norm_weight, double eps,
                            int64_t ggml_type) {
  OSD_CHECK(x.device().is_cpu(), "quant_linear CPU kernel got a ", x.device(), " tensor");
  check_dtype(x, at::kFloat, "x");
  OSD_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows, got ",
            x.sizes(), " strides ", x.strides());
  // GGUF blocks as stored (cpu/quant_linear_blocks.cpp); scales and mins are not read
  if (ggml_type >= kX16Offset) {
    return quant_linear_x16_cpu(x, qweight, ggml_type, bias, norm_weight, eps);
  }
  if (ggml_type != 0) {
    return quant_linear_blocks_cpu(x, qweight, ggml_type, bias, norm_weight, eps);
  }
  const int64_t K = x.size(1);
  OSD_CHECK(K % kBlock == 0, "quant_linear needs K to be a multiple of ", kBlock, ", got ", K);
  OSD_CHECK(qweight.dim() == 2 && qweight.is_contiguous(),
            "qweight must be contiguous [N, K / 2] uint8 or [N, K] int8, got ", qweight.sizes());
  int bits = 0;
  if (qweight.scalar_type() == at::kByte) {
    bits = 4;
    OSD_CHECK(qweight.size(1) * 2 == K, "4-bit qweight must be [N, K / 2 = ", K / 2,
              "], got ", qweight.sizes());
  } else if (qweight.scalar_type() == at::kChar) {
    bits = 8;
    OSD_CHECK(qweight.size(1) == K, "8-bit qweight must be [N, K = ", K, "], got ",
              qweight.sizes());
  } else {
    OSD_CHECK(false, "qweight must be uint8 (4-bit codes) or int8 (8-bit codes), got ",
              qweight.scalar_type());
  }
  const int64_t N = qweight.size(0);
  check_same_device(x, qweight, "x", "qweight");
  check_dtype(scales, at::kFloat, "scales");
  check_same_device(x, scales, "x", "scales");
  OSD_CHECK(scales.dim() == 2 && scales.size(0) == N &&
                (scales.size(1) == K / kBlock || scales.size(1) == 2 * K / kBlock) &&
                scales.is_contiguous(),
            "scales must be contiguous [N=", N, ", K / 32=", K / kBlock, "] or [N, K / 16=",
            2 * K / kBlock, "], got ", scales.sizes());
  const int halves = scales.size(1) == K / kBlock ? 1 : 2;
  QuantArgs q{static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(), nullptr,
              K, bits, halves};
  if (mins.has_value()) {
    check_dtype(*mins, at::kFloat, "mins");
    check_same_device(x, *mins, "x", "mins");
    OSD_CHECK(mins->sizes() == scales.sizes() && mins->is_contiguous(),
              "mins must be contiguous like scales ", scales.sizes(), ", got ", mins->sizes());
    q.mins = mins->data_ptr<float>();
  }
  linear_rows::Args a;
  a.M = x.size(0);
  a.K = K;
  a.ldx = x.stride(0);
  a.x = x.data_ptr<float>();
  const float* bias_ptr = linear_rows::bias_data(bias, x, N);
  const at::Tensor normed = linear_rows::apply_norm(a, x, norm_weight, eps);
  at::Tensor y = at::empty({a.M, N}, x.options());
  float* y_ptr = y.data_ptr<float>();
  a.ldy = N;
  if (a.M > kFusedMaxRows) {
    const bool avx2 = use_avx2_fma();
    gemm_dequantized_tiles(a.x, a.ldx, a.M, K, N, bias_ptr, y_ptr, N,
                           [&](int64_t n0, int64_t g, float* out) {
#if defined(__x86_64__)
                             if (avx2) {
                               if (bits == 4) return dequant_avx2<4>(q, n0, g, out);
                               return dequant_avx2<8>(q, n0, g, out);
                             }
#endif
                             (void)avx2;
                             dequant_portable(q, n0, g, out);
                           });
    return y;
  }
  if (a.M > 0 && N > 0) {
    const bool avx2 = use_avx2_fma();
    const bool avx512 = use_avx512();
    at::parallel_for(0, N, 4 * kGroup, [&](int64_t n_begin, int64_t n_end) {
#if defined(__x86_64__)
      if (avx2) {
        linear_rows::Args g = a;
        g.y = y_ptr;
        g.bias = bias_ptr;
        return all_rows_fused(q, g, n_begin, n_end, N, avx512);
      }
#endif
      thread_local std::vector<float> buffer;
      buffer.resize(static_cast<size_t>(kGroup * K));
      for (int64_t n = n_begin; n < n_end; n += kGroup) {
        const int64_t rows = std::min(kGroup, n_end - n);
        dequant_portable(q, n, rows, buffer.data());
        linear_rows::Args g = a;  // the group's rows of W, bias and y
        g.w = buffer.data();
        g.N = rows;
        g.bias = bias_ptr != nullptr ? bias_ptr + n : nullptr;
        g.y = y_ptr + n;
        linear_rows::all_rows(g, 0, rows, false);
      }
    });
  }
  return y;
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_IMPL(osd, CPU, m) { m.impl("quant_linear", &osd::quant_linear_cpu); }
