// quant_linear's int8-activation types on AMX-INT8 tiles, for calls of many rows of x
// (prefill pieces, a batch's verify forward). VNNI multiplies a block of 32 weights into
// one row of x with 8 dot-product instructions, so a pass of M rows costs 8 M of them a
// block; one tile product (TDPBSUD: signed int8 x rows times unsigned weight codes, int32
// sums) does a block for up to 16 rows. The 16 rows' codes of a block are already in the
// tile's B layout (chunk j, row r: codes 4j..4j+3 at bytes 4r..4r+3, so the 8 chunks are
// 8 rows of 64 bytes); the nibble formats' are unpacked once a group, for all its passes.
// The rows of x are the A tile (rows of 32 bytes, K apart). The int32 sums (exact in any
// order) are stored and then scaled with the very float operations of the VNNI kernel in
// the same order, so the two agree bit for bit.
//
// A tile load, product or store costs several nanoseconds whatever its rows, and every
// block's sums go through memory, so tiles pay only for many rows, and not for Q6_K's two
// sub-blocks a block (twice the tiles): the caller (cpu/quant_linear_x16.cpp) picks them.
//
// Tiles: 0-3 the products (rows of 16 int32), 4 and 6 x, 5 and 7 the codes. A round issues
// the products of 4 blocks before storing any, so their latency overlaps, and the sums of
// the round before are scaled meanwhile.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "cpu/quant_x16_format.h"

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define OSD_X16_AMX                                                                          \
  __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,avx512vnni,avx2,fma,f16c,amx-tile," \
                        "amx-int8")))
#define OSD_HAVE_AMX 1
#endif

namespace osd {
namespace x16 {

#if defined(OSD_HAVE_AMX)
namespace {

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an XSAVE feature
constexpr int kXfeatureTileData = 18;      // the tile registers' state

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// (the tile intrinsics are asm statements without memory operands: the compiler must not
// move stores of what a tile loads past them)
inline void compiler_fence() { asm volatile("" ::: "memory"); }

// The products of `used` blocks issued: block i's x at a[i], its codes at c[i] (the tiles'
// numbers are immediates, hence the cases).
#define OSD_AMX_PRODUCT(C, A, B, ap, lda, bp) \
  do {                                        \
    _tile_loadd(A, ap, lda);                  \
    _tile_loadd(B, bp, 64);                   \
    _tile_zero(C);                            \
    _tile_dpbsud(C, A, B);                    \
  } while (0)

OSD_X16_AMX inline void product(int t, const int8_t* a, int64_t lda, const uint8_t* c) {
  switch (t) {
    case 0: OSD_AMX_PRODUCT(0, 4, 5, a, lda, c); break;
    case 1: OSD_AMX_PRODUCT(1, 6, 7, a, lda, c); break;
    case 2: OSD_AMX_PRODUCT(2, 4, 5, a, lda, c); break;
    default: OSD_AMX_PRODUCT(3, 6, 7, a, lda, c); break;
  }
}

OSD_X16_AMX inline void store(int t, int32_t* out) {
  switch (t) {
    case 0: _tile_stored(0, out, 64); break;
    case 1: _tile_stored(1, out, 64); break;
    case 2: _tile_stored(2, out, 64); break;
    default: _tile_stored(3, out, 64); break;
  }
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <int MP>
OSD_X16_AMX void group_amx(const Format& f, const uint8_t* w, int64_t nb, const Quantized& qx,
                           int64_t K, int64_t m0, int store_rows, float* y, int64_t ldy,
                           const float* bias, const uint8_t* unpacked) {
  const int64_t ns = K / 32;
  const int64_t ahead = 8 * f.block_bytes();
  constexpr int kRound = 4;  // blocks a round, one product tile each
  // Two rounds in flight: round r's products are issued and stored while round r - 1's
  // sums, stored a round earlier, are scaled; the buffers alternate, so no load of a sum
  // waits on (or is replayed behind) a tile store to the same lines.
  alignas(64) int32_t sums[2][4][MP][16];
  Block v[2][kRound];
  int used[2] = {0, 0};
  __m512 acc[MP];
  for (int m = 0; m < MP; ++m) acc[m] = _mm512_setzero_ps();
  const int8_t* xq = qx.q.data() + m0 * K;
  const int64_t rounds = (nb + kRound - 1) / kRound;
  for (int64_t r = 0; r <= rounds; ++r) {
    if (r < rounds) {
      const int p = static_cast<int>(r % 2);
      const int64_t b0 = r * kRound;
      used[p] = static_cast<int>(std::min<int64_t>(kRound, nb - b0));
      for (int i = 0; i < used[p]; ++i) {
        const Block vi = v[p][i] = block_at(f, w, b0 + i);
        for (int64_t at = 0; at < f.block_bytes(); at += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(vi.codes + ahead + at), _MM_HINT_T0);
        }
        const uint8_t* c = f.nibbles ? unpacked + 512 * (b0 + i) : vi.codes;
        const int8_t* a = xq + 32 * (b0 + i);
        product(i, a, K, c);
      }
      for (int t = 0; t < used[p]; ++t) store(t, &sums[p][t][0][0]);
    }
    if (r == 0) continue;
    const int p = static_cast<int>((r - 1) % 2);
    const int64_t b0 = (r - 1) * kRound;
    for (int i = 0; i < used[p]; ++i) {
      const int64_t b = b0 + i;
      __m512 d, mn;
      factors_512(f, v[p][i], 0, &d, &mn);
      for (int m = 0; m < MP; ++m) {
        acc[m] = scale_block(f, qx, (m0 + m) * ns + b, _mm512_load_si512(sums[p][i][m]), d, mn,
                             acc[m]);
      }
    }
  }
  const __m512 bv = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int m = 0; m < std::min(MP, store_rows); ++m) {
    _mm512_storeu_ps(y + m * ldy, bias != nullptr ? _mm512_add_ps(acc[m], bv) : acc[m]);
  }
}

// The nibble formats' codes of a group's nb blocks as bytes, 512 a block (the tiles' B
// layout), once for all the passes over the group.
OSD_X16_AMX void unpack_group(const Format& f, const uint8_t* w, int64_t nb, uint8_t* out) {
  for (int64_t b = 0; b < nb; ++b) {
    __m512i u[8];
    codes_512(f, block_at(f, w, b), u);
    for (int j = 0; j < 8; ++j) _mm512_store_si512(out + 512 * b + 64 * j, u[j]);
  }
  compiler_fence();
}
#pragma GCC diagnostic pop

template <int MP = 1>
void group_rows(int rows, int64_t M, const Format& f, const uint8_t* w, int64_t nb,
                const Quantized& qx, int64_t K, float* y, int64_t ldy, const float* bias,
                const uint8_t* unpacked) {
  if constexpr (MP < kAmxRows) {
    if (rows > MP) {
      group_rows<MP + 1>(rows, M, f, w, nb, qx, K, y, ldy, bias, unpacked);
      return;
    }
  }
  for (int64_t m0 = 0; m0 < M; m0 += MP) {
    const int keep = static_cast<int>(std::min<int64_t>(MP, M - m0));
    group_amx<MP>(f, w, nb, qx, K, m0, keep, y + m0 * ldy, ldy, bias, unpacked);
  }
}

bool cpu_has_amx_int8() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  return ((d >> 24) & 1) != 0 && ((d >> 25) & 1) != 0;  // AMX-TILE, AMX-INT8
}

}  // namespace

