// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11):
// the counter-based generator every stochastic osd kernel draws from. The same function
// exists in PyTorch (osd_kernels/philox.py) and Triton (osd_kernels/triton/philox.py), so
// the reference, C++, Triton and CUDA backends see bit-identical uniforms.
//
// One call maps a 128-bit counter (c0, c1, c2, c3) and a 64-bit key (k0, k1) to four
// 32-bit words. Ten rounds of
//   (c0, c1, c2, c3) <- (hi(B*c2) ^ c1 ^ k0, lo(B*c2), hi(A*c0) ^ c3 ^ k1, lo(A*c0))
//   (k0, k1)         <- (k0 + W0, k1 + W1)
// with A = 0xD2511F53, B = 0xCD9E8D57, W0 = 0x9E3779B9, W1 = 0xBB67AE85. Known answer:
// key (0, 0), counter (0, 0, 0, 0) -> 0x6627e8d5 0xe169c58d 0xbc57ac4c 0x9b00dbd8.
// (This is exactly Triton's `tl.randint4x(seed, offset)` with key = (lo, hi) of the seed
// and counter = (lo, hi) of its offset followed by two zero words.)
//
// osd layout: uniform u(seed, offset, stream, index) for a sequence's 64-bit `seed` and
// `offset` (the per-call stream selector, e.g. a step counter or the committed length;
// calls that reuse a (seed, offset) pair reuse their randomness):
//   key     = (lo32(seed), hi32(seed))
//   counter = (index >> 2, stream, lo32(offset), hi32(offset))
//   word    = output word (index & 3), converted by philox_to_uniform.
// Four consecutive indices share one Philox call, so a vocab sweep costs V/4 calls.
// `stream` = 2 * position + purpose, where position is the draft position (chain) or the
// tree node and purpose is kPhiloxAccept (the accept test; index 0 for a chain position,
// any index for per-candidate tests) or kPhiloxSample (the Gumbel/exponential-race noise
// of a resampled row; index = vocab id). Distinct (position, purpose, index) triples never
// share a uniform.
#pragma once
#include <cstdint>

#include "kernels/common.h"

namespace osd {

constexpr uint32_t kPhiloxMulA = 0xD2511F53u;
constexpr uint32_t kPhiloxMulB = 0xCD9E8D57u;
constexpr uint32_t kPhiloxWeylA = 0x9E3779B9u;
constexpr uint32_t kPhiloxWeylB = 0xBB67AE85u;

// Purposes of a stream (see the layout above).
constexpr uint32_t kPhiloxAccept = 0;
constexpr uint32_t kPhiloxSample = 1;

struct Philox4 {
  uint32_t x[4];
};

OSD_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

// Philox-4x32 with ten rounds.
OSD_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                             uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    uint32_t hi_a, lo_a, hi_b, lo_b;
    philox_mulhilo(kPhiloxMulA, c0, hi_a, lo_a);
    philox_mulhilo(kPhiloxMulB, c2, hi_b, lo_b);
    c0 = hi_b ^ c1 ^ k0;
    c1 = lo_b;
    c2 = hi_a ^ c3 ^ k1;
    c3 = lo_a;
    k0 += kPhiloxWeylA;
    k1 += kPhiloxWeylB;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// A 32-bit word to a float in the open interval (0, 1): (2 * (x >> 9) + 1) * 2^-24, an
// exact float (23 random bits), so log(u) is finite and every backend rounds identically.
OSD_HD float philox_to_uniform(uint32_t x) {
  return static_cast<float>(x >> 9) * 0x1p-23f + 0x1p-24f;
}

OSD_HD uint32_t philox_stream(uint32_t position, uint32_t purpose) {
  return position * 2u + purpose;
}

// The four words of the Philox block holding indices 4*block .. 4*block+3.
OSD_HD Philox4 philox_block(uint64_t seed, uint64_t offset, uint32_t stream, uint32_t block) {
  return philox4x32_10(block, stream, static_cast<uint32_t>(offset),
                       static_cast<uint32_t>(offset >> 32), static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32));
}

// u(seed, offset, stream, index) in (0, 1), as laid out above.
OSD_HD float philox_uniform(uint64_t seed, uint64_t offset, uint32_t stream, uint32_t index) {
  const Philox4 w = philox_block(seed, offset, stream, index >> 2);
  return philox_to_uniform(w.x[index & 3u]);
}

}  // namespace osd
