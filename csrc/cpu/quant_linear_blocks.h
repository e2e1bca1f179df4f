// GGUF block formats read as stored by quant_linear (ggml_type != 0): how one unit of a
// weight row (a block of 32 weights, or a K-quant super-block of 256) turns into unsigned
// 8-bit codes and float32 factors, so that weight i of the unit is
//
//     codes[i] * scale[i / G] + min[i / G]
//
// with the scales computed in float32 as osd/models/gguf/blocks.py (after ggml's
// dequantize_row_*) computes them, and a format's signed codes q made unsigned by an offset
// o (q + o) that the min takes back (-o * scale; Q4_K's min is its own -dmin * m). A scale
// is a float16 value times an integer of at most 8 bits and a code has at most 8 bits, so
// code * scale and o * scale are exact in float32, and code * scale + min rounds once to
// the reference's weight (exactly it where, as for every format but Q4_1 and Q4_K, that
// weight is q * scale): the fused kernels (fmadd) and the portable path (the reference's
// own arithmetic) compute exactly the dequantizer's weights.
//
// Per format F: F::kType (the ggml type id), F::kWeights and F::kBytes (per unit),
// F::kGroup (G: weights per factor, 32 or 16), F::kPairLayout (how the AVX-512 path holds
// two rows' codes of a sub-block: 0, [row n's 32 | row n + 1's 32] from codes(); 1, the
// nibble formats' pair_codes(u0, u1, j), see nibble_pairs), and
//   codes(unit, j)          (AVX2) the 32 codes of sub-block j (weights 32j..32j+31) as the
//                           bytes of a __m256i, in weight order;
//   factors(unit, sc, mn)   (AVX2) the unit's kWeights / G scales and mins, float32;
//   dequant(unit, out)      (portable) the unit's weights, float32, in order;
// and the formats of blocks of 32 (one scale a block, an fp16 at byte 0) say where their
// min is: an fp16 at byte kMinAt, or (kMinAt < 0) -kOffset * scale.
#pragma once
#include <c10/util/Half.h>
#include <cstdint>
#include <cstring>
#include <functional>

#include "cpu/fast_math.h"

#if defined(__x86_64__)
#include <immintrin.h>
// The block kernels convert float16 factors with F16C (every AVX2 CPU has it).
#define OSD_BLK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define OSD_BLK_VBMI \
  __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,avx512vbmi,avx2,fma,f16c")))
// AVX-512 without VBMI (the prefill dequantizer widens bytes 16 at a time, permutes none)
#define OSD_BLK_512 \
  __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma,f16c")))
#endif

namespace osd {
namespace gguf_blocks {

enum Type : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

#if defined(__x86_64__)
OSD_BLK_AVX2 inline float half_at_f16c(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

OSD_BLK_AVX2 inline __m256i nibbles_16(const uint8_t* p) {  // lows then highs of 16 bytes
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low4), _mm_and_si128(raw, low4));
}

// The pair form of two rows' 32-weight blocks of nibbles (kPairLayout 1): [row n's weights
// 0..15 | row n + 1's 0..15 | row n's 16..31 | row n + 1's 16..31], a byte each.
OSD_BLK_VBMI inline __m512i nibble_pairs(const uint8_t* q0, const uint8_t* q1) {
  const __m256i both = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(q1),
                                           reinterpret_cast<const __m128i*>(q0));
  const __m512i z =
      _mm512_inserti64x4(_mm512_castsi256_si512(both), _mm256_srli_epi16(both, 4), 1);
  return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
}
#endif

// Q4_0: fp16 d, 16 bytes of nibbles (byte j: weights j and j + 16); w = (q - 8) d.
struct Q4_0 {
  static constexpr int64_t kType = kQ4_0, kWeights = 32, kBytes = 18;
  static constexpr int64_t kGroup = 32;  // weights per factor
  static constexpr int kPairLayout = 1;
  // the fp16 scale is at byte 0; the min: the fp16 at kMinAt, or -kOffset * scale
  static constexpr int kMinAt = -1;
  static constexpr float kOffset = 8.0f;
  #if defined(__x86_64__)
  OSD_BLK_AVX2 static __m256i codes(const uint8_t* u, int) { return nibbles_16(u + 2); }
  OSD_BLK_VBMI static __m512i pair_codes(const uint8_t* u0, const uint8_t* u1, int) {
    return nibble_pairs(u0 + 2, u1 + 2);
  }
  OSD_BLK_AVX2 static void factors(const uint8_t* u, float* sc, float* mn) {
    sc[0] = half_at_f16c(u);
    mn[0] = -8.0f * sc[0];
  }
#endif
  static void dequant(const uint8_t* u, float* out) {
    const float d = half_at(u);
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<float>((u[2 + j] & 0xF) - 8) * d;
      out[j + 16] = static_cast<float>((u[2 + j] >> 4) - 8) * d;
    }
  }
};

// Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; w = q d + m.
struct Q4_1 {
  static constexpr int64_t kType = kQ4_1, kWeights = 32, kBytes = 20;
  static constexpr int64_t kGroup = 32;  // weights per factor
  static constexpr int kPairLayout = 1;
  // the fp16 scale is at byte 0; the min: the fp16 at kMinAt, or -kOffset * scale
  static constexpr int kMinAt = 2;
  static constexpr float kOffset = 0.0f;
  #if defined(__x86_64__)
  OSD_BLK_AVX2 static __m256i codes(const uint8_t* u, int) { return nibbles_16(u + 4); }
  OSD_BLK_VBMI static __m512i pair_codes(const uint8_t* u0, const uint8_t* u1, int) {
    return nibble_pairs(u0 + 4, u1 + 4);
  }
  OSD_BLK_AVX2 static void factors(const uint8_t* u, float* sc, float* mn) {
    sc[0] = half_at_f16c(u);
    mn[0] = half_at_f16c(u + 2);
  }
#endif
  static void dequant(const uint8_t* u, float* out) {
    const float d = half_at(u), m = half_at(u + 2);
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<float>(u[4 + j] & 0xF) * d + m;
      out[j + 16] = static_cast<float>(u[4 + j] >> 4) * d + m;
    }
  }
};

// Q5_0: fp16 d, u32 of fifth bits (bit j: weight j), 16 bytes of nibbles; w = (q - 16) d.
struct Q5_0 {
  static constexpr int64_t kType = kQ5_0, kWeights = 32, kBytes = 22;
  static constexpr int64_t kGroup = 32;  // weights per factor
  static constexpr int kPairLayout = 1;
  // the fp16 scale is at byte 0; the min: the fp16 at kMinAt, or -kOffset * scale
  static constexpr int kMinAt = -1;
  static constexpr float kOffset = 16.0f;
  #if defined(__x86_64__)
  OSD_BLK_AVX2 static __m256i codes(const uint8_t* u, int) {
    uint32_t qh;
    std::memcpy(&qh, u + 2, 4);
    // byte i of the result holds bit i of qh: spread qh's bytes 8 lanes each, keep one
    // bit per lane (ggml's bytes_from_bits_32)
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(qh)),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
    const __m256i high = _mm256_and_si256(
        _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nibbles_16(u + 6), high);
  }
  OSD_BLK_VBMI static __m512i pair_codes(const uint8_t* u0, const uint8_t* u1, int) {
    // the fifth bits of both rows in every qword, each byte of the pair form picking the
    // byte of them that holds its weight's bit (see nibble_pairs for the order)
    uint32_t h0, h1;
    std::memcpy(&h0, u0 + 2, 4);
    std::memcpy(&h1, u1 + 2, 4);
    const __m512i bits = _mm512_set1_epi64(static_cast<int64_t>(h0 | (uint64_t{h1} << 32)));
    const __m512i pick = _mm512_set_epi64(0x0707070707070707, 0x0606060606060606,
                                          0x0303030303030303, 0x0202020202020202,
                                          0x0505050505050505, 0x0404040404040404,
                                          0x0101010101010101, 0);
    const __m512i bit = _mm512_set1_epi64(static_cast<int64_t>(0x8040201008040201ULL));
    const __mmask64 set = _mm512_test_epi8_mask(_mm512_shuffle_epi8(bits, pick), bit);
    const __m512i low = nibble_pairs(u0 + 6, u1 + 6);
    return _mm512_mask_add_epi8(low, set, low, _mm512_set1_epi8(16));
  }
  OSD_BLK_AVX2 static void factors(const uint8_t* u, float* sc, float* mn) {
    sc[0] = half_at_f16c(u);
    mn[0] = -16.0f * sc[0];
  }
