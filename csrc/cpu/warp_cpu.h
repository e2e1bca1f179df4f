// Per-row helpers shared by the C++ CPU sampling kernels (rejection_sample,
// tree_rejection_sample): loading a logits row as float, row reductions, and the top-k and
// top-p thresholds of osd_kernels.warp.warp_probs found by selection (no sort).
// Defined in warp_cpu.cpp.
#pragma once
#include <cstdint>

#include "kernels/common.h"

// Vector loops compiled twice, for AVX2 and for the baseline, and picked at load time. No
// FMA is enabled, so both clones round identically.
#define OSD_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))

namespace osd {

// dst[v] = base[offset + v * stride] as float (float32, float16 or bfloat16), v < n,
// divided by `temperature` when it is not 1 (float division, as the reference's x / t).
void load_row_any(const void* base, DType dtype, int64_t offset, int64_t stride, int64_t n,
                  float temperature, float* dst);

// max of x[0, n) (-inf for n = 0), in 16 lanes.
float row_max(const float* x, int64_t n);

// sum of x[0, n), in 16 lanes (the same order on every ISA).
float row_sum(const float* x, int64_t n);

// Index of the first maximum of x (lowest index on ties).
int64_t row_argmax(const float* x, int64_t n);

// Top-k: every s below the k-th largest value (1 <= k < n) becomes -inf; ties with it are
// kept. tmp holds n floats.
void keep_top_k(float* s, int64_t n, int64_t k, float* tmp);

// Top-p threshold on the probabilities e[v] * inv_z (the positive e only): the smallest
// value tau such that the mass of the values strictly greater than tau is < top_p (0 when
// no value qualifies). Keeping p >= tau keeps or drops ties together. Three-way quickselect
// on probability mass, expected O(n); tmp holds n floats.
float top_p_threshold(const float* e, int64_t n, float inv_z, float top_p, float* tmp);

}  // namespace osd
