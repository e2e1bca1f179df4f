// quant_linear on GGUF blocks as stored (cpu/quant_linear_blocks.cpp), called by the
// quant_linear op's CPU kernel when its ggml_type argument is not 0.
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <optional>

namespace osd {

// True for the ggml types quant_linear reads as stored: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K.
bool quant_blocks_supported(int64_t ggml_type);

// x float32 [M, K] with contiguous rows; blocks uint8 [N, K / U * B] (U weights in B bytes
// a unit of the type).
at::Tensor quant_linear_blocks_cpu(const at::Tensor& x, const at::Tensor& blocks,
                                   int64_t ggml_type, const std::optional<at::Tensor>& bias,
                                   const std::optional<at::Tensor>& norm_weight, double eps);

}  // namespace osd
