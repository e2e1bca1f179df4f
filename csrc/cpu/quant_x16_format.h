// The 16-row interleaved block formats of quant_linear's int8-activation types (the layout
// is described at the top of cpu/quant_linear_x16.cpp): where a group's block keeps its
// codes and factors, a row's reading of them, the quantized activations, and the AVX-512
// helpers that unpack a block, shared by the VNNI kernels (cpu/quant_linear_x16.cpp) and
// the AMX ones (cpu/quant_linear_x16_amx.cpp).
#pragma once
#include <c10/util/Half.h>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/quant_linear_x16.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define OSD_X16_VNNI \
  __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,avx512vnni,avx2,fma,f16c")))
#endif

namespace osd {
namespace x16 {

constexpr int64_t kGroup = 16;  // weight rows a group (one float32 lane each)
constexpr int64_t kSuperBlocks = 8;  // blocks of 32 a K-quant super-block

// kHalf: float16 d (and m) a block; kQ4K / kQ6K: the K-quants' integer scales a block
// under float16 super-block factors; kFloat: float32 d and m a sub-block, codes stored
// as code + 128 (codes and factors: any type osd holds so, a fused projection of mixed
// types included).
enum class Factors { kHalf, kQ4K, kQ6K, kFloat };

struct Format {
  int64_t base;       // the GGUF type: 2, 3, 6, 8, 12 or 14 (0: codes and factors)
  int64_t unit;       // weights a stored unit of a row (32, or 256 for the K-quants)
  int64_t bytes;      // a unit's bytes a row
  Factors factors;    // kHalf: float16 d (and m) a block; K-quants: scales per block
  bool nibbles;       // two 4-bit codes a byte (else one 8-bit code)
  int hbits;          // high bits above the nibbles: 0, 1 (Q5_0) or 2 (Q6_K)
  float min_per_d;    // m = min_per_d * d (0: stored; Q4_K: -dmin * min)
  int64_t code_bytes() const { return nibbles ? 256 : 512; }
  int64_t block_bytes() const {  // a group's block of 32, factors included
    const int64_t head = factors == Factors::kHalf    ? (min_per_d != 0.0f ? 32 : 64)
                         : factors == Factors::kFloat ? 128 * (halves_ ? 2 : 1)
                                                      : 32;
    return code_bytes() + 64 * hbits + head;
  }
  int64_t super_head() const {  // the 16 rows' super-block factors (float16)
    return factors == Factors::kQ4K ? 64 : factors == Factors::kQ6K ? 32 : 0;
  }
  bool halves_ = false;  // two sub-blocks of 16 a block (Q6_K; kFloat with groups of 16)
  bool halves() const { return halves_; }
};

inline bool format_of(int64_t ggml_type, Format* f) {
  switch (ggml_type) {
    case kX16Offset + 2: *f = {2, 32, 18, Factors::kHalf, true, 0, -8.0f}; return true;
    case kX16Offset + 3: *f = {3, 32, 20, Factors::kHalf, true, 0, 0.0f}; return true;
    case kX16Offset + 6: *f = {6, 32, 22, Factors::kHalf, true, 1, -16.0f}; return true;
    case kX16Offset + 8: *f = {8, 32, 34, Factors::kHalf, false, 0, -128.0f}; return true;
    case kX16Offset + 12: *f = {12, 256, 148, Factors::kQ4K, true, 0, 0.0f}; return true;
    case kX16Offset + 14: *f = {14, 256, 210, Factors::kQ6K, true, 2, -32.0f, true}; return true;
    case kX16Offset + 132: *f = {0, 32, 40, Factors::kFloat, false, 0, 0.0f}; return true;
    case kX16Offset + 116: *f = {0, 32, 48, Factors::kFloat, false, 0, 0.0f, true}; return true;
    default: return false;
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// Where block b of a group (starting at w) keeps its codes, high bits and factors, and
// its super-block's factors (K-quants).
struct Block {
  const uint8_t* codes;
  const uint8_t* high;
  const uint8_t* factors;
  const uint8_t* super;
};

inline Block block_at(const Format& f, const uint8_t* w, int64_t b) {
  Block v;
  if (f.super_head() == 0) {
    v.codes = w + b * f.block_bytes();
    v.super = nullptr;
  } else {
    v.super = w + (b / kSuperBlocks) * kGroup * f.bytes;
    v.codes = v.super + f.super_head() + (b % kSuperBlocks) * f.block_bytes();
  }
  v.high = v.codes + f.code_bytes();
  v.factors = v.high + 64 * f.hbits;
  return v;
}

// Row r's d and m of sub-block s (0, or 0 and 1 for Q6_K's halves).
inline void factors_of(const Format& f, const Block& v, int64_t r, int s, float* d, float* m) {
  switch (f.factors) {
    case Factors::kHalf:
      *d = half_at(v.factors + 2 * r);
      *m = f.min_per_d != 0.0f ? f.min_per_d * *d : half_at(v.factors + 32 + 2 * r);
      return;
    case Factors::kQ4K:
      *d = half_at(v.super + 2 * r) * static_cast<float>(v.factors[r]);
      *m = -(half_at(v.super + 32 + 2 * r) * static_cast<float>(v.factors[16 + r]));
      return;
    case Factors::kQ6K:
      *d = half_at(v.super + 2 * r) *
           static_cast<float>(static_cast<int8_t>(v.factors[16 * s + r]));
      *m = f.min_per_d * *d;
      return;
    case Factors::kFloat:
      std::memcpy(d, v.factors + 128 * s + 4 * r, 4);
      std::memcpy(m, v.factors + 128 * s + 64 + 4 * r, 4);
      return;
  }
}

// Row r's code k (0..31) of block v.
inline int32_t code_of(const Format& f, const Block& v, int64_t r, int64_t k) {
  const int64_t j = k / 4, i = k % 4;
  int32_t u;
  if (f.nibbles) {
    const uint8_t byte = v.codes[64 * (j % 4) + 4 * r + i];
    u = j < 4 ? (byte & 15) : (byte >> 4);
  } else {
    u = v.codes[64 * j + 4 * r + i];
  }
  if (f.hbits == 1) u |= ((v.high[4 * r + i] >> j) & 1) << 4;
  if (f.hbits == 2) u |= ((v.high[64 * (j / 4) + 4 * r + i] >> (2 * (j % 4))) & 3) << 4;
  return u;
}

// x [M, K] (ldx apart) -> qx int8 [M, K]; dx [M, K / 32]; sx [M, K / 32] (dx times the
// block's sum of qx), h [M, K / 16] (dx times each half's sum) and n [M, K / 16] (each
// half's sum of qx).
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> d, s, h;
  std::vector<int32_t> n;
};

// Sub-block s's sum of qx in block at (= m * nb + b): the offset of codes held as code +
// 128, taken off the dot product so that it is the signed codes' (exact, in int32).
inline int32_t sub_sum(const Quantized& qx, int64_t at, int s, int subs) {
  return subs == 2 ? qx.n[2 * at + s] : qx.n[2 * at] + qx.n[2 * at + 1];
}


// AMX (cpu/quant_linear_x16_amx.cpp): whether the CPU and the OS let this process run
// AMX-INT8 tile products (asks the kernel for the tile state once); then, on one thread,
// amx_configure(rows) before amx_group calls in passes of that many rows of x (1..16), and
// amx_release() after them. Formats of one sub-block a block (not Q6_K's halves).
constexpr int kAmxRows = 16;
bool amx_available();
void amx_configure(int rows);
void amx_release();
// The M rows of x times the group of 16 weight rows at w, in passes of `rows` (qx holds
// whole passes: rows past M are zeros, computed and not stored): the same float
// operations in the same order as the VNNI kernel, so the same results bit for bit.
void amx_group(const Format& f, const uint8_t* w, int64_t nb, const Quantized& qx, int64_t K,
               int64_t M, int rows, float* y, int64_t ldy, const float* bias);

#if defined(__x86_64__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
OSD_X16_VNNI inline __m512 halves(const uint8_t* p) {  // 16 float16 values
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

OSD_X16_VNNI inline __m128i bytes(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// Sub-block s's d and m of the 16 rows (lane r: row r).
OSD_X16_VNNI inline void factors_512(const Format& f, const Block& v, int s, __m512* d,
                                     __m512* m) {
  switch (f.factors) {
    case Factors::kHalf:
      *d = halves(v.factors);
      *m = f.min_per_d != 0.0f ? _mm512_mul_ps(_mm512_set1_ps(f.min_per_d), *d)
                               : halves(v.factors + 32);
      return;
    case Factors::kQ4K: {
      *d = _mm512_mul_ps(halves(v.super),
                         _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(v.factors))));
      const __m512 dm = _mm512_mul_ps(
          halves(v.super + 32), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(v.factors + 16))));
      *m = _mm512_xor_ps(dm, _mm512_set1_ps(-0.0f));
      return;
    }
    case Factors::kQ6K:
      *d = _mm512_mul_ps(halves(v.super),
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(v.factors + 16 * s))));
      *m = _mm512_mul_ps(_mm512_set1_ps(f.min_per_d), *d);
      return;
    case Factors::kFloat:
      *d = _mm512_loadu_ps(reinterpret_cast<const float*>(v.factors + 128 * s));
      *m = _mm512_loadu_ps(reinterpret_cast<const float*>(v.factors + 128 * s + 64));
      return;
  }
}