bool amx_available() {
  // Linux gives a process the tile state only when asked (arch_prctl); asked once
  static const bool ok = cpu_has_amx_int8() && __builtin_cpu_supports("avx512vnni") &&
                         syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) == 0;
  return ok;
}

OSD_X16_AMX void amx_configure(int rows) {
  TileConfig c;
  std::memset(&c, 0, sizeof(c));
  c.palette = 1;
  for (int t = 0; t < 4; ++t) {  // products: rows x 16 int32
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = 64;
  }
  for (int t : {4, 6}) {  // x: rows x a block of 32 int8
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = 32;
  }
  for (int t : {5, 7}) {  // codes: 8 rows of 4 codes x 16 weight rows
    c.rows[t] = 8;
    c.colsb[t] = 64;
  }
  compiler_fence();
  _tile_loadconfig(&c);
}

OSD_X16_AMX void amx_release() { _tile_release(); }

void amx_group(const Format& f, const uint8_t* w, int64_t nb, const Quantized& qx, int64_t K,
               int64_t M, int rows, float* y, int64_t ldy, const float* bias) {
  thread_local std::vector<uint8_t> unpacked;
  if (f.nibbles) {
    // 64-byte aligned: the tile loads read whole lines
    unpacked.resize(static_cast<size_t>(512 * nb + 64));
    uint8_t* base = unpacked.data();
    base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
    unpack_group(f, w, nb, base);
    group_rows(rows, M, f, w, nb, qx, K, y, ldy, bias, base);
  } else {
    group_rows(rows, M, f, w, nb, qx, K, y, ldy, bias, nullptr);
  }
}

#else

bool amx_available() { return false; }
void amx_configure(int) {}
void amx_release() {}
void amx_group(const Format&, const uint8_t*, int64_t, const Quantized&, int64_t, int64_t, int,
               float*, int64_t, const float*) {}

#endif

}  // namespace x16
}  // namespace osd