#endif
  static void dequant(const uint8_t* u, float* out) {
    const float d = half_at(u);
    uint32_t qh;
    std::memcpy(&qh, u + 2, 4);
    for (int j = 0; j < 16; ++j) {
      const int lo = (u[6 + j] & 0xF) | static_cast<int>(((qh >> j) & 1) << 4);
      const int hi = (u[6 + j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1) << 4);
      out[j] = static_cast<float>(lo - 16) * d;
      out[j + 16] = static_cast<float>(hi - 16) * d;
    }
  }
};

// Q8_0: fp16 d, 32 int8 codes; w = q d.
struct Q8_0 {
  static constexpr int64_t kType = kQ8_0, kWeights = 32, kBytes = 34;
  static constexpr int64_t kGroup = 32;  // weights per factor
  static constexpr int kPairLayout = 0;
  // the fp16 scale is at byte 0; the min: the fp16 at kMinAt, or -kOffset * scale
  static constexpr int kMinAt = -1;
  static constexpr float kOffset = 128.0f;
  #if defined(__x86_64__)
  OSD_BLK_AVX2 static __m256i codes(const uint8_t* u, int) {  // q + 128
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 2));
    return _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
  }
  OSD_BLK_AVX2 static void factors(const uint8_t* u, float* sc, float* mn) {
    sc[0] = half_at_f16c(u);
    mn[0] = -128.0f * sc[0];
  }
#endif
  static void dequant(const uint8_t* u, float* out) {
    const float d = half_at(u);
    for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(static_cast<int8_t>(u[2 + j])) * d;
  }
};

// Q4_K: fp16 d, fp16 dmin, 12 bytes of six-bit scales and mins (8 each), 128 bytes of
// nibbles: sub-block j (32 weights) is the low (j even) or high (j odd) nibbles of bytes
// 32 (j / 2) .. 32 (j / 2) + 31. w = q (d sc_j) - (dmin m_j).
struct Q4_K {
  static constexpr int64_t kType = kQ4_K, kWeights = 256, kBytes = 144;
  static constexpr int64_t kGroup = 32;  // weights per factor
  static constexpr int kPairLayout = 0;
    // ggml's get_scale_min_k4
  static void scale_min(const uint8_t* s, int j, int* sc, int* m) {
    if (j < 4) {
      *sc = s[j] & 63;
      *m = s[j + 4] & 63;
    } else {
      *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
      *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
  }
#if defined(__x86_64__)
  OSD_BLK_AVX2 static __m256i codes(const uint8_t* u, int j) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 16 + 32 * (j / 2)));
    const __m256i shifted = (j & 1) ? _mm256_srli_epi16(raw, 4) : raw;
    return _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F));
  }
  OSD_BLK_AVX2 static void factors(const uint8_t* u, float* sc, float* mn) {
    // the 8 six-bit scales to bytes 0..7 and the 8 mins to bytes 8..15 (ggml's utmp
    // shuffle in the AVX2 dot product), then to float32 8 at a time
    uint32_t t[4];
    std::memcpy(t, u + 4, 12);
    t[3] = ((t[2] >> 4) & 0x0F0F0F0F) | (((t[1] >> 6) & 0x03030303) << 4);
    const uint32_t mins_low = t[1] & 0x3F3F3F3F;
    t[1] = (t[2] & 0x0F0F0F0F) | (((t[0] >> 6) & 0x03030303) << 4);
    t[2] = mins_low;
    t[0] &= 0x3F3F3F3F;
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t));
    const __m256 s8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    const __m256 m8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
    _mm256_storeu_ps(sc, _mm256_mul_ps(_mm256_set1_ps(half_at_f16c(u)), s8));
    const __m256 neg = _mm256_mul_ps(_mm256_set1_ps(half_at_f16c(u + 2)), m8);
    _mm256_storeu_ps(mn, _mm256_xor_ps(neg, _mm256_set1_ps(-0.0f)));
  }