// Bits [from, from + n) of every byte of v, moved to bits 4.. (n = 1 or 2; the callers'
// loops are unrolled, so the shifts are immediates).
OSD_X16_VNNI inline __m512i high_at_4(__m512i v, int from, int n) {
  const __m512i mask = _mm512_set1_epi8(static_cast<char>(((1 << n) - 1) << 4));
  // 16-bit shifts: the bits a byte takes from its neighbour fall outside the mask
  return from <= 4 ? _mm512_and_si512(_mm512_slli_epi16(v, 4 - from), mask)
                   : _mm512_and_si512(_mm512_srli_epi16(v, from - 4), mask);
}

// Codes of block v: register j lane r holds row r's codes 4j..4j+3.
OSD_X16_VNNI inline void codes_512(const Format& f, const Block& v, __m512i* c) {
  if (!f.nibbles) {
    for (int j = 0; j < 8; ++j) c[j] = _mm512_loadu_si512(v.codes + 64 * j);
    return;
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m512i x = _mm512_loadu_si512(v.codes + 64 * j);
    c[j] = _mm512_and_si512(x, low);
    c[j + 4] = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
  }
  if (f.hbits == 1) {  // bit j of each byte: code 4j + i's fifth bit
    const __m512i h = _mm512_loadu_si512(v.high);
    for (int j = 0; j < 8; ++j) c[j] = _mm512_or_si512(c[j], high_at_4(h, j, 1));
  } else if (f.hbits == 2) {  // chunk j / 4, bits 2 (j % 4): code 4j + i's top two bits
    const __m512i h[2] = {_mm512_loadu_si512(v.high), _mm512_loadu_si512(v.high + 64)};
    for (int j = 0; j < 8; ++j) c[j] = _mm512_or_si512(c[j], high_at_4(h[j / 4], 2 * (j % 4), 2));
  }
}
// acc plus block `at` (= m * K / 32 + b) of row m's exact int32 sums si against the 16
// weight rows whose factors are d and mn (one sub-block a block): fma(float(si), d * dx,
// acc), then fma(mn, sx, .). The VNNI and AMX kernels both scale their sums here, so they
// round alike and agree bit for bit.
OSD_X16_VNNI inline __m512 scale_block(const Format& f, const Quantized& qx, int64_t at,
                                       __m512i si, __m512 d, __m512 mn, __m512 acc) {
  if (f.factors == Factors::kFloat) {  // codes held as code + 128: take the offset off
    si = _mm512_sub_epi32(si, _mm512_set1_epi32(128 * (qx.n[2 * at] + qx.n[2 * at + 1])));
  }
  const __m512 fs = _mm512_cvtepi32_ps(si);
  acc = _mm512_fmadd_ps(fs, _mm512_mul_ps(d, _mm512_set1_ps(qx.d[at])), acc);
  return _mm512_fmadd_ps(mn, _mm512_set1_ps(qx.s[at]), acc);
}
#pragma GCC diagnostic pop
#endif

}  // namespace x16
}  // namespace osd
