// Vectorised row loops of the C++ chain sampler (cpu/rejection_sample.cpp,
// cpu/rejection_sample_split.cpp): exponentials, residuals, Philox uniforms and
// exponential-race keys over float rows. Each is compiled for AVX2 and for the baseline
// and picked at load time (OSD_VECTOR_CLONES, no FMA: both clones round identically).
// Defined in cpu/sample_vec.cpp.
#pragma once
#include <cstdint>

namespace osd {

// e[v] = exp(s[v] - max) (Cephes polynomial, within 1 ulp; 0 below -104); returns sum e.
float exp_and_sum(const float* s, float max, int64_t n, float* e);

// e[v] = exp2((l[v] - max) * c), the CPU form of scaled_exp (kernels/chunk_stats.h; 0
// below 2^-150); returns sum e. max must be finite.
float exp2_and_sum(const float* l, float max, float c, int64_t n, float* e);

// y[v] = x[v] * f.
void scale_row(const float* x, float f, int64_t n, float* y);

// d[v] = max(0, p[v] - d[v]).
void residual_row(const float* p, float* d, int64_t n);

// Uniforms u(seed, offset, stream, v) for v in [4 * first, 4 * (first + nblocks)), four
// per Philox call, into u[0 .. 4 * nblocks).
void philox_row(uint64_t seed, uint64_t offset, uint32_t stream, int64_t first,
                int64_t nblocks, float* u);

// Exponential-race keys in place: u[v] <- r[v] / -log(u[v]).
void race_keys(const float* r, float* u, int64_t n);

// The race's winner over the few positive rates of r[0, n): the first index of the
// largest r[v] / -log(u(seed, offset, stream, v)) among r[v] > 0, which is the winner of
// the full race (philox_row, race_keys, row_argmax: a zero rate's key is 0, below every
// positive key). -1 when more than n / kSparseRaceShare rates are positive (the full
// race is then the faster).
int64_t race_sparse(const float* r, int64_t n, uint64_t seed, uint64_t offset, uint32_t stream);
constexpr int64_t kSparseRaceShare = 8;

}  // namespace osd