#endif
  static void dequant(const uint8_t* u, float* out) {
    const float d = half_at(u), dmin = half_at(u + 2);
    for (int j = 0; j < 8; ++j) {
      int s, m;
      scale_min(u + 4, j, &s, &m);
      const float scale = d * static_cast<float>(s), mn = -(dmin * static_cast<float>(m));
      const uint8_t* q = u + 16 + 32 * (j / 2);
      for (int l = 0; l < 32; ++l) {
        const int code = (j & 1) ? q[l] >> 4 : q[l] & 0xF;
        out[32 * j + l] = static_cast<float>(code) * scale + mn;
      }
    }
  }
};

// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d. Sub-block
// j = 4h + i (32 weights): low nibbles (i < 2) or high ones of bytes 64h + 32 (i & 1) + l,
// high bits 2i, 2i + 1 of byte 128 + 32h + l; w = (q - 32) (d sc_g), g = weight / 16.
struct Q6_K {
  static constexpr int64_t kType = kQ6_K, kWeights = 256, kBytes = 210;
  static constexpr int64_t kGroup = 16;  // weights per factor
  static constexpr int kPairLayout = 0;
  #if defined(__x86_64__)
  OSD_BLK_AVX2 static __m256i codes(const uint8_t* u, int j) {
    const int h = j / 4, i = j % 4;
    const __m256i ql =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64 * h + 32 * (i & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 128 + 32 * h));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i low = _mm256_and_si256(i < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
    // bits 2i, 2i + 1 of each qh byte to bits 4, 5 (16-bit shifts; the mask drops what
    // crossed from the neighbouring byte)
    const __m256i hs = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * i));
    const __m256i high = _mm256_and_si256(_mm256_slli_epi16(hs, 4), _mm256_set1_epi8(0x30));
    return _mm256_or_si256(low, high);
  }
  OSD_BLK_AVX2 static void factors(const uint8_t* u, float* sc, float* mn) {
    const __m256 d = _mm256_set1_ps(half_at_f16c(u + 208));
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 192));
    const __m256 lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s)));
    const __m256 hi =
        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s, 8))));
    const __m256 offset = _mm256_set1_ps(-32.0f);
    _mm256_storeu_ps(sc, lo);
    _mm256_storeu_ps(sc + 8, hi);
    _mm256_storeu_ps(mn, _mm256_mul_ps(offset, lo));
    _mm256_storeu_ps(mn + 8, _mm256_mul_ps(offset, hi));
  }
#endif
  static void dequant(const uint8_t* u, float* out) {
    const float d = half_at(u + 208);
    const auto* s = reinterpret_cast<const int8_t*>(u + 192);
    for (int j = 0; j < 8; ++j) {
      const int h = j / 4, i = j % 4;
      for (int l = 0; l < 32; ++l) {
        const uint8_t lb = u[64 * h + 32 * (i & 1) + l];
        const int low = i < 2 ? lb & 0xF : lb >> 4;
        const int high = (u[128 + 32 * h + l] >> (2 * i)) & 3;
        const int w = 32 * j + l;
        out[w] = static_cast<float>((low | (high << 4)) - 32) * (d * static_cast<float>(s[w / 16]));
      }
    }
  }
};

// f(F{}) for the format of ggml type `type`; false when the type is not one of them.
template <typename Fn>
inline bool with_format(int64_t type, Fn&& f) {
  switch (type) {
    case kQ4_0: f(Q4_0{}); return true;
    case kQ4_1: f(Q4_1{}); return true;
    case kQ5_0: f(Q5_0{}); return true;
    case kQ8_0: f(Q8_0{}); return true;
    case kQ4_K: f(Q4_K{}); return true;
    case kQ6_K: f(Q6_K{}); return true;
    default: return false;
  }
}

}  // namespace gguf_blocks

// y[m, n] = x[m] . W[n] + bias[n] (bias may be null) for M rows of x (ldx apart) into y
// (ldy apart), W [N, K] float32 made a tile of weight rows at a time by dequant(n0, rows,
// out [rows, K]): each thread dequantizes its tiles into its own buffer and multiplies
// them by a single-threaded GEMM while they are cached (quant_linear_blocks.cpp). The
// GEMM sets the summation order: F.linear on the dequantized W to float rounding.
void gemm_dequantized_tiles(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t N,
                            const float* bias, float* y, int64_t ldy,
                            const std::function<void(int64_t, int64_t, float*)>& dequant);
}  // namespace osd
