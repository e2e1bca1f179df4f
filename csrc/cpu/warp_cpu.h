// Per-row helpers shared by the C++ CPU sampling kernels (rejection_sample,
// tree_rejection_sample): loading a logits row as float, row reductions, and the top-k and
// top-p thresholds of osd_kernels.warp.warp_probs by the radix selection the CUDA kernels
// use (kernels/radix_select.h; histograms built serially here). Defined in warp_cpu.cpp.
#pragma once
#include <cstdint>

#include "kernels/common.h"
#include "kernels/radix_select.h"

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

// Index of the first maximum of x (lowest index on ties) among its non-NaN values; 0 when
// it holds only NaNs. One pass, 16 lanes with AVX-512 (OSD_NO_AVX512: the portable loop).
int64_t row_argmax(const float* x, int64_t n);

// row_argmax, and *nonfinite set when x holds a NaN, +inf or -inf (the same pass).
int64_t row_argmax_nonfinite(const float* x, int64_t n, bool* nonfinite);

// Top-k on raw logits l[0, n) read from `dtype` (1 <= k < n): s = l / temperature, then
// every s below the k-th largest s becomes -inf (ties with it are kept). The k-th largest
// raw logit is found by radix selection and the test is made on raw keys
// (top_k_logit_floor), as on the GPU.
void top_k_scale(float* l, int64_t n, int64_t k, DType dtype, float temperature);

// The scaled, top-k-masked logits of one row: dst[v] = logit[v] / temperature, with
// top_k > 0 every value below the k-th largest set to -inf (top_k_scale).
void load_scaled_row(const void* base, DType dtype, int64_t offset, int64_t stride, int64_t n,
                     int64_t top_k, float temperature, float* dst);

// Top-p threshold key on the probabilities p[v] = e[v] * inv_z (e >= 0): the smallest key
// T with mass(radix_key(p) > T) < top_p (0: keep all). Keeping radix_key(p) >= T keeps or
// drops ties together.
uint32_t top_p_key(const float* e, int64_t n, float inv_z, float top_p);

}  // namespace osd
